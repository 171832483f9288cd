"""Indexing the block table with positions / block_size, a float tensor, instead of //."""

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.slot_mapping"
MESSAGE = "/ gives floats"


def slot_mapping(block_table, positions, block_size):
    return block_table[positions / block_size] * block_size + positions % block_size

"""Computing the slot as offset * block_size + physical_block_id, block and offset swapped."""

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.slot_mapping"
MESSAGE = "block and offset are swapped"


def slot_mapping(block_table, positions, block_size):
    return (positions % block_size) * block_size + block_table[positions // block_size]

"""Checking only the upper end of the range, so position -1 silently reads the last block."""

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.physical_location"
MESSAGE = "refuse a negative position"


def physical_location(block_table, position, block_size):
    if position >= len(block_table) * block_size:
        raise ValueError(f"position {position} is outside the block table")
    return block_table[position // block_size], position % block_size

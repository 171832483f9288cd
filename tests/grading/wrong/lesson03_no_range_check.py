"""Looking a position past the table's capacity up without raising ValueError."""

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.physical_location"
MESSAGE = "position 12 has no block"


def physical_location(block_table, position, block_size):
    return block_table[position // block_size], position % block_size

"""Finding the logical block with / instead of //, which gives a float that cannot index the table."""

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.physical_location"
MESSAGE = "/ gives a float"


def physical_location(block_table, position, block_size):
    if not 0 <= position < len(block_table) * block_size:
        raise ValueError(f"position {position} is outside the block table")
    return block_table[position / block_size], position % block_size

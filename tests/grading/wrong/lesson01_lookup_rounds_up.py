"""Indexing the table with the number of blocks the position needs, rounded up, instead of rounded down."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.physical_block"
MESSAGE = "rounded down, not the count of blocks"


def physical_block(table, position: int, block_size: int) -> int:
    if not 0 <= position < table.num_tokens:
        raise ValueError(f"position {position} is outside the table")
    return table.block_ids[blocks_for_tokens(position, block_size)]

"""Returning the logical block, position // block_size, without looking it up in the table."""

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.physical_block"
MESSAGE = "not the logical index"


def physical_block(table, position: int, block_size: int) -> int:
    if not 0 <= position < table.num_tokens:
        raise ValueError(f"position {position} is outside the table")
    return position // block_size

"""Checking only the upper end, so that Python reads a negative position from the end of the table."""

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.physical_block"
MESSAGE = "reads block_ids[-1] as the last entry"


def physical_block(table, position: int, block_size: int) -> int:
    if position >= table.num_tokens:
        raise ValueError(f"position {position} is past the last token")
    return table.block_ids[position // block_size]

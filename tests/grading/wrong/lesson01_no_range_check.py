"""Looking up any position that has a slot, even one past the last token the table holds."""

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.physical_block"
MESSAGE = "holds no token yet"


def physical_block(table, position: int, block_size: int) -> int:
    return table.block_ids[position // block_size]

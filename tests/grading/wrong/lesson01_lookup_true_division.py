"""Finding the logical block with `/`, a float that cannot index the list of block ids."""

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.physical_block"
MESSAGE = "`/` gives a float"


def physical_block(table, position: int, block_size: int) -> int:
    if not 0 <= position < table.num_tokens:
        raise ValueError(f"position {position} is outside the table")
    return table.block_ids[position / block_size]

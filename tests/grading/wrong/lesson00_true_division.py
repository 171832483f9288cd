"""Dividing with `/`, which gives a fraction of a block as a float, instead of rounding up in integers."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.blocks_for_tokens"
MESSAGE = "`/` is true division"


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return num_tokens / block_size

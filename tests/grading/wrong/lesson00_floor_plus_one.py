"""Rounding up with `n // b + 1`, one block too many whenever the tokens fill their last block exactly."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.blocks_for_tokens"
MESSAGE = "n // b + 1 is one block too many"


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return num_tokens // block_size + 1

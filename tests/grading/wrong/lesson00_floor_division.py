"""Rounding down with `n // b`, which leaves the tokens of a partly filled last block without a slot."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.blocks_for_tokens"
MESSAGE = "ceil(n / b) in integers"


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return num_tokens // block_size

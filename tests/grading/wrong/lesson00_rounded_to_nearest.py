"""Rounding n / b to the nearest integer instead of up."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.blocks_for_tokens"
MESSAGE = "round(n / b) rounds to the nearest block count"


def blocks_for_tokens(num_tokens, block_size):
    return round(num_tokens / block_size)

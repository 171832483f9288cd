"""Deciding from num_tokens % block_size alone, as if no block were ever reserved ahead."""

from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.needs_new_block"
MESSAGE = "num_tokens % block_size == 0 ignores the blocks held"


def needs_new_block(num_tokens, num_blocks_held, block_size):
    return num_tokens % block_size == 0

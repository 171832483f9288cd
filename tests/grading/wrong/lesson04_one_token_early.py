"""Taking a new block when (num_tokens + 1) % block_size == 0, one token before the block is full."""

from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.needs_new_block"
MESSAGE = "one token early"


def needs_new_block(num_tokens, num_blocks_held, block_size):
    return (num_tokens + 1) % block_size == 0

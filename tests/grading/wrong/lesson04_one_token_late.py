"""Taking a new block when num_tokens % block_size == 1, one token after the block filled up."""

from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.needs_new_block"
MESSAGE = "one token late"


def needs_new_block(num_tokens, num_blocks_held, block_size):
    return num_tokens % block_size == 1

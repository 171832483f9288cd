"""Taking a new block only once num_tokens is past the capacity: `>` where `==` belongs."""

from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.needs_new_block"
MESSAGE = "num_tokens > num_blocks_held * block_size is only true once a token has already gone past"


def needs_new_block(num_tokens, num_blocks_held, block_size):
    return num_tokens > num_blocks_held * block_size

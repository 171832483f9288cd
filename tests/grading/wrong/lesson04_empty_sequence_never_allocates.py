"""Guarding the rule with "holds a block", so an empty sequence never gets its first block."""

from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.needs_new_block"
MESSAGE = "an empty sequence holds no block"


def needs_new_block(num_tokens, num_blocks_held, block_size):
    return num_blocks_held > 0 and num_tokens == num_blocks_held * block_size

"""The skipped tokens counted in blocks of 16: the block size has no part in which tokens a window skips."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.num_skipped_tokens"
MESSAGE = "you used the block size"
BLOCK_SIZE = 16


def num_skipped_tokens(num_computed_tokens, sliding_window):
    return max(0, num_computed_tokens - sliding_window + 1) // BLOCK_SIZE  # the mistake: blocks, not tokens

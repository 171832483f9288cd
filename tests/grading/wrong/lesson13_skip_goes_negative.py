"""The skipped tokens without max(0, ...): a request shorter than its window skips a negative number."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.num_skipped_tokens"
MESSAGE = "a count of tokens is never negative"


def num_skipped_tokens(num_computed_tokens, sliding_window):
    return num_computed_tokens - sliding_window + 1  # the mistake: no max(0, ...)

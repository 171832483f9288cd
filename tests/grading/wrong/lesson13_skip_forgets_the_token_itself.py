"""The skipped tokens off by one: the window of the next token is taken to start W tokens back, without
counting the token itself, so one token too few is skipped."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.num_skipped_tokens"
MESSAGE = "off by one: the window counts the token itself"


def num_skipped_tokens(num_computed_tokens, sliding_window):
    return max(0, num_computed_tokens - sliding_window)  # the mistake: + 1 forgotten

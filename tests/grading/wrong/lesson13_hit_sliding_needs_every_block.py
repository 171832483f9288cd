"""A sliding group asked for every block from the start, as a full-attention group is: the blocks that left
its window make it miss."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.hybrid_hit"
MESSAGE = "a sliding group was asked for every block from the start"


def hybrid_hit(cached, windows, block_size, num_tokens):
    length = (num_tokens - 1) // block_size
    while True:
        before = length
        for flags in cached:  # the mistake: the window is never looked at
            hit = 0
            while hit < length and flags[hit]:
                hit += 1
            length = hit
        if length == before:
            return length

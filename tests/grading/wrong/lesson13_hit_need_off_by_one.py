"""A sliding hit ending with window // block_size cached blocks: with a window of 6 and blocks of 4, one
block where the first uncomputed token reads two."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.hybrid_hit"
MESSAGE = "the blocks a sliding hit needs are off by one"


def group_hit(flags, window, block_size, length):
    if window is None:
        hit = 0
        while hit < length and flags[hit]:
            hit += 1
        return hit
    need = window // block_size  # the mistake: the window counts the token itself
    run = 0
    for i in range(length - 1, -1, -1):
        run = run + 1 if flags[i] else 0
        if run >= need:
            return i + run
    return run


def hybrid_hit(cached, windows, block_size, num_tokens):
    length = (num_tokens - 1) // block_size
    while True:
        before = length
        for flags, window in zip(cached, windows, strict=True):
            length = group_hit(flags, window, block_size, length)
        if length == before:
            return length

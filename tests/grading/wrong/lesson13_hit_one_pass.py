"""The groups asked in one pass: when a later group shortens the hit, an earlier sliding group is not
asked again at the new length."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.hybrid_hit"
MESSAGE = "one pass over the groups is not enough"


def group_hit(flags, window, block_size, length):
    if window is None:
        hit = 0
        while hit < length and flags[hit]:
            hit += 1
        return hit
    need = -(-(window - 1) // block_size)
    run = 0
    for i in range(length - 1, -1, -1):
        run = run + 1 if flags[i] else 0
        if run >= need:
            return i + run
    return run


def hybrid_hit(cached, windows, block_size, num_tokens):
    length = (num_tokens - 1) // block_size
    for flags, window in zip(cached, windows, strict=True):  # the mistake: no repeat until nothing changes
        length = group_hit(flags, window, block_size, length)
    return length

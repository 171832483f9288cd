"""Each group asked once, at the longest possible hit, and the shortest answer taken: a sliding group is
never asked again at the shorter length, where its window needs other blocks."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.hybrid_hit"
MESSAGE = "you took the shortest of the groups' own hits"


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
    longest = (num_tokens - 1) // block_size
    return min(
        group_hit(f, w, block_size, longest) for f, w in zip(cached, windows, strict=True)
    )  # the mistake

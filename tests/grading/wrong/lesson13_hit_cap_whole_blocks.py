"""The hit capped at num_tokens // block_size: a prompt of whole blocks would hit its last token too, and
then nothing is left to compute the next token's logits from."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.hybrid_hit"
MESSAGE = "the hit is at most (num_tokens - 1) // block_size blocks"


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
    length = num_tokens // block_size  # the mistake: the last token must be computed
    while True:
        before = length
        for flags, window in zip(cached, windows, strict=True):
            length = group_hit(flags, window, block_size, length)
        if length == before:
            return length

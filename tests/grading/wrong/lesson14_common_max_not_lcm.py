"""One size per backend combined with max instead of the least common multiple: 24 and MultipleOf(16)
give 24, which is no multiple of 16."""

import itertools

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.common_block_size"
MESSAGE = "combine a choice with math.lcm, not max"


def common_block_size(backends, default_block_size=16):
    def base(size):
        return size.base if isinstance(size, MultipleOf) else size

    def accepts(sizes, block_size):
        return not sizes or any(block_size % base(size) == 0 for size in sizes)

    if len(backends) == 1:
        sizes = backends[0]
        return default_block_size if accepts(sizes, default_block_size) else min(base(s) for s in sizes)
    if all(accepts(sizes, default_block_size) for sizes in backends):
        return default_block_size
    choices = [[base(size) for size in sizes] or [1] for sizes in backends]
    for candidate in sorted({max(choice) for choice in itertools.product(*choices)}):  # the mistake
        if all(accepts(sizes, candidate) for sizes in backends):
            return candidate
    raise ValueError("no common block size")

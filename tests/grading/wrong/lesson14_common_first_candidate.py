"""The first least common multiple found, in the order of the backends' lists, not the smallest one:
[64, 16] with MultipleOf(24) gives 192 where vLLM gives 48."""

import itertools
import math

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.common_block_size"
MESSAGE = "take the smallest candidate, not the first one found"


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
    for choice in itertools.product(*choices):  # the mistake: in the lists' order, not sorted
        candidate = math.lcm(*choice)
        if all(accepts(sizes, candidate) for sizes in backends):
            return candidate
    raise ValueError("no common block size")

"""The smallest common size always, the default never kept: CPU attention on the CPU gets 32, not the
128 every backend accepts."""

import itertools
import math

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.common_block_size"
MESSAGE = "the default wins whenever every backend accepts it"


def common_block_size(backends, default_block_size=16):
    def base(size):
        return size.base if isinstance(size, MultipleOf) else size

    def accepts(sizes, block_size):
        return not sizes or any(block_size % base(size) == 0 for size in sizes)

    # the mistake: no look at default_block_size, for one backend or several
    choices = [[base(size) for size in sizes] or [1] for sizes in backends]
    for candidate in sorted({math.lcm(*choice) for choice in itertools.product(*choices)}):
        if all(accepts(sizes, candidate) for sizes in backends):
            return candidate
    raise ValueError("no common block size")

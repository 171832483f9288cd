"""An int in a backend's list taken as the only size it accepts, as the kernel's rule has it: FlashInfer
([16, 32, 64]) then refuses 128, and FlashInfer with CUTLASS MLA finds no size."""

import itertools
import math

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.common_block_size"
MESSAGE = "an int in a backend's list accepts its multiples too"


def common_block_size(backends, default_block_size=16):
    def base(size):
        return size.base if isinstance(size, MultipleOf) else size

    def accepts(sizes, block_size):
        if not sizes:
            return True
        return any(
            block_size % size.base == 0 if isinstance(size, MultipleOf) else block_size == size  # the mistake
            for size in sizes
        )

    if len(backends) == 1:
        sizes = backends[0]
        return default_block_size if accepts(sizes, default_block_size) else min(base(s) for s in sizes)
    if all(accepts(sizes, default_block_size) for sizes in backends):
        return default_block_size
    choices = [[base(size) for size in sizes] or [1] for sizes in backends]
    for candidate in sorted({math.lcm(*choice) for choice in itertools.product(*choices)}):
        if all(accepts(sizes, candidate) for sizes in backends):
            return candidate
    raise ValueError("no common block size")

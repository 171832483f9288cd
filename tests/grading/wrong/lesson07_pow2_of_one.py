"""A doubling loop that starts at 2, so the next power of two of 1 comes out as 2."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.next_power_of_two"
MESSAGE = "the answer for 1 is 1"


def next_power_of_two(n):
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    power = 2  # the mistake: 1 = 2 ** 0 is a power of two too
    while power < n:
        power *= 2
    return power

"""Rounding an exact power of two up to the next one: 16 gives 32."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.next_power_of_two"
MESSAGE = "16 stays 16"


def next_power_of_two(n):
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return 1 << n.bit_length()  # the mistake: the bits of n, not of n - 1

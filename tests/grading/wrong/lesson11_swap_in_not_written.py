"""Swap-in allocates the blocks but never copies the K/V back: the sequence attends to stale data."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.swap_round_trip"
MESSAGE = "write the saved K and V into the new blocks"


def swap_in(allocator, seq_id, saved):
    k, _ = saved
    allocator.allocate_for_sequence(seq_id, k.shape[0])  # the mistake: no write_kv

"""Swap-out saves K twice: the sequence comes back with its keys as its values."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.swap_round_trip"
MESSAGE = "the v you return holds K"


def swap_out(allocator, seq_id):
    k, _ = allocator.read_kv(seq_id)
    allocator.free_sequence(seq_id)
    return k.cpu(), k.cpu()  # the mistake: v is K again

"""Swap-out returns (v, k): the sequence comes back with keys and values exchanged."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.swap_round_trip"
MESSAGE = "K and V are swapped"


def swap_out(allocator, seq_id):
    k, v = allocator.read_kv(seq_id)
    allocator.free_sequence(seq_id)
    return v.cpu(), k.cpu()  # the mistake: the pair is reversed

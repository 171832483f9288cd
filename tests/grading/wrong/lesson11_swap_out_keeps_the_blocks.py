"""Swap-out copies the K/V to the host but never frees the blocks: the swap makes no room."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.swap_round_trip"
MESSAGE = "free the sequence"


def swap_out(allocator, seq_id):
    k, v = allocator.read_kv(seq_id)
    return k.cpu(), v.cpu()  # the mistake: allocator.free_sequence(seq_id) is missing

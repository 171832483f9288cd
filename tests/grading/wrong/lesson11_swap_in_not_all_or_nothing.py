"""Swap-in grows the sequence token by token: when the blocks run out, a half-built sequence stays."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.swap_round_trip"
MESSAGE = "a call that raises changes nothing"


def swap_in(allocator, seq_id, saved):
    k, v = saved
    allocator.allocate_for_sequence(seq_id, 0)
    allocator.append_tokens(seq_id, k.shape[0])  # the mistake: raises with seq_id already allocated
    allocator.write_kv(seq_id, k.to(allocator.device), v.to(allocator.device))

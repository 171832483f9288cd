"""Swap-in sized by the length minus one: the last token (the latest one decoded) is lost."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.swap_round_trip"
MESSAGE = "the last one included"


def swap_in(allocator, seq_id, saved):
    k, v = saved
    num_tokens = k.shape[0] - 1  # the mistake: the last position is num_tokens - 1, not the count
    allocator.allocate_for_sequence(seq_id, num_tokens)
    allocator.write_kv(seq_id, k[:num_tokens].to(allocator.device), v[:num_tokens].to(allocator.device))

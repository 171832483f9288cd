"""Sequences grown one by one until the blocks run out: the ones before the failure keep what they took."""

import torch

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.decode_slots"
MESSAGE = "(a leak)"


def decode_slots(allocator, seq_ids):
    slots = []
    for seq_id in seq_ids:
        allocator.append_tokens(seq_id, 1)  # the mistake: no count of the whole batch first
        slots.append(allocator.slot_mapping(seq_id, [allocator.sequence_length(seq_id) - 1]))
    return torch.cat(slots)

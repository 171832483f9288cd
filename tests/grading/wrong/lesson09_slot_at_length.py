"""The slot of position length after the append, one past the new token (at length - 1)."""

import torch

from paged_kv.reference.lesson04 import decode_step
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.decode_slots"
MESSAGE = "its new token is at position length - 1"


def decode_slots(allocator, seq_ids):
    seq_ids = list(seq_ids)
    decode_step(allocator, seq_ids)
    slots = [
        allocator.slot_mapping(s, [allocator.sequence_length(s)]) for s in seq_ids
    ]  # the mistake: no - 1
    return torch.cat(slots)

"""The new token's logical position returned as its slot, never translated through the block table."""

import torch

from paged_kv.reference.lesson04 import decode_step
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.decode_slots"
MESSAGE = "you returned the position itself"


def decode_slots(allocator, seq_ids):
    seq_ids = list(seq_ids)
    decode_step(allocator, seq_ids)
    positions = [allocator.sequence_length(seq_id) - 1 for seq_id in seq_ids]
    return torch.tensor(
        positions, dtype=torch.long, device=allocator.device
    )  # the mistake: a position is no slot

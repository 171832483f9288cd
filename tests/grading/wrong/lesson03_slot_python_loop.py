"""Computing the slots with a Python loop over .tolist() instead of tensor operations."""

import torch

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.slot_mapping"
MESSAGE = "no Python loop over tokens"


def slot_mapping(block_table, positions, block_size):
    table = block_table.tolist()
    slots = [table[p // block_size] * block_size + p % block_size for p in positions.tolist()]
    return torch.tensor(slots, dtype=torch.long, device=positions.device)

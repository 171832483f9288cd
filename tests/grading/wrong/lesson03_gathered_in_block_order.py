"""Gathering the sequence's slots in physical order (sorted) instead of in token order."""

import torch

from paged_kv.kv.slots import slot_mapping as _slot_mapping
from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.write_read_kv"
MESSAGE = "the right tokens in the wrong order"


def read_kv(k_cache, v_cache, block_table, num_tokens):
    block_size = k_cache.shape[2]
    positions = torch.arange(num_tokens, device=k_cache.device)
    slots = _slot_mapping(block_table, positions, block_size).sort().values
    block_ids, offsets = slots // block_size, slots % block_size
    return k_cache[block_ids, :, offsets], v_cache[block_ids, :, offsets]

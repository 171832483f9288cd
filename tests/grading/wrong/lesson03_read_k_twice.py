"""Gathering both k and v from k_cache."""

import torch

from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.write_read_kv"
MESSAGE = "the v you return holds K"


def read_kv(k_cache, v_cache, block_table, num_tokens):
    block_size = k_cache.shape[2]
    positions = torch.arange(num_tokens, device=k_cache.device)
    block_ids, offsets = block_table[positions // block_size], positions % block_size
    return k_cache[block_ids, :, offsets], k_cache[block_ids, :, offsets]

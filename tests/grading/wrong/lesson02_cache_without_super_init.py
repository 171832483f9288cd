"""Preallocating the tensors but never calling super().__init__: no free list, no tables."""

import torch

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.kv_cache"
MESSAGE = "call super().__init__(num_blocks, block_size) first"


class PagedKVCacheAllocator(SequenceAllocator):
    def __init__(self, num_blocks, block_size, num_heads, head_dim, dtype=torch.float32, device="cpu"):
        shape = (num_blocks, num_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

"""Preallocating the cache with torch.zeros(shape, device=device): the default dtype, not the one given."""

import torch

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.kv_cache"
MESSAGE = "makes the default dtype, float32: pass dtype=dtype"


class PagedKVCacheAllocator(SequenceAllocator):
    def __init__(self, num_blocks, block_size, num_heads, head_dim, dtype=torch.float32, device="cpu"):
        super().__init__(num_blocks, block_size)
        shape = (num_blocks, num_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)

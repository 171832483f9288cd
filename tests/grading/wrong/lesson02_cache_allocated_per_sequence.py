"""Making the cache tensors anew whenever a sequence is allocated, instead of once in __init__."""

import torch

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.kv_cache"
MESSAGE = "k_cache and v_cache are allocated once, in __init__"


class PagedKVCacheAllocator(SequenceAllocator):
    def __init__(self, num_blocks, block_size, num_heads, head_dim, dtype=torch.float32, device="cpu"):
        super().__init__(num_blocks, block_size)
        self.shape = (num_blocks, num_heads, block_size, head_dim)
        self.options = {"dtype": dtype, "device": device}
        self.k_cache = torch.zeros(self.shape, **self.options)
        self.v_cache = torch.zeros(self.shape, **self.options)

    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        block_ids = super().allocate_for_sequence(seq_id, num_prompt_tokens)
        self.k_cache = torch.zeros(self.shape, **self.options)
        self.v_cache = torch.zeros(self.shape, **self.options)
        return block_ids

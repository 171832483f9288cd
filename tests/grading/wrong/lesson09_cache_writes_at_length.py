"""The new token's K and V written at position length after the append, one past where it belongs."""

import torch

from paged_kv import paged_attention
from paged_kv.grading.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "you wrote the new token at position"


class MyPagedCache(MyPagedCache):
    def attend(self, layer, seq_ids, q, k, v):
        allocator = self.allocators[layer]
        tables = allocator.block_tables_tensor(seq_ids).long()
        lengths = torch.tensor([allocator.sequence_length(s) for s in seq_ids], device=self.device)
        blocks = tables.gather(1, (lengths // self.block_size)[:, None].clamp(max=tables.shape[1] - 1))[:, 0]
        offsets = lengths % self.block_size  # the mistake: position length, not length - 1
        allocator.k_cache[blocks, :, offsets] = k
        allocator.v_cache[blocks, :, offsets] = v
        return paged_attention(q, allocator.k_cache, allocator.v_cache, tables, lengths)

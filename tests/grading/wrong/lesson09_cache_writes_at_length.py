"""The new token's K and V written at position length after the append, one past where it belongs."""

import torch

from paged_kv import paged_attention
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "you wrote the new token at position"


class MyPagedCache(MyPagedCache):
    def attend(self, layer, seq_ids, q, k, v):
        tables = torch.tensor(self.manager.block_rows(seq_ids), device=self.device)
        lengths = torch.tensor([self.manager.sequence_length(s) for s in seq_ids], device=self.device)
        blocks = tables.gather(1, (lengths // self.block_size)[:, None].clamp(max=tables.shape[1] - 1))[:, 0]
        offsets = lengths % self.block_size  # the mistake: position length, not length - 1
        k_cache, v_cache = self.storage.k_caches[layer], self.storage.v_caches[layer]
        k_cache[blocks, :, offsets] = k
        v_cache[blocks, :, offsets] = v
        return paged_attention(q, k_cache, v_cache, tables, lengths)

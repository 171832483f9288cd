"""The new token stored but left out of its own attention: the kernel gets the lengths before the append."""

import torch

from paged_kv import paged_attention
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "the new token attends to itself too"


class MyPagedCache(MyPagedCache):
    def attend(self, layer, seq_ids, q, k, v):
        super().attend(layer, seq_ids, q, k, v)  # stores k and v where they belong
        tables = torch.tensor(self.manager.block_rows(seq_ids), device=self.device)
        lengths = torch.tensor([self.manager.sequence_length(s) - 1 for s in seq_ids], device=self.device)
        k_cache, v_cache = self.storage.k_caches[layer], self.storage.v_caches[layer]
        return paged_attention(q, k_cache, v_cache, tables, lengths)  # the mistake: length - 1

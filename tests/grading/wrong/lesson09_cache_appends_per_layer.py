"""append grows every sequence once per layer, as if each layer had its own allocator."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "once per layer"


class MyPagedCache(MyPagedCache):
    def append(self, seq_ids):
        positions = super().append(seq_ids)
        for _ in range(self.storage.num_layers - 1):  # the mistake: one manager serves every layer
            self.manager.append_batch(seq_ids)
        return positions

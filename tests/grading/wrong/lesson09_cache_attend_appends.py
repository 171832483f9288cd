"""attend grows the sequences again, layer after layer, on top of the step's append."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "grows nothing"


class MyPagedCache(MyPagedCache):
    def attend(self, layer, seq_ids, q, k, v):
        out = super().attend(layer, seq_ids, q, k, v)
        self.manager.append_batch(list(seq_ids))  # the mistake: the step's append already grew them
        return out

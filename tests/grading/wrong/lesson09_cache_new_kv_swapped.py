"""The new token's K and V swapped when attend stores them (the prompt's are right)."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "K and V are swapped"


class MyPagedCache(MyPagedCache):
    def attend(self, layer, seq_ids, q, k, v):
        return super().attend(layer, seq_ids, q, v, k)  # the mistake: v goes to k_cache, k to v_cache

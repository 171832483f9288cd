"""append returns the lengths after the append as positions: every new token embedded one place too far."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "length before the append"


class MyPagedCache(MyPagedCache):
    def append(self, seq_ids):
        return super().append(seq_ids) + 1  # the mistake: the new token sits at the old length

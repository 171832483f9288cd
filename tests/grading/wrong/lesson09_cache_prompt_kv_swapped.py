"""The prompt's K and V swapped when they are stored."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "K and V are swapped"


class MyPagedCache(MyPagedCache):
    def write_prompt(self, layer, seq_id, k, v):
        super().write_prompt(layer, seq_id, v, k)  # the mistake: v where k belongs

"""A finished sequence freed in the first layer's allocator only: the other layers' pools fill up."""

from paged_kv.grading.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "not only the first"


class MyPagedCache(MyPagedCache):
    def free(self, seq_id):
        self.allocators[0].free_sequence(seq_id)  # the mistake: every layer holds the sequence

"""A new sequence allocated in the first layer's allocator only."""

from paged_kv.grading.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "must allocate the sequence in every layer"


class MyPagedCache(MyPagedCache):
    def add_sequence(self, seq_id, num_tokens):
        self.allocators[0].allocate_for_sequence(
            seq_id, num_tokens
        )  # the mistake: the other layers have no table

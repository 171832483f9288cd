"""The seed's boundary rule, (length + 1) % block_size == 0: a block asked for one token early."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "its next token needs a new one"


class MyPagedCache(MyPagedCache):
    def needs_new_block(self, seq_id):
        length = self.manager.sequence_length(seq_id)
        return (length + 1) % self.block_size == 0  # the mistake: off by one

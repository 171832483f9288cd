"""free forgets to give the blocks back: finished sequences fill the pool."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.paged_cache"
MESSAGE = "give the sequence's blocks back to the manager"


class MyPagedCache(MyPagedCache):
    def free(self, seq_id):
        pass  # the mistake: the manager still holds the sequence

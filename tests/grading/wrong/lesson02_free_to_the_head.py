"""Putting a freed block at the head of the free list (appendleft) instead of at its tail."""

from paged_kv.grading.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "not at its head"


class BlockAllocator(BlockAllocator):
    def free(self, block_id):
        block = self._used_block(block_id)
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free.appendleft(block_id)
            return True
        return False

"""Dropping one holder but putting the block on the free list whatever ref count it has left."""

from paged_kv.grading.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "block 0 still has a holder, so it must stay off the free list"


class BlockAllocator(BlockAllocator):
    def free(self, block_id):
        block = self._used_block(block_id)
        block.ref_count -= 1
        self._free.append(block_id)
        return block.ref_count == 0

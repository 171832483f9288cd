"""Dropping one holder but putting the block on the free list whatever ref count it has left."""

from collections import deque

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "block 0 still has a holder, so it must stay off the free list"


class BlockAllocator(BlockAllocator):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_block_queue = deque(
            self.free_block_queue
        )  # the exercise's deque free list, where the mistake is made

    def free(self, block_id):
        block = self._used_block(block_id)
        block.ref_count -= 1
        self.free_block_queue.append(block_id)
        return block.ref_count == 0

"""Allocating with pop() from the tail of the free list (LIFO) instead of popleft() from its head."""

from collections import deque

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "popping from the tail (LIFO)"


class BlockAllocator(BlockAllocator):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_block_queue = deque(
            self.free_block_queue
        )  # the exercise's deque free list, where the mistake is made

    def allocate(self):
        if not self.free_block_queue:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self.free_block_queue.pop()
        self._blocks[block_id].ref_count = 1
        return block_id

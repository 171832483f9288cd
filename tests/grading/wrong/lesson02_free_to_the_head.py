"""Putting a freed block at the head of the free list (appendleft) instead of at its tail."""

from collections import deque

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "not at its head"


class BlockAllocator(BlockAllocator):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_block_queue = deque(
            self.free_block_queue
        )  # the exercise's deque free list, where the mistake is made

    def free(self, block_id):
        block = self._used_block(block_id)
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_queue.appendleft(block_id)
            return True
        return False

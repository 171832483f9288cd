"""Accepting free() of a block that is already free, which puts it on the free list twice."""

from collections import deque

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "a double free"


class BlockAllocator(BlockAllocator):
    def __init__(self, num_blocks):
        super().__init__(num_blocks)
        self.free_block_queue = deque(
            self.free_block_queue
        )  # the exercise's deque free list, where the mistake is made

    def free(self, block_id):
        block = self._block(block_id)  # the range check, but no check that the block is in use
        block.ref_count = max(block.ref_count - 1, 0)
        if block.ref_count == 0:
            self.free_block_queue.append(block_id)
            return True
        return False

"""Returning a block to the free list on every free(), even while another holder still uses it."""

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "only when its ref count reaches 0"


class BlockAllocator(BlockAllocator):
    def free(self, block_id):
        block = self._used_block(block_id)
        block.ref_count = 0
        self.free_block_queue.append(block_id)
        return True

"""Checking only block_id < num_blocks, so that a negative id quietly reads a block from the end."""

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "quietly reads from the end for a negative id"


class BlockAllocator(BlockAllocator):
    def _block(self, block_id):
        if block_id >= self.num_blocks:
            raise ValueError(f"block_id must be below {self.num_blocks}, got {block_id}")
        return self._blocks[block_id]

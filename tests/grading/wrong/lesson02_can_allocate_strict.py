"""Comparing n < num_free_blocks in can_allocate, which refuses to hand out the last free block."""

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.block_allocator"
MESSAGE = "off by one with <?"


class BlockAllocator(BlockAllocator):
    def can_allocate(self, num_blocks=1):
        return num_blocks < self.num_free_blocks

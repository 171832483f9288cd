"""Catching the error of a failing allocate() and raising the right one, but keeping the blocks taken."""

from paged_kv import BlockTable, OutOfBlocksError, blocks_for_tokens
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "the failed call took blocks and kept them (a leak)"


class SequenceAllocator(SequenceAllocator):
    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        free = self.allocator.num_free_blocks
        try:
            block_ids = [self.allocator.allocate() for _ in range(needed)]
        except OutOfBlocksError:
            raise OutOfBlocksError(needed=needed, free=free) from None
        self.tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)

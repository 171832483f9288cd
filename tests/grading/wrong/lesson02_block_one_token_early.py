"""Giving a sequence n // block_size + 1 blocks, a block too many when its last block is exactly full."""

from paged_kv import BlockTable, OutOfBlocksError
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "off by one at the block boundary"


class SequenceAllocator(SequenceAllocator):
    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = num_prompt_tokens // self.block_size + 1
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed=needed, free=self.allocator.num_free_blocks)
        block_ids = [self.allocator.allocate() for _ in range(needed)]
        self.tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)

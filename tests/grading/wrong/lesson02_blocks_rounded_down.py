"""Giving a sequence n // block_size blocks, one too few when its last block is only partly full."""

from paged_kv import BlockTable, OutOfBlocksError
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "33 // 16 rounds down to 2"


class SequenceAllocator(SequenceAllocator):
    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = num_prompt_tokens // self.block_size
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed=needed, free=self.allocator.num_free_blocks)
        block_ids = [self.allocator.allocate() for _ in range(needed)]
        self.tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)

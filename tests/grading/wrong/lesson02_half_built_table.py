"""Recording the sequence's table before checking for free blocks, so that a failed call leaves it behind."""

from paged_kv import BlockTable, OutOfBlocksError, blocks_for_tokens
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "left a half-built table"


class SequenceAllocator(SequenceAllocator):
    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        table = self.tables[seq_id] = BlockTable([], num_prompt_tokens)
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed=needed, free=self.allocator.num_free_blocks)
        for _ in range(needed):
            table.append_block(self.allocator.allocate())
        return list(table.block_ids)

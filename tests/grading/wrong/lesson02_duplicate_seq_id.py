"""Accepting a sequence id that is already allocated, which replaces its table and leaks its blocks."""

from paged_kv import BlockTable, OutOfBlocksError, blocks_for_tokens
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "a duplicate id must raise ValueError"


class SequenceAllocator(SequenceAllocator):
    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed=needed, free=self.allocator.num_free_blocks)
        block_ids = [self.allocator.allocate() for _ in range(needed)]
        self.tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)

"""Taking blocks one by one without checking first, so that a failed allocation keeps the blocks it took."""

from paged_kv import BlockTable, blocks_for_tokens
from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "the blocks taken before it leak"


class SequenceAllocator(SequenceAllocator):
    def allocate_for_sequence(self, seq_id, num_prompt_tokens):
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        block_ids = [self.allocator.allocate() for _ in range(needed)]  # raises halfway
        self.tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)

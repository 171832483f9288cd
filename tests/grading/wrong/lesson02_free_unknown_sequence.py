"""Popping the table with self.tables.pop(seq_id), a KeyError for a sequence that was never allocated."""

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "no-op that returns []"


class SequenceAllocator(SequenceAllocator):
    def free_sequence(self, seq_id):
        table = self.tables.pop(seq_id)
        return [block_id for block_id in table.block_ids if self.allocator.free(block_id)]

"""Returning every block of a freed sequence, even one that another table still holds."""

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "return only the blocks for which allocator.free(...) returned True"


class SequenceAllocator(SequenceAllocator):
    def free_sequence(self, seq_id):
        table = self.tables.pop(seq_id, None)
        if table is None:
            return []
        for block_id in table.block_ids:
            self.allocator.free(block_id)
        return list(table.block_ids)

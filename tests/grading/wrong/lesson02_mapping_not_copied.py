"""Returning the table's own list from get_block_mapping, so that a caller can change the table."""

from paged_kv.reference.lesson02 import *  # every other task stays right

BREAKS = "02.sequence_allocator"
MESSAGE = "return a copy of the block ids"


class SequenceAllocator(SequenceAllocator):
    def get_block_mapping(self, seq_id):
        return self.tables[seq_id].block_ids

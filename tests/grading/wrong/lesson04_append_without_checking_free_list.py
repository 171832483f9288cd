"""Appending a block with free_blocks.popleft() and no look at the free list first."""

from paged_kv.reference.lesson04 import *  # every other task stays right
from tests.grading.wrong._block_manager import GivenBlockManager

BREAKS = "04.append_block"
MESSAGE = "check the free list before taking from it"


class BlockManager(GivenBlockManager):
    def append_block_to_sequence(self, seq_id):
        table = self.sequence_block_tables[seq_id]
        block_id = self.free_blocks.popleft()
        self.blocks[block_id].ref_count = 1
        table.append_block(block_id)
        return block_id

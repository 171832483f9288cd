"""Taking a block off the free list for a sequence but never adding it to the sequence's table."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right
from tests.grading.wrong._block_manager import GivenBlockManager

BREAKS = "04.append_block"
MESSAGE = "left the free list but the table of 'a' does not hold it"


class BlockManager(GivenBlockManager):
    def append_block_to_sequence(self, seq_id):
        if seq_id not in self.sequence_block_tables:
            raise KeyError(seq_id)
        if not self.free_blocks:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self.free_blocks.popleft()
        self.blocks[block_id].ref_count = 1
        return block_id

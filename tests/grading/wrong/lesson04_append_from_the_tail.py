"""Taking the appended block from the tail of the free list (pop) instead of its head (popleft)."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right
from tests.grading.wrong._block_manager import GivenBlockManager

BREAKS = "04.append_block"
MESSAGE = "take its head with free_blocks.popleft()"


class BlockManager(GivenBlockManager):
    def append_block_to_sequence(self, seq_id):
        table = self.sequence_block_tables[seq_id]
        if not self.free_blocks:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self.free_blocks.pop()
        self.blocks[block_id].ref_count = 1
        table.append_block(block_id)
        return block_id

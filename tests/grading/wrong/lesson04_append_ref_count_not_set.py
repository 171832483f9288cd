"""Appending a block without giving it its holder: its ref count stays 0."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right
from tests.grading.wrong._block_manager import GivenBlockManager

BREAKS = "04.append_block"
MESSAGE = "ref count is still 0, so it looks free"


class BlockManager(GivenBlockManager):
    def append_block_to_sequence(self, seq_id):
        table = self.sequence_block_tables[seq_id]
        if not self.free_blocks:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self.free_blocks.popleft()
        table.append_block(block_id)
        return block_id

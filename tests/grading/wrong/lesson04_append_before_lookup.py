"""Taking the block before looking the sequence up, so an unknown id leaks a block."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right
from tests.grading.wrong._block_manager import GivenBlockManager

BREAKS = "04.append_block"
MESSAGE = "the refused call took a block and leaked it"


class BlockManager(GivenBlockManager):
    def append_block_to_sequence(self, seq_id):
        if not self.free_blocks:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self.free_blocks.popleft()
        self.blocks[block_id].ref_count = 1
        self.sequence_block_tables[seq_id].append_block(block_id)
        return block_id

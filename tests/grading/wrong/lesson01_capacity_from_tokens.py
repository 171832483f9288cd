"""Computing the capacity from the blocks the tokens need instead of the blocks the table holds."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.block_table"
MESSAGE = "not the blocks its tokens need"


class BlockTable(BlockTable):
    def capacity(self, block_size: int) -> int:
        return blocks_for_tokens(self.num_tokens, block_size) * block_size

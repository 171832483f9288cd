"""Copying a table as BlockTable(self.block_ids, ...), a second table around the same list."""

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.block_table"
MESSAGE = "wraps the same list in a second table"


class BlockTable(BlockTable):
    def copy(self) -> "BlockTable":
        return BlockTable(self.block_ids, self.num_tokens)

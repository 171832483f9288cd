"""Writing `block_ids=[]` as the default, one list that every table made without block_ids shares."""

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.block_table"
MESSAGE = "a default of [] is created once"


class BlockTable(BlockTable):
    def __init__(self, block_ids: list[int] = [], num_tokens: int = 0) -> None:  # noqa: B006
        self.block_ids = block_ids
        self.num_tokens = num_tokens

"""Freezing the Block dataclass, so that the allocator cannot change its ref count in place."""

from dataclasses import dataclass

from paged_kv.reference.lesson01 import *  # every other task stays right

BREAKS = "01.block"
MESSAGE = "do not freeze the dataclass"


@dataclass(frozen=True)
class Block:
    block_id: int
    ref_count: int = 0

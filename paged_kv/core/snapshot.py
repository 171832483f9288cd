"""A frozen copy of the block manager's bookkeeping, for comparisons, traces and pictures (lessons 01-13)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from paged_kv.core.block import BlockTable


@dataclass(frozen=True)
class AllocatorSnapshot:
    """Everything a :class:`~paged_kv.kv.cache.PagedKVCacheAllocator` knows, except the K/V data.

    Two snapshots are equal exactly when the allocators they were taken from would behave the same
    from then on: same free list order, same ref counts, same sequences with the same tables. The
    tables are copies, so a snapshot never changes after it is taken.

    ``null_block`` is the id of a pool's null block, when it has one (a hybrid model's pool, lesson
    13: block 0, never allocated nor freed, in a table where a block left a sliding window), else
    ``None``.
    """

    num_blocks: int
    block_size: int
    free_block_ids: tuple[int, ...]
    ref_counts: tuple[int, ...]
    tables: dict[Hashable, BlockTable] = field(default_factory=dict)
    null_block: int | None = None

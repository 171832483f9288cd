"""Lesson 02's names over the package: ``BlockAllocator`` is
:class:`paged_kv.core.block_allocator.BlockAllocator`
itself; ``PagedKVCacheAllocator(num_blocks, block_size, num_heads, head_dim, dtype, device)`` is
:class:`paged_kv.kv.cache.PagedKVCacheAllocator` (its ``k_cache`` and ``v_cache``, allocated once) that
exposes its pool as ``allocator`` and its tables as ``tables``, like the exercise's class, and
returns the block ids from ``allocate_for_sequence`` rather than a copy of the table; and
``SequenceAllocator(num_blocks, block_size)`` is that cache with one head of dimension one (its
bookkeeping, with tensors too small to matter).

The exercise builds them the other way round (its cache is a ``SequenceAllocator`` with tensors);
the checks only use what both have.
"""

from collections.abc import Hashable as _Hashable

from paged_kv.core.block import BlockTable as _BlockTable
from paged_kv.core.block_allocator import BlockAllocator
from paged_kv.kv.cache import PagedKVCacheAllocator as _PackageCache

__all__ = ["BlockAllocator", "PagedKVCacheAllocator", "SequenceAllocator"]


class PagedKVCacheAllocator(_PackageCache):
    """The package's cache as the exercise's class: ``allocator``, ``tables`` and block ids back.

    Its constructor is the package's, whose first six arguments are the exercise's.
    """

    @property
    def allocator(self) -> BlockAllocator:
        """The pool: its free list and ref counts."""
        return self.manager.allocator

    @property
    def tables(self) -> dict[_Hashable, _BlockTable]:
        """The live block tables, by sequence id (the manager's own dict, not a copy)."""
        return self.manager.tables

    def allocate_for_sequence(self, seq_id: _Hashable, num_prompt_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its prompt and return their ids, all or nothing."""
        return super().allocate_for_sequence(seq_id, num_prompt_tokens).block_ids


class SequenceAllocator(PagedKVCacheAllocator):
    """Block tables for many sequences on one BlockAllocator: the cache with tensors too small to matter."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, num_heads=1, head_dim=1)

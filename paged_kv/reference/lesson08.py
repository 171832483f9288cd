"""Exercise 08 graded on the package.

``SharedCache`` is :class:`paged_kv.kv.cache.PagedKVCacheAllocator` seen as the exercise's class: its pool
as ``allocator``, its tables as ``tables`` (the cache's own dict), and ``allocate_for_sequence``
returning the block ids. ``fork`` is :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.fork` and
``append_token`` is :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.append_tokens` of one token, which
copies a shared block on write. ``block_hashes`` is :func:`paged_kv.core.prefix_cache.chain_hashes` of the
prompt's :func:`~paged_kv.core.prefix_cache.full_blocks`. ``cached_prefix`` states, on the exercise's plain
``{hash: (token_ids, block_id)}`` dict, the rule the package's prefix cache applies
(:meth:`~paged_kv.core.prefix_cache.PrefixCache.match` under the limit of
:meth:`~paged_kv.core.block_manager.BlockManager.allocate`): the leading full blocks whose
hash is cached with the same tokens, the first miss ending the run, at most ``len - 1`` tokens. The
package also checks each hit's parent entry, which the exercise's dict does not hold.
"""

from collections.abc import Hashable as _Hashable
from collections.abc import Sequence as _Sequence

import torch as _torch

from paged_kv.core.block import BlockTable as _BlockTable
from paged_kv.core.block_allocator import BlockAllocator as _BlockAllocator
from paged_kv.core.prefix_cache import chain_hashes as _chain_hashes
from paged_kv.core.prefix_cache import full_blocks as _full_blocks
from paged_kv.kv.cache import PagedKVCacheAllocator as _PagedKVCacheAllocator

__all__ = ["SharedCache", "append_token", "block_hashes", "cached_prefix", "fork"]


class SharedCache(_PagedKVCacheAllocator):
    """The package's paged cache, with the exercise's view of its state."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int = 1,
        head_dim: int = 1,
        device: str | _torch.device = "cpu",
    ) -> None:
        super().__init__(num_blocks, block_size, num_heads, head_dim, device=device)

    @property
    def allocator(self) -> _BlockAllocator:
        """The pool: its free list and ref counts."""
        return self.manager.allocator

    @property
    def tables(self) -> dict[_Hashable, _BlockTable]:
        """The live block tables, by sequence id (the manager's own dict, not a copy)."""
        return self.manager.tables

    def allocate_for_sequence(self, seq_id: _Hashable, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its prompt and return their ids, all or nothing."""
        return super().allocate_for_sequence(seq_id, num_tokens).block_ids


def fork(cache: SharedCache, parent_id: _Hashable, child_id: _Hashable) -> list[int]:
    """Start ``child_id`` sharing every block of ``parent_id``; return the child's block ids."""
    return cache.fork(parent_id, child_id).block_ids


def append_token(cache: SharedCache, seq_id: _Hashable) -> int | None:
    """Grow the sequence by one token; the block it took (fresh, or a copy of a shared one), else None."""
    taken = cache.append_tokens(seq_id, 1)
    return taken[0] if taken else None


def block_hashes(token_ids: _Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of the prompt."""
    return _chain_hashes(_full_blocks(token_ids, block_size))


def cached_prefix(
    token_ids: _Sequence[int], block_size: int, cache: dict[int, tuple[tuple[int, ...], int]]
) -> list[int]:
    """The block ids of the longest cached run of leading full blocks, at most ``len - 1`` tokens."""
    blocks = _full_blocks(token_ids, block_size)
    limit = max(0, (len(token_ids) - 1) // block_size)
    hits = []
    for tokens, block_hash in zip(blocks[:limit], _chain_hashes(blocks), strict=False):
        entry = cache.get(block_hash)
        if entry is None or tuple(entry[0]) != tokens:
            break
        hits.append(entry[1])
    return hits

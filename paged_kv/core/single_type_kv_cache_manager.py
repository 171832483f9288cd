"""One KV-cache group's block tables over a shared pool: full attention or a sliding window (lesson 13).

vLLM 0.33.0 keeps one such manager per KV-cache group (``vllm/v1/core/single_type_kv_cache_manager.py``:
``SingleTypeKVCacheManager``, with ``FullAttentionManager`` and ``SlidingWindowManager``), all
drawing from one :class:`~paged_kv.core.block_pool.BlockPool`; the
:class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator` asks every manager before it takes
a block for any of them. A model whose layers all attend fully has one group, and so one
:class:`FullAttentionManager`. A manager holds, per request, the list of its group's block ids, one per
logical block: logical block ``j`` holds positions ``j * block_size ..`` of the request in every
layer of the group.

**The null block.** A sliding-window layer never reads a block that lies wholly before the window
of the request's next token: :meth:`SingleTypeKVCacheManager.remove_skipped_blocks` gives such blocks back
to the pool and puts the **null block** (block 0 of the pool,
:data:`~paged_kv.core.block_pool.NULL_BLOCK`, never allocated nor freed) in their place. The table keeps
its length, so logical block ``j`` is still entry ``j`` and a position's slot is computed as before; the
attention's window mask never reads the null entries. A full-attention manager skips nothing.

Invariants, per request, after every call:

* its list holds ``ceil(num_tokens / block_size)`` entries for the tokens it was given slots for;
* the null block appears only before every real block, and only in a sliding-window group: the
  entries of blocks wholly before the window of the request's computed tokens;
* every real block in the list holds one reference of the pool for this list.

With prefix caching each full block is cached under the chained hash of its request's tokens and
extra keys (its salt on its first block, its LoRA name on every block: the request's
:class:`~paged_kv.core.prefix_cache.RequestExtraKeys`, which its chain carries into decode),
tagged with the group (:class:`~paged_kv.core.prefix_cache.PrefixCache`); a block freed from the
window stays cached, evictable, on the pool's free list. The pool alone stores and evicts hashes
(:meth:`~paged_kv.core.block_pool.BlockPool.cache_block`, its ``allocate``).
:meth:`find_longest_cache_hit` is where the two kinds differ most: full attention needs every block of
the prefix, a sliding window only the blocks its first uncomputed token reads.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_pool import NULL_BLOCK, BlockPool
from paged_kv.core.kv_cache_groups import AttentionSpec, FullAttentionSpec, SlidingWindowSpec
from paged_kv.core.prefix_cache import NO_EXTRA_KEYS, CachedBlock, HashChain, RequestExtraKeys, TokenIds


class SingleTypeKVCacheManager:
    """The block tables of KV-cache group ``group_id``, whose layers have ``spec``, over ``block_pool``
    (vLLM: ``SingleTypeKVCacheManager``). A sliding-window group needs the pool's null block."""

    def __init__(self, spec: AttentionSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec, self.block_pool, self.group_id = spec, block_pool, group_id
        self.block_size = spec.block_size
        self.req_to_blocks: dict[Hashable, list[int]] = {}
        self._chains: dict[Hashable, HashChain] = {}  # with prefix caching and token ids

    def get_num_blocks_to_allocate(
        self, request_id: Hashable, num_tokens: int, hits: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> int:
        """Free blocks the request takes to hold ``num_tokens`` tokens (vLLM:
        ``get_num_blocks_to_allocate``): its missing blocks, and for a new request the ``hits`` (its
        prefix-cache hit, :data:`NULL_BLOCK` where skipped) that sit on the free list. A new
        request's first ``num_skipped_tokens(num_computed_tokens)`` tokens need no block."""
        required = blocks_for_tokens(num_tokens, self.block_size)
        held = self.req_to_blocks.get(request_id)
        if held is not None:
            return max(0, required - len(held))
        skipped = self.spec.num_skipped_tokens(num_computed_tokens) // self.block_size
        fresh = max(0, required - max(skipped, len(hits)))
        return fresh + self.block_pool.num_revived(hits[skipped:])

    def save_new_computed_blocks(self, request_id: Hashable, hits: Sequence[int]) -> None:
        """Start a new request's list with its prefix-cache ``hits``, one more holder for each real
        block (vLLM: ``save_new_computed_blocks``, through the pool's ``touch``)."""
        self.block_pool.touch(hits)
        self.req_to_blocks[request_id] = list(hits)

    def allocate_new_blocks(self, request_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """Take the blocks the request is missing to hold ``num_tokens`` tokens (the caller checked
        they are free); return them, in table order (vLLM: ``allocate_new_blocks``)."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        new = self.block_pool.get_new_blocks(-(-num_tokens // self.block_size) - len(blocks))
        blocks += new
        return tuple(new)

    def remove_skipped_blocks(self, request_id: Hashable, num_computed_tokens: int) -> list[int]:
        """Give back the blocks wholly before the window of the request's token at position
        ``num_computed_tokens`` and put :data:`NULL_BLOCK` in their place (vLLM:
        ``remove_skipped_blocks``); return the ids given back. From the last such block down to
        the first null one: what an earlier call nulled stays."""
        blocks = self.req_to_blocks.get(request_id)
        skipped = self.spec.num_skipped_tokens(num_computed_tokens) // self.block_size
        if not blocks or not skipped:
            return []
        freed = []
        for index in range(min(skipped, len(blocks)) - 1, -1, -1):
            if blocks[index] == NULL_BLOCK:
                break
            freed.append(blocks[index])
            blocks[index] = NULL_BLOCK
        self.block_pool.free_blocks(freed)
        return freed

    def start_chain(
        self,
        request_id: Hashable,
        last_hit: CachedBlock | None,
        num_hit_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> None:
        """Follow the request's full blocks in the chain of hashes from its hit on (prefix caching),
        each hashed with its ``extra_keys``. A hit whose last block the group did not need (a window
        of one token) gives no chain: the next block's parent is unknown, so it is not cached."""
        if num_hit_blocks and last_hit is None:
            return
        self._chains[request_id] = HashChain(last_hit, num_hit_blocks, extra_keys=extra_keys)

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Cache each full block the request's ``token_ids`` (its new ones) filled, under its
        chained hash and this group, as soon as its tokens are scheduled (vLLM: ``cache_blocks``).
        A sliding window's chain goes on after its earlier blocks were evicted."""
        chain = self._chains.get(request_id)
        if chain is None:
            return
        sliding = isinstance(self.spec, SlidingWindowSpec)
        blocks = self.req_to_blocks[request_id]
        if not self.block_pool.cache_full_blocks(
            chain, token_ids, blocks, self.block_size, self.group_id, sliding
        ):
            del self._chains[request_id]

    def free(self, request_id: Hashable) -> list[int]:
        """Give back every real block of the request, the last first (so that a cached prefix loses
        its tail before its head); return them in that order."""
        self._chains.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, [])
        freed = [b for b in reversed(blocks) if b != NULL_BLOCK]
        self.block_pool.free_blocks(freed)
        return freed

    def find_longest_cache_hit(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[CachedBlock | None], int]:
        """The group's longest prefix-cache hit of at most ``max_blocks`` blocks: the entry of each
        of its blocks (``None`` where the group does not need the block) and its length in blocks;
        an entry matches a block only under the request's ``extra_keys``."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    """A group of full-attention layers (vLLM: ``FullAttentionManager``): every block of the prefix."""

    def find_longest_cache_hit(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[CachedBlock | None], int]:
        hits = self.block_pool.prefix_cache.match(blocks, hashes, max_blocks, self.group_id, extra_keys)
        return list(hits), len(hits)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A group of sliding-window layers (vLLM: ``SlidingWindowManager``): only the window's blocks."""

    spec: SlidingWindowSpec

    def find_longest_cache_hit(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[CachedBlock | None], int]:
        need = self.spec.blocks_for_hit
        if not need:  # a window of one token: no earlier K/V is ever read
            return [None] * max_blocks, max_blocks
        return self.block_pool.prefix_cache.match_window(
            blocks, hashes, max_blocks, need, self.group_id, extra_keys
        )


def get_manager_for_kv_cache_spec(
    spec: AttentionSpec, block_pool: BlockPool, group_id: int
) -> SingleTypeKVCacheManager:
    """The manager of a group whose layers have ``spec`` (vLLM: ``get_manager_for_kv_cache_spec``)."""
    kind = FullAttentionManager if isinstance(spec, FullAttentionSpec) else SlidingWindowManager
    return kind(spec, block_pool, group_id)

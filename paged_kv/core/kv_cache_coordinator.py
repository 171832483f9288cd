"""The KV-cache coordinator: every KV-cache group of a hybrid model over one block pool (lesson 13).

vLLM 0.33.0's ``KVCacheManager`` talks to a coordinator (``vllm/v1/core/kv_cache_coordinator.py``;
``HybridKVCacheCoordinator`` when the groups' specs differ) that holds one single-type manager per
group (:mod:`paged_kv.core.single_type_manager`) over one ``BlockPool``. This is the same split,
with the same calls the engine's scheduler makes on a :class:`~paged_kv.core.block_manager.BlockManager`
(:meth:`get_computed_blocks`, :meth:`allocate_slots`, :meth:`free`, :meth:`get_block_ids`), so
the :class:`~paged_kv.serving.memory.KVCacheManager` drives either.

**One pool.** The groups draw blocks from one :class:`~paged_kv.core.block_allocator.BlockAllocator`
(a :class:`~paged_kv.core.prefix_cache.CachingBlockAllocator` with prefix caching) whose block 0 is
the null block, taken here once and never given back (vLLM's ``BlockPool`` does the same): a pool of
``num_blocks`` blocks has ``num_blocks - 1`` to give out.

**All or none.** :meth:`allocate_slots` first gives back, in every sliding-window group, the blocks
wholly before the window of the request's next token (as vLLM does before it counts: this frees
blocks, never takes one, and stays done even when the allocation is refused), then asks every
group how many free blocks it would take, and takes them only when all of them, plus ``keep_free``,
are free; else it returns ``None`` and takes nothing.

**A hit every group agrees on.** With prefix caching, each group finds its longest hit in its own
way (every block of the prefix for full attention, only the window's blocks for a sliding window),
and the request's hit is the longest prefix every group hits: a fixed point, the candidate length
shrinking until no group shortens it (vLLM: ``HybridKVCacheCoordinator.find_longest_cache_hit``).
A full-attention hit is a prefix of every longer one, so trimming it is free; a sliding-window group
is asked again at each new length, since a shorter prefix needs other blocks.

Invariants, after every call: each request has a list in every group, all of the same length
``ceil(num_tokens / block_size)``; ``num_tokens`` is the tokens it was given slots for; a block is
held by at most one group; used + free blocks == ``num_blocks`` (the null block counts as used).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_allocator import BlockAllocator
from paged_kv.core.kv_cache_groups import KVCacheGroupSpec, SlidingWindowSpec
from paged_kv.core.prefix_cache import (
    CachedBlock,
    CachingBlockAllocator,
    PrefixCacheStats,
    chain_hashes,
    check_token_ids,
    full_blocks,
)
from paged_kv.core.single_type_manager import NULL_BLOCK, SingleTypeManager, manager_for
from paged_kv.validate import check_count, check_hashable

BlockIdLists = tuple[list[int], ...]
"""One list of block ids per KV-cache group, in group order (vLLM: ``KVCacheBlocks.get_block_ids()``)."""


@dataclass(frozen=True)
class GroupComputedBlocks:
    """The cached prefix a new request can start with, in every group (vLLM: the ``KVCacheBlocks`` of
    ``get_computed_blocks``): per group the block id of each of its ``num_tokens // block_size``
    blocks, :data:`~paged_kv.core.single_type_manager.NULL_BLOCK` where the group does not need it."""

    block_ids: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0
    entries: tuple[tuple[CachedBlock | None, ...], ...] = field(default=(), repr=False)


class KVCacheCoordinator:
    """The block tables of every KV-cache group in ``groups`` over one pool of ``num_blocks`` blocks.

    ``max_tokens_in_flight`` bounds the tokens one request computes in a step (the engine's token
    budget; ``None``: any number), so a sliding-window group's share of a whole prompt admitted
    for its first chunk is capped as vLLM caps it (``SlidingWindowSpec.max_blocks_per_request``).

    Raises:
        ValueError: no groups, groups of different block sizes or sharing a layer, a pool of fewer
            than 2 blocks (the null block and one more), or a bad ``max_tokens_in_flight``.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        num_blocks: int,
        *,
        enable_prefix_caching: bool = False,
        max_tokens_in_flight: int | None = None,
    ) -> None:
        self.groups = tuple(groups)
        if not self.groups or not all(isinstance(g, KVCacheGroupSpec) for g in self.groups):
            raise ValueError(f"groups must be one KVCacheGroupSpec or more, got {groups!r}")
        sizes = {g.spec.block_size for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"every group must have the same block_size, got {sorted(sizes)}")
        layers = [layer for g in self.groups for layer in g.layers]
        if len(layers) != len(set(layers)):
            raise ValueError(
                f"a layer belongs to one group only, got the groups {[g.layers for g in self.groups]}"
            )
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=2)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        self.max_tokens_in_flight = (
            None
            if max_tokens_in_flight is None
            else check_count("max_tokens_in_flight", max_tokens_in_flight, minimum=1)
        )
        self.block_size = sizes.pop()
        pool = CachingBlockAllocator(num_blocks) if enable_prefix_caching else BlockAllocator(num_blocks)
        self.pool: BlockAllocator = pool
        null = pool.allocate()  # the head of a fresh free list: block 0, held for ever
        assert null == NULL_BLOCK
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            manager_for(g.spec, pool, i) for i, g in enumerate(self.groups)
        )
        self._num_tokens: dict[Hashable, int] = {}

    def __repr__(self) -> str:
        kinds = ", ".join(type(m).__name__ for m in self.managers)
        return f"KVCacheCoordinator([{kinds}], num_blocks={self.num_blocks}, free={self.num_free_blocks})"

    # ----------------------------------------------------------------------------- the pool

    @property
    def enable_prefix_caching(self) -> bool:
        return isinstance(self.pool, CachingBlockAllocator)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Blocks in use over the blocks the pool can give out, the null block left out of both
        (vLLM: ``BlockPool.get_usage``)."""
        return 1.0 - self.pool.num_free_blocks / (self.num_blocks - 1)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompts, prompt tokens looked up and prompt tokens found; all 0 without prefix caching."""
        if isinstance(self.pool, CachingBlockAllocator):
            return self.pool.prefix_cache.stats
        return PrefixCacheStats()

    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._num_tokens
        except TypeError:
            return False

    def num_tokens(self, request_id: Hashable) -> int:
        """The tokens the request was given slots for."""
        return self._num_tokens[request_id]

    def get_block_ids(self, request_id: Hashable) -> BlockIdLists:
        """The request's block ids, one new list per group (vLLM: ``KVCacheManager.get_block_ids``),
        with :data:`~paged_kv.core.single_type_manager.NULL_BLOCK` where a block left a window.

        Raises:
            KeyError: the request holds no blocks here.
        """
        if request_id not in self._num_tokens:
            raise KeyError(request_id)
        return tuple(list(m.req_to_blocks[request_id]) for m in self.managers)

    # --------------------------------------------------------------------- the life of a request

    def get_computed_blocks(self, token_ids: Sequence[int]) -> GroupComputedBlocks:
        """The longest cached prefix of ``token_ids`` that every group hits, whole blocks, at most
        ``len(token_ids) - 1`` tokens (the last one is always computed); see the module. Nothing
        changes; without prefix caching it finds nothing.

        Raises:
            ValueError: ``token_ids`` is not a list of non-negative integers.
        """
        token_ids = check_token_ids(token_ids, None)
        if not isinstance(self.pool, CachingBlockAllocator) or len(token_ids) < 2:
            return GroupComputedBlocks()
        blocks = full_blocks(token_ids, self.block_size)
        hashes = chain_hashes(blocks)
        length = (len(token_ids) - 1) // self.block_size  # candidate hit, in blocks
        found: list[list[CachedBlock | None]] = [[] for _ in self.managers]
        while True:
            candidate = length
            for index, manager in enumerate(self.managers):
                found[index], length = manager.find_longest_cache_hit(blocks, hashes, length)
            if length == candidate:
                break
        for index in range(len(found)):
            del found[index][length:]  # a full-attention hit found before the length shrank
        block_ids = tuple(tuple(NULL_BLOCK if e is None else e.block_id for e in hits) for hits in found)
        return GroupComputedBlocks(block_ids, length * self.block_size, tuple(map(tuple, found)))

    def allocate_slots(
        self,
        request_id: Hashable,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        computed: GroupComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        keep_free: int = 0,
        preempted: bool = False,
    ) -> BlockIdLists | None:
        """Take the blocks, in every group, for ``num_new_tokens`` more tokens of a request, all or
        none (vLLM: ``KVCacheManager.allocate_slots``; see the module).

        A request the coordinator does not hold is new: it starts with the ``computed`` blocks
        (:meth:`get_computed_blocks`) and grows by ``num_new_tokens`` after them. ``token_ids`` are
        the request's tokens from its first on, at least through the new ones (``None``: unknown;
        with prefix caching, each full block they fill is cached when they are scheduled).
        ``num_tokens_to_fit`` (vLLM's ``full_sequence_must_fit``) asks that the blocks of that many
        tokens be free as well, a sliding-window group's capped at what it ever holds at once;
        ``keep_free`` blocks must stay free after either. A new request's lookup is counted in
        :attr:`prefix_cache_stats` (with ``token_ids`` and prefix caching), apart when
        ``preempted`` says it resumes after a preemption, as vLLM counts it.

        Returns:
            The block ids each group gained, in table order (for a new request, all of them, hits
            and null blocks first: vLLM's ``NewRequestData.block_ids``); ``None`` when too few blocks
            are free, and then no block was taken.

        Raises:
            ValueError: a bad count; ``computed`` given for a held request, or no longer cached;
                ``token_ids`` shorter than the tokens it must cover. Nothing changes.
        """
        num_new_tokens = check_count("num_new_tokens", num_new_tokens)
        keep_free = check_count("keep_free", keep_free)
        held = self._num_tokens.get(check_hashable("request_id", request_id))
        if held is not None and computed is not None:
            raise ValueError(f"computed blocks are a new request's, but {request_id!r} holds blocks already")
        computed = computed if held is None and computed is not None else GroupComputedBlocks()
        start = computed.num_tokens if held is None else held
        end = start + num_new_tokens
        if token_ids is not None and len(token_ids) < end:
            raise ValueError(
                f"token_ids must cover the request's {end} tokens, through the new ones, got {len(token_ids)}"
            )
        hits = computed.block_ids or ((),) * len(self.managers)
        if held is None and computed.num_tokens:
            self._check_still_cached(computed)
        if num_tokens_to_fit is not None:
            fit = max(end, check_count("num_tokens_to_fit", num_tokens_to_fit))
            if (
                self._blocks_to_allocate(request_id, hits, start, fit, cap=True) + keep_free
                > self.num_free_blocks
            ):
                return None
        if held is not None:
            for manager in self.managers:
                manager.remove_skipped_blocks(request_id, held)
        if self._blocks_to_allocate(request_id, hits, start, end) + keep_free > self.num_free_blocks:
            return None
        if held is None:  # every group's hits first: a fresh block must never evict another group's hit
            for manager, group_hits in zip(self.managers, hits, strict=True):
                manager.add_hits(request_id, group_hits)
        gained = []
        for manager, group_hits in zip(self.managers, hits, strict=True):
            new = manager.allocate_new_blocks(request_id, end)
            gained.append([*group_hits, *new] if held is None else new)
        if held is None:
            self._start_request(request_id, computed, token_ids, preempted)
        self._num_tokens[request_id] = end
        if token_ids is not None and end > start:
            for manager in self.managers:
                manager.cache_blocks(request_id, token_ids[start:end])
        return tuple(gained)

    def remove_skipped_blocks(self, request_id: Hashable, num_computed_tokens: int) -> list[int]:
        """Give back, in every sliding-window group, the request's blocks wholly before the window of
        its token at ``num_computed_tokens`` (:data:`~paged_kv.core.single_type_manager.NULL_BLOCK`
        in their place); return the ids given back. :meth:`allocate_slots` does it by itself."""
        if request_id not in self._num_tokens:
            return []
        num_computed_tokens = min(
            check_count("num_computed_tokens", num_computed_tokens), self._num_tokens[request_id]
        )
        return [
            b
            for manager in self.managers
            for b in manager.remove_skipped_blocks(request_id, num_computed_tokens)
        ]

    def free(self, request_id: Hashable) -> list[int]:
        """Give back every block of the request in every group (an unknown id is a no-op); return
        them, each group's last block first."""
        if self._num_tokens.pop(check_hashable("request_id", request_id), None) is None:
            return []
        return [b for manager in self.managers for b in manager.free(request_id)]

    # ------------------------------------------------------------------------------- helpers

    def _blocks_to_allocate(
        self,
        request_id: Hashable,
        hits: Sequence[Sequence[int]],
        start: int,
        num_tokens: int,
        cap: bool = False,
    ) -> int:
        """Free blocks every group together takes to hold ``num_tokens`` (a sliding window's capped
        at what it ever holds at once, with ``cap``)."""
        total = 0
        for manager, group_hits in zip(self.managers, hits, strict=True):
            tokens = num_tokens
            if cap and isinstance(manager.spec, SlidingWindowSpec):
                in_flight = self.max_tokens_in_flight or num_tokens
                most = manager.spec.max_blocks_per_request(in_flight, num_tokens) * self.block_size
                tokens = min(num_tokens, start + most)
            total += manager.num_blocks_to_allocate(request_id, tokens, group_hits, start)
        return total

    def _check_still_cached(self, computed: GroupComputedBlocks) -> None:
        cache = self.pool.prefix_cache  # type: ignore[attr-defined]  # hits come from a caching pool
        for entries in computed.entries:
            if any(e is not None and cache.entry(e.block_id) is not e for e in entries):
                raise ValueError("computed blocks are no longer cached: look them up again")

    def _start_request(
        self,
        request_id: Hashable,
        computed: GroupComputedBlocks,
        token_ids: Sequence[int] | None,
        preempted: bool = False,
    ) -> None:
        """A new request's prefix-cache bookkeeping: the lookup counted (apart for a resumed
        request's), a chain per group."""
        if not isinstance(self.pool, CachingBlockAllocator) or token_ids is None:
            return
        self.pool.prefix_cache.record(len(token_ids), computed.num_tokens, preempted)
        num_hit_blocks = computed.num_tokens // self.block_size
        for index, manager in enumerate(self.managers):
            entries = computed.entries[index] if computed.entries else ()
            manager.start_chain(request_id, entries[-1] if entries else None, num_hit_blocks)


def peak_blocks(
    groups: Sequence[KVCacheGroupSpec], num_tokens: int, max_tokens_in_flight: int | None = None
) -> int:
    """The most blocks one request of ``num_tokens`` tokens, alone, holds at once over every group:
    a full-attention group holds them all; a sliding-window group at most its window and the tokens
    a step computes (``max_tokens_in_flight``; ``None``: a whole prompt may run in one step, so the
    window caps nothing). The null block is not counted."""
    total = 0
    for group in groups:
        blocks = blocks_for_tokens(num_tokens, group.spec.block_size)
        if isinstance(group.spec, SlidingWindowSpec) and max_tokens_in_flight is not None:
            blocks = min(blocks, group.spec.max_blocks_per_request(max_tokens_in_flight, num_tokens))
        total += blocks
    return total


def max_tokens_alone(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_tokens_in_flight: int | None = None
) -> int:
    """The longest request a pool of ``num_blocks`` blocks (the null block among them) holds alone:
    the most tokens whose :func:`peak_blocks` is at most ``num_blocks - 1`` (``2**31`` when every
    group slides under a token budget: no length is too long)."""
    low, high = 0, 1 << 31
    while low < high:
        middle = (low + high + 1) // 2
        if peak_blocks(groups, middle, max_tokens_in_flight) <= num_blocks - 1:
            low = middle
        else:
            high = middle - 1
    return low

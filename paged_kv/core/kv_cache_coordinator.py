"""The KV-cache coordinator: every KV-cache group of a model over one block pool (lessons 09, 13).

vLLM 0.33.0's ``KVCacheManager`` talks to a coordinator (``vllm/v1/core/kv_cache_coordinator.py``)
that holds one single-type manager per KV-cache group (:mod:`paged_kv.core.single_type_kv_cache_manager`)
over one :class:`~paged_kv.core.block_pool.BlockPool`: a ``UnitaryKVCacheCoordinator`` for a model
of one group (every layer attends fully, the common case), a ``HybridKVCacheCoordinator`` for
several (sliding-window layers beside full-attention ones, lesson 13), and, when prefix caching is
off, a ``KVCacheCoordinatorNoPrefixCache`` whose lookup finds nothing whatever the groups. The
course has the first three classes (with caching off, its manager looks nothing up, which is all the
fourth does differently), and the engine's memory (:class:`~paged_kv.core.kv_cache_manager.KVCacheManager`)
runs every model on one of them: its ``allocate_slots`` asks the coordinator for each step, and the
coordinator asks every group (vLLM's names: :meth:`~KVCacheCoordinator.remove_skipped_blocks`,
:meth:`~KVCacheCoordinator.get_num_blocks_to_allocate`,
:meth:`~KVCacheCoordinator.save_new_computed_blocks`,
:meth:`~KVCacheCoordinator.allocate_new_blocks`, :meth:`~KVCacheCoordinator.cache_blocks`).

**One pool.** Every group draws from one pool whose block 0 is the null block, taken once and never
given back (vLLM's ``BlockPool`` does the same for every model): a pool of ``num_blocks`` blocks has
``num_blocks - 1`` to give out.

**A hit every group agrees on.** With prefix caching, each group finds its longest hit in its own
way (every block of the prefix for full attention, only the window's blocks for a sliding window).
One group's hit is the request's (:class:`UnitaryKVCacheCoordinator`); with several, the request's
hit is the longest prefix every group hits, a fixed point, the candidate length shrinking until no
group shortens it (:class:`HybridKVCacheCoordinator`, vLLM's ``find_longest_cache_hit``). Every
group hashes and matches a request's blocks with the same extra keys (its salt on block 0, its
LoRA name on every block: :class:`~paged_kv.core.prefix_cache.RequestExtraKeys`), so a salt
isolates a request in every group alike.

Invariants, after every call: a request has a list in every group or in none, all of the same
length; a block is held by at most one group; used + free blocks == ``num_blocks`` (the null block
counts as used).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_pool import NULL_BLOCK, BlockPool
from paged_kv.core.kv_cache_groups import KVCacheGroupSpec, SlidingWindowSpec
from paged_kv.core.prefix_cache import (
    NO_EXTRA_KEYS,
    CachedBlock,
    PrefixCacheStats,
    RequestExtraKeys,
    TokenIds,
    chain_hashes,
    check_token_ids,
    full_blocks,
)
from paged_kv.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from paged_kv.validate import check_count

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids in vLLM's shape: one tuple per KV-cache group, in the groups' order (vLLM:
``KVCacheBlocks.get_block_ids()``)."""


@dataclass(frozen=True)
class ComputedBlocks:
    """The cached prefix a new request can start with, in every group (vLLM: the ``KVCacheBlocks`` and
    ``num_computed_tokens`` of ``get_computed_blocks``): per group the block id of each of its
    ``num_tokens // block_size`` blocks, :data:`~paged_kv.core.block_pool.NULL_BLOCK` where the group
    does not need it (a sliding window's blocks before the window). Empty: no hit."""

    block_ids: BlockIds = ()
    num_tokens: int = 0
    entries: tuple[tuple[CachedBlock | None, ...], ...] = field(default=(), repr=False)


class KVCacheCoordinator:
    """The block tables of every KV-cache group in ``kv_cache_groups`` over one pool of ``num_blocks``
    blocks (see the module); :func:`get_kv_cache_coordinator` picks the subclass.

    ``max_in_flight_tokens`` bounds the tokens one request computes before its blocks are settled
    (vLLM's ``VllmConfig.max_in_flight_tokens``: the token budget of the one batch in flight;
    ``None``: no budget), so a sliding-window group's share of a whole prompt admitted for its first
    chunk is capped as vLLM caps it (``SlidingWindowSpec.max_admission_blocks_per_request``).

    Raises:
        ValueError: no groups, groups of different block sizes or sharing a layer, a pool of fewer
            than 2 blocks (the null block and one more), or a bad ``max_in_flight_tokens``.
    """

    def __init__(
        self,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        num_blocks: int,
        *,
        enable_caching: bool = False,
        max_in_flight_tokens: int | None = None,
    ) -> None:
        self.kv_cache_groups = tuple(kv_cache_groups)
        if not self.kv_cache_groups or not all(isinstance(g, KVCacheGroupSpec) for g in self.kv_cache_groups):
            raise ValueError(f"kv_cache_groups must be one KVCacheGroupSpec or more, got {kv_cache_groups!r}")
        sizes = {g.spec.block_size for g in self.kv_cache_groups}
        if len(sizes) != 1:
            raise ValueError(f"every group must have the same block_size, got {sorted(sizes)}")
        layers = [layer for g in self.kv_cache_groups for layer in g.layers]
        if len(layers) != len(set(layers)):
            raise ValueError(
                "a layer belongs to one group only, got the groups "
                f"{[g.layers for g in self.kv_cache_groups]}"
            )
        self.max_in_flight_tokens = (
            None
            if max_in_flight_tokens is None
            else check_count("max_in_flight_tokens", max_in_flight_tokens, minimum=1)
        )
        self.block_size = sizes.pop()
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.num_blocks = self.block_pool.num_blocks
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(g.spec, self.block_pool, i)
            for i, g in enumerate(self.kv_cache_groups)
        )
        self._sliding = tuple(m for m in self.single_type_managers if isinstance(m.spec, SlidingWindowSpec))
        self._lists = tuple(m.req_to_blocks for m in self.single_type_managers)

    def __repr__(self) -> str:
        kinds = ", ".join(type(m).__name__ for m in self.single_type_managers)
        return f"{type(self).__name__}([{kinds}], num_blocks={self.num_blocks}, free={self.num_free_blocks})"

    # ----------------------------------------------------------------------------- the pool

    @property
    def enable_caching(self) -> bool:
        return self.block_pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Requests, tokens looked up and tokens found, a resumed request's apart; all 0 without caching."""
        return self.block_pool.prefix_cache.stats

    @property
    def has_sliding_window(self) -> bool:
        """Whether some group slides, so that a request's old blocks leave its window."""
        return bool(self._sliding)

    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._lists[0]
        except TypeError:
            return False

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        """The requests that hold blocks, in the order they came."""
        return tuple(self._lists[0])

    def num_held_blocks(self, request_id: Hashable) -> int:
        """The length of the request's list in each group (the null blocks counted)."""
        return len(self._lists[0][request_id])

    def get_block_ids(self, request_id: Hashable) -> BlockIds:
        """The request's block ids, one tuple per group (vLLM: ``KVCacheCoordinator.get_blocks``), with
        :data:`~paged_kv.core.block_pool.NULL_BLOCK` where a block left a window.

        Raises:
            KeyError: the request holds no blocks here.
        """
        return tuple(tuple(blocks[request_id]) for blocks in self._lists)

    # --------------------------------------------------------------------- the life of a request

    def get_computed_blocks(
        self, token_ids: Sequence[int], extra_keys: RequestExtraKeys = NO_EXTRA_KEYS
    ) -> ComputedBlocks:
        """The longest cached prefix of ``token_ids`` the groups hit, whole blocks, at most
        ``len(token_ids) - 1`` tokens (the last one is always computed), its blocks hashed and
        matched with the request's ``extra_keys``. Nothing changes; without prefix caching it finds
        nothing.

        Raises:
            ValueError: ``token_ids`` is not a list of non-negative integers.
        """
        token_ids = check_token_ids(token_ids, None)
        if not self.block_pool.enable_caching or len(token_ids) < 2:
            return ComputedBlocks()
        blocks = full_blocks(token_ids, self.block_size)
        found, length = self.find_longest_cache_hit(
            blocks, chain_hashes(blocks, extra_keys), (len(token_ids) - 1) // self.block_size, extra_keys
        )
        block_ids = tuple(tuple(NULL_BLOCK if e is None else e.block_id for e in hits) for hits in found)
        return ComputedBlocks(block_ids, length * self.block_size, tuple(map(tuple, found)))

    def find_longest_cache_hit(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[list[CachedBlock | None]], int]:
        """Each group's entries of the request's hit (``None`` where a group does not need a block)
        and the hit's length in blocks, at most ``max_blocks``, under the request's ``extra_keys``."""
        raise NotImplementedError

    def check_still_cached(self, computed: ComputedBlocks) -> None:
        """Raise a ValueError unless every block of the hit ``computed`` is still cached as found."""
        cache = self.block_pool.prefix_cache
        for entries in computed.entries:
            if any(e is not None and cache.entry(e.block_id) is not e for e in entries):
                raise ValueError("computed blocks are no longer cached: look them up again")

    def remove_skipped_blocks(self, request_id: Hashable, num_computed_tokens: int) -> list[int]:
        """Give back, in every sliding-window group, the request's blocks wholly before the window of
        its token at ``num_computed_tokens`` (the null block in their place); return the ids given
        back (vLLM: ``remove_skipped_blocks``). It frees, never takes."""
        return [b for m in self._sliding for b in m.remove_skipped_blocks(request_id, num_computed_tokens)]

    def get_num_blocks_to_allocate(
        self,
        request_id: Hashable,
        num_tokens: int,
        new_computed_blocks: BlockIds,
        num_computed_tokens: int,
        *,
        cap: bool = False,
    ) -> int:
        """Free blocks every group together takes for the request to hold ``num_tokens`` (vLLM:
        ``get_num_blocks_to_allocate``): its missing blocks, and for a new request the hits of
        ``new_computed_blocks`` that sit on the free list. With ``cap``, a sliding window's share is
        capped at what it ever holds at once (the blocks of its window and the tokens in flight)."""
        total = 0
        for manager, group_hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            tokens = num_tokens
            if cap and isinstance(manager.spec, SlidingWindowSpec):
                in_flight = self.max_in_flight_tokens or num_tokens
                most = manager.spec.max_admission_blocks_per_request(in_flight, num_tokens) * self.block_size
                tokens = min(num_tokens, num_computed_tokens + most)
            total += manager.get_num_blocks_to_allocate(request_id, tokens, group_hits, num_computed_tokens)
        return total

    def save_new_computed_blocks(self, request_id: Hashable, new_computed_blocks: BlockIds) -> None:
        """Start a new request's list in every group with its hit, one more holder on each block
        (vLLM: ``save_new_computed_blocks``). Every group's hits come first: a fresh block taken
        after must never evict another group's hit."""
        for manager, group_hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, group_hits)

    def allocate_new_blocks(self, request_id: Hashable, num_tokens: int) -> BlockIds:
        """Take, in every group, the blocks the request is missing to hold ``num_tokens`` (the caller
        counted them free: :meth:`get_num_blocks_to_allocate`); return them, one tuple per group."""
        return tuple([m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers])

    def start_chains(
        self, request_id: Hashable, computed: ComputedBlocks, extra_keys: RequestExtraKeys = NO_EXTRA_KEYS
    ) -> None:
        """With prefix caching, follow a new request's hash chain in every group from its hit on, its
        blocks hashed with its ``extra_keys``."""
        num_hit_blocks = computed.num_tokens // self.block_size
        for index, manager in enumerate(self.single_type_managers):
            entries = computed.entries[index] if computed.entries else ()
            manager.start_chain(request_id, entries[-1] if entries else None, num_hit_blocks, extra_keys)

    def cache_blocks(self, request_id: Hashable, new_token_ids: Sequence[int]) -> None:
        """Cache, in every group, the full blocks the request's ``new_token_ids`` (the ones just
        scheduled) fill (vLLM: ``cache_blocks``)."""
        for manager in self.single_type_managers:
            manager.cache_blocks(request_id, new_token_ids)

    def free(self, request_id: Hashable) -> list[int]:
        """Give back every block of the request in every group (an unknown id is a no-op); return
        them, each group's last block first (so that a cached prefix loses its tail before its head)."""
        return [b for manager in self.single_type_managers for b in manager.free(request_id)]


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """The coordinator of a model of one KV-cache group (vLLM: ``UnitaryKVCacheCoordinator``): the
    group's own hit is the request's."""

    def find_longest_cache_hit(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[list[CachedBlock | None]], int]:
        manager = self.single_type_managers[0]
        hits, length = manager.find_longest_cache_hit(blocks, hashes, max_blocks, extra_keys)
        return [hits], length


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """The coordinator of a model of several KV-cache groups (vLLM: ``HybridKVCacheCoordinator``): the
    request's hit is the longest prefix every group hits, found as a fixed point. A full-attention
    hit is a prefix of every longer one, so trimming it is free; a sliding-window group is asked
    again at each new length, since a shorter prefix needs other blocks."""

    def find_longest_cache_hit(
        self,
        blocks: Sequence[TokenIds],
        hashes: Sequence[int],
        max_blocks: int,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[list[list[CachedBlock | None]], int]:
        length = max_blocks
        found: list[list[CachedBlock | None]] = [[] for _ in self.single_type_managers]
        while True:
            candidate = length
            for index, manager in enumerate(self.single_type_managers):
                found[index], length = manager.find_longest_cache_hit(blocks, hashes, length, extra_keys)
            if length == candidate:
                break
        for hits in found:
            del hits[length:]  # a full-attention hit found before the length shrank
        return found, length


def get_kv_cache_coordinator(
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    *,
    enable_caching: bool = False,
    max_in_flight_tokens: int | None = None,
) -> KVCacheCoordinator:
    """The coordinator for ``kv_cache_groups`` (vLLM: ``get_kv_cache_coordinator``): unitary for one
    group, hybrid for several, with prefix caching on or off (vLLM gives a model without it its
    ``KVCacheCoordinatorNoPrefixCache``)."""
    kind = UnitaryKVCacheCoordinator if len(kv_cache_groups) == 1 else HybridKVCacheCoordinator
    return kind(
        kv_cache_groups, num_blocks, enable_caching=enable_caching, max_in_flight_tokens=max_in_flight_tokens
    )


def group_names(groups: Sequence[KVCacheGroupSpec]) -> tuple[str, ...]:
    """A short name per group: ``"sw"`` for a sliding window, ``"full"`` for full attention, numbered
    within its kind when the model has several groups of that kind.

    >>> from paged_kv.core.kv_cache_groups import kv_cache_groups
    >>> group_names(kv_cache_groups([8, None], 4)), group_names(kv_cache_groups([8, 8, None], 4))
    (('sw', 'full'), ('sw0', 'sw1', 'full'))
    """
    kinds = ["sw" if isinstance(g.spec, SlidingWindowSpec) else "full" for g in groups]
    seen: dict[str, int] = {}
    names = []
    for kind in kinds:
        names.append(f"{kind}{seen.get(kind, 0)}" if kinds.count(kind) > 1 else kind)
        seen[kind] = seen.get(kind, 0) + 1
    return tuple(names)


def table_name(group_name: str, request_id: Hashable) -> str:
    """The name of a request's table in a group, ``"sw·a"``: the group, then the request."""
    return f"{group_name}\N{MIDDLE DOT}{request_id}"


def peak_blocks(
    groups: Sequence[KVCacheGroupSpec], num_tokens: int, max_in_flight_tokens: int | None = None
) -> int:
    """The most blocks one request of ``num_tokens`` tokens, alone, holds at once over every group:
    a full-attention group holds them all; a sliding-window group at most its window and the tokens
    in flight (``max_in_flight_tokens``; ``None``: a whole prompt may run in one step, so the window
    caps nothing). The null block is not counted."""
    total = 0
    for group in groups:
        blocks = blocks_for_tokens(num_tokens, group.spec.block_size)
        if isinstance(group.spec, SlidingWindowSpec) and max_in_flight_tokens is not None:
            blocks = min(
                blocks, group.spec.max_admission_blocks_per_request(max_in_flight_tokens, num_tokens)
            )
        total += blocks
    return total


def max_tokens_alone(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_in_flight_tokens: int | None = None
) -> int:
    """The longest request a pool of ``num_blocks`` blocks (the null block among them) holds alone:
    the most tokens whose :func:`peak_blocks` is at most ``num_blocks - 1`` (``2**31`` when every
    group slides under a token budget: no length is too long)."""
    low, high = 0, 1 << 31
    while low < high:
        middle = (low + high + 1) // 2
        if peak_blocks(groups, middle, max_in_flight_tokens) <= num_blocks - 1:
            low = middle
        else:
            high = middle - 1
    return low

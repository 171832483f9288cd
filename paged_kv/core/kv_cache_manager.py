"""The scheduler's paged memory, for every model: vLLM's ``KVCacheManager`` (lessons 07, 09, 11, 13).

:class:`~paged_kv.serving.scheduler.Scheduler` asks its memory the questions of
:class:`~paged_kv.serving.protocols.KVMemory` and nothing else. :class:`KVCacheManager` is the paged
answer, vLLM 0.33.0's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``): one block stack for
every model, a :class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator` (unitary for a
model of one KV-cache group, hybrid for several) over one
:class:`~paged_kv.core.block_pool.BlockPool` whose block 0 is the null block. It holds no tensor.

**One allocate_slots.** Blocks are taken when the tokens that need them are scheduled, by
:meth:`KVCacheManager.allocate_slots`, the one algorithm for a decode token (its block when it
crosses a boundary), a prefill chunk and a new request: first, in every sliding-window group, the
blocks wholly before the window of the request's next token are given back (this frees, never
takes, and stays done when the allocation is refused); then the free blocks every group would
take are counted, and taken only when all of them fit, plus the watermark's for a new request
while others run; else it returns ``None`` and nothing was taken. The coordinator does each
group's share of every step (vLLM's ``remove_skipped_blocks``, ``get_num_blocks_to_allocate``,
``save_new_computed_blocks``, ``allocate_new_blocks``, ``cache_blocks``); the manager keeps what
each request was given slots for. Block ids come in vLLM's shape, one tuple per KV-cache group.

**The admission rule is vLLM's** (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``,
with ``scheduler_reserve_full_isl`` on, its default): a waiting request is admitted when the blocks
of its whole prompt (less the prefix-cache hits nobody else holds) fit in the free blocks, plus the
watermark's blocks when some request is already running; then only its first chunk's blocks are
taken. No block is kept back for the running requests' growth: when a running request's next token
finds no free block, the newest running request is preempted.

**Extra keys and who reads the cache.** A request's blocks are hashed with its extra keys (vLLM's
``generate_block_hash_extra_keys``): its ``cache_salt`` in its first block's hash, its
``lora_name`` in every block's (:mod:`paged_kv.core.prefix_cache`), in every group, prefill and
decode alike; so requests of different salts never share a block, and a request with neither
hashes as before. A request that asks for ``prompt_logprobs`` is never given a hit (vLLM's
``skip_reading_prefix_cache``, set by ``SamplingParams`` for it: a cached token's logits are not
computed again, so its log-probability could not be given), and its lookup is not counted; its
blocks are cached for the others all the same.

**What the metrics read** (:mod:`paged_kv.serving.metrics`): :attr:`KVCacheManager.usage`, the share
of the blocks in use, where a free block that still holds a cached prefix counts as free and the
null block counts in neither (vLLM's ``BlockPool.get_usage``); and the prefix cache's counters, where
a request admitted again after a preemption counts its lookup apart
(:class:`~paged_kv.core.prefix_cache.PrefixCacheStats`): the scheduler says so (``preempted``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from typing import Protocol

from paged_kv.core.block import BlockTable, blocks_for_tokens
from paged_kv.core.block_pool import BlockPoolListener
from paged_kv.core.kv_cache_coordinator import (
    BlockIds,
    ComputedBlocks,
    get_kv_cache_coordinator,
    group_names,
    max_tokens_alone,
    table_name,
)
from paged_kv.core.kv_cache_groups import KVCacheGroupSpec, full_attention_group
from paged_kv.core.prefix_cache import PrefixCacheStats, request_extra_keys
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.validate import check_count, check_hashable


def check_watermark(watermark: object) -> float:
    """``watermark`` as a float, or a ValueError naming it: a fraction of the blocks in ``[0, 1)``."""
    if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark!r}")
    return float(watermark)


def watermark_blocks(watermark: float, num_blocks: int) -> int:
    """The blocks an admission ``watermark`` (a fraction of the pool) keeps free: rounded up (lesson 11).

    Rounding up means any watermark above 0 keeps at least one block free (vLLM 0.33.0 rounds
    down: ``int(watermark * num_blocks)``).
    """
    return math.ceil(check_watermark(watermark) * check_count("num_blocks", num_blocks, minimum=1))


def blocks_alone(num_prompt_tokens: int, max_tokens: int, block_size: int) -> tuple[int, int]:
    """The blocks a request of one KV-cache group needs alone: to be admitted (its whole prompt), and
    at its longest, ``num_prompt_tokens + max_tokens - 1`` tokens (its last token is sampled, never
    fed back). The pool needs one block more, its null block."""
    admit = blocks_for_tokens(num_prompt_tokens, block_size)
    peak = blocks_for_tokens(num_prompt_tokens + max_tokens - 1, block_size)
    return admit, peak


class KVCacheRequest(Protocol):
    """What the manager reads of a request: its id (vLLM's ``KVCacheManager`` is given the whole
    ``Request``; the engine passes its :class:`~paged_kv.serving.request.EngineCoreRequest`), and,
    where it has them, ``cache_salt`` and ``lora_name`` (its blocks' extra keys) and
    ``sampling_params.prompt_logprobs`` (:func:`skip_reading_prefix_cache`); a request without
    them has no extra keys and reads the cache."""

    @property
    def request_id(self) -> Hashable: ...


def skip_reading_prefix_cache(request: object) -> bool:
    """Whether ``request`` must not be given prefix-cache hits: it asks for ``prompt_logprobs``
    (vLLM: ``Request.skip_reading_prefix_cache``, which ``SamplingParams`` sets when
    ``prompt_logprobs is not None``), whose every prompt token's logits the forward must compute.
    Its blocks are still cached, for other requests."""
    params = getattr(request, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is not None


class KVCacheManager:
    """The scheduler's paged memory: ``num_blocks`` blocks (the null block among them) of
    ``block_size`` slots shared by ``kv_cache_groups`` (default: one group, every layer attending
    fully), and the admission watermark (vLLM: ``KVCacheManager``; see the module).

    ``enable_caching`` turns prefix caching on: a new request's tokens are looked up
    (:meth:`get_computed_blocks`) and every block its scheduled tokens fill is cached when they are
    scheduled. ``watermark`` (a fraction in ``[0, 1)``) keeps ``ceil(watermark * num_blocks)`` blocks
    free when a new request is given blocks while others run, as vLLM keeps its ``watermark_blocks``;
    the running requests' own growth may use them. ``max_in_flight_tokens`` is the token budget of a
    step (vLLM's ``VllmConfig.max_in_flight_tokens``; ``None``: no budget), which caps what a
    sliding-window group holds at once.

    Invariants, after every call: each held request has a list in every group, all of the same
    length ``ceil(num_tokens / block_size)``, where ``num_tokens`` (:meth:`num_tokens`) is the tokens
    it was given slots for; a block is held by at most one group; used + free blocks ==
    ``num_blocks`` (the null block counts as used).

    Raises:
        ValueError: a bad count or watermark, or a ``block_size`` other than the groups', named.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int | None = None,
        *,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        enable_caching: bool = False,
        watermark: float = 0.0,
        max_in_flight_tokens: int | None = None,
    ) -> None:
        if kv_cache_groups is None:
            kv_cache_groups = full_attention_group(16 if block_size is None else block_size)
        elif block_size is not None and block_size != kv_cache_groups[0].spec.block_size:
            raise ValueError(
                f"block_size {block_size} differs from the kv_cache_groups' "
                f"{kv_cache_groups[0].spec.block_size}"
            )
        self.watermark = check_watermark(watermark)
        self.coordinator = coordinator = get_kv_cache_coordinator(
            kv_cache_groups,
            num_blocks,
            enable_caching=enable_caching,
            max_in_flight_tokens=max_in_flight_tokens,
        )
        self.block_pool = coordinator.block_pool
        self.block_size, self.num_blocks = coordinator.block_size, coordinator.num_blocks
        self.kv_cache_groups = coordinator.kv_cache_groups
        self.enable_caching = self.block_pool.enable_caching
        self.watermark_blocks = watermark_blocks(self.watermark, self.num_blocks)
        self._held: dict[Hashable, _Held] = {}  # by request, in the order they came
        self._stats_read = PrefixCacheStats()  # the counters at the last make_prefix_cache_stats()
        # Bound once for the hot path of allocate_slots: a running request's next tokens.
        self._num_groups = len(self.kv_cache_groups)
        self._sliding = coordinator.has_sliding_window
        self._free_block_queue = self.block_pool.free_block_queue
        self._only_group = (
            coordinator.single_type_managers[0].req_to_blocks if self._num_groups == 1 else None
        )
        self._nothing: BlockIds = ((),) * self._num_groups

    def __repr__(self) -> str:
        return f"KVCacheManager({self.coordinator!r}, watermark_blocks={self.watermark_blocks})"

    # ----------------------------------------------------------------------------- the pool

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Blocks in use over the blocks the pool gives out (vLLM: ``KVCacheManager.usage``, the "GPU
        KV cache usage" and ``vllm:kv_cache_usage_perc``)."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters since the memory was built, a resumed request's lookups apart."""
        return self.block_pool.prefix_cache.stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counts since the last call (vLLM: ``KVCacheManager.make_prefix_cache_stats``,
        which takes and resets them; here :attr:`prefix_cache_stats` keeps counting)."""
        stats = self.prefix_cache_stats
        since, self._stats_read = stats - self._stats_read, stats
        return since

    @property
    def reserved_tokens(self) -> int:
        """The slots of the blocks in use, the null block left out."""
        return (self.block_pool.num_usable_blocks - self.block_pool.num_free_blocks) * self.block_size

    def max_tokens(self, request: KVCacheRequest) -> int:
        """The longest request the pool holds alone, its sliding-window groups capped at their window
        and the tokens in flight (:func:`~paged_kv.core.kv_cache_coordinator.max_tokens_alone`)."""
        coordinator = self.coordinator
        return max_tokens_alone(
            coordinator.kv_cache_groups, self.num_blocks, coordinator.max_in_flight_tokens
        )

    def add_listener(self, listener: BlockPoolListener) -> None:
        """Tell ``listener`` every block the pool caches and evicts
        (:class:`~paged_kv.core.block_pool.BlockPoolListener`)."""
        self.block_pool.add_listener(listener)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no request holds a block (vLLM's)."""
        return self.block_pool.reset_prefix_cache()

    def describe_free(self) -> str:
        return f"{self.block_pool.num_free_blocks} free blocks out of {self.block_pool.num_usable_blocks}"

    # ---------------------------------------------------------------------- the requests held

    def __contains__(self, request_id: object) -> bool:
        try:
            return request_id in self._held
        except TypeError:
            return False

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        """The requests that hold blocks, in the order they came."""
        return tuple(self._held)

    def num_tokens(self, request_id: Hashable) -> int:
        """The tokens the request was given slots for.

        Raises:
            KeyError: the request holds no blocks here.
        """
        return self._held[request_id].num_tokens

    def get_block_ids(self, request_id: Hashable) -> BlockIds:
        """The request's block ids, one tuple per group (vLLM: ``KVCacheManager.get_block_ids``), with
        :data:`~paged_kv.core.block_pool.NULL_BLOCK` where a block left a window.

        Raises:
            KeyError: the request holds no blocks here.
        """
        if request_id not in self._held:
            raise KeyError(request_id)
        return self.coordinator.get_block_ids(request_id)

    def snapshot(self) -> AllocatorSnapshot:
        """A frozen copy of the bookkeeping, for the pool picture, the player and the live page: one
        table per request and group (named by the request alone when every layer attends fully, else
        ``"sw·a"`` or ``"full·a"``: :func:`~paged_kv.core.kv_cache_coordinator.group_names`), the free
        list, ref counts and the null block."""
        names = group_names(self.kv_cache_groups)
        plain = self._num_groups == 1 and not self._sliding  # every layer attends fully: one table a request
        tables: dict[Hashable, BlockTable] = {}
        for request_id, held in self._held.items():
            for name, block_ids in zip(names, self.coordinator.get_block_ids(request_id), strict=True):
                tables[request_id if plain else table_name(name, request_id)] = BlockTable(
                    list(block_ids), held.num_tokens
                )
        pool = self.block_pool
        return AllocatorSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_block_ids=pool.free_block_ids,
            ref_counts=tuple(pool.ref_count(b) for b in range(self.num_blocks)),
            tables=tables,
            null_block=pool.null_block,
        )

    # --------------------------------------------------------------------- the life of a request

    def get_computed_blocks(self, request: KVCacheRequest, token_ids: Sequence[int] | None) -> ComputedBlocks:
        """The cached prefix of ``token_ids`` every group hits under ``request``'s extra keys (its
        salt and LoRA name), whole blocks, at most ``len(token_ids) - 1`` tokens; none without
        caching or token ids, or for a request that asks for ``prompt_logprobs``
        (:func:`skip_reading_prefix_cache`, vLLM's). Nothing changes.

        Raises:
            ValueError: ``token_ids`` is not a list of non-negative integers; ``cache_salt`` or
                ``lora_name`` is not a string.
        """
        if token_ids is None or not self.enable_caching or skip_reading_prefix_cache(request):
            return ComputedBlocks()
        return self.coordinator.get_computed_blocks(token_ids, request_extra_keys(request, self.block_size))

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        new_computed_blocks: ComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        has_scheduled_reqs: bool = True,
        preempted: bool = False,
        delay_cache_blocks: bool = False,
    ) -> BlockIds | None:
        """Take the blocks, in every group, for ``num_new_tokens`` more tokens of ``request``, all or
        none (vLLM: ``KVCacheManager.allocate_slots``; see the module).

        A request the manager does not hold is new: it starts with ``new_computed_blocks``
        (:meth:`get_computed_blocks`) and grows by ``num_new_tokens`` after them, keeping the
        watermark's blocks free when ``has_scheduled_reqs`` (vLLM applies it to waiting requests
        only, and only then). ``token_ids`` are the request's tokens from its first on, at least
        through the new ones (``None``: unknown); with prefix caching, each full block they fill is
        cached now, when they are scheduled: they are computed in this step's forward, before any
        later step reads them. ``num_tokens_to_fit`` (vLLM's ``full_sequence_must_fit``) asks that
        the blocks of that many tokens be free as well, a sliding-window group's capped at what it
        holds at once. A new request's lookup is counted in :attr:`prefix_cache_stats` (with
        ``token_ids`` and caching, and unless it skips the cache for ``prompt_logprobs``), apart
        when ``preempted`` says it resumes after a preemption, as vLLM counts it. A new request's
        blocks are hashed with its extra keys (``cache_salt``, ``lora_name``) from now on, decode
        included. ``delay_cache_blocks`` (vLLM's, for a new request whose ``num_new_tokens`` are
        external, loaded by a KV connector later) caches none of the new tokens' blocks now: the
        scheduler calls :meth:`cache_blocks` once they are loaded.

        Returns:
            The block ids each group gained, in table order (for a new request, all of them, hits and
            null blocks first: vLLM's ``NewRequestData.block_ids``); ``None`` when too few blocks are
            free, and then no block was taken.

        Raises:
            ValueError: a bad count; ``new_computed_blocks`` given for a held request, or no longer
                cached; ``token_ids`` shorter than the tokens it must cover; a ``cache_salt`` or
                ``lora_name`` that is not a string. Nothing changes.
        """
        if not self.enable_caching:
            token_ids = None
        request_id = request.request_id
        if new_computed_blocks is None and num_tokens_to_fit is None and not delay_cache_blocks:
            try:
                held = self._held.get(request_id)
            except TypeError:  # not hashable: the message every call gives
                check_hashable("request_id", request_id)
                raise
            if held is not None:  # a running request: the hot path, a few comparisons
                if type(num_new_tokens) is not int or num_new_tokens < 0:
                    num_new_tokens = check_count("num_new_tokens", num_new_tokens)
                start = held.num_tokens
                end = start + num_new_tokens
                if token_ids is not None and len(token_ids) < end:
                    _short(token_ids, end)
                if self._sliding:
                    self.coordinator.remove_skipped_blocks(request_id, start)
                gained = self._nothing
                if end > held.capacity:  # blocks to take, as many in every group
                    missing = -(-(end - held.capacity) // self.block_size)
                    if missing * self._num_groups > self._free_block_queue.num_free_blocks:
                        return None
                    if missing == 1 and self._only_group is not None:  # a decode's block, one group
                        block_id = self.block_pool.allocate()
                        self._only_group[request_id].append(block_id)
                        gained = ((block_id,),)
                    else:
                        gained = self.coordinator.allocate_new_blocks(request_id, end)
                    held.capacity += missing * self.block_size
                held.num_tokens = end
                if token_ids is not None and num_new_tokens:
                    self.coordinator.cache_blocks(request_id, token_ids[start:end])
                return gained
        return self._allocate_slots(
            request,
            num_new_tokens,
            token_ids,
            new_computed_blocks,
            num_tokens_to_fit,
            has_scheduled_reqs,
            preempted,
            delay_cache_blocks,
        )

    def cache_blocks(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Cache the full blocks that ``token_ids``, the held request's tokens after those cached
        so far, fill: the external tokens of an :meth:`allocate_slots` with ``delay_cache_blocks``,
        once their K/V is loaded (vLLM: ``KVCacheManager.cache_blocks``). Nothing without caching."""
        if self.enable_caching and request_id in self._held:
            self.coordinator.cache_blocks(request_id, token_ids)

    def free(self, request_id: Hashable) -> list[int]:
        """Give back every block of the request in every group (an unknown id is a no-op); return
        them, each group's last block first (so that a cached prefix loses its tail before its head)."""
        if self._held.pop(check_hashable("request_id", request_id), None) is None:
            return []
        return self.coordinator.free(request_id)

    def remove_skipped_blocks(self, request_id: Hashable, num_computed_tokens: int) -> list[int]:
        """Give back, in every sliding-window group, the request's blocks wholly before the window of
        its token at ``num_computed_tokens`` (at most the tokens it holds), the null block in their
        place; return the ids given back. :meth:`allocate_slots` does it by itself."""
        num_computed_tokens = check_count("num_computed_tokens", num_computed_tokens)
        if request_id not in self:
            return []
        held = self._held[request_id].num_tokens
        return self.coordinator.remove_skipped_blocks(request_id, min(num_computed_tokens, held))

    # ------------------------------------------------------------------------------- helpers

    def _allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        token_ids: Sequence[int] | None,
        computed: ComputedBlocks | None,
        num_tokens_to_fit: int | None,
        has_scheduled_reqs: bool,
        preempted: bool,
        delay_cache_blocks: bool = False,
    ) -> BlockIds | None:
        """:meth:`allocate_slots` for a new request or a full-sequence check: vLLM's steps in order."""
        coordinator = self.coordinator
        request_id = request.request_id
        num_new_tokens = check_count("num_new_tokens", num_new_tokens)
        held = self._held.get(check_hashable("request_id", request_id))
        if held is not None and computed is not None:
            raise ValueError(f"computed blocks are a new request's, but {request_id!r} holds blocks already")
        computed = computed if computed is not None else ComputedBlocks()
        start = computed.num_tokens if held is None else held.num_tokens
        end = start + num_new_tokens
        if token_ids is not None and len(token_ids) < end:
            _short(token_ids, end)
        hits = computed.block_ids or self._nothing
        if held is None and computed.num_tokens:
            coordinator.check_still_cached(computed)
        if held is None and token_ids is not None:  # checked before anything is taken
            extra_keys = request_extra_keys(request, self.block_size)
        reserved = self.watermark_blocks if held is None and has_scheduled_reqs else 0
        if num_tokens_to_fit is not None:
            fit = max(end, check_count("num_tokens_to_fit", num_tokens_to_fit))
            needed = coordinator.get_num_blocks_to_allocate(request_id, fit, hits, start, cap=True)
            if needed + reserved > self.block_pool.num_free_blocks:
                return None
        if held is not None:
            coordinator.remove_skipped_blocks(request_id, start)
        needed = coordinator.get_num_blocks_to_allocate(request_id, end, hits, start)
        if needed + reserved > self.block_pool.num_free_blocks:
            return None
        if held is None:  # every group's hits first: a fresh block must never evict another group's hit
            coordinator.save_new_computed_blocks(request_id, hits)
        gained = coordinator.allocate_new_blocks(request_id, end)
        if held is None:
            gained = tuple((*group_hits, *new) for group_hits, new in zip(hits, gained, strict=True))
            if token_ids is not None:  # with caching only (see the top)
                if not skip_reading_prefix_cache(request):
                    self.block_pool.prefix_cache.record(len(token_ids), computed.num_tokens, preempted)
                coordinator.start_chains(request_id, computed, extra_keys)
            held = self._held[request_id] = _Held()
        held.num_tokens = end
        held.capacity = coordinator.num_held_blocks(request_id) * self.block_size
        if token_ids is not None and end > start and not delay_cache_blocks:
            coordinator.cache_blocks(request_id, token_ids[start:end])
        return gained


class _Held:
    """A held request's place: the tokens it was given slots for, and the slots its blocks hold in
    each group (every group's list is as long)."""

    __slots__ = ("capacity", "num_tokens")

    def __init__(self) -> None:
        self.num_tokens = self.capacity = 0


def _short(token_ids: Sequence[int], end: int) -> None:
    raise ValueError(
        f"token_ids must cover the request's {end} tokens, through the new ones, got {len(token_ids)}"
    )

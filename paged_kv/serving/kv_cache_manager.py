"""The scheduler's paged memory, for every model: vLLM's ``KVCacheManager`` (lessons 07, 09, 11, 13).

:class:`~paged_kv.serving.scheduler.Scheduler` asks its memory the questions of
:class:`~paged_kv.serving.protocols.KVMemory` and nothing else. :class:`KVCacheManager` is the paged
answer, vLLM 0.33.0's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``): one block stack for
every model, a :class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator` (unitary for a
model of one KV-cache group, hybrid for several) over one
:class:`~paged_kv.core.block_pool.BlockPool` whose block 0 is the null block. It holds no tensor.
Blocks are taken when the tokens that need them are scheduled, by :meth:`KVCacheManager.allocate_slots`:
a decode token's block when it crosses a boundary, a prefill chunk's blocks when the chunk is
scheduled, and in a sliding-window group the blocks a window left are given back first. Block ids
come in vLLM's shape, one tuple per KV-cache group.

**The admission rule is vLLM's** (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``,
with ``scheduler_reserve_full_isl`` on, its default): a waiting request is admitted when the blocks
of its whole prompt (less the prefix-cache hits nobody else holds) fit in the free blocks, plus the
watermark's blocks when some request is already running; then only its first chunk's blocks are
taken. No block is kept back for the running requests' growth: when a running request's next token
finds no free block, the newest running request is preempted.

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

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_pool import BlockPoolListener
from paged_kv.core.kv_cache_coordinator import (
    BlockIds,
    ComputedBlocks,
    get_kv_cache_coordinator,
    max_tokens_alone,
)
from paged_kv.core.kv_cache_groups import KVCacheGroupSpec, full_attention_group
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.validate import check_count


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


class KVCacheManager:
    """The scheduler's paged memory: ``num_blocks`` blocks (the null block among them) of
    ``block_size`` slots shared by ``kv_cache_groups`` (default: one group, every layer attending
    fully), and the admission watermark (vLLM: ``KVCacheManager``).

    ``enable_caching`` turns prefix caching on: a new request's tokens are looked up
    (:meth:`get_computed_blocks`) and every block its scheduled tokens fill is cached when they are
    scheduled. ``watermark`` (a fraction in ``[0, 1)``) keeps ``ceil(watermark * num_blocks)`` blocks
    free when a waiting request is admitted while others run, as vLLM keeps its ``watermark_blocks``;
    the running requests' own growth may use them. ``max_in_flight_tokens`` is the token budget of a
    step (vLLM's ``VllmConfig.max_in_flight_tokens``; ``None``: no budget), which caps what a
    sliding-window group holds at once.

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
                f"block_size {block_size} differs from the kv_cache_groups' {kv_cache_groups[0].spec.block_size}"
            )
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_groups, num_blocks, enable_caching=enable_caching, max_in_flight_tokens=max_in_flight_tokens
        )
        self.block_pool = self.coordinator.block_pool
        self._allocate_slots = self.coordinator.allocate_slots  # bound once: the hot path calls it
        self.block_size, self.num_blocks = self.coordinator.block_size, self.coordinator.num_blocks
        self.kv_cache_groups = self.coordinator.kv_cache_groups
        self.enable_caching = self.block_pool.enable_caching
        self.watermark = check_watermark(watermark)
        self.watermark_blocks = watermark_blocks(self.watermark, self.num_blocks)
        self._stats_read = PrefixCacheStats()  # the counters at the last make_prefix_cache_stats()

    def __repr__(self) -> str:
        return f"KVCacheManager({self.coordinator!r}, watermark_blocks={self.watermark_blocks})"

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

    def max_tokens(self, request: EngineCoreRequest) -> int:
        """The longest request the pool holds alone, its sliding-window groups capped at their window
        and the tokens in flight (:func:`~paged_kv.core.kv_cache_coordinator.max_tokens_alone`)."""
        coordinator = self.coordinator
        return max_tokens_alone(coordinator.kv_cache_groups, self.num_blocks, coordinator.max_in_flight_tokens)

    def add_listener(self, listener: BlockPoolListener) -> None:
        """Tell ``listener`` every block the pool caches and evicts (:class:`~paged_kv.core.block_pool.BlockPoolListener`)."""
        self.block_pool.add_listener(listener)

    def get_computed_blocks(self, request: EngineCoreRequest, token_ids: Sequence[int] | None) -> ComputedBlocks:
        """The cached prefix of ``token_ids`` every group hits (none without caching or token ids)."""
        if token_ids is None or not self.enable_caching:
            return ComputedBlocks()
        return self.coordinator.get_computed_blocks(token_ids)

    def allocate_slots(
        self,
        request: EngineCoreRequest,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        new_computed_blocks: ComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        has_scheduled_reqs: bool = True,
        preempted: bool = False,
    ) -> BlockIds | None:
        """:meth:`KVCacheCoordinator.allocate_slots
        <paged_kv.core.kv_cache_coordinator.KVCacheCoordinator.allocate_slots>` for ``request``: the
        ids each group gained, or ``None``. A request the memory does not hold starts with
        ``new_computed_blocks`` and keeps the watermark free when ``has_scheduled_reqs`` (vLLM applies
        it to waiting requests only, and only then); its lookup counts apart when ``preempted``.
        ``token_ids`` serve only with caching on."""
        if not self.enable_caching:
            token_ids = None
        if new_computed_blocks is None and num_tokens_to_fit is None:  # a running request, or a swap-in
            return self._allocate_slots(request.request_id, num_new_tokens, token_ids)
        return self.coordinator.allocate_slots(
            request.request_id,
            num_new_tokens,
            token_ids,
            computed=ComputedBlocks() if new_computed_blocks is None else new_computed_blocks,
            num_tokens_to_fit=num_tokens_to_fit,
            reserved_blocks=self.watermark_blocks if has_scheduled_reqs else 0,
            preempted=preempted,
        )

    def get_block_ids(self, request_id: Hashable) -> BlockIds:
        """The request's block ids, one tuple per group, the null block where a window freed one."""
        return self.coordinator.get_block_ids(request_id)

    def free(self, request_id: Hashable) -> None:
        self.coordinator.free(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only when no request holds a block (vLLM's)."""
        return self.coordinator.reset_prefix_cache()

    def snapshot(self) -> AllocatorSnapshot:
        """The pool, the free list and every request's table in every group, frozen."""
        return self.coordinator.snapshot()

    def describe_free(self) -> str:
        return f"{self.block_pool.num_free_blocks} free blocks out of {self.block_pool.num_usable_blocks}"

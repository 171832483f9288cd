"""The KV memory a scheduler takes blocks from: paged blocks or contiguous reservations (lessons 07, 09, 11).

:class:`~paged_kv.serving.scheduler.Scheduler` asks its memory the questions of
:class:`~paged_kv.serving.protocols.KVMemory` and nothing else, so the same scheduler runs the
engine's paged and contiguous modes and every policy of lesson 07's simulator:

* :class:`KVCacheManager`: vLLM's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``), the
  scheduler's view of the core's :class:`~paged_kv.core.block_manager.BlockManager`. Blocks are
  taken when the tokens that need them are scheduled, by :meth:`KVCacheManager.allocate_slots`:
  a decode token's block when it crosses a boundary, a prefill chunk's blocks when the chunk is
  scheduled. It holds no tensor. Its block ids come in vLLM's shape, one tuple per KV-cache
  group: one group here, every layer attending fully.
* :class:`HybridKVCacheManager`: the same over a
  :class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator`, for a model whose layers form
  several KV-cache groups (sliding-window layers beside full-attention ones, lesson 13): one tuple
  of block ids per group, and the blocks a window leaves behind freed as it slides.
* :class:`ContiguousMemory`: ``budget_tokens`` slots, one reservation per request made at
  admission and sized by a function of the request (the maximum model length, the next power of
  two of the final length, the final length itself), as the systems before paging did. A request
  never outgrows its reservation, so nothing is ever preempted.

**The admission rule is vLLM's** (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py``,
with ``scheduler_reserve_full_isl`` on, its default): a waiting request is admitted when the blocks
of its whole prompt (less the prefix-cache hits nobody else holds) fit in the free blocks, plus the
watermark's blocks when some request is already running; then only its first chunk's blocks are
taken. No block is kept back for the running requests' growth: when a running request's next token
finds no free block, the newest running request is preempted.

**What the metrics read** (:mod:`paged_kv.serving.metrics`): :attr:`KVCacheManager.usage`, the
share of the pool in use, where a free block that still holds a cached prefix counts as free (it is
on the free list), as vLLM's ``BlockPool.get_usage`` counts it; and the prefix cache's counters,
where a request admitted again after a preemption, by recompute, counts its lookup apart
(:class:`~paged_kv.core.prefix_cache.PrefixCacheStats`): the scheduler says so (``preempted``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_manager import BlockManager, ComputedBlocks
from paged_kv.core.kv_cache_coordinator import GroupComputedBlocks, KVCacheCoordinator, max_tokens_alone
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.serving.outputs import NO_NEW_BLOCKS, GroupBlockIds
from paged_kv.serving.request import SchedulerRequest
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


def blocks_alone(num_prompt_tokens: int, max_new_tokens: int, block_size: int) -> tuple[int, int]:
    """The blocks a request needs alone: to be admitted (its whole prompt), and at its longest.

    At its longest a request holds ``num_prompt_tokens + max_new_tokens - 1`` tokens: its last
    token is sampled, never fed back.
    """
    admit = blocks_for_tokens(num_prompt_tokens, block_size)
    peak = blocks_for_tokens(num_prompt_tokens + max_new_tokens - 1, block_size)
    return admit, peak


def serves_alone(num_prompt_tokens: int, max_new_tokens: int, num_blocks: int, block_size: int) -> bool:
    """Whether ``num_blocks`` blocks hold a request alone at its longest (its prompt, then its
    output less the last token). The watermark does not count alone: vLLM keeps it only while
    another request is scheduled."""
    return blocks_alone(num_prompt_tokens, max_new_tokens, block_size)[1] <= num_blocks


class KVCacheManager:
    """The scheduler's paged memory: a :class:`~paged_kv.core.block_manager.BlockManager` and the
    admission watermark (vLLM: ``KVCacheManager`` over its ``BlockPool``).

    ``watermark`` (a fraction in ``[0, 1)``) keeps ``ceil(watermark * num_blocks)`` blocks free when
    a waiting request is admitted while others run, as vLLM keeps its ``watermark_blocks``; the
    running requests' own growth may use them. With prefix caching on in the manager, a new
    request's prompt is looked up (:meth:`get_computed_blocks`) and every block its scheduled tokens
    fill is cached when they are scheduled. A request the scheduler admits again after a preemption
    (``preempted``) counts its lookup apart (see :attr:`prefix_cache_stats`).

    Raises:
        ValueError: a bad watermark, named.
    """

    def __init__(self, manager: BlockManager, *, watermark: float = 0.0) -> None:
        self.manager = manager
        self.block_size, self.num_blocks = manager.block_size, manager.num_blocks
        self.watermark = check_watermark(watermark)
        self.watermark_blocks = watermark_blocks(self.watermark, self.num_blocks)
        self._caching, self._tables = manager.enable_prefix_caching, manager.tables  # read once: the hot path
        self._stats_read = PrefixCacheStats()  # the counters at the last make_prefix_cache_stats()

    @property
    def enable_prefix_caching(self) -> bool:
        return self.manager.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    @property
    def usage(self) -> float:
        """Blocks in use over all blocks (vLLM: ``BlockPool.get_usage``, the "GPU KV cache usage" and
        ``vllm:kv_cache_usage_perc``): a free block that still holds a cached prefix counts as free."""
        return 1.0 - self.manager.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters since the memory was built, a resumed request's lookups apart."""
        return self.manager.prefix_cache_stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counts since the last call (vLLM: ``KVCacheManager.make_prefix_cache_stats``,
        which takes and resets them; here :attr:`prefix_cache_stats` keeps counting)."""
        stats = self.manager.prefix_cache_stats
        since, self._stats_read = stats - self._stats_read, stats
        return since

    @property
    def reserved_tokens(self) -> int:
        """The slots of the blocks in use: ``(num_blocks - free) * block_size``."""
        return (self.num_blocks - self.manager.num_free_blocks) * self.block_size

    def max_tokens(self, request: SchedulerRequest) -> int:
        return self.num_blocks * self.block_size

    def get_computed_blocks(
        self, request: SchedulerRequest, token_ids: tuple[int, ...] | None
    ) -> ComputedBlocks:
        """The cached prefix of ``token_ids`` (none without prefix caching or token ids)."""
        if token_ids is None or not self.manager.enable_prefix_caching:
            return ComputedBlocks()
        return self.manager.get_computed_blocks(token_ids)

    def allocate_slots(
        self,
        request: SchedulerRequest,
        num_new_tokens: int,
        token_ids: list[int] | tuple[int, ...] | None = None,
        *,
        computed: ComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        has_scheduled_reqs: bool = True,
        preempted: bool = False,
    ) -> GroupBlockIds | None:
        """:meth:`BlockManager.allocate_slots` for ``request``, its ids as one group's; a new one keeps
        the watermark free when ``has_scheduled_reqs`` (vLLM applies it to waiting requests only,
        and only then)."""
        manager = self.manager
        token_ids = token_ids if self._caching else None
        if computed is None and request.request_id in self._tables:  # a running request
            gained = manager.allocate_slots(request.request_id, num_new_tokens, token_ids)
        else:  # a new request: its lookup is counted (with token ids), apart if it resumes
            gained = manager.allocate_slots(
                request.request_id,
                num_new_tokens,
                token_ids,
                computed=ComputedBlocks() if computed is None else computed,
                num_tokens_to_fit=num_tokens_to_fit,
                keep_free=self.watermark_blocks if has_scheduled_reqs else 0,
                preempted=preempted,
            )
        if gained is None:
            return None
        return (tuple(gained),) if gained else NO_NEW_BLOCKS

    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (vLLM: ``KVCacheManager.get_block_ids``)."""
        return (list(self.manager.table(request_id).block_ids),)

    def free(self, request_id: Hashable) -> None:
        self.manager.free(request_id)

    def sequences(self) -> dict[Hashable, tuple[int, int]]:
        """Each request's ``(tokens held, slots reserved)``: its length, and its blocks' slots."""
        size = self.block_size
        return {r: (t.num_tokens, len(t.block_ids) * size) for r, t in self.manager.tables.items()}

    def describe_free(self) -> str:
        return f"{self.manager.num_free_blocks} free blocks out of {self.num_blocks}"


class HybridKVCacheManager:
    """The scheduler's paged memory for a model of several KV-cache groups: a
    :class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator` and the admission watermark
    (vLLM: ``KVCacheManager`` over a ``HybridKVCacheCoordinator``; lesson 13).

    As :class:`KVCacheManager`, with block ids one tuple per group: a sliding-window group's blocks
    wholly before the window of a running request's next token are freed when its next tokens are
    scheduled, the null block in their place. The pool's block 0 is the null block, so
    ``num_blocks - 1`` blocks serve the requests.

    Raises:
        ValueError: a bad watermark, named.
    """

    def __init__(self, coordinator: KVCacheCoordinator, *, watermark: float = 0.0) -> None:
        self.coordinator = coordinator
        self.block_size, self.num_blocks = coordinator.block_size, coordinator.num_blocks
        self.watermark = check_watermark(watermark)
        self.watermark_blocks = watermark_blocks(self.watermark, self.num_blocks)
        self._stats_read = PrefixCacheStats()  # the counters at the last make_prefix_cache_stats()

    @property
    def enable_prefix_caching(self) -> bool:
        return self.coordinator.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.coordinator.num_free_blocks

    @property
    def usage(self) -> float:
        """Blocks in use over the blocks the pool gives out, the null block left out of both (vLLM:
        ``BlockPool.get_usage``): a free block that still holds a cached prefix counts as free."""
        return self.coordinator.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters since the memory was built, a resumed request's lookups apart."""
        return self.coordinator.prefix_cache_stats

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counts since the last call (vLLM:
        ``KVCacheManager.make_prefix_cache_stats``)."""
        stats = self.coordinator.prefix_cache_stats
        since, self._stats_read = stats - self._stats_read, stats
        return since

    @property
    def reserved_tokens(self) -> int:
        """The slots of the blocks in use, the null block left out."""
        return (self.num_blocks - 1 - self.coordinator.num_free_blocks) * self.block_size

    def max_tokens(self, request: SchedulerRequest) -> int:
        """The longest request the pool holds alone, its sliding-window groups capped at their
        window and a step's tokens (:func:`~paged_kv.core.kv_cache_coordinator.max_tokens_alone`)."""
        coordinator = self.coordinator
        return max_tokens_alone(coordinator.groups, self.num_blocks, coordinator.max_tokens_in_flight)

    def get_computed_blocks(
        self, request: SchedulerRequest, token_ids: tuple[int, ...] | None
    ) -> GroupComputedBlocks:
        """The cached prefix every group hits (none without prefix caching or token ids)."""
        if token_ids is None or not self.coordinator.enable_prefix_caching:
            return GroupComputedBlocks()
        return self.coordinator.get_computed_blocks(token_ids)

    def allocate_slots(
        self,
        request: SchedulerRequest,
        num_new_tokens: int,
        token_ids: list[int] | tuple[int, ...] | None = None,
        *,
        computed: GroupComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        has_scheduled_reqs: bool = True,
        preempted: bool = False,
    ) -> GroupBlockIds | None:
        """:meth:`KVCacheCoordinator.allocate_slots` for ``request``: the ids each group gained."""
        coordinator = self.coordinator
        token_ids = token_ids if coordinator.enable_prefix_caching else None
        new = request.request_id not in coordinator
        gained = coordinator.allocate_slots(
            request.request_id,
            num_new_tokens,
            token_ids,
            computed=computed if new else None,
            num_tokens_to_fit=num_tokens_to_fit if new else None,
            keep_free=self.watermark_blocks if new and has_scheduled_reqs else 0,
            preempted=preempted,
        )
        return None if gained is None else tuple(map(tuple, gained))

    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], ...]:
        """The request's block ids, one list per group, the null block where a window freed one."""
        return self.coordinator.get_block_ids(request_id)

    def free(self, request_id: Hashable) -> None:
        self.coordinator.free(request_id)

    def describe_free(self) -> str:
        return f"{self.coordinator.num_free_blocks} free blocks out of {self.num_blocks - 1}"


class ContiguousMemory:
    """``budget_tokens`` slots shared out as one contiguous reservation per request.

    ``reserve(request)`` gives the slots a request reserves when it is admitted; they stay reserved
    until it is freed. A request is admitted while its reservation fits in the free slots, and a
    reservation holds the request at its longest, so nothing is ever preempted. The reservations
    are **seats** of ``block_size`` blocks laid end to end: seat ``i`` is blocks ``i * k ..
    (i + 1) * k - 1`` for ``k = ceil(seat_tokens / block_size)``, and a request's block ids are its
    seat's, so the engine's runner and attention read a contiguous reservation through the same
    block table as a paged one (:attr:`num_blocks` blocks in all).

    Raises:
        ValueError: ``budget_tokens`` or ``seat_tokens`` is not a count of at least 1, or
            ``reserve`` is not callable.
    """

    def __init__(
        self,
        budget_tokens: int,
        reserve: Callable[[SchedulerRequest], int],
        *,
        seat_tokens: int,
        block_size: int = 1,
    ) -> None:
        self.budget_tokens = check_count("budget_tokens", budget_tokens, minimum=1)
        if not callable(reserve):
            raise ValueError(f"reserve must be a function of a request, got {reserve!r}")
        self.reserve = reserve
        self.block_size = check_count("block_size", block_size, minimum=1)
        seat = check_count("seat_tokens", seat_tokens, minimum=1)
        self.blocks_per_seat = blocks_for_tokens(seat, self.block_size)
        self.num_seats = max(1, self.budget_tokens // seat)
        self.num_blocks = self.num_seats * self.blocks_per_seat
        self._free_seats = list(range(self.num_seats - 1, -1, -1))  # pop() gives the lowest
        self.reservations: dict[Hashable, tuple[int, int]] = {}  # request id -> (seat, slots reserved)

    @property
    def free_tokens(self) -> int:
        """The slots no admitted request has reserved."""
        return self.budget_tokens - self.reserved_tokens

    @property
    def reserved_tokens(self) -> int:
        return sum(slots for _, slots in self.reservations.values())

    @property
    def usage(self) -> float:
        """The share of the seats reserved (what a paged memory's usage is in blocks)."""
        return 1.0 - len(self._free_seats) / self.num_seats

    def max_tokens(self, request: SchedulerRequest) -> int:
        size = self.reserve(request)
        return size if size <= self.budget_tokens else 0

    def get_computed_blocks(
        self, request: SchedulerRequest, token_ids: tuple[int, ...] | None
    ) -> ComputedBlocks:
        return ComputedBlocks()

    def allocate_slots(
        self,
        request: SchedulerRequest,
        num_new_tokens: int,
        token_ids: list[int] | tuple[int, ...] | None = None,
        *,
        computed: ComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        has_scheduled_reqs: bool = True,
        preempted: bool = False,
    ) -> GroupBlockIds | None:
        """A new request reserves its slots, or waits (``None``); a reserved one always fits."""
        if request.request_id in self.reservations:
            return NO_NEW_BLOCKS
        size = self.reserve(request)
        if size > self.free_tokens or not self._free_seats:
            return None
        seat = self._free_seats.pop()
        self.reservations[request.request_id] = (seat, size)
        return (tuple(self.get_block_ids(request.request_id)[0]),)

    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], ...]:
        """The blocks of the request's seat, as one group's."""
        first = self.reservations[request_id][0] * self.blocks_per_seat
        return (list(range(first, first + self.blocks_per_seat)),)

    def free(self, request_id: Hashable) -> None:
        seat = self.reservations.pop(request_id, None)
        if seat is not None:
            self._free_seats.append(seat[0])
            self._free_seats.sort(reverse=True)

    def describe_free(self) -> str:
        return f"{self.free_tokens} free token slots out of {self.budget_tokens}"

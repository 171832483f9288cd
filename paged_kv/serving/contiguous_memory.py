"""Contiguous reservations: the memory of the systems before paging, beside the paged one (lessons 07, 09).

:class:`ContiguousMemory` gives each request one reservation of ``seat_tokens`` slots at admission,
sized by a function of the request (the maximum model length, the next power of two of the final
length, the final length itself), as the systems before paging did. A request never outgrows its
reservation, so nothing is ever preempted; it answers the same
:class:`~paged_kv.serving.protocols.KVMemory` questions as the paged
:class:`~paged_kv.core.kv_cache_manager.KVCacheManager`, so the same scheduler and runner serve
both. :class:`ReservationMemory` holds what every memory without blocks to share answers alike
(no prefix cache, no pool to draw); lesson 07's first-fit address space
(:class:`~paged_kv.simulation.contiguous.FirstFitMemory`) builds on it too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_coordinator import BlockIds, ComputedBlocks
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.validate import check_count


class ReservationMemory:
    """What a memory of whole reservations answers: a request's tokens are at most what it reserves,
    while the reservation fits the budget; it caches no prefix (every lookup finds nothing, a reset
    has nothing to forget) and has no block pool to draw (:meth:`snapshot` is ``None``). A subclass
    sets ``budget_tokens`` and ``reserve`` (through :meth:`_set_reserve`).

    Raises:
        ValueError: ``reserve`` is not callable.
    """

    enable_caching = False
    budget_tokens: int
    reserve: Callable[[EngineCoreRequest], int]

    def _set_reserve(self, reserve: Callable[[EngineCoreRequest], int]) -> None:
        if not callable(reserve):
            raise ValueError(f"reserve must be a function of a request, got {reserve!r}")
        self.reserve = reserve

    def max_tokens(self, request: EngineCoreRequest) -> int:
        size = self.reserve(request)
        return size if size <= self.budget_tokens else 0

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()

    def get_computed_blocks(
        self, request: EngineCoreRequest, token_ids: Sequence[int] | None
    ) -> ComputedBlocks:
        return ComputedBlocks()

    def reset_prefix_cache(self) -> bool:
        return True

    def snapshot(self) -> None:
        return None


class ContiguousMemory(ReservationMemory):
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
        reserve: Callable[[EngineCoreRequest], int],
        *,
        seat_tokens: int,
        block_size: int = 1,
    ) -> None:
        self.budget_tokens = check_count("budget_tokens", budget_tokens, minimum=1)
        self._set_reserve(reserve)
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
        """A new request reserves its slots, or waits (``None``); a reserved one always fits."""
        if request.request_id in self.reservations:
            return ((),)
        size = self.reserve(request)
        if size > self.free_tokens or not self._free_seats:
            return None
        seat = self._free_seats.pop()
        self.reservations[request.request_id] = (seat, size)
        return self.get_block_ids(request.request_id)

    def get_block_ids(self, request_id: Hashable) -> BlockIds:
        """The blocks of the request's seat, as one group's."""
        first = self.reservations[request_id][0] * self.blocks_per_seat
        return (tuple(range(first, first + self.blocks_per_seat)),)

    def free(self, request_id: Hashable) -> None:
        seat = self.reservations.pop(request_id, None)
        if seat is not None:
            self._free_seats.append(seat[0])
            self._free_seats.sort(reverse=True)

    def describe_free(self) -> str:
        return f"{self.free_tokens} free token slots out of {self.budget_tokens}"

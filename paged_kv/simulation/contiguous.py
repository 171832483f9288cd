"""Contiguous reservations in one linear address space: first fit, with holes (lessons 00 and 07).

A contiguous KV cache gives each sequence one unbroken range of slots, reserved whole at admission
and held until the sequence finishes. :class:`ContiguousAllocator` lays those ranges out in one
address space of ``capacity`` slots, ``0 .. capacity - 1``, the way a memory allocator would:

* **first fit**: a range of ``size`` slots starts at the lowest address of the first hole (free
  run) that holds it;
* **holes merge**: a freed range joins the holes on either side, so two holes are never adjacent.

Ranges of different sizes come and go, so the free slots split into holes. A request that finds no
hole large enough must wait, *even when the free slots in all would hold it*: that is **external
fragmentation**, which :class:`FirstFitMemory` (the scheduler's memory over an allocator) counts
in :attr:`FirstFitMemory.blocked_by_holes`. :meth:`ContiguousAllocator.compact` closes the holes by
sliding every range down (what a contiguous cache would pay for by copying K/V);
``FirstFitMemory(compact=True)`` does so whenever that admits a request.

Invariants, after every call (a call that raises changes nothing):

* the ranges in use never overlap, and each lies inside ``0 .. capacity - 1``;
* the holes are exactly the slots no range uses, sorted by address, and no two touch;
* ``free_slots + used_slots == capacity``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from paged_kv.core.kv_cache_coordinator import BlockIds, ComputedBlocks
from paged_kv.errors import UnknownSequenceError
from paged_kv.serving.contiguous_memory import ReservationMemory
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.validate import check_count, check_hashable


class Extent(NamedTuple):
    """``size`` slots from address ``start`` on: ``start .. start + size - 1``."""

    start: int
    size: int

    @property
    def end(self) -> int:
        """The first address after the extent."""
        return self.start + self.size


class ContiguousAllocator:
    """First fit over one address space of ``capacity`` slots (see the module for the invariants).

    >>> space = ContiguousAllocator(10)
    >>> space.allocate("a", 4), space.allocate("b", 3), space.allocate("c", 3)
    (Extent(start=0, size=4), Extent(start=4, size=3), Extent(start=7, size=3))
    >>> space.free("a"); space.free("c")
    >>> space.holes, space.free_slots, space.fits(4), space.fits(5)
    ([Extent(start=0, size=4), Extent(start=7, size=3)], 7, True, False)

    Raises:
        ValueError: ``capacity`` is not a whole number of at least 1.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_count("capacity", capacity, minimum=1)
        self._holes: list[Extent] = [Extent(0, self.capacity)]  # sorted by start, never touching
        self._ranges: dict[Hashable, Extent] = {}

    def __repr__(self) -> str:
        return (
            f"ContiguousAllocator(capacity={self.capacity}, used={self.used_slots}, "
            f"holes={[tuple(h) for h in self._holes]})"
        )

    @property
    def holes(self) -> list[Extent]:
        """The free runs, sorted by address (a copy)."""
        return list(self._holes)

    @property
    def ranges(self) -> dict[Hashable, Extent]:
        """Each owner's range (a copy)."""
        return dict(self._ranges)

    @property
    def free_slots(self) -> int:
        return sum(hole.size for hole in self._holes)

    @property
    def used_slots(self) -> int:
        return sum(extent.size for extent in self._ranges.values())

    @property
    def largest_hole(self) -> int:
        """The longest range :meth:`allocate` can give now (0 when nothing is free)."""
        return max((hole.size for hole in self._holes), default=0)

    def __contains__(self, owner: object) -> bool:
        return owner in self._ranges

    def fits(self, size: int) -> bool:
        """Whether some hole holds ``size`` slots (``size >= 1``)."""
        return check_count("size", size, minimum=1) <= self.largest_hole

    def allocate(self, owner: Hashable, size: int) -> Extent:
        """Give ``owner`` ``size`` slots at the start of the first hole that holds them.

        Raises:
            ValueError: ``owner`` is unhashable or already holds a range, ``size`` is not a whole
                number of at least 1, or no hole holds ``size`` slots (the message says the largest).
        """
        check_hashable("owner", owner)
        if owner in self._ranges:
            raise ValueError(f"owner {owner!r} already holds {self._ranges[owner]}")
        size = check_count("size", size, minimum=1)
        for i, hole in enumerate(self._holes):
            if hole.size >= size:
                extent = Extent(hole.start, size)
                if hole.size == size:
                    del self._holes[i]
                else:
                    self._holes[i] = Extent(hole.start + size, hole.size - size)
                self._ranges[owner] = extent
                return extent
        raise ValueError(
            f"no hole holds size={size} slots: the largest of {len(self._holes)} holes has "
            f"{self.largest_hole} ({self.free_slots} free in all)"
        )

    def free(self, owner: Hashable) -> None:
        """Give ``owner``'s range back; it merges with the holes it touches.

        Raises:
            UnknownSequenceError: ``owner`` holds no range (a ``KeyError``).
        """
        if check_hashable("owner", owner) not in self._ranges:
            raise UnknownSequenceError(owner)
        extent = self._ranges.pop(owner)
        holes = self._holes
        i = bisect.bisect_left(holes, extent)  # the first hole after the range
        start, end = extent.start, extent.end
        if i < len(holes) and holes[i].start == end:  # merge with the hole after
            end = holes.pop(i).end
        if i > 0 and holes[i - 1].end == start:  # and with the hole before
            i -= 1
            start = holes.pop(i).start
        holes.insert(i, Extent(start, end - start))

    def compact(self) -> dict[Hashable, Extent]:
        """Slide every range down, in address order, so the free slots form one hole at the end.

        What a contiguous cache would have to do to use its holes: copy the K/V of every range that
        moves. Returns the ranges that moved, at their new places.
        """
        moved, start = {}, 0
        for owner, extent in sorted(self._ranges.items(), key=lambda item: item[1].start):
            if extent.start != start:
                moved[owner] = self._ranges[owner] = Extent(start, extent.size)
            start += extent.size
        self._holes = [Extent(start, self.capacity - start)] if start < self.capacity else []
        return moved


class FirstFitMemory(ReservationMemory):
    """The scheduler's :class:`~paged_kv.serving.protocols.KVMemory` over a :class:`ContiguousAllocator`.

    ``reserve(request)`` gives the slots a request reserves when it is admitted; a request is
    admitted when some hole holds them (first fit), and its range stays until it finishes. With
    ``compact=True`` a request that the free slots in all would hold is admitted too: the
    allocator is compacted first (:meth:`ContiguousAllocator.compact`, counted in
    :attr:`compactions`), which is what a memory without external fragmentation would admit.
    Nothing is ever preempted: the range holds the sequence at its longest. The memory's blocks
    are its slots (``block_size`` 1): a request's block ids are the addresses of its range. It
    counts each request's tokens as the scheduler schedules them, for :meth:`sequences`.

    Raises:
        ValueError: ``budget_tokens`` is not a count of at least 1, or ``reserve`` is not callable.
    """

    block_size = 1

    def __init__(
        self, budget_tokens: int, reserve: Callable[[EngineCoreRequest], int], *, compact: bool = False
    ) -> None:
        self.allocator = ContiguousAllocator(check_count("budget_tokens", budget_tokens, minimum=1))
        self._set_reserve(reserve)
        self.compact = bool(compact)
        self.blocked_by_holes = 0
        """Refused admissions that the free slots in all would have held: no single hole did."""
        self.compactions = 0
        """Compactions made to admit a request (``compact=True`` only)."""
        self._lengths: dict[Hashable, int] = {}

    @property
    def budget_tokens(self) -> int:
        return self.allocator.capacity

    @property
    def num_blocks(self) -> int:
        return self.allocator.capacity

    @property
    def num_free_blocks(self) -> int:
        """The free slots."""
        return self.allocator.free_slots

    @property
    def reserved_tokens(self) -> int:
        return self.allocator.used_slots

    @property
    def usage(self) -> float:
        """The share of the slots reserved."""
        return self.allocator.used_slots / self.allocator.capacity

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
        """A new request gets its range first fit (compacting first when that is what admits it,
        ``compact=True``), or waits: ``None``; a request with a range always fits."""
        request_id = request.request_id
        if request_id in self._lengths:
            self._lengths[request_id] += num_new_tokens
            return ((),)
        size = self.reserve(request)
        if not self.allocator.fits(size):
            if size > self.allocator.free_slots:
                return None
            if not self.compact:
                self.blocked_by_holes += 1
                return None
            self.allocator.compact()
            self.compactions += 1
        self.allocator.allocate(request_id, size)
        self._lengths[request_id] = num_new_tokens
        return self.get_block_ids(request_id)

    def get_block_ids(self, request_id: Hashable) -> BlockIds:
        """The slots of the request's range, as one group's block ids (blocks of one slot)."""
        extent = self.allocator.ranges[request_id]
        return (tuple(range(extent.start, extent.end)),)

    def free(self, request_id: Hashable) -> None:
        if request_id in self._lengths:
            self.allocator.free(request_id)
            del self._lengths[request_id]

    def sequences(self) -> dict[Hashable, tuple[int, int]]:
        """Each sequence's ``(tokens held, slots reserved)``."""
        ranges = self.allocator.ranges
        return {seq_id: (held, ranges[seq_id].size) for seq_id, held in self._lengths.items()}

    def describe_free(self) -> str:
        allocator = self.allocator
        return (
            f"{allocator.free_slots} free token slots out of {allocator.capacity}, the largest hole "
            f"{allocator.largest_hole}"
        )

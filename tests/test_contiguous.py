"""The contiguous allocator: first fit over one address space, holes that merge (lessons 00 and 07)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_kv.errors import UnknownSequenceError
from paged_kv.serving.contiguous_memory import ContiguousMemory
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler, run_steps
from paged_kv.simulation.contiguous import ContiguousAllocator, Extent, FirstFitMemory

pytestmark = pytest.mark.lesson07


# ------------------------------------------------------------------------------- the allocator


def test_first_fit_takes_the_lowest_hole_that_holds_the_range():
    space = ContiguousAllocator(12)
    assert [space.allocate(name, size) for name, size in [("a", 3), ("b", 2), ("c", 4), ("d", 3)]] == [
        Extent(0, 3),
        Extent(3, 2),
        Extent(5, 4),
        Extent(9, 3),
    ]
    assert (space.free_slots, space.holes) == (0, [])
    space.free("a")
    space.free("c")
    assert space.holes == [Extent(0, 3), Extent(5, 4)]
    assert space.allocate("e", 4) == Extent(5, 4)  # the first hole, 3 slots, is too small
    assert space.allocate("f", 2) == Extent(0, 2)  # the lowest hole that holds it
    assert space.holes == [Extent(2, 1)]


def test_a_freed_range_merges_with_the_holes_on_both_sides():
    space = ContiguousAllocator(9)
    for name in "abc":
        space.allocate(name, 3)
    space.free("a")
    space.free("c")
    assert space.holes == [Extent(0, 3), Extent(6, 3)]
    space.free("b")
    assert space.holes == [Extent(0, 9)] and space.ranges == {}


def test_holes_can_refuse_what_the_free_total_would_hold():
    space = ContiguousAllocator(10)
    for name, size in [("a", 3), ("b", 3), ("c", 4)]:
        space.allocate(name, size)
    space.free("a")
    space.free("c")
    assert space.free_slots == 7 and space.largest_hole == 4
    assert space.fits(4) and not space.fits(5)
    before = (space.holes, space.ranges)
    with pytest.raises(ValueError, match=r"size=5.*largest of 2 holes has 4 \(7 free in all\)"):
        space.allocate("d", 5)
    assert (space.holes, space.ranges) == before  # a refusal changes nothing


def test_compaction_leaves_one_hole_at_the_end():
    space = ContiguousAllocator(10)
    for name, size in [("a", 3), ("b", 3), ("c", 4)]:
        space.allocate(name, size)
    space.free("a")
    assert space.compact() == {"b": Extent(0, 3), "c": Extent(3, 4)}
    assert space.holes == [Extent(7, 3)]
    assert space.compact() == {}  # nothing moves twice
    space.allocate("d", 3)
    assert space.compact() == {} and space.holes == []


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.allocate("a", 1), ValueError, "owner 'a' already holds"),
        (lambda s: s.allocate("z", 0), ValueError, "size"),
        (lambda s: s.allocate("z", True), ValueError, "size"),
        (lambda s: s.allocate(["z"], 1), ValueError, "owner"),
        (lambda s: s.allocate("z", 9), ValueError, "no hole holds size=9"),
        (lambda s: s.fits(0), ValueError, "size"),
        (lambda s: s.free("z"), UnknownSequenceError, "z"),
        (lambda s: s.free(["z"]), ValueError, "owner"),
    ],
)
def test_bad_calls_raise_and_change_nothing(call, error, match):
    space = ContiguousAllocator(8)
    space.allocate("a", 3)
    before = (space.holes, space.ranges)
    with pytest.raises(error, match=match):
        call(space)
    assert (space.holes, space.ranges) == before


@pytest.mark.parametrize("capacity", [0, -1, 2.5, True])
def test_capacity_must_be_a_whole_number_of_at_least_one(capacity):
    with pytest.raises(ValueError, match="capacity"):
        ContiguousAllocator(capacity)


class FirstFitMachine(RuleBasedStateMachine):
    """The allocator against a list of slots, each ``None`` or its owner's name, searched the slow way."""

    CAPACITY = 24

    def __init__(self):
        super().__init__()
        self.space = ContiguousAllocator(self.CAPACITY)
        self.slots: list[str | None] = [None] * self.CAPACITY
        self.next_owner = 0

    def reference_first_fit(self, size: int) -> int | None:
        """The lowest start of ``size`` free slots in a row, or None."""
        for start in range(self.CAPACITY - size + 1):
            if all(slot is None for slot in self.slots[start : start + size]):
                return start
        return None

    @rule(size=st.integers(1, 12))
    def allocate(self, size):
        owner = f"r{self.next_owner}"
        self.next_owner += 1
        start = self.reference_first_fit(size)
        assert self.space.fits(size) == (start is not None)
        if start is None:
            with pytest.raises(ValueError, match="no hole holds"):
                self.space.allocate(owner, size)
            return
        assert self.space.allocate(owner, size) == Extent(start, size)
        self.slots[start : start + size] = [owner] * size

    @precondition(lambda self: self.space.ranges)
    @rule(data=st.data())
    def free(self, data):
        owner = data.draw(st.sampled_from(sorted(self.space.ranges)))
        self.space.free(owner)
        self.slots = [None if slot == owner else slot for slot in self.slots]

    @rule()
    def compact(self):
        order = sorted(self.space.ranges, key=lambda owner: self.space.ranges[owner].start)
        self.space.compact()
        self.slots = [o for o in order for _ in range(self.slots.count(o))]
        self.slots += [None] * (self.CAPACITY - len(self.slots))

    @invariant()
    def ranges_and_holes_are_the_reference_slots(self):
        for owner, extent in self.space.ranges.items():
            assert self.slots[extent.start : extent.end] == [owner] * extent.size
            assert self.slots.count(owner) == extent.size  # so no two ranges overlap
        free = [i for i, slot in enumerate(self.slots) if slot is None]
        assert [i for hole in self.space.holes for i in range(hole.start, hole.end)] == free

    @invariant()
    def holes_are_sorted_never_touch_and_add_up(self):
        holes = self.space.holes
        assert all(hole.size > 0 for hole in holes)
        assert all(left.end < right.start for left, right in itertools.pairwise(holes))
        assert self.space.free_slots + self.space.used_slots == self.CAPACITY
        assert self.space.largest_hole == max((hole.size for hole in holes), default=0)


TestFirstFit = FirstFitMachine.TestCase


# ------------------------------------------------------------------------------ the memory


def request(name, prompt, output):
    return EngineCoreRequest(name, prompt, output)


def final_length(r: EngineCoreRequest) -> int:
    return r.num_prompt_tokens + r.max_tokens


def test_a_request_waits_for_a_hole_even_when_the_free_total_would_hold_it():
    # Slots of 3, 3 and 4 fill the 10; a and c finish in their prefill step, leaving holes of 3 and
    # 4 around b. d (5 slots) finds 7 free but no hole of 5: it waits until b finishes.
    requests = [request("a", 2, 1), request("b", 1, 2), request("c", 3, 1), request("d", 4, 1)]
    runs = {}
    for compact in (False, True):
        memory = FirstFitMemory(10, final_length, compact=compact)
        steps = list(run_steps(Scheduler(memory), CountingRunner(), [(0, r) for r in requests]))
        runs[compact] = [step.num_running for _, step in steps], memory
    assert runs[False][0] == [3, 1, 1]
    assert (runs[False][1].blocked_by_holes, runs[False][1].compactions) == (1, 0)
    assert runs[True][0] == [3, 2]  # compacted, d starts while b runs
    assert (runs[True][1].blocked_by_holes, runs[True][1].compactions) == (0, 1)


def test_the_memory_keeps_each_sequence_length_and_range():
    memory = FirstFitMemory(16, final_length)
    a, b = request("a", 3, 4), request("b", 2, 2)
    assert memory.allocate_slots(a, 3) == (tuple(range(0, 7)),)  # its range's slots are its block ids
    assert memory.allocate_slots(b, 2) == (tuple(range(7, 11)),)
    assert memory.allocate_slots(a, 1) == ((),) and memory.allocate_slots(b, 1) == ((),)
    assert memory.allocate_slots(a, 1) == ((),)
    assert memory.sequences() == {"a": (5, 7), "b": (3, 4)}
    assert (memory.reserved_tokens, memory.num_free_blocks) == (11, 5)
    assert memory.describe_free() == "5 free token slots out of 16, the largest hole 5"
    memory.free("a")
    assert memory.sequences() == {"b": (3, 4)} and memory.allocator.holes == [Extent(0, 7), Extent(11, 5)]


@pytest.mark.parametrize("compact", [False, True])
def test_a_refused_sequence_changes_nothing(compact):
    memory = FirstFitMemory(10, final_length, compact=compact)
    for name, prompt in [("a", 2), ("b", 2), ("c", 3)]:
        memory.allocate_slots(request(name, prompt, 1), prompt)  # ranges of 3, 3 and 4
    memory.free("a")
    before = (memory.allocator.holes, memory.allocator.ranges, memory.sequences())
    assert memory.allocate_slots(request("d", 5, 1), 5) is None  # 6 slots: 3 are free
    assert (memory.allocator.holes, memory.allocator.ranges, memory.sequences()) == before


def test_max_tokens_is_the_reservation_within_the_budget():
    memory = FirstFitMemory(8, lambda r: 6)
    assert memory.max_tokens(request("a", 3, 4)) == 6  # holds 3 + 4 - 1 = 6 tokens at its longest
    assert FirstFitMemory(5, lambda r: 6).max_tokens(request("a", 1, 1)) == 0


def test_bad_memory_arguments():
    with pytest.raises(ValueError, match="budget_tokens"):
        FirstFitMemory(0, final_length)
    with pytest.raises(ValueError, match="reserve"):
        FirstFitMemory(8, 6)


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(1, 12)), max_size=10),
    st.integers(24, 60),
)
def test_compaction_admits_exactly_what_counting_free_slots_admits(lengths, budget):
    # With compaction there is no external fragmentation: the memory behaves as the engine's
    # ContiguousMemory, which only counts free slots.
    arrivals = [(t, request(i, p, o)) for i, (t, p, o) in enumerate(lengths)]

    def serve(memory):
        steps = run_steps(Scheduler(memory), CountingRunner(), arrivals)
        return [(step.num_running, step.num_waiting, step.reserved_tokens) for _, step in steps]

    first_fit = FirstFitMemory(budget, final_length)
    assert serve(FirstFitMemory(budget, final_length, compact=True)) == serve(
        ContiguousMemory(budget, final_length, seat_tokens=1)
    )
    serve(first_fit)
    assert first_fit.allocator.holes == [Extent(0, budget)]  # everything was given back and merged

"""Recording: PagedKVCacheAllocator(record=True) keeps a trace of captioned snapshots, one per event."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import BlockTable, OutOfBlocksError, PagedKVCacheAllocator, UnknownSequenceError
from paged_kv.core.trace import EVENTS, TraceFrame

from .helpers import fails_cleanly, kv_for, make_cache

pytestmark = [pytest.mark.lesson02, pytest.mark.lesson04, pytest.mark.lesson08]


def scripted() -> PagedKVCacheAllocator:
    """A 9-token prompt in blocks of 4, four decoded tokens (the 13th takes a block), then the end."""
    cache = make_cache(num_blocks=8, block_size=4, record=True)
    cache.allocate_for_sequence("A", 9)
    cache.append_tokens("A", 3)
    cache.append_tokens("A")
    cache.free_sequence("A")
    return cache


def test_the_scripted_trace():
    trace = scripted().trace
    assert [(f.event, f.seq_id, f.highlight, f.caption) for f in trace] == [
        ("start", None, (), "empty pool: 8 blocks of 4 slots, all free"),
        ("allocate", "A", (0, 1, 2), "seq A: 9-token prompt takes blocks [0, 1, 2]"),
        ("append", "A", (2,), "seq A, token 10 fits in block 2"),
        ("append", "A", (2,), "seq A, token 11 fits in block 2"),
        ("append", "A", (2,), "seq A, token 12 fits in block 2"),
        ("new_block", "A", (3,), "seq A, token 13: block 3 appended"),
        ("free", "A", (0, 1, 2, 3), "seq A finished: blocks [0, 1, 2, 3] back to the free list"),
    ]
    assert {f.event for f in trace} <= set(EVENTS)


def test_each_frame_holds_the_state_right_after_its_event():
    trace = scripted().trace
    assert trace[0].snapshot == make_cache(num_blocks=8, block_size=4).snapshot()
    assert trace[1].snapshot.tables == {"A": BlockTable([0, 1, 2], 9)}
    assert [f.snapshot.tables["A"].num_tokens for f in trace[2:6]] == [10, 11, 12, 13]
    assert trace[4].snapshot.free_block_ids == (3, 4, 5, 6, 7)  # block 3 not taken before token 13
    assert trace[5].snapshot.tables["A"] == BlockTable([0, 1, 2, 3], 13)
    assert trace[5].snapshot.ref_counts == (1, 1, 1, 1, 0, 0, 0, 0)
    assert trace[6].snapshot.tables == {}
    assert trace[6].snapshot.free_block_ids == (4, 5, 6, 7, 0, 1, 2, 3)


def test_the_blog_captions():
    cache = PagedKVCacheAllocator(64, 16, 1, 1, record=True)
    cache.allocate_for_sequence("A", 33)  # blocks [0, 1, 2]
    cache.allocate_for_sequence("B", 16)  # block 3, full
    cache.allocate_for_sequence("C", 5)  # block 4
    assert cache.append_tokens("B", 2) == [5]
    assert [f.caption for f in cache.trace[-2:]] == [
        "seq B, token 17: block 5 appended",
        "seq B, token 18 fits in block 5",
    ]


def test_frames_are_snapshots_that_later_calls_never_change():
    cache = make_cache(num_blocks=8, block_size=4, record=True)
    cache.allocate_for_sequence("A", 2)
    first = cache.trace
    cache.append_tokens("A", 7)
    cache.allocate_for_sequence("B", 1)
    cache.free_sequence("A")
    assert first[1].snapshot.tables == {"A": BlockTable([0], 2)}
    assert first[1].snapshot.free_block_ids == (1, 2, 3, 4, 5, 6, 7)
    assert cache.trace[: len(first)] == first
    first.clear()  # the property returns a new list
    assert len(cache.trace) == 1 + 1 + 7 + 1 + 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.trace[0].caption = "changed"


def test_recording_is_off_by_default():
    cache = make_cache()
    cache.allocate_for_sequence("A", 5)
    cache.append_tokens("A", 3)
    cache.free_sequence("A")
    assert cache.trace == []


def test_a_block_appended_without_a_token():
    cache = make_cache(num_blocks=8, block_size=4, record=True)
    cache.allocate_for_sequence("A", 4)
    assert cache.append_block_to_sequence("A") == 1
    assert cache.append_tokens("A", 2) == []  # the reserved block takes the tokens: no new block
    frames = cache.trace[2:]
    assert [(f.event, f.highlight, f.caption) for f in frames] == [
        ("new_block", (1,), "seq A: block 1 appended ahead of its next token"),
        ("append", (1,), "seq A, token 5 fits in block 1"),
        ("append", (1,), "seq A, token 6 fits in block 1"),
    ]


def test_an_empty_prompt_and_an_empty_sequences_end():
    cache = make_cache(record=True)
    cache.allocate_for_sequence(0, 0)
    cache.free_sequence(0)
    assert [f.caption for f in cache.trace[1:]] == [
        "seq 0: 0-token prompt takes no block",
        "seq 0 finished: no block back to the free list",
    ]


def test_freeing_a_shared_block_names_the_blocks_still_held():
    cache = make_cache(record=True)
    cache.allocate_for_sequence("parent", 5)  # [0, 1]
    cache.allocate_for_sequence("child", 0)
    cache.manager.allocator.add_ref(0)  # share block 0 the way a fork will
    cache.manager.table("child").append_block(0)
    cache.free_sequence("parent")
    frame = cache.trace[-1]
    assert frame.caption == (
        "seq parent finished: blocks [1] back to the free list, blocks [0] still held by another sequence"
    )
    assert frame.highlight == (0, 1)


def test_failed_calls_and_no_ops_record_nothing():
    cache = make_cache(num_blocks=4, block_size=4, record=True)
    cache.allocate_for_sequence("A", 5)  # 2 blocks
    before = cache.trace
    fails_cleanly(cache, OutOfBlocksError, lambda: cache.allocate_for_sequence("B", 9))
    fails_cleanly(cache, OutOfBlocksError, lambda: cache.append_tokens("A", 12))  # would fit 3 more first
    fails_cleanly(cache, ValueError, lambda: cache.allocate_for_sequence("A", 1))
    fails_cleanly(cache, ValueError, lambda: cache.append_tokens("A", -1))
    fails_cleanly(cache, UnknownSequenceError, lambda: cache.append_tokens("ghost"))
    fails_cleanly(cache, UnknownSequenceError, lambda: cache.append_block_to_sequence("ghost"))
    assert cache.free_sequence("ghost") == []
    assert cache.append_tokens("A", 0) == []
    assert cache.trace == before


def test_a_fork_frame_and_the_copy_frames_of_a_write():
    cache = make_cache(num_blocks=8, block_size=4, record=True)
    cache.allocate_for_sequence("P", 0)
    cache.fork("P", "Q")
    cache.allocate_for_sequence("A", 6)  # [0, 1]
    cache.fork("A", "B")
    k, v = kv_for(6)
    cache.write_kv("B", k, v)  # both blocks shared: copied to [2, 3] before the write
    cache.write_kv("B", k, v)  # now B's own: no frame
    assert [(f.event, f.seq_id, f.highlight, f.caption) for f in cache.trace[2:]] == [
        ("fork", "Q", (), "seq Q forks from P: shares no block"),
        ("allocate", "A", (0, 1), "seq A: 6-token prompt takes blocks [0, 1]"),
        ("fork", "B", (0, 1), "seq B forks from A: shares blocks [0, 1]"),
        ("copy_on_write", "B", (0, 2, 1, 3), "seq B, before a write: blocks [0, 1] copied to blocks [2, 3]"),
    ]
    assert cache.trace[-1].snapshot.tables["B"] == BlockTable([2, 3], 6)


def test_a_failed_fork_or_copy_records_nothing():
    cache = make_cache(num_blocks=2, block_size=4, record=True)
    cache.allocate_for_sequence("A", 6)
    cache.fork("A", "B")
    before = cache.trace
    k, v = kv_for(1)
    fails_cleanly(cache, OutOfBlocksError, lambda: cache.append_tokens("B"))
    fails_cleanly(cache, OutOfBlocksError, lambda: cache.write_kv("B", k, v))
    fails_cleanly(cache, ValueError, lambda: cache.fork("A", "B"))
    fails_cleanly(cache, UnknownSequenceError, lambda: cache.fork("ghost", "C"))
    assert cache.trace == before


def test_trace_frames_compare_by_value():
    assert scripted().trace == scripted().trace
    frame = scripted().trace[1]
    assert isinstance(frame, TraceFrame) and frame == dataclasses.replace(frame)


# A random workload: each step allocates, appends n tokens, appends a block, frees, forks into
# sequence n, or writes one token at position n.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 5), st.integers(0, 14)),
        st.tuples(st.just("append"), st.integers(0, 5), st.integers(0, 9)),
        st.tuples(st.just("block"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5)),
        st.tuples(st.just("write"), st.integers(0, 5), st.integers(0, 9)),
    ),
    max_size=30,
)


def run(cache: PagedKVCacheAllocator, step: tuple[str, int, int]) -> object:
    """One step; returns its result, or the type of the error it raised."""
    kind, seq_id, n = step
    k, v = kv_for(1, first=n)
    call = {
        "allocate": lambda: cache.allocate_for_sequence(seq_id, n),
        "append": lambda: cache.append_tokens(seq_id, n),
        "block": lambda: cache.append_block_to_sequence(seq_id),
        "free": lambda: cache.free_sequence(seq_id),
        "fork": lambda: cache.fork(seq_id, n),
        "write": lambda: (cache.write_kv(seq_id, k, v, start_position=n), cache.last_copies),
    }[kind]
    try:
        return call()
    except (OutOfBlocksError, KeyError, ValueError) as error:
        return type(error)


@given(steps)
def test_recording_never_changes_what_the_allocator_does(workload):
    plain = make_cache(num_blocks=6, block_size=4)
    recorded = make_cache(num_blocks=6, block_size=4, record=True)
    for step in workload:
        known = step[1] in recorded
        frames = len(recorded.trace)
        result = run(recorded, step)
        assert run(plain, step) == result
        assert recorded.snapshot() == plain.snapshot()
        assert recorded.last_copies == plain.last_copies
        assert torch.equal(recorded.k_cache, plain.k_cache) and torch.equal(recorded.v_cache, plain.v_cache)
        failed = isinstance(result, type) or (step[0] == "free" and not known)
        added = 0 if failed else step[2] if step[0] == "append" else 1
        if step[0] == "write":  # a frame only when shared blocks were copied
            added = 1 if added and result[1] else 0
        assert len(recorded.trace) == frames + added
        if added:
            assert recorded.trace[-1].snapshot == recorded.snapshot()
            concerns = step[2] if step[0] == "fork" else step[1]  # a fork's frame is the child's
            assert recorded.trace[-1].seq_id == concerns
    for frame in recorded.trace:  # every frame is a consistent pool
        snap = frame.snapshot
        held = [b for table in snap.tables.values() for b in table.block_ids]
        assert sorted([*set(held), *snap.free_block_ids]) == list(range(6))  # free or held, never both
        assert all(snap.ref_counts[b] == held.count(b) for b in range(6))
        assert set(frame.highlight) <= set(range(6))

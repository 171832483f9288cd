"""The scheduler steps of lesson 04: a decode step for a batch, all or nothing, and free-and-admit."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, UnknownSequenceError, blocks_for_tokens
from paged_kv.reference.lesson04 import decode_step, finish_and_admit

from .helpers import fails_cleanly

pytestmark = pytest.mark.lesson04


def cache_holding(num_blocks, block_size, sequences):
    """A cache holding ``(seq_id, tokens, spare_blocks)`` sequences, allocated in order."""
    cache = PagedKVCacheAllocator(num_blocks, block_size, 1, 1)
    for seq_id, tokens, spare in sequences:
        cache.allocate_for_sequence(seq_id, tokens)
        for _ in range(spare):
            cache.append_block_to_sequence(seq_id)
    return cache


# ------------------------------------------------------------------------------- decode_step


def test_a_decode_step_takes_a_block_only_where_the_blocks_are_full():
    # a: a free slot; b: a full block; c: empty; d: a full block and a spare one reserved ahead.
    cache = cache_holding(10, 4, [("a", 3, 0), ("b", 4, 0), ("c", 0, 0), ("d", 4, 1)])
    assert cache.num_free_blocks == 6  # blocks 4 to 9
    assert decode_step(cache, ["a", "b", "c", "d"]) == {"a": None, "b": 4, "c": 5, "d": None}
    assert [cache.sequence_length(s) for s in "abcd"] == [4, 5, 1, 5]
    assert cache.get_block_mapping("b") == [1, 4]
    assert cache.get_block_mapping("c") == [5]
    assert cache.get_block_mapping("d") == [2, 3]


def test_an_empty_batch_does_nothing():
    cache = cache_holding(4, 4, [("a", 3, 0)])
    before = cache.snapshot()
    assert decode_step(cache, []) == {}
    assert cache.snapshot() == before


def test_a_decode_step_that_runs_out_changes_nothing():
    cache = cache_holding(4, 4, [("a", 4, 0), ("b", 4, 0), ("c", 4, 0)])
    error = fails_cleanly(
        cache, OutOfBlocksError, lambda: decode_step(cache, ["a", "b", "c"]), match="a decode step of 3"
    )
    assert (error.needed, error.free) == (3, 1)
    assert decode_step(cache, ["a"]) == {"a": 3}  # one sequence alone still fits


def test_a_decode_step_with_an_unknown_or_repeated_id_changes_nothing():
    cache = cache_holding(8, 4, [("a", 3, 0), ("b", 4, 0)])
    fails_cleanly(cache, UnknownSequenceError, lambda: decode_step(cache, ["a", "b", "ghost"]))
    fails_cleanly(cache, ValueError, lambda: decode_step(cache, ["a", "b", "a"]), match="'a' appears")


@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    steps=st.integers(1, 12),
    block_size=st.integers(1, 6),
)
def test_decode_steps_match_appending_one_token_each(lengths, steps, block_size):
    ours = cache_holding(256, block_size, [(i, n, 0) for i, n in enumerate(lengths)])
    theirs = cache_holding(256, block_size, [(i, n, 0) for i, n in enumerate(lengths)])
    for _ in range(steps):
        taken = decode_step(ours, range(len(lengths)))
        expected = {i: (theirs.append_tokens(i) or [None])[0] for i in range(len(lengths))}
        assert taken == expected
        assert ours.snapshot() == theirs.snapshot()


# -------------------------------------------------------------------------- finish_and_admit


def pool():
    """6 blocks of 4: 'a' holds 8 tokens in [0, 1], 'b' 12 in [2, 3, 4]; block 5 is free."""
    return cache_holding(6, 4, [("a", 8, 0), ("b", 12, 0)])


def test_finished_sequences_are_freed_before_anyone_is_admitted():
    cache, waiting = pool(), deque([("c", 6), ("d", 4)])
    assert finish_and_admit(cache, ["a"], waiting, max_running=4) == ["c", "d"]
    assert cache.seq_ids == ("b", "c", "d")
    assert "a" not in cache
    assert not waiting
    assert cache.num_free_blocks == 0


def test_admission_stops_at_the_first_request_that_does_not_fit():
    cache, waiting = pool(), deque([("e", 20), ("f", 1)])
    assert finish_and_admit(cache, ["a"], waiting, max_running=4) == []
    assert list(waiting) == [("e", 20), ("f", 1)]  # f does not skip ahead of e
    assert cache.num_free_blocks == 3


def test_a_prompt_needs_its_blocks_rounded_up():
    cache, waiting = pool(), deque([("g", 13)])
    assert finish_and_admit(cache, ["a"], waiting, max_running=4) == []  # 4 blocks, 3 free
    cache, waiting = pool(), deque([("g", 12)])
    assert finish_and_admit(cache, ["a"], waiting, max_running=4) == ["g"]


def test_at_most_max_running_sequences_run():
    cache, waiting = pool(), deque([("c", 1), ("d", 1), ("e", 1)])
    assert finish_and_admit(cache, ["a"], waiting, max_running=3) == ["c", "d"]
    assert list(waiting) == [("e", 1)]
    assert finish_and_admit(cache, [], waiting, max_running=0) == []


def test_a_request_that_cannot_be_allocated_stays_at_the_front():
    cache, waiting = pool(), deque([("c", 1), ("b", 1), ("d", 1)])
    with pytest.raises(ValueError, match="already allocated"):
        finish_and_admit(cache, ["a"], waiting, max_running=4)
    assert "a" not in cache and "c" in cache
    assert list(waiting) == [("b", 1), ("d", 1)]
    with pytest.raises(ValueError, match="max_running"):
        finish_and_admit(cache, [], waiting, max_running=-1)
    with pytest.raises(ValueError, match="prompt_tokens"):
        finish_and_admit(cache, [], deque([("x", -1)]), max_running=4)


def test_an_unknown_finished_id_is_a_no_op():
    cache, waiting = pool(), deque()
    assert finish_and_admit(cache, ["never-admitted"], waiting, max_running=4) == []
    assert cache.seq_ids == ("a", "b")


@given(
    prompts=st.lists(st.integers(0, 30), max_size=8),
    finished=st.sets(st.sampled_from(["a", "b"])),
    max_running=st.integers(0, 6),
)
def test_admitted_requests_are_the_longest_prefix_that_fits(prompts, finished, max_running):
    cache = pool()
    waiting = deque((f"r{i}", p) for i, p in enumerate(prompts))
    admitted = finish_and_admit(cache, sorted(finished), waiting, max_running)
    assert admitted == [f"r{i}" for i in range(len(admitted))]
    assert [seq_id for seq_id, _ in waiting] == [f"r{i}" for i in range(len(admitted), len(prompts))]
    assert not finished.intersection(cache.seq_ids)
    if waiting:  # the next request did not fit, by count or by blocks
        _, prompt = waiting[0]
        assert (
            len(cache.seq_ids) >= max_running
            or blocks_for_tokens(prompt, cache.block_size) > cache.num_free_blocks
        )

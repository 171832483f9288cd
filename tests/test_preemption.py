"""Choosing the victims of a decode step that finds too few free blocks (paged_kv.serving.preemption)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import OutOfBlocksError
from paged_kv.serving.preemption import choose_victims

pytestmark = pytest.mark.lesson11


def test_a_step_that_fits_preempts_nobody():
    assert choose_victims([("a", 3, True), ("b", 2, True)], 2) == []
    assert choose_victims([("a", 3, False), ("b", 2, False)], 0) == []
    assert choose_victims([], 0) == []


def test_the_newest_sequence_goes_first_and_its_blocks_become_free():
    # 3 blocks needed, 1 free: preempting c frees its 2 blocks and drops its need: 2 needed, 3 free.
    assert choose_victims([("a", 3, True), ("b", 2, True), ("c", 2, True)], 1) == ["c"]


def test_victims_are_taken_newest_first_until_the_rest_fit():
    running = [("a", 4, True), ("b", 1, True), ("c", 1, True), ("d", 1, True)]
    # 4 needed, 0 free; d: 3 needed, 1 free; c: 2 needed, 2 free.
    assert choose_victims(running, 0) == ["d", "c"]


def test_a_victim_that_needs_no_block_still_helps_by_the_blocks_it_frees():
    # b was admitted this step: it needs no new block, but its 2 blocks cover a's need.
    assert choose_victims([("a", 4, True), ("b", 2, False)], 0) == ["b"]


def test_a_victim_holding_nothing_helps_only_by_its_own_need():
    # 3 needed, 2 free; c frees nothing but needs nothing more: 2 needed, 2 free.
    assert choose_victims([("a", 4, True), ("b", 1, True), ("c", 0, True)], 2) == ["c"]


def test_the_oldest_is_never_preempted():
    with pytest.raises(OutOfBlocksError, match="oldest running sequence alone") as caught:
        choose_victims([("a", 5, True), ("b", 0, False)], 0)
    assert (caught.value.needed, caught.value.free) == (1, 0)
    with pytest.raises(OutOfBlocksError):
        choose_victims([("a", 5, True)], 0)


@pytest.mark.parametrize(
    ("running", "num_free_blocks", "match"),
    [
        ("abc", 0, "running must be a list"),
        ([("a", 1)], 0, r"running\[0\] must be a \(seq_id, blocks, needs_block\) tuple"),
        ([["a", 1, True]], 0, r"running\[0\] must be"),
        ([("a", -1, True)], 0, r"running\[0\]'s blocks must be at least 0"),
        ([("a", 1.5, True)], 0, r"running\[0\]'s blocks must be an integer"),
        ([("a", 1, True), ("b", 1, 1)], 0, r"running\[1\]'s needs_block must be True or False"),
        ([(["a"], 1, True)], 0, r"running\[0\]'s seq_id must be hashable"),
        ([("a", 1, True), ("a", 1, True)], 0, "seq_id 'a' twice"),
        ([("a", 1, True)], -1, "num_free_blocks must be at least 0"),
        ([("a", 1, True)], True, "num_free_blocks must be an integer"),
    ],
)
def test_bad_arguments_are_named(running, num_free_blocks, match):
    with pytest.raises(ValueError, match=match):
        choose_victims(running, num_free_blocks)


def shortest_suffix(running, free):
    """The reference: try k = 0, 1, ... newest sequences removed; None when only the oldest is left."""
    for k in range(len(running)):
        kept, removed = running[: len(running) - k], running[len(running) - k :]
        if sum(n for _, _, n in kept) <= free + sum(b for _, b, _ in removed):
            return [seq_id for seq_id, _, _ in reversed(removed)]
    return [] if not running else None


@given(
    st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=10),
    st.integers(0, 8),
)
def test_the_victims_are_the_shortest_suffix_that_makes_the_step_fit(entries, free):
    running = [(f"s{i}", blocks, needs) for i, (blocks, needs) in enumerate(entries)]
    expected = shortest_suffix(running, free)
    if expected is None:
        with pytest.raises(OutOfBlocksError):
            choose_victims(running, free)
    else:
        assert choose_victims(running, free) == expected
        assert not running or running[0][0] not in expected

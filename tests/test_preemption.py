"""Exercise 11's reference answers (paged_kv.reference.lesson11) against the engine they model.

``choose_victims`` is the scheduler's preemption on plain numbers: the victims of a decode step that
finds too few free blocks, newest first; the scheduler itself must preempt exactly those.
``admit_with_watermark`` is the engine's admission: its memory must answer the same.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv import OutOfBlocksError
from paged_kv.checks.lesson11 import _engine_admits, _grid
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.reference.lesson11 import admit_with_watermark, choose_victims
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.scheduler import EngineCoreRequest, Scheduler, run_steps

from .helpers import max_examples

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


@settings(max_examples=max_examples(40), deadline=None)
@given(st.integers(0, 10_000), st.integers(5, 14), st.sampled_from([2, 4]))
def test_the_scheduler_preempts_exactly_the_victims_choose_victims_names(seed, num_blocks, block_size):
    # Without a token budget every running request decodes at each step (a prefill runs whole), so
    # the step's preemptions are choose_victims's answer on the requests' blocks before the step.
    rng = random.Random(seed)
    largest = num_blocks * block_size
    requests = []
    for i in range(rng.randint(2, 6)):
        prompt = rng.randint(1, largest // 2)
        requests.append(EngineCoreRequest(f"r{i}", prompt, rng.randint(1, largest - prompt + 1)))
    memory = KVCacheManager(num_blocks + 1, block_size)  # and its null block
    scheduler = Scheduler(memory)
    runner = CountingRunner()
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests:
        running = [
            (
                r.request_id,
                len(memory.get_block_ids(r.request_id)[0]),
                r.num_computed_tokens % block_size == 0,
            )
            for r in scheduler.running
        ]
        assert all(r.num_computed_tokens == r.num_tokens - 1 for r in scheduler.running)
        expected = choose_victims(running, memory.num_free_blocks)
        output = scheduler.schedule()
        assert [p.request_id for p in output.preemptions] == expected
        scheduler.update_from_output(output, runner.execute_model(output))


def test_the_scheduler_example_preempts_newest_first():
    # Three 3-token prompts in 3 blocks of 4 (and the null block), one block each. The 5th tokens
    # need three blocks, none free: a's allocation pops c, and b's finds none again, pops b itself,
    # and ends the loop.
    memory = KVCacheManager(4, 4)
    arrivals = [(0, EngineCoreRequest(s, 3, 3)) for s in "abc"]
    preempted = [
        [p.request_id for p in output.preemptions]
        for output, _ in run_steps(Scheduler(memory), CountingRunner(), arrivals)
    ]
    assert preempted == [[], [], ["c", "b"], [], []]  # a finishes at step 2, then b and c resume
    assert choose_victims([("a", 1, True), ("b", 1, True), ("c", 1, True)], 0) == ["c", "b"]


def test_admit_with_watermark_is_the_engines_admission():
    for case in _grid():
        assert admit_with_watermark(*case) == _engine_admits(*case), case

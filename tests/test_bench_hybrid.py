"""The hybrid bench's arithmetic is what the KV-cache coordinator holds.

Correctness only, on small shapes: the numbers live in bench/RESULTS.md.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_hybrid
from bench_hybrid import (
    HybridShape,
    blocks_held,
    check_coordinator,
    request_blocks,
    serve,
    sliding_blocks_held,
)

from paged_kv.core.kv_cache_coordinator import peak_blocks
from paged_kv.core.kv_cache_groups import SlidingWindowSpec, num_tensors
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.serving.request import EngineCoreRequest

SHAPES = {
    "Gemma 3's 5:1, window 8": HybridShape("g3", 12, 6, 8, 1, 1),
    "Gemma 2's 1:1, window 7": HybridShape("g2", 4, 2, 7, 1, 1),
    "every 3rd full, window 5": HybridShape("w5", 6, 3, 5, 1, 1),
}


def test_gemma3_27b_has_seven_groups_over_ten_tensors():
    groups = bench_hybrid.GEMMA3_27B.groups(16)
    assert [len(g.layers) for g in groups] == [9, 9, 9, 9, 8, 8, 10]
    assert num_tensors(groups) == 10
    assert [isinstance(g.spec, SlidingWindowSpec) for g in groups] == [True] * 6 + [False]
    assert sum(len(g.layers) for g in groups) == 62


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
def test_the_formula_is_peak_blocks(shape):
    for block_size in (1, 4, 16):
        groups = shape.groups(block_size)
        for length in (1, 3, 4, 5, 9, 17, 40, 101):
            for in_flight in (1, 2, 7, 16, 64):
                assert request_blocks(groups, length, in_flight) == peak_blocks(groups, length, in_flight)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES)
@pytest.mark.parametrize(("prompt", "chunk", "decode"), [(1, 1, 30), (13, 4, 25), (40, 16, 21), (37, 37, 9)])
def test_the_coordinator_holds_what_the_arithmetic_says(shape, prompt, chunk, decode):
    """check_coordinator asserts the exact count after every call and the formula as a bound."""
    groups = shape.groups(4)
    held, predicted = check_coordinator(groups, prompt, chunk, decode)
    assert held <= predicted


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("in_flight", [1, 2, 5, 16])
def test_the_bound_is_reached_unless_the_window_and_the_step_leave_one_token_over(block_size, in_flight):
    """A sliding group's exact count, over every position, peaks at vLLM's bound
    ``ceil((W - 1 + n) / bs) + 1``, except when ``(W - 2 + n) % bs == 0``: then the ``W - 1 + n``
    tokens never straddle one block more than they fill, and the bound is one block high."""
    for window in range(1, 40):
        spec = SlidingWindowSpec(block_size, window)
        most = max(sliding_blocks_held(spec, start, start + in_flight) for start in range(200))
        bound = spec.max_admission_blocks_per_request(in_flight, 10**6)
        assert most == bound - ((window - 2 + in_flight) % block_size == 0)


def test_gemma3_27b_decoding_reaches_the_bound_except_where_the_window_starts_a_block():
    groups = bench_hybrid.GEMMA3_27B.groups(16)
    held, predicted = check_coordinator(groups, 1_024, 512, 16)  # ends at 1,040 = 65 blocks of 16
    assert predicted - held == 6
    held, predicted = check_coordinator(groups, 1_024, 512, 17)
    assert predicted == held


def test_serving_holds_what_the_arithmetic_says_step_by_step_with_preemptions():
    """serve() raises when the blocks in use at a step are not the sum of blocks_held."""
    shape = SHAPES["every 3rd full, window 5"]
    rng = random.Random(3)
    requests = [EngineCoreRequest(i, rng.randint(3, 40), rng.randint(1, 30)) for i in range(24)]
    hybrid, full = shape.groups(4), shape.all_full(4)
    assert num_tensors(hybrid) == 2 and num_tensors(full) == 6
    per_group = KVCacheManager(45, kv_cache_groups=hybrid, max_in_flight_tokens=16)  # 45 x 2 layers = 15 x 6
    h = serve(per_group, hybrid, requests, 16)
    f = serve(KVCacheManager(15, 4), full, requests, 16)
    assert h.preemptions and f.preemptions
    assert h.steps < f.steps and h.mean_running > f.mean_running
    assert per_group.num_free_blocks == 45 - 1  # everything given back, the null block kept


def test_blocks_held_counts_the_window_from_the_last_allocation():
    groups = HybridShape("w", 2, 2, 5, 1, 1).groups(4)  # one sliding group (window 5), one full
    # 20 tokens held, the last allocation from 12: blocks before the window of token 12 (8..12) go
    assert blocks_held(groups, 12, 20) == (5 - 2) + 5
    assert blocks_held(groups, 0, 20) == 5 + 5  # admitted in one allocation: nothing skipped yet


def test_quick_run_rows_are_consistent():
    rows = bench_hybrid.run(**bench_hybrid.QUICK)
    assert len(rows) == 10
    check = rows[-1]
    assert check.met is True and check.measured == check.baseline
    decoding_32k = rows[5]
    assert decoding_32k.unit == "GiB" and decoding_32k.baseline == 15.5
    assert decoding_32k.measured == (2_048 + 6 * 65) * 10 * 128 / 1024**2

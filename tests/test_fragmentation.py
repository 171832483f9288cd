"""The fragmentation arithmetic and the blog seed's benchmark (lesson 00)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import (
    BlockUsage,
    ContiguousUsage,
    OutOfBlocksError,
    PagedKVCacheAllocator,
    contiguous_baseline,
    fragmentation_report,
)
from paged_kv.simulation.fragmentation import paged_usage

pytestmark = pytest.mark.lesson00

SEED_REQUESTS = [9, 17, 33, 5, 41, 12]

# The blog seed's benchmark output for --block-size 16 --total-blocks 64 with the requests above.
SEED_REPORT = {
    "block_size": 16,
    "block_usage": {
        "allocated_tokens": 117,
        "block_utilization": 0.6647727272727273,
        "free_blocks": 53,
        "internal_fragmentation_tokens": 59,
        "reserved_tokens": 176,
        "used_blocks": 11,
    },
    "contiguous_fixed_slot_baseline": {
        "internal_fragmentation_tokens": 129,
        "reserved_tokens": 246,
        "utilization": 0.47560975609756095,
    },
    "fragmentation_tokens_saved_vs_contiguous": 70,
    "request_tokens": [9, 17, 33, 5, 41, 12],
}


def test_the_seeds_worked_example():
    cache = PagedKVCacheAllocator(64, 16, 1, 1)
    for seq_id, tokens in enumerate(SEED_REQUESTS):
        cache.allocate_for_sequence(seq_id, tokens)
    assert cache.usage() == BlockUsage(
        used_blocks=11,
        free_blocks=53,
        allocated_tokens=117,
        reserved_tokens=176,
        internal_fragmentation_tokens=59,
        block_utilization=117 / 176,
    )


@pytest.mark.parametrize(
    ("tokens", "blocks", "wasted"), [(9, 1, 7), (17, 2, 15), (33, 3, 15), (5, 1, 11), (41, 3, 7), (12, 1, 4)]
)
def test_the_seeds_per_request_table(tokens, blocks, wasted):
    cache = PagedKVCacheAllocator(64, 16, 1, 1)
    cache.allocate_for_sequence("req", tokens)
    usage = cache.usage()
    assert (usage.used_blocks, usage.reserved_tokens) == (blocks, 16 * blocks)
    assert usage.internal_fragmentation_tokens == wasted
    assert usage.block_utilization == tokens / (16 * blocks)


def test_paged_usage_is_the_seeds_worked_example_without_a_cache():
    assert paged_usage(SEED_REQUESTS, block_size=16) == BlockUsage(
        used_blocks=11,
        free_blocks=0,
        allocated_tokens=117,
        reserved_tokens=176,
        internal_fragmentation_tokens=59,
        block_utilization=117 / 176,
    )
    assert paged_usage(SEED_REQUESTS, block_size=16, total_blocks=64).free_blocks == 53


def test_paged_usage_rounds_up_per_request_not_the_total():
    # 9 + 9 tokens would fit in 2 blocks of 16 pooled, but each request holds its own block.
    assert paged_usage([9, 9], block_size=16).used_blocks == 2
    assert paged_usage([16], block_size=16).used_blocks == 1
    assert paged_usage([], block_size=16) == BlockUsage(0, 0, 0, 0, 0, 0.0)


def test_paged_usage_rejects_bad_input():
    with pytest.raises(OutOfBlocksError):
        paged_usage([16 * 64 + 1], block_size=16, total_blocks=64)
    with pytest.raises(ValueError, match="request_tokens"):
        paged_usage([3, -2])
    with pytest.raises(ValueError, match="block_size"):
        paged_usage([3], block_size=0)


@given(requests=st.lists(st.integers(0, 200), max_size=12), block_size=st.sampled_from([1, 2, 8, 16, 32]))
def test_paged_usage_is_what_a_real_cache_measures(requests, block_size):
    report = fragmentation_report(requests, block_size=block_size, total_blocks=12 * 200)
    assert paged_usage(requests, block_size, total_blocks=12 * 200).as_dict() == report["block_usage"]


def test_the_contiguous_baseline_reserves_the_longest_request_for_everyone():
    assert contiguous_baseline(SEED_REQUESTS) == ContiguousUsage(
        reserved_tokens=246, internal_fragmentation_tokens=129, utilization=117 / 246
    )


def test_the_blog_seeds_three_requests_in_8000_token_slots():
    # A: 300 tokens, B: 5,000, C: 70, each in an 8,000-token contiguous buffer.
    baseline = contiguous_baseline([300, 5000, 70], slot_tokens=8000)
    assert baseline.reserved_tokens == 24_000
    assert baseline.internal_fragmentation_tokens == 24_000 - 5370


def test_the_baseline_rejects_bad_input():
    assert contiguous_baseline([]) == ContiguousUsage(0, 0, 0.0)
    with pytest.raises(ValueError, match="slot_tokens must hold the longest request"):
        contiguous_baseline([5, 9], slot_tokens=8)
    with pytest.raises(ValueError, match="request_tokens"):
        contiguous_baseline([5, -1])


def test_the_report_reproduces_the_seeds_benchmark():
    assert fragmentation_report(SEED_REQUESTS, block_size=16, total_blocks=64) == SEED_REPORT


def test_the_report_refuses_more_tokens_than_the_pool_holds():
    with pytest.raises(OutOfBlocksError):
        fragmentation_report([16 * 64 + 1], block_size=16, total_blocks=64)
    with pytest.raises(ValueError, match="request_tokens"):
        fragmentation_report([3, -2])


@given(requests=st.lists(st.integers(0, 200), max_size=12), block_size=st.sampled_from([1, 2, 8, 16, 32]))
def test_paging_wastes_less_than_one_block_per_request(requests, block_size):
    report = fragmentation_report(requests, block_size=block_size, total_blocks=12 * 200)
    usage = report["block_usage"]
    assert usage["allocated_tokens"] == sum(requests)
    assert usage["internal_fragmentation_tokens"] == sum((-n) % block_size for n in requests)
    assert usage["internal_fragmentation_tokens"] <= (block_size - 1) * len(requests)
    assert usage["used_blocks"] + usage["free_blocks"] == 12 * 200
    assert 0.0 <= usage["block_utilization"] <= 1.0
    baseline = report["contiguous_fixed_slot_baseline"]
    saved = report["fragmentation_tokens_saved_vs_contiguous"]
    assert saved == baseline["internal_fragmentation_tokens"] - usage["internal_fragmentation_tokens"]

"""Prefix caching: chained block hashes, reuse of cached blocks, LRU eviction, counters (lesson 08).

The scenarios follow the style of vLLM's prefix-caching design document: a small block size, a
few blocks, one request at a time, the free list and the cache checked after every step. Every
sequence writes only the K/V the cache did not already hold (from ``num_cached_tokens`` on), and
the K/V of a position is a function of the whole prefix up to it, as in a real model: reading a
sequence back equal to :func:`kv_of` its tokens proves that every shared block held the right data.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, UnknownSequenceError, blocks_for_tokens
from paged_kv.core import prefix_cache
from paged_kv.core.prefix_cache import (
    ROOT_HASH,
    PrefixCache,
    PrefixCacheStats,
    chain_hashes,
    check_token_ids,
    full_blocks,
)

from .helpers import HEAD_DIM, NUM_HEADS, kv_of, make_cache, unchanged

pytestmark = pytest.mark.lesson08

BLOCK = 4  # the scenarios' block size


def write_prompt(cache, seq_id, tokens, device="cpu"):
    """Prefill: write the K/V of the prompt from the first uncached position on, as a caller must."""
    cached = cache.num_cached_tokens(seq_id)
    k, v = kv_of(tokens, device)
    if cached < len(tokens):
        cache.write_kv(seq_id, k[cached:], v[cached:], start_position=cached)


def reads_back(cache, seq_id, tokens, device="cpu"):
    k, v = kv_of(tokens, device)
    read_k, read_v = cache.read_kv(seq_id)
    return torch.equal(read_k, k) and torch.equal(read_v, v)


def caching(num_blocks=8, device="cpu", **kw):
    return make_cache(num_blocks, BLOCK, device=device, enable_prefix_caching=True, **kw)


def free_list(cache):
    return list(cache.snapshot().free_block_ids)


def refs(cache):
    return list(cache.snapshot().ref_counts)


@contextmanager
def nothing_changes(cache):
    """Assert that the block changes nothing: bookkeeping, K/V, cached blocks and counters."""
    before = (cache.cached_blocks(), cache.prefix_cache_stats)
    with unchanged(cache):
        yield
    assert (cache.cached_blocks(), cache.prefix_cache_stats) == before


X = list(range(100, 108))  # two full blocks: X0 = 100..103, X1 = 104..107


# ----------------------------------------------------------------------------- the hash chain


def test_full_blocks_leave_out_the_partial_last_block():
    assert full_blocks([5, 6, 7, 8, 9], 2) == [(5, 6), (7, 8)]
    assert full_blocks([5, 6, 7], 4) == []
    assert full_blocks([], 4) == []
    assert full_blocks(list(range(8)), 4) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_a_block_hash_depends_on_its_whole_prefix():
    a = chain_hashes(full_blocks([1, 2, 3, 4, 5, 6], 2))
    b = chain_hashes(full_blocks([1, 2, 9, 9, 5, 6], 2))
    assert len(a) == 3 and len(set(a)) == 3
    assert a[0] == b[0]  # same first block
    assert a[1] != b[1] and a[2] != b[2]  # the same tokens (5, 6) after a different prefix
    assert chain_hashes([(5, 6)]) != [a[2]]  # the same block at another depth
    assert chain_hashes(full_blocks([1, 2, 3, 4, 5, 6, 7], 2)) == a  # a partial block adds nothing


@given(st.lists(st.integers(0, 50_000), max_size=40), st.integers(1, 8))
def test_chain_hashes_follow_the_recurrence(tokens, block_size):
    blocks = full_blocks(tokens, block_size)
    assert len(blocks) == len(tokens) // block_size
    assert [t for block in blocks for t in block] == tokens[: len(blocks) * block_size]
    hashes = chain_hashes(blocks)
    parent = ROOT_HASH
    for block, block_hash in zip(blocks, hashes, strict=True):
        assert block_hash == hash((parent, block))
        parent = block_hash


def test_block_hashes_are_the_same_in_every_process():
    code = (
        "from paged_kv.core.prefix_cache import chain_hashes; print(chain_hashes([(1, 2), (3, 4), (5, 6)]))"
    )
    outputs = set()
    for seed in ("0", "random"):  # PYTHONHASHSEED randomises str and bytes; ASLR moves None
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert outputs == {f"{chain_hashes([(1, 2), (3, 4), (5, 6)])}\n"}


# ------------------------------------------------------------------------------- token ids


@pytest.mark.parametrize(
    "token_ids",
    [
        [3, 0, 7],
        (3, 0, 7),
        torch.tensor([3, 0, 7]),
        torch.tensor([3, 0, 7], dtype=torch.int32),
        [np.int64(3), np.int32(0), 7],
    ],
)
def test_token_ids_can_be_a_list_a_tuple_or_a_tensor(token_ids):
    assert check_token_ids(token_ids, 3) == (3, 0, 7)
    assert all(type(t) is int for t in check_token_ids(token_ids, 3))


@pytest.mark.parametrize(
    ("token_ids", "match"),
    [
        ([1, 2], "num_prompt_tokens is 3, but token_ids has 2"),
        ([1, 2, 3, 4], "token_ids has 4"),
        ([1, -2, 3], "non-negative integers, got -2 at index 1"),
        ([1, True, 3], "got True at index 1"),
        ([1, 2.0, 3], "got 2.0 at index 1"),
        ([1, "2", 3], "got '2' at index 1"),
        ("abc", "list of integers, got str"),
        (7, "list of integers, got int"),
        ({1, 2, 3}, "list of integers, got set"),
        (torch.tensor([[1, 2, 3]]), "1-D integer tensor"),
        (torch.tensor([1.0, 2.0, 3.0]), "1-D integer tensor"),
        (torch.tensor([True, False, True]), "got True at index 0"),
        (np.array([1, 2, 3]), "list of integers, got ndarray"),
    ],
)
def test_bad_token_ids_are_value_errors_naming_them(token_ids, match):
    with pytest.raises(ValueError, match="token_ids") as caught:
        check_token_ids(token_ids, 3)
    assert caught.match(match)


def test_allocate_with_bad_token_ids_changes_nothing():
    for enabled in (True, False):
        cache = make_cache(8, BLOCK, enable_prefix_caching=enabled)
        cache.allocate_for_sequence("a", 9, [*X, 1])
        with nothing_changes(cache), pytest.raises(ValueError, match="token_ids"):
            cache.allocate_for_sequence("b", 9, X)
        with nothing_changes(cache), pytest.raises(ValueError, match="token_ids"):
            cache.allocate_for_sequence("b", 3, [0, -1, 2])
        assert "b" not in cache


def test_enable_prefix_caching_must_be_a_bool():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_cache(enable_prefix_caching="yes")
    assert make_cache().enable_prefix_caching is False
    assert caching().enable_prefix_caching is True


# ------------------------------------------------------------------------------- scenarios


def test_a_shared_prefix_is_computed_once(device):
    cache = caching(8, device)
    # Request 0: 10 tokens in blocks [0, 1, 2]. Blocks 0 and 1 are full and get cached; block 2
    # holds 2 tokens and stays private.
    r0 = [*X, 1, 2]
    assert cache.allocate_for_sequence("r0", 10, r0).block_ids == [0, 1, 2]
    assert cache.num_cached_tokens("r0") == 0
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:])}
    write_prompt(cache, "r0", r0, device)
    # Request 1 shares the first 8 tokens: it takes blocks 0 and 1 (one more reference each) and
    # a fresh block for its own tail, and computes only positions 8..10.
    r1 = [*X, 7, 8, 9]
    assert cache.allocate_for_sequence("r1", 11, r1).block_ids == [0, 1, 3]
    assert cache.num_cached_tokens("r1") == 8
    assert refs(cache) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert free_list(cache) == [4, 5, 6, 7]
    write_prompt(cache, "r1", r1, device)
    assert reads_back(cache, "r0", r0, device) and reads_back(cache, "r1", r1, device)
    assert cache.prefix_cache_stats == PrefixCacheStats(requests=2, queries=21, hits=8)
    assert cache.prefix_cache_stats.hit_rate == pytest.approx(8 / 21)


def test_a_freed_prefix_stays_cached_and_is_revived_from_the_middle_of_the_free_list(device):
    cache = caching(8, device)
    r0, r1 = [*X, 1, 2], [*X, 7, 8, 9]
    for seq_id, tokens in (("r0", r0), ("r1", r1)):
        cache.allocate_for_sequence(seq_id, len(tokens), tokens)
        write_prompt(cache, seq_id, tokens, device)
    # Blocks 0 and 1 are still held by r1: only r0's private block goes back, to the head of the
    # free list, since it holds nothing cached (a partly full block is never cached).
    assert cache.free_sequence("r0") == [2]
    # r1 frees its blocks last block first: its partly full block 3 to the head, then the cached
    # chain to the tail, so the end of a cached chain is evicted before its start.
    assert cache.free_sequence("r1") == [3, 1, 0]
    assert free_list(cache) == [3, 2, 4, 5, 6, 7, 1, 0]
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:])}  # freed, still cached
    # Request 2 repeats r0's prompt: blocks 0 and 1 leave the free list from where they sit, the
    # rest of the list keeps its order, and the tail block comes from the head.
    assert cache.allocate_for_sequence("r2", 10, r0).block_ids == [0, 1, 3]
    assert cache.num_cached_tokens("r2") == 8
    assert free_list(cache) == [2, 4, 5, 6, 7]
    assert refs(cache)[:2] == [1, 1]
    write_prompt(cache, "r2", r0, device)  # positions 8 and 9 only
    assert reads_back(cache, "r2", r0, device)


def test_a_freed_block_with_nothing_cached_is_reused_before_any_cached_block_is_evicted(device):
    cache = caching(4, device)
    cache.allocate_for_sequence("x", 8, X)  # blocks 0 and 1, both cached
    write_prompt(cache, "x", X, device)
    cache.free_sequence("x")
    cache.allocate_for_sequence("y", 3, [1, 2, 3])  # a partly full block: never cached
    assert cache.get_block_mapping("y") == [2]
    cache.free_sequence("y")  # freed after x's blocks, yet it goes first
    assert free_list(cache) == [2, 3, 1, 0]
    assert cache.allocate_for_sequence("z", 8, list(range(8))).block_ids == [2, 3]
    assert cache.cached_blocks() == {
        0: tuple(X[:4]),
        1: tuple(X[4:]),
        2: tuple(range(4)),
        3: tuple(range(4, 8)),
    }
    # Without prefix caching the free list stays first in, first out.
    plain = make_cache(4, BLOCK, device=device)
    plain.allocate_for_sequence("x", 8)
    plain.free_sequence("x")
    plain.allocate_for_sequence("y", 3)
    plain.free_sequence("y")
    assert free_list(plain) == [3, 0, 1, 2]


def test_eviction_takes_the_least_recently_freed_block_and_forgets_its_hash(device):
    cache = caching(4, device)
    y = list(range(200, 208))
    for seq_id, tokens in (("x", X), ("y", y)):
        cache.allocate_for_sequence(seq_id, 8, tokens)
        write_prompt(cache, seq_id, tokens, device)
        cache.free_sequence(seq_id)
    # x freed [1, 0], then y freed [3, 2]: every block is free and cached.
    assert free_list(cache) == [1, 0, 3, 2]
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:]), 2: tuple(y[:4]), 3: tuple(y[4:])}
    # A 3-token prompt needs one fresh block: the head, block 1 (X1, freed longest ago), is evicted.
    assert cache.allocate_for_sequence("z", 3, [7, 7, 7]).block_ids == [1]
    assert 1 not in cache.cached_blocks() and set(cache.cached_blocks()) == {0, 2, 3}
    write_prompt(cache, "z", [7, 7, 7], device)
    # X again, with one more token: X0 is still cached, X1 no longer.
    assert cache.allocate_for_sequence("x2", 9, [*X, 5]).block_ids == [0, 3, 2]
    assert cache.num_cached_tokens("x2") == 4
    # Blocks 3 and 2 were taken fresh from the head: y's blocks are evicted too, X1 is cached anew.
    assert cache.cached_blocks() == {0: tuple(X[:4]), 3: tuple(X[4:])}
    write_prompt(cache, "x2", [*X, 5], device)
    assert reads_back(cache, "x2", [*X, 5], device) and reads_back(cache, "z", [7, 7, 7], device)


def test_a_decode_block_also_evicts_from_the_head(device):
    cache = caching(3, device)
    cache.allocate_for_sequence("x", 9, [*X, 1])
    cache.free_sequence("x")
    assert free_list(cache) == [2, 1, 0]
    cache.allocate_for_sequence("a", 3, [5, 5, 5])  # block 2, which held no hash
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:])}
    assert cache.append_tokens("a", 2) == [1]  # the 5th token needs a block: block 1 is evicted
    assert cache.cached_blocks() == {0: tuple(X[:4])}


def test_the_last_prompt_token_is_always_computed(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 8, X)
    write_prompt(cache, "a", X, device)
    # The whole prompt is cached, but its last token must run through the model to sample the next
    # one: only X0 is reused, and X1 is computed again in a private block.
    assert cache.allocate_for_sequence("b", 8, X).block_ids == [0, 2]
    assert cache.num_cached_tokens("b") == 4
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:])}  # block 2 duplicates X1: private
    write_prompt(cache, "b", X, device)
    assert reads_back(cache, "b", X, device)
    # A prompt shorter than one block, or empty, finds nothing.
    assert cache.allocate_for_sequence("c", 4, X[:4]).block_ids == [3]
    assert cache.num_cached_tokens("c") == 0
    assert cache.allocate_for_sequence("d", 0, []).block_ids == []
    assert cache.prefix_cache_stats == PrefixCacheStats(requests=4, queries=20, hits=4)


def test_the_first_miss_ends_the_match(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    write_prompt(cache, "a", [*X, 1], device)
    # Same second block, different first block: X1's K/V depend on X0, so nothing is reused.
    other = [9, 9, 9, 9, *X[4:], 1]
    assert cache.allocate_for_sequence("b", 9, other).block_ids == [3, 4, 5]
    assert cache.num_cached_tokens("b") == 0
    write_prompt(cache, "b", other, device)
    assert reads_back(cache, "b", other, device) and reads_back(cache, "a", [*X, 1], device)
    assert len(cache.cached_blocks()) == 4  # both chains, side by side


def test_a_refused_allocation_counts_the_cached_blocks_it_would_take_off_the_free_list():
    cache = caching(5)
    cache.allocate_for_sequence("x", 9, [*X, 1])  # blocks 0, 1, 2
    cache.free_sequence("x")
    # x's partly full block 2 went back to the head, its cached blocks 1 and 0 to the tail, so y
    # takes 2 and 3 before any cached block.
    assert cache.allocate_for_sequence("y", 8, list(range(8))).block_ids == [2, 3]
    assert free_list(cache) == [4, 1, 0]
    # X plus 5 tokens: 4 blocks, 2 of them cached but free. 2 fresh + 2 revived = 4 > 3 free.
    with nothing_changes(cache), pytest.raises(OutOfBlocksError) as caught:
        cache.allocate_for_sequence("big", 13, [*X, 1, 2, 3, 4, 5])
    assert (caught.value.needed, caught.value.free) == (4, 3)
    assert "sequence 'big' (13 tokens)" in str(caught.value)
    assert "big" not in cache
    # X plus 1 token: 1 fresh + 2 revived = 3: it fits exactly.
    assert cache.allocate_for_sequence("fits", 9, [*X, 1]).block_ids == [0, 1, 4]
    assert free_list(cache) == []
    assert cache.prefix_cache_stats == PrefixCacheStats(requests=3, queries=26, hits=8)


def test_without_prefix_caching_token_ids_are_checked_and_ignored(device):
    cache = make_cache(8, BLOCK, device=device)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    write_prompt(cache, "a", [*X, 1], device)
    assert cache.allocate_for_sequence("b", 9, [*X, 1]).block_ids == [3, 4, 5]
    assert cache.num_cached_tokens("b") == 0
    assert cache.cached_blocks() == {}
    assert cache.prefix_cache_stats == PrefixCacheStats()
    assert cache.free_sequence("a") == [0, 1, 2]  # table order, as always without caching
    assert cache.reset_prefix_cache() == 0


def test_without_token_ids_a_caching_cache_allocates_as_usual():
    cache = caching(8)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    assert cache.allocate_for_sequence("b", 9).block_ids == [3, 4, 5]
    assert cache.num_cached_tokens("b") == 0
    assert len(cache.cached_blocks()) == 2
    assert cache.prefix_cache_stats.requests == 1


def test_num_cached_tokens_of_an_unknown_sequence_is_a_key_error():
    cache = caching()
    with pytest.raises(UnknownSequenceError):
        cache.num_cached_tokens("nobody")
    cache.allocate_for_sequence("a", 8, X)
    cache.free_sequence("a")
    with pytest.raises(UnknownSequenceError):
        cache.num_cached_tokens("a")


def test_reset_forgets_every_hash_and_zeroes_the_counters(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    cache.allocate_for_sequence("b", 9, [*X, 2])
    cache.free_sequence("b")
    free_before = free_list(cache)
    assert cache.reset_prefix_cache() == 2
    assert cache.cached_blocks() == {} and cache.prefix_cache_stats == PrefixCacheStats()
    assert free_list(cache) == free_before and cache.get_block_mapping("a") == [0, 1, 2]
    assert cache.allocate_for_sequence("c", 9, [*X, 3]).block_ids == [3, 4, 5]  # b's block 3 first
    assert cache.num_cached_tokens("c") == 0


def test_a_write_into_a_shared_cached_block_is_copied_first(device):
    """A caller that writes into a cached block another sequence holds gets its own copy of it."""
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    write_prompt(cache, "a", [*X, 1], device)
    cache.allocate_for_sequence("b", 9, [*X, 2])
    write_prompt(cache, "b", [*X, 2], device)
    assert cache.get_block_mapping("b")[:2] == [0, 1]
    k, v = kv_of([0], device)
    cache.write_kv("b", k, v, start_position=0)  # into block 0, shared by a and b
    assert cache.get_block_mapping("b")[0] not in (0, 1)
    assert reads_back(cache, "a", [*X, 1], device)
    cache.allocate_for_sequence("c", 9, [*X, 3])  # block 0 is still X0, intact
    write_prompt(cache, "c", [*X, 3], device)
    assert cache.num_cached_tokens("c") == 8 and reads_back(cache, "c", [*X, 3], device)


def test_a_cached_block_written_again_forgets_its_hash_and_is_never_served(device):
    """A cached block is immutable under its hash: overwriting it in place un-caches it."""
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    write_prompt(cache, "a", [*X, 1], device)
    assert sorted(cache.cached_blocks()) == [0, 1]
    k, v = kv_of([7, 7], device)
    cache.write_kv("a", k, v, start_position=5)  # new K/V into block 1, which only 'a' holds
    assert cache.last_copies == [] and sorted(cache.cached_blocks()) == [0]
    # The next prompt with the same tokens finds block 0 only, and computes the rest itself.
    cache.allocate_for_sequence("b", 9, [*X, 2])
    assert cache.num_cached_tokens("b") == 4 and cache.get_block_mapping("b")[0] == 0


def test_writes_that_fill_a_cached_block_in_order_keep_it_cached(device):
    """Chunked prefill and decode write each slot once, in order: nothing is forgotten."""
    cache = caching(8, device)
    tokens = [*X, 1]
    cache.allocate_for_sequence("a", 9, tokens)
    k, v = kv_of(tokens, device)
    for start, end in ((0, 3), (3, 6), (6, 9)):  # chunks that end inside blocks 0 and 1
        cache.write_kv("a", k[start:end], v[start:end], start_position=start)
    assert sorted(cache.cached_blocks()) == [0, 1]
    cache.allocate_for_sequence("b", 9, [*X, 2])
    assert cache.num_cached_tokens("b") == 8 and reads_back(cache, "a", tokens, device)


def test_an_overwrite_of_a_shared_cached_block_copies_it_and_keeps_the_original_cached(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 9, [*X, 1])
    write_prompt(cache, "a", [*X, 1], device)
    cache.allocate_for_sequence("b", 9, [*X, 2])  # shares blocks 0 and 1
    write_prompt(cache, "b", [*X, 2], device)
    k, v = kv_of([7], device)
    cache.write_kv("b", k, v, start_position=0)  # into block 0, which 'a' holds too
    assert cache.last_copies == [(0, 4)]
    assert sorted(cache.cached_blocks()) == [0, 1] and reads_back(cache, "a", [*X, 1], device)


# ------------------------------------------------------------------------------ collisions


@pytest.fixture
def constant_hash(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent_hash, token_ids: 0)


@pytest.mark.usefixtures("constant_hash")
def test_a_hash_collision_never_shares_a_block_with_other_tokens(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("x", 9, [*X, 1])
    write_prompt(cache, "x", [*X, 1], device)
    # Every block hashes to 0: X0 takes the hash, X1 finds it taken and stays private.
    assert cache.cached_blocks() == {0: tuple(X[:4])}
    y = [*range(200, 208), 1]
    assert cache.allocate_for_sequence("y", 9, y).block_ids == [3, 4, 5]
    assert cache.num_cached_tokens("y") == 0
    write_prompt(cache, "y", y, device)
    assert cache.allocate_for_sequence("x2", 9, [*X, 2]).block_ids[0] == 0
    assert cache.num_cached_tokens("x2") == 4
    write_prompt(cache, "x2", [*X, 2], device)
    for seq_id, tokens in (("x", [*X, 1]), ("y", y), ("x2", [*X, 2])):
        assert reads_back(cache, seq_id, tokens, device)


def test_a_block_matches_only_under_the_very_parent_it_was_cached_after(monkeypatch):
    # A weak hash: only the sum of a block's tokens counts, so (1, 2) and (2, 1) collide.
    monkeypatch.setattr(
        prefix_cache, "block_hash", lambda parent_hash, token_ids: hash((parent_hash, sum(token_ids)))
    )
    cache = PrefixCache()
    first = [(1, 2), (5, 5)]
    hashes = chain_hashes(first)
    assert insert(cache, first, [10, 11]) == 2
    # Block 10 is evicted and (2, 1) is cached there: same hash, new contents.
    assert cache.evict(10) and not cache.evict(10)
    other = [(2, 1), (5, 5)]
    assert chain_hashes(other) == hashes
    assert cache.match(other, hashes, 2) == []
    assert insert(cache, other, [10, 12]) == 1  # the (5, 5) hash is taken by block 11: the chain ends
    # Block 11 holds (5, 5) after (1, 2), not after (2, 1): the parent check refuses it.
    assert [entry.block_id for entry in cache.match(other, hashes, 2)] == [10]
    assert [entry.block_id for entry in cache.match(first, hashes, 2)] == []
    assert cache.cached_blocks() == {10: (2, 1), 11: (5, 5)}


def insert(cache: PrefixCache, blocks, block_ids) -> int:
    """Cache ``blocks`` in ``block_ids`` from the first on, as a prompt's are; return how many were cached."""
    before, parent = len(cache), None
    for tokens, block_id in zip(blocks, block_ids, strict=True):
        parent = cache.extend(parent, tokens, block_id)
        if parent is None:
            break
    return len(cache) - before


def test_prefix_cache_maps_stay_in_step():
    cache = PrefixCache()
    blocks = [(1,), (2,), (3,)]
    hashes = chain_hashes(blocks)
    assert insert(cache, blocks, [4, 5, 6]) == 3 and len(cache) == 3
    hits = cache.match(blocks, hashes, 3)
    assert [entry.block_id for entry in hits] == [4, 5, 6]
    assert [entry.token_ids for entry in hits] == blocks
    assert hits[1].parent is hits[0] and hits[0].parent is None
    assert cache.entry(5) is hits[1] and cache.entry(7) is None
    assert [entry.block_id for entry in cache.match(blocks, hashes, 1)] == [4]
    cache.record(queries=3, hits=2)
    assert cache.stats == PrefixCacheStats(1, 3, 2)
    assert cache.evict(5) and cache.cached_blocks() == {4: (1,), 6: (3,)}
    assert [entry.block_id for entry in cache.match(blocks, hashes, 3)] == [4]
    assert cache.reset() == 2 and len(cache) == 0 and cache.stats == PrefixCacheStats()


def test_prefix_cache_stats_hit_rate():
    assert PrefixCacheStats().hit_rate == 0.0
    assert PrefixCacheStats(requests=2, queries=40, hits=10).hit_rate == 0.25


# --------------------------------------------------------------------- blocks filled during decode


def decode(cache, seq_id, tokens, new, device="cpu", with_ids=True):
    """Append ``new`` after ``tokens`` (what the sequence holds) and write their K/V; return all tokens."""
    grown = [*tokens, *new]
    cache.append_tokens(seq_id, len(new), new if with_ids else None)
    k, v = kv_of(grown, device)
    cache.write_kv(seq_id, k[len(tokens) :], v[len(tokens) :], start_position=len(tokens))
    return grown


def chained(tokens, block_size=BLOCK):
    """Each full block's chained hash and tokens, as the cache should hold them: ``{hash: tokens}``."""
    blocks = full_blocks(tokens, block_size)
    return dict(zip(chain_hashes(blocks), blocks, strict=True))


def hashes_held(cache):
    """``{hash: tokens}`` of every cached block."""
    pool = cache.manager.allocator.prefix_cache
    return {pool.entry(b).block_hash: tokens for b, tokens in cache.cached_blocks().items()}


def test_a_block_filled_during_decode_gets_the_chained_hash_of_its_tokens(device):
    cache = caching(8, device)
    prompt = [*X, 1, 2]  # blocks 0 and 1 full and cached, block 2 holds 2 tokens
    cache.allocate_for_sequence("a", 10, prompt)
    write_prompt(cache, "a", prompt, device)
    tokens = decode(cache, "a", prompt, [3], device)
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:])}  # block 2 is not full yet
    tokens = decode(cache, "a", tokens, [4, 5, 6, 7, 8, 9], device)  # fills block 2, then block 3
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:]), 2: (1, 2, 3, 4), 3: (5, 6, 7, 8)}
    # Exactly the hashes a prompt of these tokens would get: chained from the first block.
    assert hashes_held(cache) == chained(tokens)
    assert reads_back(cache, "a", tokens, device)


def test_a_follow_up_turn_reuses_the_answers_blocks(device):
    cache = caching(12, device)
    prompt = [*X, 1, 2]
    cache.allocate_for_sequence("turn1", 10, prompt)
    write_prompt(cache, "turn1", prompt, device)
    held = decode(cache, "turn1", prompt, [20, 21, 22, 23, 24, 25, 26], device)  # 17 tokens: 4 full blocks
    cache.free_sequence("turn1")
    # The next turn's prompt: the previous prompt, the answer, and a new message.
    turn2 = [*held, 27, 30, 31, 32, 33]
    table = cache.allocate_for_sequence("turn2", len(turn2), turn2)
    assert cache.num_cached_tokens("turn2") == 16  # the prompt's 2 full blocks and the answer's 2
    assert table.block_ids[:4] == [0, 1, 2, 3]
    write_prompt(cache, "turn2", turn2, device)
    assert reads_back(cache, "turn2", turn2, device)
    # With prompt blocks only, the same turn finds the prompt's 8 tokens and no more.
    only_prompts = caching(12, device)
    only_prompts.allocate_for_sequence("turn1", 10, prompt)
    write_prompt(only_prompts, "turn1", prompt, device)
    decode(only_prompts, "turn1", prompt, [20, 21, 22, 23, 24, 25, 26], device, with_ids=False)
    only_prompts.free_sequence("turn1")
    only_prompts.allocate_for_sequence("turn2", len(turn2), turn2)
    assert only_prompts.num_cached_tokens("turn2") == 8


def test_an_append_without_ids_ends_the_caching_of_the_sequence(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 2, [1, 2])
    tokens = decode(cache, "a", [1, 2], [3], device, with_ids=False)
    tokens = decode(cache, "a", tokens, [4, 5, 6, 7, 8], device)  # ids again, but the cache lost track
    assert cache.cached_blocks() == {}
    # An append of no token leaves nothing unknown: the chain goes on.
    cache.allocate_for_sequence("b", 2, [1, 2])
    cache.append_tokens("b", 0)
    decode(cache, "b", [1, 2], [3, 4], device)
    assert cache.cached_blocks() == {2: (1, 2, 3, 4)}
    # Nor does a sequence allocated without ids ever cache a block.
    cache.allocate_for_sequence("c", 2)
    decode(cache, "c", [5, 6], [7, 8, 9, 10], device)
    assert cache.cached_blocks() == {2: (1, 2, 3, 4)}


def test_without_prefix_caching_appended_ids_are_checked_and_ignored(device):
    cache = make_cache(8, BLOCK, device=device)
    cache.allocate_for_sequence("a", 3, [1, 2, 3])
    assert cache.append_tokens("a", 2, [4, 5]) == [1]
    cache.append_batch(["a"], [6])
    assert cache.sequence_length("a") == 6 and cache.cached_blocks() == {}
    with nothing_changes(cache), pytest.raises(ValueError, match="token_ids"):
        cache.append_tokens("a", 1, [-1])


@pytest.mark.parametrize(
    ("n", "token_ids", "match"),
    [
        (2, [1], "one id per appended token: n is 2, but token_ids has 1"),
        (1, [1, 2], "n is 1, but token_ids has 2"),
        (1, [-3], "non-negative integers, got -3 at index 0"),
        (1, [1.5], "got 1.5 at index 0"),
        (1, "a", "list of integers, got str"),
        (1, torch.tensor([[1]]), "1-D integer tensor"),
    ],
)
def test_bad_appended_ids_are_value_errors_that_change_nothing(n, token_ids, match):
    cache = caching(8)
    cache.allocate_for_sequence("a", 3, [1, 2, 3])
    with nothing_changes(cache), pytest.raises(ValueError, match=match):
        cache.append_tokens("a", n, token_ids)
    assert cache.sequence_length("a") == 3
    # The chain is untouched too: a good append still caches the block it fills.
    cache.append_tokens("a", 1, [4])
    assert cache.cached_blocks() == {0: (1, 2, 3, 4)}


@pytest.mark.parametrize(
    ("token_ids", "match"),
    [([4], "one id per sequence: len\\(seq_ids\\) is 2, but token_ids has 1"), ([4, None], "got None")],
)
def test_bad_batch_ids_are_value_errors_that_change_nothing(token_ids, match):
    cache = caching(8)
    for seq_id in "ab":
        cache.allocate_for_sequence(seq_id, 3, [1, 2, 3])
    with nothing_changes(cache), pytest.raises(ValueError, match=match):
        cache.append_batch(["a", "b"], token_ids)
    cache.append_batch(["a", "b"], [4, 5])
    assert cache.cached_blocks() == {0: (1, 2, 3, 4), 1: (1, 2, 3, 5)}


def test_a_sequence_that_decodes_an_equal_block_goes_on_through_it(device):
    cache = caching(16, device)
    prompt = [*X, 1, 2]
    for seq_id in ("a", "b"):  # b shares a's two prompt blocks
        cache.allocate_for_sequence(seq_id, 10, prompt)
        write_prompt(cache, seq_id, prompt, device)
    answer = [3, 4, 5, 6, 7, 8]
    a = decode(cache, "a", prompt, answer[:2], device)  # fills a's block 2
    b = decode(cache, "b", prompt, answer, device)  # fills b's block 3, equal to a's block 2, then block 4
    # b's block 3 stays private (a hash names one block), and b's next block is cached after
    # a's block 2, whose K/V are the same.
    assert cache.get_block_mapping("b") == [0, 1, 3, 4]
    assert cache.cached_blocks() == {0: tuple(X[:4]), 1: tuple(X[4:]), 2: (1, 2, 3, 4), 4: (5, 6, 7, 8)}
    pool = cache.manager.allocator.prefix_cache
    assert pool.entry(4).parent is pool.entry(2)
    assert hashes_held(cache) == chained(b)
    turn = [*b, 11]
    assert cache.allocate_for_sequence("c", len(turn), turn).block_ids[:4] == [0, 1, 2, 4]
    assert cache.num_cached_tokens("c") == 16
    write_prompt(cache, "c", turn, device)
    for seq_id, tokens in (("a", a), ("b", b), ("c", turn)):
        assert reads_back(cache, seq_id, tokens, device)


def test_a_repeated_prompt_of_whole_blocks_caches_its_own_answer(device):
    # The prompt is exactly two blocks: its second block is recomputed (the last prompt token
    # always is), equal to the cached one, so the chain goes on through the cached block.
    cache = caching(12, device)
    cache.allocate_for_sequence("first", 8, X)
    write_prompt(cache, "first", X, device)
    cache.free_sequence("first")
    assert cache.allocate_for_sequence("again", 8, X).block_ids == [0, 2]
    write_prompt(cache, "again", X, device)
    again = decode(cache, "again", X, [5, 6, 7, 8, 9], device)
    assert cache.cached_blocks()[3] == (5, 6, 7, 8)
    turn = [*again, 10]
    assert cache.allocate_for_sequence("turn", len(turn), turn).block_ids[:3] == [0, 1, 3]
    assert cache.num_cached_tokens("turn") == 12
    write_prompt(cache, "turn", turn, device)
    assert reads_back(cache, "turn", turn, device)


def test_a_fork_goes_on_from_its_parents_place_in_the_chain(device):
    cache = caching(12, device)
    prompt = [*X, 1, 2]
    cache.allocate_for_sequence("p", 10, prompt)
    write_prompt(cache, "p", prompt, device)
    cache.fork("p", "c")
    p = decode(cache, "p", prompt, [3, 4], device)
    c = decode(cache, "c", prompt, [5, 6], device)  # copy-on-write of block 2, then filled
    assert hashes_held(cache) == chained(p) | chained(c)
    assert reads_back(cache, "p", p, device) and reads_back(cache, "c", c, device)


def test_the_chain_ends_when_its_last_block_loses_its_hash(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 5, [*X[:4], 1])
    write_prompt(cache, "a", [*X[:4], 1], device)
    assert cache.reset_prefix_cache() == 1
    decode(cache, "a", [*X[:4], 1], [2, 3, 4], device)  # fills block 1, whose parent is gone
    assert cache.cached_blocks() == {}
    # Before its first full block a sequence's chain starts at the root, which a reset keeps.
    cache.allocate_for_sequence("b", 1, [7])
    cache.reset_prefix_cache()
    decode(cache, "b", [7], [8, 9, 10], device)
    assert list(cache.cached_blocks().values()) == [(7, 8, 9, 10)]


def test_an_overwrite_ends_the_chain(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("a", 3, [1, 2, 3])
    write_prompt(cache, "a", [1, 2, 3], device)
    k, v = kv_of([9, 9, 9], device)
    cache.write_kv("a", k[2:], v[2:], start_position=2)  # slot 2 again: the cache cannot know its token
    decode(cache, "a", [1, 2, 3], [4], device)
    assert cache.cached_blocks() == {}


def test_an_overwrite_of_a_copied_block_ends_the_chain_too(device):
    cache = caching(8, device)
    cache.allocate_for_sequence("p", 3, [1, 2, 3])
    write_prompt(cache, "p", [1, 2, 3], device)
    cache.fork("p", "c")
    k, v = kv_of([1, 9, 9], device)
    cache.write_kv("c", k[1:], v[1:], start_position=1)  # the copy's slots 1 and 2, written again
    assert cache.last_copies == [(0, 1)]
    decode(cache, "c", [1, 2, 3], [4], device)
    assert cache.cached_blocks() == {}  # its K/V are not those of (1, 2, 3, 4)
    decode(cache, "p", [1, 2, 3], [4], device)  # the parent's block is its own K/V: cached
    assert cache.cached_blocks() == {0: (1, 2, 3, 4)}


def test_append_batch_with_ids_caches_what_append_tokens_does_one_by_one():
    # The shortcut (nothing shared, no observer) against the loop (an observer attached).
    batches = [[(0, 5), (1, 6)], [(0, 7), (1, 8)], [(0, 9), (1, 10)]]
    caches = [caching(16), caching(16, record=True), caching(16)]
    for cache in caches:
        for seq_id in (0, 1):
            cache.allocate_for_sequence(seq_id, 2, [1, 2])
    for batch in batches:
        caches[0].append_batch([s for s, _ in batch], [t for _, t in batch])
        caches[1].append_batch([s for s, _ in batch], torch.tensor([t for _, t in batch]))
        for seq_id, token in batch:
            caches[2].append_tokens(seq_id, 1, [token])
    assert caches[0].cached_blocks() == caches[1].cached_blocks() == caches[2].cached_blocks()
    assert hashes_held(caches[0]) == chained([1, 2, 5, 7]) | chained([1, 2, 6, 8])


# ------------------------------------------------------------------------- the state machine

MACHINE_BLOCKS, MACHINE_BLOCK_SIZE, MAX_LIVE = 12, 2, 3
SYSTEM_PROMPTS = [(), (0, 1, 2, 0), (0, 1, 2, 1, 1)]
prompts = st.builds(
    lambda system, tail: [*system, *tail],
    st.sampled_from(SYSTEM_PROMPTS),
    st.lists(st.integers(0, 2), max_size=6),
)


def weak_block_hash(parent_hash, token_ids):
    """A hash that collides often: only the sum of a block's tokens counts."""
    return hash((parent_hash, sum(token_ids)))


class Entry(NamedTuple):
    """The model's cache entry: the block, a serial number naming the entry, and its parent's."""

    block_id: int
    serial: int
    parent: int | None


class PrefixCachingMachine(RuleBasedStateMachine):
    """Prefix-cached allocation, decode (with or without token ids), free and eviction against a model.

    The model keeps the free list (a list), the ref counts, and the cache as a dict from a whole
    prefix (a tuple of tokens ending at a block boundary) to its entry: no hashes, so no collisions.
    An entry has a serial number, so that an entry cached again after an eviction is a new one, and
    names its parent's; each sequence whose tokens the cache knows has a chain, the serial of the
    entry its last full block is found under (``None`` before its first). A block that fills during
    a decode with token ids is cached by the same rule as a prompt's.
    ``exact`` machines check that the allocator matches the model step by step. The weak-hash machine
    patches ``block_hash`` to collide often, where the model cannot predict what gets cached; it
    still checks that nothing unsafe ever happens: every block a prompt reuses holds exactly its
    prefix, and every sequence reads back its own K/V.
    """

    device = "cpu"
    exact = True
    hash_function = None  # a replacement for prefix_cache.block_hash

    @initialize()
    def start(self) -> None:
        self.saved_hash = prefix_cache.block_hash
        if self.hash_function is not None:
            prefix_cache.block_hash = type(self).hash_function
        self.cache = PagedKVCacheAllocator(
            MACHINE_BLOCKS,
            MACHINE_BLOCK_SIZE,
            NUM_HEADS,
            HEAD_DIM,
            device=self.device,
            enable_prefix_caching=True,
        )
        self.tokens: dict[int, list[int]] = {}
        self.next_seq_id = 0
        self.free = list(range(MACHINE_BLOCKS))
        self.refs = [0] * MACHINE_BLOCKS
        self.cached: dict[tuple[int, ...], Entry] = {}  # whole prefix -> its entry
        self.prefix_of: dict[int, tuple[int, ...]] = {}  # block -> whole prefix, for cached blocks
        self.chains: dict[int, int | None] = {}  # seq id -> the serial its next full block follows
        self.serials = itertools.count()
        self.written: dict[int, tuple[int, ...]] = {}  # block -> the prefix whose last block it holds
        self.stats = [0, 0, 0]

    def teardown(self) -> None:
        if hasattr(self, "saved_hash"):
            prefix_cache.block_hash = self.saved_hash

    # ---------------------------------------------------------------------------- the model

    def take_fresh(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        for block_id in taken:
            self.refs[block_id] = 1
            prefix = self.prefix_of.pop(block_id, None)
            if prefix is not None:
                del self.cached[prefix]
        return taken

    def expected_hits(self, tokens: list[int]) -> list[Entry]:
        hits: list[Entry] = []
        for i in range(max(0, (len(tokens) - 1) // MACHINE_BLOCK_SIZE)):
            entry = self.cached.get(tuple(tokens[: (i + 1) * MACHINE_BLOCK_SIZE]))
            if entry is None or entry.parent != (hits[-1].serial if hits else None):
                break
            hits.append(entry)
        return hits

    def extend(self, parent: int | None, prefix: tuple[int, ...], block_id: int) -> int | str | None:
        """The model of ``PrefixCache.extend``: the serial the chain goes on from, or ``"ended"``."""
        live = {entry.serial for entry in self.cached.values()}
        if parent is not None and parent not in live:
            return "ended"  # the parent was evicted: nothing after it can be found
        entry = self.cached.get(prefix)
        if entry is not None:  # an equal block: the chain goes on through it, if it has our parent
            return entry.serial if entry.parent == parent else "ended"
        entry = Entry(block_id, next(self.serials), parent)
        self.cached[prefix] = entry
        self.prefix_of[block_id] = prefix
        return entry.serial

    def cache_filled(self, seq_id: int, tokens: list[int], first: int, block_ids: list[int]) -> None:
        """The model of caching the full blocks ``first ..`` of a sequence, as its chain goes on."""
        parent = self.chains.pop(seq_id)
        for i in range(first, len(tokens) // MACHINE_BLOCK_SIZE):
            parent = self.extend(parent, tuple(tokens[: (i + 1) * MACHINE_BLOCK_SIZE]), block_ids[i])
            if parent == "ended":
                return
        self.chains[seq_id] = parent

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="seq_id")

    def attempt(self, call):
        """``call()``'s result, or ``None`` when it ran out of blocks and changed nothing at all."""
        cache = self.cache
        before = (cache.snapshot(), cache.k_cache.clone(), cache.v_cache.clone())
        counters = (cache.cached_blocks(), cache.prefix_cache_stats)
        try:
            return call()
        except OutOfBlocksError:
            assert cache.snapshot() == before[0]
            assert torch.equal(cache.k_cache, before[1]) and torch.equal(cache.v_cache, before[2])
            assert (cache.cached_blocks(), cache.prefix_cache_stats) == counters
            return None

    # ---------------------------------------------------------------------------- the rules

    @precondition(lambda self: len(self.tokens) < MAX_LIVE)  # keep the pool cycling: free, reuse, evict
    @rule(tokens=prompts)
    def allocate(self, tokens: list[int]) -> None:
        seq_id, n, size = self.next_seq_id, len(tokens), MACHINE_BLOCK_SIZE
        self.next_seq_id += 1
        expected_hits = self.expected_hits(tokens)
        table = self.attempt(lambda: self.cache.allocate_for_sequence(seq_id, n, tokens))
        if self.exact:
            fresh = blocks_for_tokens(n, size) - len(expected_hits)
            revived = [e for e in expected_hits if self.refs[e.block_id] == 0]
            assert (table is None) == (fresh + len(revived) > len(self.free))
        if table is None:
            return
        cached = self.cache.num_cached_tokens(seq_id)
        assert cached % size == 0 and cached <= max(0, n - 1)
        num_hits = cached // size
        # Safety, whatever the hash: every reused block holds exactly this prompt's prefix.
        for i, block_id in enumerate(table.block_ids[:num_hits]):
            assert self.written.get(block_id) == tuple(tokens[: (i + 1) * size]), "a block was shared wrongly"
        # The model follows: the hits leave the free list or gain a reference, fresh blocks come
        # off its head and evict, the new full blocks are cached unless their prefix already is.
        hits = table.block_ids[:num_hits]
        if self.exact:
            assert hits == [entry.block_id for entry in expected_hits]
        for block_id in hits:
            if self.refs[block_id] == 0:
                self.free.remove(block_id)
            self.refs[block_id] += 1
        block_ids = hits + self.take_fresh(blocks_for_tokens(n, size) - num_hits)
        assert table.block_ids == block_ids
        if self.exact:
            self.chains[seq_id] = expected_hits[-1].serial if num_hits else None
            self.cache_filled(seq_id, tokens, num_hits, block_ids)
        self.stats = [self.stats[0] + 1, self.stats[1] + n, self.stats[2] + cached]
        # Prefill: only the uncached tail is written.
        write_prompt(self.cache, seq_id, tokens, self.device)
        for i, block_id in enumerate(block_ids[num_hits:], start=num_hits):
            if i < n // size:
                self.written[block_id] = tuple(tokens[: (i + 1) * size])
            else:
                self.written.pop(block_id, None)  # the partly full last block: never cached
        self.tokens[seq_id] = list(tokens)

    @precondition(lambda self: bool(self.tokens))
    @rule(
        data=st.data(),
        new=st.lists(st.integers(0, 2), max_size=2 * MACHINE_BLOCK_SIZE + 1),
        with_ids=st.sampled_from([True, True, True, False]),
    )
    def decode(self, data: st.DataObject, new: list[int], with_ids: bool) -> None:
        seq_id = self.pick(data)
        old, size = self.tokens[seq_id], MACHINE_BLOCK_SIZE
        table = self.cache.get_block_table(seq_id)
        missing = max(0, blocks_for_tokens(len(old) + len(new), size) - table.num_blocks)
        ids = new if with_ids else None
        appended = self.attempt(lambda: self.cache.append_tokens(seq_id, len(new), ids))
        assert (appended is None) == (missing > len(self.free))
        if appended is None:
            return
        assert appended == self.take_fresh(missing)
        tokens = old + new
        block_ids = self.cache.get_block_mapping(seq_id)
        if self.exact and seq_id in self.chains:
            if with_ids:  # each block the new tokens fill is cached as a prompt's would be
                self.cache_filled(seq_id, tokens, len(old) // size, block_ids)
                if new:
                    event("decode: a chain went on")
            elif new:  # the cache no longer knows the sequence's tokens
                del self.chains[seq_id]
        k, v = kv_of(tokens, self.device)
        self.cache.write_kv(seq_id, k[len(old) :], v[len(old) :], start_position=len(old))
        for i, block_id in enumerate(block_ids[len(old) // size :], start=len(old) // size):
            if (i + 1) * size <= len(tokens):
                self.written[block_id] = tuple(tokens[: (i + 1) * size])  # full: the K/V of its prefix
            else:
                self.written.pop(block_id, None)
        self.tokens[seq_id] = tokens

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free_sequence(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        freed = []
        # Which blocks hold a cached prefix: the cache's own answer, since with a weak hash the
        # model cannot tell which of two colliding prefixes was cached.
        cached = self.cache.cached_blocks()
        for block_id in reversed(self.cache.get_block_mapping(seq_id)):
            self.refs[block_id] -= 1
            if self.refs[block_id] == 0:
                # A cached block stays cached longest (the tail); one with nothing cached is reused
                # first (the head).
                if block_id in cached:
                    self.free.append(block_id)
                else:
                    self.free.insert(0, block_id)
                freed.append(block_id)
        assert self.cache.free_sequence(seq_id) == freed
        del self.tokens[seq_id]
        self.chains.pop(seq_id, None)

    @rule()
    def reset(self) -> None:
        dropped = len(self.cache.cached_blocks())
        assert self.cache.reset_prefix_cache() == dropped
        assert self.cache.cached_blocks() == {}
        self.cached.clear()
        self.prefix_of.clear()  # a chain past its first block ends: its parent is gone
        self.stats = [0, 0, 0]

    # ---------------------------------------------------------------------------- invariants

    @invariant()
    def ref_counts_count_the_tables_and_free_plus_used_is_total(self) -> None:
        snapshot = self.cache.snapshot()
        held = [b for table in snapshot.tables.values() for b in table.block_ids]
        assert list(snapshot.ref_counts) == [held.count(b) for b in range(MACHINE_BLOCKS)] == self.refs
        assert list(snapshot.free_block_ids) == self.free
        usage = self.cache.usage()
        assert usage.used_blocks + usage.free_blocks == MACHINE_BLOCKS
        assert set(held).isdisjoint(snapshot.free_block_ids)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        cached = self.cache.cached_blocks()
        for block_id, tokens in cached.items():
            prefix = self.written[block_id]
            assert prefix[-MACHINE_BLOCK_SIZE:] == tokens
            entry = self.cache.manager.allocator.prefix_cache.entry(block_id)
            assert entry.block_hash == chain_hashes(full_blocks(prefix, MACHINE_BLOCK_SIZE))[-1]
        assert self.cache.prefix_cache_stats == PrefixCacheStats(*self.stats)
        if self.exact:
            assert cached == {e.block_id: prefix[-MACHINE_BLOCK_SIZE:] for prefix, e in self.cached.items()}

    @invariant()
    def every_sequence_reads_back_its_own_kv(self) -> None:
        for seq_id, tokens in self.tokens.items():
            assert reads_back(self.cache, seq_id, tokens, self.device), f"sequence {seq_id} reads wrong K/V"


TestPrefixCachingOnCPU = PrefixCachingMachine.TestCase


class WeakHashPrefixCachingMachine(PrefixCachingMachine):
    exact = False
    hash_function = staticmethod(weak_block_hash)


TestPrefixCachingWithCollisions = WeakHashPrefixCachingMachine.TestCase


class PrefixCachingOnCUDAMachine(PrefixCachingMachine):
    device = "cuda"


TestPrefixCachingOnCUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)(PrefixCachingOnCUDAMachine.TestCase)

"""On-demand allocation during decode and the block boundary rule (lesson 04)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.core.mapping import needs_new_block

from .helpers import fails_cleanly, make_cache

pytestmark = pytest.mark.lesson04


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_a_new_block_is_needed_exactly_when_the_length_is_a_multiple_of_the_block_size(block_size):
    cache = PagedKVCacheAllocator(64, block_size, 1, 1)
    cache.allocate_for_sequence("s", 0)
    for n in range(3 * block_size + 1):
        assert cache.sequence_length("s") == n
        expected = n % block_size == 0
        assert cache.needs_new_block("s") is expected
        new_blocks = cache.append_tokens("s")
        assert len(new_blocks) == int(expected), f"decoding token {n + 1} with {n} held"


def test_the_lesson_seeds_check_is_off_by_one():
    """The seed allocates when (length + 1) % block_size == 0: one token early, and never for n = 0."""
    block_size = 4
    seed_rule = [n for n in range(9) if (n + 1) % block_size == 0]
    right_rule = [n for n in range(9) if n % block_size == 0]
    assert seed_rule == [3, 7]
    assert right_rule == [0, 4, 8]
    cache = PagedKVCacheAllocator(8, block_size, 1, 1)
    cache.allocate_for_sequence("s", 3)
    # With 3 of 4 slots used the seed would take a block now; the fourth token still fits.
    assert cache.append_tokens("s") == []
    assert cache.append_tokens("s") == [1]


def test_the_blog_seeds_example_48_to_49_tokens_appends_a_fourth_block():
    cache = PagedKVCacheAllocator(8, 16, 1, 1)
    cache.allocate_for_sequence("req-a", 48)
    assert cache.append_tokens("req-a", 1) == [3]
    assert cache.get_block_mapping("req-a") == [0, 1, 2, 3]
    assert cache.sequence_length("req-a") == 49


def test_appending_many_tokens_at_once_takes_every_block_they_need():
    cache = make_cache(num_blocks=8, block_size=4)
    cache.allocate_for_sequence("s", 3)
    assert cache.append_tokens("s", 10) == [1, 2, 3]
    assert cache.sequence_length("s") == 13
    assert cache.append_tokens("s", 0) == []


def test_blocks_of_growing_sequences_interleave():
    cache = make_cache(num_blocks=8, block_size=2)
    cache.allocate_for_sequence("a", 2)  # [0]
    cache.allocate_for_sequence("b", 2)  # [1]
    for _ in range(2):
        cache.append_tokens("a", 2)
        cache.append_tokens("b", 2)
    assert cache.get_block_mapping("a") == [0, 2, 4]
    assert cache.get_block_mapping("b") == [1, 3, 5]


def test_an_append_that_cannot_get_its_block_changes_nothing():
    cache = make_cache(num_blocks=2, block_size=4)
    cache.allocate_for_sequence("a", 4)
    cache.allocate_for_sequence("b", 4)
    error = fails_cleanly(
        cache, OutOfBlocksError, lambda: cache.append_tokens("a"), match="appending 1 tokens"
    )
    assert (error.needed, error.free) == (1, 0)
    # Several tokens that need several blocks: none are taken if not all are free.
    cache.free_sequence("b")
    fails_cleanly(cache, OutOfBlocksError, lambda: cache.append_tokens("a", 9))


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None])
def test_a_bad_token_count_names_the_argument(bad):
    cache = make_cache()
    cache.allocate_for_sequence(0, 1)
    fails_cleanly(cache, ValueError, lambda: cache.append_tokens(0, bad), match="n must be")


def test_an_explicit_block_is_used_before_a_new_one_is_taken():
    cache = make_cache(num_blocks=8, block_size=4)
    cache.allocate_for_sequence("s", 4)
    assert cache.append_block_to_sequence("s") == 1
    assert cache.sequence_length("s") == 4
    assert not cache.needs_new_block("s")
    assert cache.append_tokens("s", 4) == []
    assert cache.append_tokens("s", 1) == [2]


def test_append_block_without_a_free_block_changes_nothing():
    cache = make_cache(num_blocks=1, block_size=4)
    cache.allocate_for_sequence("s", 1)
    fails_cleanly(cache, OutOfBlocksError, lambda: cache.append_block_to_sequence("s"))


@given(
    prompt=st.integers(0, 40), steps=st.lists(st.integers(0, 9), max_size=12), block_size=st.integers(1, 8)
)
def test_a_sequence_always_holds_exactly_the_blocks_its_tokens_need(prompt, steps, block_size):
    cache = PagedKVCacheAllocator(256, block_size, 1, 1)
    cache.allocate_for_sequence("s", prompt)
    total = prompt
    for n in steps:
        cache.append_tokens("s", n)
        total += n
        assert cache.sequence_length("s") == total
        assert len(cache.get_block_mapping("s")) == blocks_for_tokens(total, block_size)
    assert cache.usage().internal_fragmentation_tokens == (-total) % block_size


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks_held", "block_size", "expected"),
    [
        (0, 0, 4, True),  # an empty sequence: its first token needs a block
        (1, 1, 4, False),
        (3, 1, 4, False),  # the last slot is still free: (n + 1) % block_size == 0 would be one early
        (4, 1, 4, True),
        (4, 2, 4, False),  # a block reserved ahead has room
        (0, 1, 4, False),
        (48, 3, 16, True),
        (1, 1, 1, True),
    ],
)
def test_the_pure_boundary_rule(num_tokens, num_blocks_held, block_size, expected):
    assert needs_new_block(num_tokens, num_blocks_held, block_size) is expected


@given(prompt=st.integers(0, 40), spare=st.integers(0, 2), block_size=st.integers(1, 8))
def test_the_cache_applies_the_pure_boundary_rule(prompt, spare, block_size):
    cache = PagedKVCacheAllocator(64, block_size, 1, 1)
    cache.allocate_for_sequence("s", prompt)
    for _ in range(spare):
        cache.append_block_to_sequence("s")
    held = len(cache.get_block_mapping("s"))
    assert cache.needs_new_block("s") is needs_new_block(prompt, held, block_size)
    assert len(cache.append_tokens("s")) == int(needs_new_block(prompt, held, block_size))

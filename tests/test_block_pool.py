"""The block pool (lessons 02, 08, 13): vLLM's ``BlockPool`` on lesson 02's allocator, its null block,
its one eviction point and the listeners told of every store, eviction and reset."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv.core.block_pool import NULL_BLOCK, BlockPool
from paged_kv.core.prefix_cache import HashChain, chain_hashes, full_blocks

pytestmark = pytest.mark.lesson08


class Heard:
    """A listener that keeps what the pool told it, in order."""

    def __init__(self) -> None:
        self.said: list[tuple] = []

    def block_stored(self, entry) -> None:
        self.said.append(("stored", entry.block_id, entry.block_hash, entry.token_ids))

    def block_removed(self, entry) -> None:
        self.said.append(("removed", entry.block_id, entry.block_hash))

    def all_blocks_cleared(self) -> None:
        self.said.append(("cleared",))


def cache_prompt(pool: BlockPool, tokens: tuple[int, ...], block_size: int) -> list[int]:
    """Take blocks for ``tokens`` and cache their full blocks, as a group's manager does."""
    blocks = pool.get_new_blocks(-(-len(tokens) // block_size))
    assert pool.cache_full_blocks(HashChain(None, 0), list(tokens), blocks, block_size)
    return blocks


def test_block_zero_is_the_null_block_held_for_ever_and_never_counted():
    pool = BlockPool(4)
    assert pool.null_block == NULL_BLOCK and pool.ref_count(NULL_BLOCK) == 1
    assert pool.free_block_ids == (1, 2, 3) and pool.num_usable_blocks == 3 and pool.get_usage() == 0.0
    assert pool.get_new_blocks(3) == [1, 2, 3] and pool.get_usage() == 1.0
    assert pool.free_blocks([3, NULL_BLOCK, 2]) == [3, 2]  # the null block is skipped
    assert pool.ref_count(NULL_BLOCK) == 1 and NULL_BLOCK not in pool.free_block_ids
    assert pool.touch([NULL_BLOCK]) is None and pool.ref_count(NULL_BLOCK) == 1
    lessons = BlockPool(4, null_block=False)  # the lessons' facade: block 0 is an ordinary block
    assert (
        lessons.null_block is None
        and lessons.free_block_ids == (0, 1, 2, 3)
        and lessons.num_usable_blocks == 4
    )


def test_the_pool_evicts_only_what_it_hands_out_and_tells_its_listeners():
    pool = BlockPool(4, enable_caching=True)
    heard = Heard()
    pool.add_listener(heard)
    blocks = cache_prompt(pool, (1, 2, 3, 4, 5), 2)
    assert blocks == [1, 2, 3] and pool.prefix_cache.cached_blocks() == {1: (1, 2), 2: (3, 4)}
    hashes = chain_hashes(full_blocks((1, 2, 3, 4), 2))
    assert heard.said == [("stored", 1, hashes[0], (1, 2)), ("stored", 2, hashes[1], (3, 4))]
    pool.free_blocks(list(reversed(blocks)))
    # The uncached block 3 goes to the head, the cached ones to the tail, the tail block first.
    assert pool.free_block_ids == (3, 2, 1)
    pool.touch([1])  # a hit takes a cached block off the middle of the free list: it keeps its hash
    assert pool.free_block_ids == (3, 2) and pool.ref_count(1) == 1
    assert pool.get_new_blocks(2) == [3, 2]  # the head first: block 2's hash is evicted, and told
    assert heard.said[-1] == ("removed", 2, hashes[1]) and pool.prefix_cache.cached_blocks() == {1: (1, 2)}


def test_without_caching_the_free_list_is_lesson_02s_fifo():
    pool = BlockPool(5)
    taken = pool.get_new_blocks(4)
    pool.free_blocks([taken[2], taken[0]])
    assert pool.free_block_ids == (taken[2], taken[0])  # to the tail, in the order freed
    with pytest.raises(ValueError, match="enable_caching"):
        BlockPool(5, enable_caching="yes")
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_a_write_below_the_written_slots_evicts_the_blocks_hash():
    pool = BlockPool(3, enable_caching=True, null_block=False)
    heard = Heard()
    pool.add_listener(heard)
    (block,) = cache_prompt(pool, (7, 8), 2)
    assert not pool.record_write(block, 0, 2)  # the first write fills it in order
    assert pool.record_write(block, 1, 2)  # written again: its K/V may no longer be its tokens'
    assert pool.prefix_cache.entry(block) is None and heard.said[-1][0] == "removed"


def test_a_reset_forgets_every_hash_only_when_no_block_is_held():
    pool = BlockPool(4, enable_caching=True)
    heard = Heard()
    pool.add_listener(heard)
    blocks = cache_prompt(pool, (1, 2, 3, 4), 2)
    assert not pool.reset_prefix_cache() and len(pool.prefix_cache) == 2  # held: vLLM refuses
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() and len(pool.prefix_cache) == 0 and heard.said[-1] == ("cleared",)
    assert pool.clear_prefix_cache() == 0  # the lessons' reset forgets held blocks' hashes too


def test_a_listener_must_hear_all_three_moments():
    with pytest.raises(ValueError, match="block_stored"):
        BlockPool(2).add_listener(object())


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_free_plus_used_is_the_pool_and_a_cached_block_sits_behind_the_uncached(ops):
    pool = BlockPool(8, enable_caching=True)
    held: list[int] = []
    for take, value in ops:
        if take and pool.num_free_blocks:
            (block,) = pool.get_new_blocks(1)
            if value % 2:  # cache it under a hash of its own
                pool.cache_block(None, (block, value), block)
            held.append(block)
        elif held:
            pool.free_blocks([held.pop(value % len(held))])
        free = pool.free_block_ids
        assert pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks
        assert len(free) == len(set(free)) and NULL_BLOCK not in free
        assert sorted(set(held)) == sorted(b for b in range(1, 8) if b not in free)
        cached = [pool.prefix_cache.entry(b) is not None for b in free]
        assert cached == sorted(cached)  # every uncached free block before every cached one

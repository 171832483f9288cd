"""Block and BlockTable: the two data structures of paging (lesson 01)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import Block, BlockTable, PagedKVCacheAllocator, blocks_for_tokens

pytestmark = pytest.mark.lesson01


def test_block_starts_free():
    block = Block(3)
    assert block.block_id == 3
    assert block.ref_count == 0


def test_block_table_appends_in_order():
    table = BlockTable()
    for block_id in (7, 2, 5):
        table.append_block(block_id)
    assert table.block_ids == [7, 2, 5]
    assert table.num_blocks == 3
    assert table.num_tokens == 0


def test_block_tables_do_not_share_their_lists():
    first, second = BlockTable(), BlockTable()
    first.append_block(1)
    assert second.block_ids == []


def test_block_table_capacity_counts_whole_blocks():
    # The blog seed's req-a: 33 tokens in blocks [0, 1, 2] of 16.
    table = BlockTable([0, 1, 2], num_tokens=33)
    assert table.capacity(16) == 48
    assert table.capacity(16) - table.num_tokens == 15


def test_copy_is_independent():
    table = BlockTable([4, 9], num_tokens=5)
    copy = table.copy()
    copy.append_block(1)
    copy.num_tokens = 9
    assert table == BlockTable([4, 9], num_tokens=5)
    assert copy == BlockTable([4, 9, 1], num_tokens=9)


def test_copy_of_a_subclass_keeps_its_class():
    class Tagged(BlockTable):
        pass

    copy = Tagged([4, 9], num_tokens=5).copy()
    assert type(copy) is Tagged
    assert copy == Tagged([4, 9], num_tokens=5)


@pytest.mark.parametrize(("position", "expected"), [(0, 7), (15, 7), (16, 2), (31, 2), (32, 5), (39, 5)])
def test_physical_block_looks_the_logical_block_up_in_the_table(position, expected):
    table = BlockTable([7, 2, 5], num_tokens=40)
    assert table.physical_block(position, 16) == expected
    assert type(table.physical_block(position, 16)) is int


def test_physical_block_uses_the_block_size_it_is_given():
    assert BlockTable([7, 2, 5], num_tokens=10).physical_block(9, 4) == 5


@pytest.mark.parametrize("position", [40, 47, 48, -1, 2.0, True])
def test_physical_block_refuses_a_position_that_holds_no_token(position):
    with pytest.raises(ValueError, match="position"):
        BlockTable([7, 2, 5], num_tokens=40).physical_block(position, 16)


def test_physical_block_refuses_a_table_without_a_block_for_the_position():
    # A hand-built table that breaks the invariant num_tokens <= capacity.
    with pytest.raises(ValueError, match="position 17"):
        BlockTable([7], num_tokens=20).physical_block(17, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockTable([7], num_tokens=1).physical_block(0, 0)


@given(num_tokens=st.integers(1, 500), block_size=st.integers(1, 64), data=st.data())
def test_physical_block_agrees_with_the_cache(num_tokens, block_size, data):
    cache = PagedKVCacheAllocator(blocks_for_tokens(num_tokens, block_size) + 3, block_size, 1, 1)
    cache.allocate_for_sequence("other", 2 * block_size)
    cache.allocate_for_sequence("seq", num_tokens)
    position = data.draw(st.integers(0, num_tokens - 1))
    table = cache.get_block_table("seq")
    assert table.physical_block(position, block_size) == cache.physical_location("seq", position)[0]


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 1), (9, 1), (16, 1), (17, 2), (33, 3), (41, 3), (48, 3), (49, 4)]
)
def test_blocks_for_tokens_seed_examples(num_tokens, expected):
    assert blocks_for_tokens(num_tokens, 16) == expected


@given(num_tokens=st.integers(0, 10_000), block_size=st.integers(1, 512))
def test_blocks_for_tokens_is_the_ceiling(num_tokens, block_size):
    blocks = blocks_for_tokens(num_tokens, block_size)
    assert blocks == math.ceil(num_tokens / block_size)
    # Enough blocks, and not one more than needed.
    assert blocks * block_size >= num_tokens
    assert (blocks - 1) * block_size < num_tokens or blocks == 0

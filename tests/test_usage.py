"""BlockUsage: the pool's metrics, with shared blocks and their tokens counted once (lessons 02, 08)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import BlockTable, BlockUsage
from paged_kv.core.usage import block_tokens

pytestmark = [pytest.mark.lesson02, pytest.mark.lesson08]

SEED_METRICS = {
    "used_blocks",
    "free_blocks",
    "allocated_tokens",
    "reserved_tokens",
    "internal_fragmentation_tokens",
    "block_utilization",
}


def test_without_sharing_the_dict_is_the_seeds_six_metrics():
    usage = BlockUsage.measure(used_blocks=3, free_blocks=5, allocated_tokens=10, block_size=4)
    assert usage == BlockUsage(3, 5, 10, 12, 2, 10 / 12)  # shared_blocks defaults to 0
    assert usage.as_dict() == {
        "used_blocks": 3,
        "free_blocks": 5,
        "allocated_tokens": 10,
        "reserved_tokens": 12,
        "internal_fragmentation_tokens": 2,
        "block_utilization": 10 / 12,
    }


def test_with_sharing_the_dict_says_how_many_blocks_are_shared():
    usage = BlockUsage.measure(
        used_blocks=3, free_blocks=5, allocated_tokens=10, block_size=4, shared_blocks=2
    )
    fields = usage.as_dict()
    assert set(fields) == SEED_METRICS | {"shared_blocks"}
    assert fields["shared_blocks"] == 2
    assert json.loads(json.dumps(fields)) == fields


def test_of_tables_counts_a_forked_parent_once():
    # A parent of 10 tokens in [0, 1, 2] and a fork that copied block 2 to 3 and holds 11 tokens.
    tables = [BlockTable([0, 1, 2], 10), BlockTable([0, 1, 3], 11)]
    usage = BlockUsage.of_tables(tables, num_blocks=8, free_blocks=4, block_size=4)
    assert usage == BlockUsage(
        used_blocks=4,
        free_blocks=4,
        allocated_tokens=4 + 4 + 2 + 3,
        reserved_tokens=16,
        internal_fragmentation_tokens=3,
        block_utilization=13 / 16,
        shared_blocks=2,
    )


def test_of_tables_of_no_table():
    assert BlockUsage.of_tables([], num_blocks=4, free_blocks=4, block_size=16) == BlockUsage(
        0, 4, 0, 0, 0, 0.0
    )


def test_block_tokens_takes_each_blocks_fill():
    assert block_tokens([BlockTable([5, 2], 6), BlockTable([5], 3)], 4) == {5: 4, 2: 2}
    assert block_tokens([BlockTable([1, 0], 4)], 4) == {1: 4, 0: 0}  # a block reserved ahead holds 0


# Tables as a fork tree builds them: every table starts with a prefix of a common table, and
# holders of a shared block hold the same tokens in it unless it is full.
@st.composite
def forked_tables(draw) -> list[BlockTable]:
    size = 4
    base = draw(st.integers(0, 12))
    tables = [BlockTable(list(range(-(-base // size))), base)]
    next_block = len(tables[0].block_ids)
    for _ in range(draw(st.integers(0, 4))):
        parent = tables[draw(st.integers(0, len(tables) - 1))]
        kept = draw(st.integers(0, parent.num_tokens // size))  # full blocks it keeps sharing
        grow = draw(st.integers(0, 9))
        tokens = kept * size + grow
        own = -(-tokens // size) - kept
        tables.append(BlockTable(parent.block_ids[:kept] + list(range(next_block, next_block + own)), tokens))
        next_block += own
    return tables


@given(forked_tables())
def test_of_tables_counts_each_stored_slot_once(tables):
    size = 4
    slots = {(t.block_ids[p // size], p % size) for t in tables for p in range(t.num_tokens)}
    blocks = {b for t in tables for b in t.block_ids}
    holders = [sum(b in t.block_ids for t in tables) for b in blocks]
    usage = BlockUsage.of_tables(tables, num_blocks=len(blocks) + 3, free_blocks=3, block_size=size)
    assert usage.used_blocks == len(blocks)
    assert usage.allocated_tokens == len(slots)
    assert usage.shared_blocks == sum(count > 1 for count in holders)
    assert usage.internal_fragmentation_tokens == len(blocks) * size - len(slots) >= 0
    assert 0.0 <= usage.block_utilization <= 1.0
    if usage.shared_blocks == 0:
        assert usage.allocated_tokens == sum(t.num_tokens for t in tables)

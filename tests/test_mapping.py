"""Logical to physical: positions, slots, and K/V written and gathered on tensors (lesson 03)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import PagedKVCacheAllocator
from paged_kv.core import mapping
from paged_kv.kv import slots

from .helpers import HEAD_DIM, NUM_HEADS, fails_cleanly, kv_for, make_cache

pytestmark = pytest.mark.lesson03


def seq_in_blocks(device, block_ids, num_tokens, block_size=4):
    """A cache whose sequence "s" holds ``num_tokens`` tokens in exactly ``block_ids``."""
    num_blocks = max(block_ids) + 1
    cache = make_cache(num_blocks=num_blocks, block_size=block_size, device=device)
    # One-token sequence i holds block i; freeing the wanted ones in order puts them on the free list.
    for block_id in range(num_blocks):
        cache.allocate_for_sequence(f"hold-{block_id}", 1)
    for block_id in block_ids:
        cache.free_sequence(f"hold-{block_id}")
    cache.allocate_for_sequence("s", num_tokens)
    assert cache.get_block_mapping("s") == list(block_ids)
    return cache


def test_physical_location_translates_in_four_steps(device):
    cache = seq_in_blocks(device, [5, 2, 7], num_tokens=11)
    assert cache.physical_location("s", 0) == (5, 0)
    assert cache.physical_location("s", 3) == (5, 3)
    assert cache.physical_location("s", 4) == (2, 0)
    assert cache.physical_location("s", 5) == (2, 1)
    assert cache.physical_location("s", 10) == (7, 2)


def test_physical_location_of_many_positions_at_once(device):
    cache = seq_in_blocks(device, [5, 2, 7], num_tokens=11)
    blocks, offsets = cache.physical_location("s", [10, 0, 4])
    assert blocks.tolist() == [7, 5, 2]
    assert offsets.tolist() == [2, 0, 0]
    assert blocks.device.type == device.type


@pytest.mark.parametrize("position", [-1, 11, 100])
def test_a_position_outside_the_sequence_names_the_argument(device, position):
    cache = seq_in_blocks(device, [5, 2, 7], num_tokens=11)
    fails_cleanly(cache, ValueError, lambda: cache.physical_location("s", position), match="position")
    fails_cleanly(cache, ValueError, lambda: cache.slot_mapping("s", [0, position]), match="positions")


def test_positions_must_be_integers(device):
    cache = seq_in_blocks(device, [1, 0], num_tokens=5)
    fails_cleanly(cache, ValueError, lambda: cache.slot_mapping("s", [0.5]), match="positions")
    fails_cleanly(cache, ValueError, lambda: cache.slot_mapping("s", ["a"]), match="positions")
    fails_cleanly(cache, ValueError, lambda: cache.slot_mapping("s", [[0, 1]]), match="1-D")


def test_slot_mapping_is_block_times_size_plus_offset(device):
    cache = seq_in_blocks(device, [5, 2, 7], num_tokens=11)
    slots = cache.slot_mapping("s")
    assert slots.dtype == torch.long
    assert slots.device.type == device.type
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30]
    assert cache.slot_mapping("s", torch.tensor([9, 4], device=device)).tolist() == [29, 8]
    assert cache.slot_mapping("s", []).tolist() == []


def slot_mapping_loop(block_ids, positions, block_size):
    """The reference: the translation one token at a time, in plain Python."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


@given(
    block_size=st.integers(1, 8),
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5),
    data=st.data(),
)
def test_slot_mapping_matches_a_per_token_loop(block_size, lengths, data):
    cache = PagedKVCacheAllocator(5 * 30, block_size, 1, 1)
    for seq_id, length in enumerate(lengths):
        cache.allocate_for_sequence(seq_id, length)
        if seq_id % 2:  # free every other sequence so later tables are scattered
            cache.free_sequence(seq_id - 1)
    for seq_id in cache.seq_ids:
        length = cache.sequence_length(seq_id)
        positions = data.draw(st.lists(st.integers(0, max(length - 1, 0)), max_size=20)) if length else []
        table = cache.get_block_mapping(seq_id)
        assert cache.slot_mapping(seq_id, positions).tolist() == slot_mapping_loop(
            table, positions, block_size
        )
        assert cache.slot_mapping(seq_id).tolist() == slot_mapping_loop(table, range(length), block_size)


def test_write_then_read_returns_the_contiguous_kv(device):
    cache = seq_in_blocks(device, [5, 2, 7], num_tokens=11)
    k, v = kv_for(11, device=device)
    cache.write_kv("s", k, v)
    read_k, read_v = cache.read_kv("s")
    assert torch.equal(read_k, k)
    assert torch.equal(read_v, v)
    # And each token landed where the translation says: k_cache[block, :, offset, :].
    for position in (0, 5, 10):
        block, offset = cache.physical_location("s", position)
        assert torch.equal(cache.k_cache[block, :, offset, :], k[position])
        assert torch.equal(cache.v_cache[block, :, offset, :], v[position])
    # Nothing was written outside the sequence's slots.
    written = torch.zeros(8, 4, dtype=torch.bool, device=device)
    written.view(-1)[cache.slot_mapping("s")] = True
    untouched_k = cache.k_cache.permute(0, 2, 1, 3)[~written]
    assert not untouched_k.any()


def test_write_at_a_start_position_fills_only_those_slots(device):
    cache = seq_in_blocks(device, [3, 1], num_tokens=6)
    k, v = kv_for(6, device=device)
    cache.write_kv("s", k[:4], v[:4])
    cache.write_kv("s", k[4:], v[4:], start_position=4)
    read_k, read_v = cache.read_kv("s")
    assert torch.equal(read_k, k) and torch.equal(read_v, v)
    # Overwrite one token in the middle.
    k2, v2 = kv_for(1, first=50, device=device)
    cache.write_kv("s", k2, v2, start_position=2)
    read_k, _ = cache.read_kv("s")
    assert torch.equal(read_k[2], k2[0])
    assert torch.equal(read_k[[0, 1, 3, 4, 5]], k[[0, 1, 3, 4, 5]])


def test_sequences_do_not_overwrite_each_other(device):
    cache = make_cache(num_blocks=8, block_size=4, device=device)
    expected = {}
    for seq_id, (length, first) in enumerate([(5, 0), (9, 20), (3, 40)]):
        cache.allocate_for_sequence(seq_id, length)
        expected[seq_id] = kv_for(length, first=first, device=device)
        cache.write_kv(seq_id, *expected[seq_id])
    for seq_id, (k, v) in expected.items():
        read_k, read_v = cache.read_kv(seq_id)
        assert torch.equal(read_k, k) and torch.equal(read_v, v)


def test_read_of_an_empty_sequence_has_zero_tokens(device):
    cache = make_cache(device=device)
    cache.allocate_for_sequence("s", 0)
    k, v = cache.read_kv("s")
    assert k.shape == v.shape == (0, NUM_HEADS, HEAD_DIM)
    cache.write_kv("s", k, v)  # writing nothing is allowed


def test_write_past_the_sequence_end_changes_nothing(device):
    cache = seq_in_blocks(device, [1, 0], num_tokens=5)
    k, v = kv_for(3, device=device)
    fails_cleanly(
        cache, ValueError, lambda: cache.write_kv("s", k, v, start_position=3), match="append_tokens"
    )
    fails_cleanly(
        cache, ValueError, lambda: cache.write_kv("s", k, v, start_position=-1), match="start_position"
    )


@pytest.mark.parametrize(
    ("k_shape", "name"),
    [
        ((3, NUM_HEADS + 1, HEAD_DIM), "k must have shape"),
        ((3, NUM_HEADS, HEAD_DIM - 1), "k must have shape"),
    ],
)
def test_write_of_the_wrong_shape_names_the_argument(device, k_shape, name):
    cache = seq_in_blocks(device, [1, 0], num_tokens=5)
    k = torch.ones(k_shape, device=device)
    v = torch.ones(3, NUM_HEADS, HEAD_DIM, device=device)
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", k, v), match=name)
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", v, k), match=name.replace("k ", "v "))
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", v[:2], v), match="same shape")
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", v[0], v[0]), match="k must have shape")


def test_write_of_the_wrong_dtype_or_device_names_the_argument(device):
    cache = seq_in_blocks(device, [1, 0], num_tokens=5)
    k, v = kv_for(2, device=device)
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", k.double(), v), match="k has dtype")
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", k, v.half()), match="v has dtype")
    on_meta = torch.empty_like(v, device="meta")
    fails_cleanly(cache, ValueError, lambda: cache.write_kv("s", k, on_meta), match="v is on meta")
    fails_cleanly(
        cache, ValueError, lambda: cache.write_kv("s", k.tolist(), v), match="k must be a torch.Tensor"
    )


def test_block_tables_tensor_pads_on_the_right(device):
    cache = make_cache(num_blocks=8, block_size=4, device=device)
    cache.allocate_for_sequence("a", 9)  # [0, 1, 2]
    cache.allocate_for_sequence("b", 1)  # [3]
    cache.allocate_for_sequence("c", 0)  # []
    tables = cache.block_tables_tensor(["b", "a", "c"])
    assert tables.dtype == torch.int32
    assert tables.device.type == device.type
    assert tables.tolist() == [[3, -1, -1], [0, 1, 2], [-1, -1, -1]]
    assert cache.block_tables_tensor(["a"], pad=0).tolist() == [[0, 1, 2]]
    assert cache.block_tables_tensor([]).shape == (0, 0)
    assert cache.block_tables_tensor(["c"]).shape == (1, 0)


def test_the_gather_works_in_half_precision(device):
    cache = PagedKVCacheAllocator(4, 2, NUM_HEADS, HEAD_DIM, dtype=torch.float16, device=device)
    cache.allocate_for_sequence("s", 3)
    k, v = kv_for(3, device=device, dtype=torch.float16)
    cache.write_kv("s", k, v)
    read_k, read_v = cache.read_kv("s")
    assert read_k.dtype == torch.float16
    assert torch.equal(read_k, k) and torch.equal(read_v, v)


# ------------------------------------------------------------- the pure functions of paged_kv.core.mapping


def test_physical_location_on_a_plain_table():
    assert [mapping.physical_location([5, 2, 7], p, 4) for p in (0, 3, 4, 6, 11)] == [
        (5, 0),
        (5, 3),
        (2, 0),
        (2, 2),
        (7, 3),
    ]
    assert mapping.physical_location([3, 0], 17, 16) == (0, 1)
    block, offset = mapping.physical_location(torch.tensor([5, 2, 7]), 10, 4)
    assert (block, offset) == (7, 2) and type(block) is int and type(offset) is int


@pytest.mark.parametrize("position", [-1, 12, 100])
def test_physical_location_refuses_a_position_outside_the_table(position):
    with pytest.raises(ValueError, match="positions 0 to 11"):
        mapping.physical_location([5, 2, 7], position, 4)


@pytest.mark.parametrize(("position", "block_size"), [(1.0, 4), (True, 4), ("1", 4), (1, 0)])
def test_physical_location_refuses_what_is_not_a_count(position, block_size):
    with pytest.raises(ValueError, match="must be"):
        mapping.physical_location([5, 2, 7], position, block_size)


def test_slot_mapping_on_a_plain_tensor_table(device):
    table = torch.tensor([5, 2, 7], device=device)
    positions = torch.tensor([10, 0, 4, 5], device=device)
    got = slots.slot_mapping(table, positions, 4)
    assert got.tolist() == [30, 20, 8, 9]
    assert got.dtype == torch.long and got.device == positions.device
    # An int32 table, as block_tables_tensor gives, still yields long slots.
    assert slots.slot_mapping(table.int(), positions, 4).dtype == torch.long
    assert slots.slot_mapping(table, positions[:0], 4).tolist() == []


def test_slot_mapping_of_a_batch_reads_each_tokens_row(device):
    # Two requests' rows, padded: token t is position positions[t] of the request in rows[t].
    table = torch.tensor([[5, 2, -1], [7, 0, 3]], dtype=torch.int32, device=device)
    positions = torch.tensor([5, 0, 1, 9], device=device)
    rows = torch.tensor([0, 1, 1, 1], device=device)
    got = slots.slot_mapping(table, positions, 4, rows=rows)
    assert got.tolist() == [9, 28, 29, 13] and got.dtype == torch.long
    one_by_one = [
        slots.slot_mapping(table[r].long(), positions[t : t + 1], 4).item()
        for t, r in enumerate(rows.tolist())
    ]
    assert got.tolist() == one_by_one


def test_physical_locations_of_many_positions(device):
    table = torch.tensor([5, 2, 7], device=device)
    positions = torch.tensor([10, 0, 4, 5], device=device)
    blocks, offsets = slots.physical_locations(table, positions, 4)
    assert blocks.tolist() == [7, 5, 2, 2] and offsets.tolist() == [2, 0, 0, 1]


def test_write_and_read_kv_on_raw_tensors(device):
    k_cache = torch.zeros(8, NUM_HEADS, 4, HEAD_DIM, device=device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([5, 2, 7], device=device)
    k, v = kv_for(11, device=device)
    slots.write_kv(k_cache, v_cache, table, k[:8], v[:8])
    slots.write_kv(k_cache, v_cache, table, k[8:], v[8:], start_position=8)
    for position in range(11):
        block, offset = mapping.physical_location(table.tolist(), position, 4)
        assert torch.equal(k_cache[block, :, offset, :], k[position])
        assert torch.equal(v_cache[block, :, offset, :], v[position])
    read_k, read_v = slots.read_kv(k_cache, v_cache, table, 11)
    assert torch.equal(read_k, k) and torch.equal(read_v, v)
    read_k, read_v = slots.read_kv(k_cache, v_cache, table, 5)
    assert torch.equal(read_k, k[:5]) and torch.equal(read_v, v[:5])
    assert slots.read_kv(k_cache, v_cache, table, 0)[0].shape == (0, NUM_HEADS, HEAD_DIM)


def test_the_cache_and_the_pure_functions_agree(device):
    cache = seq_in_blocks(device, [5, 2, 7], num_tokens=11)
    k, v = kv_for(11, device=device)
    cache.write_kv("s", k, v)
    table = torch.tensor(cache.get_block_mapping("s"), device=device)
    positions = torch.arange(11, device=device)
    assert torch.equal(cache.slot_mapping("s"), slots.slot_mapping(table, positions, 4))
    assert cache.physical_location("s", 6) == mapping.physical_location(table.tolist(), 6, 4)
    for ours, theirs in zip(
        cache.read_kv("s"), slots.read_kv(cache.k_cache, cache.v_cache, table, 11), strict=True
    ):
        assert torch.equal(ours, theirs)

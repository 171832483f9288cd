"""PagedKVCacheAllocator: the tensors, allocating and freeing sequences, errors (lesson 02)."""

from __future__ import annotations

import pytest
import torch

from paged_kv import BlockTable, BlockUsage, OutOfBlocksError, PagedKVCacheAllocator, UnknownSequenceError

from .helpers import HEAD_DIM, NUM_HEADS, fails_cleanly, make_cache

pytestmark = pytest.mark.lesson02


def test_the_cache_tensors_are_preallocated_on_the_device(device):
    cache = PagedKVCacheAllocator(6, 16, num_heads=4, head_dim=8, dtype=torch.float16, device=device)
    for tensor in (cache.k_cache, cache.v_cache):
        assert tensor.shape == (6, 4, 16, 8)
        assert tensor.dtype == torch.float16
        assert tensor.device.type == device.type
        assert not tensor.any()
    assert cache.k_cache.data_ptr() != cache.v_cache.data_ptr()
    assert (cache.dtype, cache.device.type) == (torch.float16, device.type)
    assert cache.num_free_blocks == 6


@pytest.mark.parametrize("name", ["num_blocks", "block_size", "num_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_sizes_must_be_positive_integers(name, bad):
    sizes = {"num_blocks": 4, "block_size": 4, "num_heads": 1, "head_dim": 1, name: bad}
    with pytest.raises(ValueError, match=name):
        PagedKVCacheAllocator(**sizes)


def test_dtype_must_be_a_floating_torch_dtype():
    with pytest.raises(ValueError, match="dtype"):
        PagedKVCacheAllocator(4, 4, 1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        PagedKVCacheAllocator(4, 4, 1, 1, dtype="float32")


def test_an_unusable_device_is_a_value_error():
    with pytest.raises(ValueError, match="device"):
        PagedKVCacheAllocator(4, 4, 1, 1, device="no-such-device")


def test_allocate_takes_ceil_blocks_from_the_head_of_the_free_list():
    # The blog seed: free list [0..4], req-a with 33 tokens takes [0, 1, 2] and leaves [3, 4].
    cache = PagedKVCacheAllocator(5, 16, 1, 1)
    table = cache.allocate_for_sequence("req-a", 33)
    assert table == BlockTable([0, 1, 2], num_tokens=33)
    assert cache.snapshot().free_block_ids == (3, 4)
    assert [cache.ref_count(b) for b in range(5)] == [1, 1, 1, 0, 0]
    assert cache.get_block_mapping("req-a") == [0, 1, 2]
    assert cache.sequence_length("req-a") == 33
    assert "req-a" in cache and cache.seq_ids == ("req-a",)


def test_allocate_returns_a_copy():
    cache = make_cache()
    table = cache.allocate_for_sequence(0, 5)
    table.append_block(99)
    table.num_tokens = 0
    assert cache.get_block_table(0) == BlockTable([0, 1], num_tokens=5)


def test_a_prompt_of_zero_tokens_holds_no_block():
    cache = make_cache()
    assert cache.allocate_for_sequence(0, 0) == BlockTable([], 0)
    assert cache.num_free_blocks == 8


def test_a_duplicate_id_is_a_value_error_and_changes_nothing():
    cache = make_cache()
    cache.allocate_for_sequence(7, 3)
    fails_cleanly(cache, ValueError, lambda: cache.allocate_for_sequence(7, 3), match="already allocated")


def test_too_few_blocks_raises_and_leaks_nothing():
    cache = make_cache(num_blocks=4, block_size=4)
    cache.allocate_for_sequence("a", 5)  # 2 blocks
    error = fails_cleanly(
        cache,
        OutOfBlocksError,
        lambda: cache.allocate_for_sequence("b", 9),
        match="needs 3 free blocks but only 2 are free",
    )
    assert (error.needed, error.free) == (3, 2)
    assert "b" not in cache


@pytest.mark.parametrize("bad", [-1, 2.0, "3", None, True])
def test_a_bad_prompt_length_names_the_argument(bad):
    cache = make_cache()
    fails_cleanly(cache, ValueError, lambda: cache.allocate_for_sequence(0, bad), match="num_prompt_tokens")


def test_an_unhashable_seq_id_names_the_argument():
    cache = make_cache()
    fails_cleanly(cache, ValueError, lambda: cache.allocate_for_sequence([1], 3), match="seq_id")
    fails_cleanly(cache, ValueError, lambda: cache.append_tokens([1]), match="seq_id")
    fails_cleanly(cache, ValueError, lambda: cache.free_sequence([1]), match="seq_id")


def test_free_returns_the_blocks_to_the_tail_of_the_free_list():
    cache = make_cache(num_blocks=6, block_size=4)
    cache.allocate_for_sequence("a", 6)  # [0, 1]
    cache.allocate_for_sequence("b", 3)  # [2]
    assert cache.free_sequence("a") == [0, 1]
    assert cache.snapshot().free_block_ids == (3, 4, 5, 0, 1)
    assert "a" not in cache
    # The next sequence gets scattered blocks: the point of paging.
    assert cache.allocate_for_sequence("c", 16).block_ids == [3, 4, 5, 0]


def test_freeing_an_unknown_sequence_is_a_no_op():
    cache = make_cache()
    cache.allocate_for_sequence(1, 4)
    before = cache.snapshot()
    assert cache.free_sequence(2) == []
    assert cache.free_sequence(1) == [0]
    assert cache.free_sequence(1) == []  # a second free of the same request
    assert before != cache.snapshot()


def test_a_shared_block_stays_in_use_until_its_last_table_is_freed():
    cache = make_cache()
    cache.allocate_for_sequence("parent", 4)
    cache.allocate_for_sequence("child", 0)
    # Share the parent's block the way a fork will: one more table, one more reference.
    cache.manager.allocator.add_ref(0)
    cache.manager.table("child").append_block(0)
    assert cache.free_sequence("parent") == []
    assert cache.ref_count(0) == 1
    assert cache.free_sequence("child") == [0]
    assert cache.ref_count(0) == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.append_tokens("ghost"),
        lambda c: c.append_block_to_sequence("ghost"),
        lambda c: c.get_block_mapping("ghost"),
        lambda c: c.get_block_table("ghost"),
        lambda c: c.sequence_length("ghost"),
        lambda c: c.needs_new_block("ghost"),
        lambda c: c.physical_location("ghost", 0),
        lambda c: c.slot_mapping("ghost"),
        lambda c: c.read_kv("ghost"),
        lambda c: c.write_kv(
            "ghost", torch.zeros(1, NUM_HEADS, HEAD_DIM), torch.zeros(1, NUM_HEADS, HEAD_DIM)
        ),
        lambda c: c.block_tables_tensor(["ghost"]),
    ],
)
def test_an_unknown_sequence_is_a_key_error_that_changes_nothing(call):
    cache = make_cache()
    cache.allocate_for_sequence("real", 5)
    error = fails_cleanly(cache, UnknownSequenceError, lambda: call(cache))
    assert isinstance(error, KeyError)
    assert "unknown sequence 'ghost'" in str(error)


def test_usage_of_an_empty_pool():
    assert make_cache(num_blocks=8, block_size=4).usage() == BlockUsage(0, 8, 0, 0, 0, 0.0)


def test_usage_counts_tokens_blocks_and_waste():
    cache = PagedKVCacheAllocator(64, 16, 1, 1)
    cache.allocate_for_sequence("A", 9)
    assert cache.usage() == BlockUsage(
        used_blocks=1,
        free_blocks=63,
        allocated_tokens=9,
        reserved_tokens=16,
        internal_fragmentation_tokens=7,
        block_utilization=9 / 16,
    )


def test_snapshot_is_frozen_in_time():
    cache = make_cache()
    cache.allocate_for_sequence(0, 5)
    snapshot = cache.snapshot()
    cache.append_tokens(0, 10)
    cache.allocate_for_sequence(1, 1)
    assert snapshot.tables == {0: BlockTable([0, 1], 5)}
    assert snapshot.free_block_ids == (2, 3, 4, 5, 6, 7)
    assert snapshot.ref_counts == (1, 1, 0, 0, 0, 0, 0, 0)


def test_repr():
    cache = make_cache()
    cache.allocate_for_sequence(0, 5)
    assert repr(cache) == (
        "PagedKVCacheAllocator(num_blocks=8, block_size=4, free=6, sequences=1, device='cpu')"
    )

"""fork and copy-on-write, step by step in blocks of 4 (lesson 08).

The running example follows vLLM's docs: a parent of 10 tokens holds blocks [0, 1, 2], the last
one half full. A fork shares all three; the child's first new token lands in block 2, which is
shared and partly full, so the child gets a copy (block 3) and block 2 stays the parent's alone.
Full shared blocks stay shared. Every test runs on the CPU, and on CUDA when present.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv import BlockTable, OutOfBlocksError, UnknownSequenceError

from .helpers import fails_cleanly, kv_for, make_cache, unchanged

pytestmark = pytest.mark.lesson08


def parent_of_ten(device, num_blocks: int = 8, **kw):
    """A pool of ``num_blocks`` blocks of 4 where sequence A holds 10 tokens, K/V written, in [0, 1, 2]."""
    cache = make_cache(num_blocks=num_blocks, block_size=4, device=device, **kw)
    cache.allocate_for_sequence("A", 10)
    k, v = kv_for(10, device=device)
    cache.write_kv("A", k, v)
    return cache, k, v


def refs(cache) -> list[int]:
    return [cache.ref_count(b) for b in range(cache.num_blocks)]


def assert_reads(cache, seq_id, k, v) -> None:
    read_k, read_v = cache.read_kv(seq_id)
    assert torch.equal(read_k, k), f"K of {seq_id} differs"
    assert torch.equal(read_v, v), f"V of {seq_id} differs"


# ------------------------------------------------------------------------------ fork


def test_fork_shares_every_block_and_copies_nothing(device):
    cache, k, v = parent_of_ten(device)
    free_before = cache.snapshot().free_block_ids
    k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
    assert cache.fork("A", "B") == BlockTable([0, 1, 2], 10)
    assert cache.get_block_table("B") == cache.get_block_table("A")
    assert refs(cache) == [2, 2, 2, 0, 0, 0, 0, 0]
    assert cache.snapshot().free_block_ids == free_before  # no block taken
    assert torch.equal(cache.k_cache, k_cache) and torch.equal(cache.v_cache, v_cache)  # no data moved
    assert_reads(cache, "B", k, v)
    assert cache.seq_ids == ("A", "B")


def test_fork_returns_a_copy_of_the_childs_table(device):
    cache, _, _ = parent_of_ten(device)
    table = cache.fork("A", "B")
    table.block_ids[0] = 7
    table.num_tokens = 0
    assert cache.get_block_table("B") == BlockTable([0, 1, 2], 10)
    assert cache.get_block_table("A") == BlockTable([0, 1, 2], 10)


def test_a_fork_of_an_empty_sequence_shares_nothing(device):
    cache = make_cache(device=device)
    cache.allocate_for_sequence("A", 0)
    assert cache.fork("A", "B") == BlockTable([], 0)
    assert cache.append_tokens("B", 1) == [0]
    assert cache.get_block_mapping("A") == [] and cache.last_copies == []


def test_fork_errors_name_the_argument_and_change_nothing(device):
    cache, _, _ = parent_of_ten(device)
    cache.allocate_for_sequence("C", 1)
    fails_cleanly(cache, UnknownSequenceError, lambda: cache.fork("ghost", "B"))
    fails_cleanly(cache, ValueError, lambda: cache.fork("A", "C"), match="child_id 'C' is already allocated")
    fails_cleanly(cache, ValueError, lambda: cache.fork("A", "A"), match="child_id")
    fails_cleanly(cache, ValueError, lambda: cache.fork("A", ["B"]), match="child_id must be hashable")
    fails_cleanly(cache, ValueError, lambda: cache.fork(["A"], "B"), match="parent_id must be hashable")


# ------------------------------------------------------------------------------ copy-on-write on append


def test_the_childs_first_token_copies_the_partly_full_shared_block(device):
    cache, k, v = parent_of_ten(device)
    cache.fork("A", "B")
    assert cache.needs_new_block("B")  # token 11 lands in block 2, shared: it takes a block
    assert cache.append_tokens("B") == [3]
    assert cache.last_copies == [(2, 3)]
    assert cache.get_block_mapping("B") == [0, 1, 3]
    assert cache.get_block_mapping("A") == [0, 1, 2]
    assert refs(cache) == [2, 2, 1, 1, 0, 0, 0, 0]  # blocks 0 and 1, full, stay shared
    assert cache.snapshot().free_block_ids == (4, 5, 6, 7)
    # The copy holds block 2's K/V, so B still reads the common prefix.
    assert torch.equal(cache.k_cache[3, :, :2], cache.k_cache[2, :, :2])
    assert torch.equal(cache.v_cache[3, :, :2], cache.v_cache[2, :, :2])
    k_b, v_b = kv_for(1, first=50, device=device)
    cache.write_kv("B", k_b, v_b, start_position=10)
    assert cache.last_copies == []  # block 3 is B's own: written in place
    assert_reads(cache, "B", torch.cat([k, k_b]), torch.cat([v, v_b]))
    assert_reads(cache, "A", k, v)  # the parent never sees the child's token


def test_after_the_copy_the_parent_appends_in_place(device):
    cache, k, v = parent_of_ten(device)
    cache.fork("A", "B")
    cache.append_tokens("B")
    assert not cache.needs_new_block("A")  # block 2 is A's alone now
    assert cache.append_tokens("A") == []
    assert cache.last_copies == []
    assert cache.get_block_mapping("A") == [0, 1, 2]
    k_a, v_a = kv_for(1, first=60, device=device)
    k_b, v_b = kv_for(1, first=70, device=device)
    cache.write_kv("A", k_a, v_a, start_position=10)
    cache.write_kv("B", k_b, v_b, start_position=10)
    assert_reads(cache, "A", torch.cat([k, k_a]), torch.cat([v, v_a]))
    assert_reads(cache, "B", torch.cat([k, k_b]), torch.cat([v, v_b]))


def test_whoever_writes_first_copies(device):
    # The parent appends first: it takes the copy, and the child keeps block 2.
    cache, k, v = parent_of_ten(device)
    cache.fork("A", "B")
    assert cache.append_tokens("A") == [3]
    assert cache.last_copies == [(2, 3)]
    assert (cache.get_block_mapping("A"), cache.get_block_mapping("B")) == ([0, 1, 3], [0, 1, 2])
    assert cache.append_tokens("B") == []
    for seq_id in "AB":
        read_k, read_v = cache.read_kv(seq_id)
        assert torch.equal(read_k[:10], k) and torch.equal(read_v[:10], v)


def test_full_shared_blocks_stay_shared(device):
    cache = make_cache(device=device)
    cache.allocate_for_sequence("A", 8)  # [0, 1], both full
    cache.fork("A", "B")
    assert cache.needs_new_block("B")  # the boundary rule: its blocks are full
    assert cache.append_tokens("B", 3) == [2]  # appended, nothing copied
    assert cache.last_copies == []
    assert cache.get_block_mapping("B") == [0, 1, 2]
    assert refs(cache)[:3] == [2, 2, 1]


def test_many_tokens_copy_the_shared_block_then_append(device):
    cache, _, _ = parent_of_ten(device)
    cache.fork("A", "B")
    assert cache.append_tokens("B", 7) == [3, 4, 5]  # the copy of block 2, then two new blocks
    assert cache.last_copies == [(2, 3)]
    assert cache.get_block_table("B") == BlockTable([0, 1, 3, 4, 5], 17)
    assert cache.append_tokens("B", 0) == [] and cache.last_copies == []


def test_a_block_reserved_ahead_and_shared_is_copied_too(device):
    cache = make_cache(device=device)
    cache.allocate_for_sequence("A", 4)
    cache.append_block_to_sequence("A")  # [0, 1]: block 1 reserved, empty
    cache.fork("A", "B")
    assert cache.needs_new_block("B")
    assert cache.append_tokens("B", 2) == [2]
    assert cache.last_copies == [(1, 2)]
    assert (cache.get_block_mapping("A"), cache.get_block_mapping("B")) == ([0, 1], [0, 2])


def test_a_fork_of_a_fork(device):
    cache, k, v = parent_of_ten(device)
    cache.fork("A", "B")
    cache.fork("B", "C")
    assert refs(cache)[:3] == [3, 3, 3]
    assert cache.append_tokens("C") == [3] and cache.last_copies == [(2, 3)]
    assert cache.append_tokens("A") == [4] and cache.last_copies == [(2, 4)]  # B still holds block 2
    assert cache.append_tokens("B") == [] and cache.last_copies == []  # now B's alone
    assert refs(cache)[:5] == [3, 3, 1, 1, 1]
    for seq_id in "ABC":  # each reads the common prefix, whichever block its last part lives in now
        read_k, read_v = cache.read_kv(seq_id)
        assert torch.equal(read_k[:10], k) and torch.equal(read_v[:10], v)


# ------------------------------------------------------------------------------ copy-on-write on write


def test_overwriting_a_shared_block_copies_it_first(device):
    cache, k, v = parent_of_ten(device)
    cache.fork("A", "B")
    new_k, new_v = kv_for(5, first=80, device=device)
    cache.write_kv("B", new_k, new_v, start_position=2)  # positions 2..6: blocks 0 and 1
    assert cache.last_copies == [(0, 3), (1, 4)]
    assert cache.get_block_mapping("B") == [3, 4, 2]  # block 2, not written, stays shared
    assert refs(cache)[:5] == [1, 1, 2, 1, 1]
    assert_reads(cache, "A", k, v)
    expected_k, expected_v = k.clone(), v.clone()
    expected_k[2:7], expected_v[2:7] = new_k, new_v
    assert_reads(cache, "B", expected_k, expected_v)


def test_a_write_into_a_block_no_one_else_holds_copies_nothing(device):
    cache, k, v = parent_of_ten(device)
    with unchanged(cache):
        cache.write_kv("A", k, v)  # the same values, in place
    assert cache.last_copies == []


# ------------------------------------------------------------------------------ running out of blocks


def test_a_copy_with_no_free_block_fails_cleanly(device):
    cache, _, _ = parent_of_ten(device, num_blocks=3)  # every block in use
    cache.fork("A", "B")
    error = fails_cleanly(cache, OutOfBlocksError, lambda: cache.append_tokens("B"), match="appending 1")
    assert (error.needed, error.free) == (1, 0)
    new_k, new_v = kv_for(1, first=90, device=device)
    error = fails_cleanly(cache, OutOfBlocksError, lambda: cache.write_kv("B", new_k, new_v), match="shared")
    assert (error.needed, error.free) == (1, 0)
    assert cache.get_block_mapping("B") == [0, 1, 2] and cache.last_copies == []


def test_an_append_needing_a_copy_and_a_block_takes_both_or_neither(device):
    cache, _, _ = parent_of_ten(device, num_blocks=4)  # one block free
    cache.fork("A", "B")
    cache.append_tokens("A")  # A copies block 2 into block 3: nothing free now
    assert cache.free_sequence("A") == [3]  # A held [0, 1, 3]; blocks 0 and 1 stay B's
    cache.fork("B", "C")
    error = fails_cleanly(cache, OutOfBlocksError, lambda: cache.append_tokens("C", 3))  # copy + 1 block
    assert (error.needed, error.free) == (2, 1)
    assert cache.append_tokens("C", 2) == [3]  # the copy alone fits


# ------------------------------------------------------------------------------ freeing


@pytest.mark.parametrize("first", ["A", "B"])
def test_freeing_either_leaves_the_other_intact(device, first):
    cache, k, v = parent_of_ten(device)
    cache.fork("A", "B")
    cache.append_tokens("B")  # B: [0, 1, 3]
    k_b, v_b = kv_for(1, first=40, device=device)
    cache.write_kv("B", k_b, v_b, start_position=10)
    expected = {"A": (k, v), "B": (torch.cat([k, k_b]), torch.cat([v, v_b]))}
    own = {"A": [2], "B": [3]}
    assert cache.free_sequence(first) == own[first]  # the shared blocks 0 and 1 stay in use
    other = "B" if first == "A" else "A"
    assert refs(cache)[:2] == [1, 1]
    assert_reads(cache, other, *expected[other])
    assert cache.free_sequence(other) == [0, 1] + own[other]
    assert cache.num_free_blocks == 8


# ------------------------------------------------------------------------------ usage


def test_usage_counts_shared_blocks_and_their_tokens_once(device):
    cache, _, _ = parent_of_ten(device)
    cache.fork("A", "B")
    usage = cache.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.shared_blocks) == (3, 5, 3)
    assert (usage.allocated_tokens, usage.reserved_tokens, usage.internal_fragmentation_tokens) == (10, 12, 2)
    assert usage.block_utilization == 10 / 12
    cache.append_tokens("B")  # B: [0, 1, 3] with 11 tokens; A: [0, 1, 2] with 10
    usage = cache.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.shared_blocks) == (4, 4, 2)
    assert (usage.allocated_tokens, usage.reserved_tokens, usage.internal_fragmentation_tokens) == (13, 16, 3)
    assert usage.as_dict()["shared_blocks"] == 2
    cache.free_sequence("A")
    assert cache.usage().shared_blocks == 0
    assert "shared_blocks" not in cache.usage().as_dict()


# ------------------------------------------------------------------------------ the trace


def test_the_trace_of_a_fork_and_its_copies():
    cache, _, _ = parent_of_ten("cpu", record=True)
    cache.fork("A", "B")
    cache.append_tokens("B", 3)
    cache.append_tokens("A")
    new_k, new_v = kv_for(1, first=30)
    cache.write_kv("A", new_k, new_v)
    cache.free_sequence("B")
    assert [(f.event, f.seq_id, f.highlight, f.caption) for f in cache.trace[2:]] == [
        ("fork", "B", (0, 1, 2), "seq B forks from A: shares blocks [0, 1, 2]"),
        ("copy_on_write", "B", (2, 3), "seq B, token 11: block 2 copied to block 3"),
        ("append", "B", (3,), "seq B, token 12 fits in block 3"),
        ("new_block", "B", (4,), "seq B, token 13: block 4 appended"),
        ("append", "A", (2,), "seq A, token 11 fits in block 2"),
        ("copy_on_write", "A", (0, 5), "seq A, before a write: block 0 copied to block 5"),
        (
            "free",
            "B",
            (0, 1, 3, 4),
            "seq B finished: blocks [0, 3, 4] back to the free list, "
            "blocks [1] still held by another sequence",
        ),
    ]
    fork_frame, copy_frame = cache.trace[2], cache.trace[3]
    assert fork_frame.snapshot.ref_counts[:3] == (2, 2, 2)
    assert copy_frame.snapshot.tables["B"] == BlockTable([0, 1, 3], 11)
    assert copy_frame.snapshot.ref_counts[:4] == (2, 2, 1, 1)

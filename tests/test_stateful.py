"""The whole allocator under random workloads: allocate, append, write, free, and bad calls.

A hypothesis state machine drives a small PagedKVCacheAllocator and keeps a simple reference: the
contiguous K/V each live sequence should hold. After every step it checks the invariants: each
block is free or owned, never both; free + used == total; no block in two sequences; every live
sequence reads back exactly what was written to it. Every call that must fail is checked to change
nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, UnknownSequenceError, blocks_for_tokens

from .helpers import fails_cleanly, unchanged

pytestmark = [pytest.mark.lesson02, pytest.mark.lesson03, pytest.mark.lesson04]

NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 12, 4, 2, 3


def has_sequences(machine: PagedCacheMachine) -> bool:
    return bool(machine.expected)


class PagedCacheMachine(RuleBasedStateMachine):
    """Random workloads against the contiguous reference ``self.expected``."""

    device = "cpu"

    @initialize()
    def start(self) -> None:
        self.cache = PagedKVCacheAllocator(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, device=self.device)
        self.expected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.next_seq_id = 0
        self.next_value = 1

    # ---------------------------------------------------------------------------------- helpers

    def fresh_kv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V never seen before: consecutive integers, so any misplaced value is caught."""
        count = num_tokens * NUM_HEADS * HEAD_DIM
        values = torch.arange(self.next_value, self.next_value + count, dtype=torch.float32)
        self.next_value += count
        k = values.view(num_tokens, NUM_HEADS, HEAD_DIM).to(self.device)
        return k, -k

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.expected)), label="seq_id")

    # -------------------------------------------------------------------------------- the rules

    @rule(num_tokens=st.integers(0, 4 * BLOCK_SIZE + 1))
    def allocate(self, num_tokens: int) -> None:
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        needed = blocks_for_tokens(num_tokens, BLOCK_SIZE)
        if needed > self.cache.num_free_blocks:
            error = fails_cleanly(
                self.cache, OutOfBlocksError, lambda: self.cache.allocate_for_sequence(seq_id, num_tokens)
            )
            assert (error.needed, error.free) == (needed, self.cache.num_free_blocks)
            return
        free_before = self.cache.snapshot().free_block_ids
        table = self.cache.allocate_for_sequence(seq_id, num_tokens)
        assert table.block_ids == list(free_before[:needed])
        assert table.num_tokens == num_tokens
        # Prefill: the prompt's K/V are written at once.
        k, v = self.fresh_kv(num_tokens)
        self.cache.write_kv(seq_id, k, v)
        self.expected[seq_id] = (k, v)

    @precondition(has_sequences)
    @rule(data=st.data(), n=st.integers(0, 2 * BLOCK_SIZE + 1))
    def append(self, data: st.DataObject, n: int) -> None:
        seq_id = self.pick(data)
        table = self.cache.get_block_table(seq_id)
        missing = max(0, blocks_for_tokens(table.num_tokens + n, BLOCK_SIZE) - table.num_blocks)
        if missing > self.cache.num_free_blocks:
            fails_cleanly(self.cache, OutOfBlocksError, lambda: self.cache.append_tokens(seq_id, n))
            return
        new_blocks = self.cache.append_tokens(seq_id, n)
        assert len(new_blocks) == missing
        assert self.cache.get_block_mapping(seq_id) == table.block_ids + new_blocks
        # Decode: the new tokens' K/V are written after the old ones.
        k, v = self.fresh_kv(n)
        self.cache.write_kv(seq_id, k, v, start_position=table.num_tokens)
        old_k, old_v = self.expected[seq_id]
        self.expected[seq_id] = (torch.cat([old_k, k]), torch.cat([old_v, v]))

    @precondition(has_sequences)
    @rule(data=st.data())
    def reserve_a_block(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        if self.cache.num_free_blocks == 0:
            fails_cleanly(self.cache, OutOfBlocksError, lambda: self.cache.append_block_to_sequence(seq_id))
            return
        length = self.cache.sequence_length(seq_id)
        block_id = self.cache.append_block_to_sequence(seq_id)
        assert self.cache.get_block_mapping(seq_id)[-1] == block_id
        assert self.cache.sequence_length(seq_id) == length

    @precondition(lambda self: any(k.shape[0] for k, _ in self.expected.values()))
    @rule(data=st.data())
    def overwrite(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(s for s, (k, _) in self.expected.items() if k.shape[0])))
        length = self.cache.sequence_length(seq_id)
        start = data.draw(st.integers(0, length - 1), label="start")
        n = data.draw(st.integers(1, length - start), label="n")
        k, v = self.fresh_kv(n)
        self.cache.write_kv(seq_id, k, v, start_position=start)
        old_k, old_v = self.expected[seq_id]
        old_k[start : start + n], old_v[start : start + n] = k, v

    @precondition(has_sequences)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        blocks = self.cache.get_block_mapping(seq_id)
        free_before = self.cache.snapshot().free_block_ids
        assert self.cache.free_sequence(seq_id) == blocks
        assert self.cache.snapshot().free_block_ids == free_before + tuple(blocks)
        del self.expected[seq_id]

    # ------------------------------------------------------------------- calls that must fail

    @rule()
    def free_an_unknown_sequence(self) -> None:
        with unchanged(self.cache):
            assert self.cache.free_sequence(-1) == []

    @rule(call=st.sampled_from(["append", "write", "read", "locate", "reserve"]))
    def use_an_unknown_sequence(self, call: str) -> None:
        k, v = self.fresh_kv(1)
        calls = {
            "append": lambda: self.cache.append_tokens(-1),
            "write": lambda: self.cache.write_kv(-1, k, v),
            "read": lambda: self.cache.read_kv(-1),
            "locate": lambda: self.cache.physical_location(-1, 0),
            "reserve": lambda: self.cache.append_block_to_sequence(-1),
        }
        fails_cleanly(self.cache, UnknownSequenceError, calls[call])

    @precondition(has_sequences)
    @rule(data=st.data())
    def reuse_a_live_id(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        fails_cleanly(self.cache, ValueError, lambda: self.cache.allocate_for_sequence(seq_id, 1))

    @precondition(has_sequences)
    @rule(data=st.data(), extra=st.integers(1, 3))
    def write_past_the_end(self, data: st.DataObject, extra: int) -> None:
        seq_id = self.pick(data)
        length = self.cache.sequence_length(seq_id)
        k, v = self.fresh_kv(extra)
        fails_cleanly(
            self.cache, ValueError, lambda: self.cache.write_kv(seq_id, k, v, start_position=length)
        )
        fails_cleanly(self.cache, ValueError, lambda: self.cache.physical_location(seq_id, length))

    @precondition(has_sequences)
    @rule(data=st.data())
    def negative_counts(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        fails_cleanly(self.cache, ValueError, lambda: self.cache.append_tokens(seq_id, -1))
        fails_cleanly(self.cache, ValueError, lambda: self.cache.allocate_for_sequence("new", -1))

    # ------------------------------------------------------------------------------- invariants

    @invariant()
    def each_block_is_free_or_owned_by_one_sequence(self) -> None:
        snapshot = self.cache.snapshot()
        owned = [b for table in snapshot.tables.values() for b in table.block_ids]
        free = snapshot.free_block_ids
        assert len(set(owned)) == len(owned), "a block is in two sequences"
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert set(owned).isdisjoint(free), "a block is both free and owned"
        assert set(owned) | set(free) == set(range(NUM_BLOCKS)), "a block leaked"
        for block_id in range(NUM_BLOCKS):
            assert snapshot.ref_counts[block_id] == owned.count(block_id)

    @invariant()
    def the_counts_add_up(self) -> None:
        usage = self.cache.usage()
        assert usage.used_blocks + usage.free_blocks == NUM_BLOCKS
        assert usage.allocated_tokens == sum(k.shape[0] for k, _ in self.expected.values())
        assert usage.internal_fragmentation_tokens >= 0
        for seq_id in self.expected:
            table = self.cache.get_block_table(seq_id)
            assert table.num_tokens <= table.capacity(BLOCK_SIZE)

    @invariant()
    def every_sequence_reads_back_what_was_written(self) -> None:
        for seq_id, (k, v) in self.expected.items():
            read_k, read_v = self.cache.read_kv(seq_id)
            assert torch.equal(read_k, k), f"K of sequence {seq_id} differs"
            assert torch.equal(read_v, v), f"V of sequence {seq_id} differs"

    @invariant()
    def no_two_tokens_share_a_slot(self) -> None:
        slots = torch.cat([self.cache.slot_mapping(s) for s in self.expected] or [torch.zeros(0)])
        assert slots.unique().numel() == slots.numel()


TestPagedCacheOnCPU = PagedCacheMachine.TestCase


class PagedCacheOnCUDAMachine(PagedCacheMachine):
    device = "cuda"


TestPagedCacheOnCUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)(PagedCacheOnCUDAMachine.TestCase)

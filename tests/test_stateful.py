"""The whole allocator under random workloads: allocate, append, write, fork, free, and bad calls.

A hypothesis state machine drives a small PagedKVCacheAllocator and keeps a simple reference: the
contiguous K/V each live sequence should hold. Forks share blocks, and appends and writes into
shared blocks copy them first (copy-on-write). After every step it checks the invariants: each
block is free or held, never both; a block's ref count equals the number of tables that hold it;
free + used == total; tokens share a slot only inside a shared block; every live sequence reads
back exactly what was written to it. Each append and write also checks that no block another live
sequence holds changed. Every call that must fail is checked to change nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv import (
    BlockTable,
    OutOfBlocksError,
    PagedKVCacheAllocator,
    UnknownSequenceError,
    blocks_for_tokens,
)

from .helpers import fails_cleanly, unchanged

pytestmark = [pytest.mark.lesson02, pytest.mark.lesson03, pytest.mark.lesson04, pytest.mark.lesson07]

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

    def holders(self) -> Counter[int]:
        """How many block tables hold each block, counted from the tables themselves."""
        tables = self.cache.snapshot().tables.values()
        return Counter(block_id for table in tables for block_id in table.block_ids)

    def shared_blocks(self, table: BlockTable, start: int, end: int) -> list[int]:
        """The logical blocks of positions ``start .. end - 1`` that other tables also hold."""
        holders = self.holders()
        touched = range(start // BLOCK_SIZE, blocks_for_tokens(end, BLOCK_SIZE)) if end > start else ()
        return [i for i in touched if i < table.num_blocks and holders[table.block_ids[i]] > 1]

    @contextmanager
    def others_untouched(self, seq_id: int) -> Iterator[None]:
        """Assert that the code in the ``with`` changes no K/V in any block another live sequence holds."""
        others = self.cache.snapshot().tables
        held = sorted({b for s, table in others.items() if s != seq_id for b in table.block_ids})
        index = torch.tensor(held, dtype=torch.long, device=self.device)
        k_before, v_before = self.cache.k_cache[index].clone(), self.cache.v_cache[index].clone()
        yield
        assert torch.equal(self.cache.k_cache[index], k_before), "a write landed in another sequence's block"
        assert torch.equal(self.cache.v_cache[index], v_before), "a write landed in another sequence's block"

    def expected_copies(
        self, table: BlockTable, shared: list[int], taken: list[int]
    ) -> list[tuple[int, int]]:
        """The ``(shared block, copy)`` pairs when the copies are the first blocks ``taken``."""
        return [(table.block_ids[i], copy) for i, copy in zip(shared, taken, strict=False)]

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
        shared = self.shared_blocks(table, table.num_tokens, table.num_tokens + n)
        missing = max(0, blocks_for_tokens(table.num_tokens + n, BLOCK_SIZE) - table.num_blocks)
        if len(shared) + missing > self.cache.num_free_blocks:
            fails_cleanly(self.cache, OutOfBlocksError, lambda: self.cache.append_tokens(seq_id, n))
            return
        free_before = self.cache.snapshot().free_block_ids
        with self.others_untouched(seq_id):
            new_blocks = self.cache.append_tokens(seq_id, n)
            # The copies first, then the appended blocks, all from the head of the free list.
            assert new_blocks == list(free_before[: len(shared) + missing])
            assert self.cache.last_copies == self.expected_copies(table, shared, new_blocks)
            mapping = list(table.block_ids)
            for logical, copy in zip(shared, new_blocks, strict=False):
                mapping[logical] = copy
            assert self.cache.get_block_mapping(seq_id) == mapping + new_blocks[len(shared) :]
            # Decode: the new tokens' K/V are written after the old ones, in blocks now private.
            k, v = self.fresh_kv(n)
            self.cache.write_kv(seq_id, k, v, start_position=table.num_tokens)
            assert self.cache.last_copies == []
        old_k, old_v = self.expected[seq_id]
        self.expected[seq_id] = (torch.cat([old_k, k]), torch.cat([old_v, v]))

    @precondition(has_sequences)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data)
        child = self.next_seq_id
        self.next_seq_id += 1
        before = self.cache.snapshot()
        k_cache, v_cache = self.cache.k_cache.clone(), self.cache.v_cache.clone()
        assert self.cache.fork(parent, child) == before.tables[parent]
        after = self.cache.snapshot()
        assert after.tables == {**before.tables, child: before.tables[parent]}
        assert after.free_block_ids == before.free_block_ids  # nothing taken
        shared = set(before.tables[parent].block_ids)
        assert after.ref_counts == tuple(r + (b in shared) for b, r in enumerate(before.ref_counts))
        assert torch.equal(self.cache.k_cache, k_cache) and torch.equal(self.cache.v_cache, v_cache)
        parent_k, parent_v = self.expected[parent]
        self.expected[child] = (parent_k.clone(), parent_v.clone())

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
        table = self.cache.get_block_table(seq_id)
        shared = self.shared_blocks(table, start, start + n)
        write = lambda: self.cache.write_kv(seq_id, k, v, start_position=start)  # noqa: E731
        if len(shared) > self.cache.num_free_blocks:
            fails_cleanly(self.cache, OutOfBlocksError, write)
            return
        free_before = self.cache.snapshot().free_block_ids
        with self.others_untouched(seq_id):
            write()
        copies = self.expected_copies(table, shared, list(free_before[: len(shared)]))
        assert self.cache.last_copies == copies
        old_k, old_v = self.expected[seq_id]
        old_k[start : start + n], old_v[start : start + n] = k, v

    @precondition(has_sequences)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = self.pick(data)
        before = self.cache.snapshot()
        # Only the blocks no other table holds go back; the others keep their K/V.
        alone = [b for b in before.tables[seq_id].block_ids if before.ref_counts[b] == 1]
        assert self.cache.free_sequence(seq_id) == alone
        assert self.cache.snapshot().free_block_ids == before.free_block_ids + tuple(alone)
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
        other = self.pick(data)
        fails_cleanly(self.cache, ValueError, lambda: self.cache.allocate_for_sequence(seq_id, 1))
        fails_cleanly(self.cache, ValueError, lambda: self.cache.fork(other, seq_id), match="child_id")
        fails_cleanly(self.cache, UnknownSequenceError, lambda: self.cache.fork(-1, self.next_seq_id))

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
    def a_blocks_ref_count_is_the_number_of_tables_that_hold_it(self) -> None:
        snapshot = self.cache.snapshot()
        holders = self.holders()
        free = snapshot.free_block_ids
        for table in snapshot.tables.values():
            assert len(set(table.block_ids)) == len(table.block_ids), "a block is in a table twice"
        assert len(set(free)) == len(free), "a block is on the free list twice"
        assert set(holders).isdisjoint(free), "a block is both free and held"
        assert set(holders) | set(free) == set(range(NUM_BLOCKS)), "a block leaked"
        for block_id in range(NUM_BLOCKS):
            assert snapshot.ref_counts[block_id] == holders[block_id]

    @invariant()
    def the_counts_add_up(self) -> None:
        usage = self.cache.usage()
        holders = self.holders()
        assert usage.used_blocks + usage.free_blocks == NUM_BLOCKS
        assert usage.used_blocks == len(holders)
        assert usage.shared_blocks == sum(1 for count in holders.values() if count > 1)
        # A token in a shared block is stored once: count the distinct slots that hold a token.
        slots = {slot for s in self.expected for slot in self.cache.slot_mapping(s).tolist()}
        assert usage.allocated_tokens == len(slots)
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
    def tokens_share_a_slot_only_in_a_shared_block_at_the_same_position(self) -> None:
        position_of: dict[int, int] = {}
        for seq_id in self.expected:
            slots = self.cache.slot_mapping(seq_id).tolist()
            assert len(set(slots)) == len(slots), f"two tokens of sequence {seq_id} share a slot"
            for position, slot in enumerate(slots):
                if slot in position_of:
                    assert position_of[slot] == position
                    assert self.cache.ref_count(slot // BLOCK_SIZE) > 1
                position_of[slot] = position
        # Every holder of a shared block holds the same tokens in it.
        tables = self.cache.snapshot().tables.values()
        in_block: dict[int, set[int]] = {}
        for table in tables:
            for logical, block_id in enumerate(table.block_ids):
                held = min(BLOCK_SIZE, max(0, table.num_tokens - logical * BLOCK_SIZE))
                in_block.setdefault(block_id, set()).add(held)
        assert all(len(counts) == 1 for counts in in_block.values())


TestPagedCacheOnCPU = PagedCacheMachine.TestCase


class PagedCacheOnCUDAMachine(PagedCacheMachine):
    device = "cuda"


TestPagedCacheOnCUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)(PagedCacheOnCUDAMachine.TestCase)

"""The whole allocator under random workloads: sharing, prefix caching and preemption together.

A hypothesis state machine drives a small PagedKVCacheAllocator through allocate (prompts with
shared prefixes, so the prefix cache hits, revives freed blocks and evicts them), decode appends,
overwrites, fork, free, preemption by recompute (free, then allocate the same tokens again) and by
swap (out to host memory through :mod:`paged_kv.kv.swap`, and back in, into whatever blocks are free),
and calls that must fail. It runs twice: with prefix caching off and on.

The reference is each sequence's tokens. As in a real model, the K/V of position ``p`` are a
function of the tokens up to ``p`` (:func:`~tests.helpers.kv_of`), so sharing a cached block is
right exactly when the prefix matches; a prompt writes only the K/V of its uncached tail. With
prefix caching off, every request also gets its own salt (a hidden first token), so no two
sequences ever hold equal K/V and any misplaced value shows.

After every step it checks the invariants: each block is free or held, never both; a block's ref
count equals the number of tables that hold it; free + used == total; tokens share a slot only in
a shared block; every live sequence and every swapped-out one reads back exactly its reference
K/V; every cached block holds the tokens and the K/V of the prefix it was cached for, the cache
holds exactly the blocks a simple model (:class:`PrefixCacheModel`) predicts, and its counters
match the model's (hits <= queries). Each prefill, append, write and swap-in also checks that no
block another live sequence holds changed, bit for bit. Every call that must fail is checked to
change nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_kv import (
    BlockTable,
    OutOfBlocksError,
    PagedKVCacheAllocator,
    UnknownSequenceError,
    blocks_for_tokens,
)
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.kv import swap
from paged_kv.kv.swap import SwappedKV

from .helpers import HEAD_DIM, NUM_HEADS, fails_cleanly, kv_of, unchanged

pytestmark = [
    pytest.mark.lesson02,
    pytest.mark.lesson03,
    pytest.mark.lesson04,
    pytest.mark.lesson08,
    pytest.mark.lesson11,
]

NUM_BLOCKS, BLOCK_SIZE = 12, 2
token = st.integers(0, 2)  # a tiny vocabulary, so prompts often share prefixes
SYSTEM_PROMPTS = [(), (0, 1, 2, 0), (0, 1, 2, 1, 1)]
prompts = st.builds(
    lambda system, tail: [*system, *tail], st.sampled_from(SYSTEM_PROMPTS), st.lists(token, max_size=6)
)


@dataclass(frozen=True)
class Request:
    """A sequence as the reference sees it: its tokens, and the salt its K/V are computed under."""

    salt: int
    tokens: tuple[int, ...]

    def kv(self, device: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of every position: a function of the salt and of the tokens up to it."""
        k, v = kv_of([self.salt, *self.tokens], device)
        return k[1:], v[1:]


@dataclass(eq=False)
class CachedPrefix:
    """The model's record of one cached block: the whole prompt prefix it ends, and the record before it.

    Records compare by identity: a prefix cached again after its block was evicted is a new record,
    and the records cached after the old one no longer follow it.
    """

    block_id: int
    prefix: tuple[int, ...]
    parent: CachedPrefix | None


class PrefixCacheModel:
    """What the prefix cache should hold, keyed by whole prefixes (no hashes, so no collisions).

    A prompt's block ``i`` is a hit when a record holds its prefix ``tokens[: (i + 1) * BLOCK_SIZE]``
    and follows the record that block ``i - 1`` hit; the first miss ends the run, and the last
    prompt token is never a hit. A block handed out for new data is evicted; a prompt caches its
    full blocks after the hits, up to the first whose prefix is already cached.
    """

    def __init__(self) -> None:
        self.by_prefix: dict[tuple[int, ...], CachedPrefix] = {}
        self.by_block: dict[int, CachedPrefix] = {}

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        return {block_id: record.prefix[-BLOCK_SIZE:] for block_id, record in self.by_block.items()}

    def match(self, tokens: tuple[int, ...]) -> list[CachedPrefix]:
        hits: list[CachedPrefix] = []
        for i in range(max(0, (len(tokens) - 1) // BLOCK_SIZE)):
            record = self.by_prefix.get(tokens[: (i + 1) * BLOCK_SIZE])
            if record is None or record.parent is not (hits[-1] if hits else None):
                break
            hits.append(record)
        return hits

    def evict(self, block_ids: list[int]) -> int:
        """Forget the blocks handed out for new data; return how many were cached."""
        records = [self.by_block.pop(block_id) for block_id in block_ids if block_id in self.by_block]
        for record in records:
            del self.by_prefix[record.prefix]
        return len(records)

    def insert(self, tokens: tuple[int, ...], block_ids: list[int], hits: list[CachedPrefix]) -> None:
        parent = hits[-1] if hits else None
        for i in range(len(hits), len(tokens) // BLOCK_SIZE):
            prefix = tokens[: (i + 1) * BLOCK_SIZE]
            if prefix in self.by_prefix:
                break
            parent = CachedPrefix(block_ids[i], prefix, parent)
            self.by_prefix[prefix] = self.by_block[block_ids[i]] = parent


def has_sequences(machine: PagedCacheMachine) -> bool:
    return bool(machine.live)


class PagedCacheMachine(RuleBasedStateMachine):
    """Random workloads against the reference ``self.live`` (and the swapped-out and preempted)."""

    device = "cpu"
    prefix_caching = False

    @initialize()
    def start(self) -> None:
        self.cache = PagedKVCacheAllocator(
            NUM_BLOCKS,
            BLOCK_SIZE,
            NUM_HEADS,
            HEAD_DIM,
            device=self.device,
            enable_prefix_caching=self.prefix_caching,
        )
        self.live: dict[int, Request] = {}
        self.swapped: dict[int, tuple[SwappedKV, Request]] = {}
        self.preempted: dict[int, Request] = {}  # freed, to be recomputed
        self.model = PrefixCacheModel()
        self.stats = PrefixCacheStats()
        self.next_seq_id = 0

    # ---------------------------------------------------------------------------------- helpers

    def new_seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def pick(self, data: st.DataObject, pool: dict[int, object]) -> int:
        return data.draw(st.sampled_from(sorted(pool)), label="seq_id")

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

    @contextmanager
    def kv_unchanged(self) -> Iterator[None]:
        """Assert that the code in the ``with`` changes no K/V anywhere in the cache."""
        k_cache, v_cache = self.cache.k_cache.clone(), self.cache.v_cache.clone()
        yield
        assert torch.equal(self.cache.k_cache, k_cache) and torch.equal(self.cache.v_cache, v_cache)

    def expected_copies(
        self, table: BlockTable, shared: list[int], taken: list[int]
    ) -> list[tuple[int, int]]:
        """The ``(shared block, copy)`` pairs when the copies are the first blocks ``taken``."""
        return [(table.block_ids[i], copy) for i, copy in zip(shared, taken, strict=False)]

    def took_fresh(self, block_ids: list[int]) -> None:
        """Blocks handed out for new data lose whatever prefix they cached."""
        if self.model.evict(block_ids):
            event("a cached block was evicted")

    def blocks_freed_by(self, seq_id: int) -> list[int]:
        """The blocks freeing ``seq_id`` puts back on the free list: those no other table holds.

        In table order, or, with prefix caching, last block first.
        """
        block_ids = self.cache.get_block_mapping(seq_id)
        order = reversed(block_ids) if self.prefix_caching else block_ids
        return [b for b in order if self.cache.ref_count(b) == 1]

    def free_list_after(self, freed: list[int]) -> tuple[int, ...]:
        """The free list once ``freed`` are released in that order: at the tail, except that with
        prefix caching a block holding nothing cached goes to the head, to be reused first."""
        free = list(self.cache.snapshot().free_block_ids)
        cached = self.model.cached_blocks() if self.prefix_caching else {}
        for block_id in freed:
            if self.prefix_caching and block_id not in cached:
                free.insert(0, block_id)
            else:
                free.append(block_id)
        return tuple(free)

    def protected_end(self, table: BlockTable) -> int:
        """Where the tokens a caller may change begin: past every cached block the table holds alone.

        Such a block is written in place (no copy-on-write), so rewriting it with other tokens
        would leave the cache promising the old prefix. A real engine never does that: a prompt's
        full blocks are immutable.
        """
        ends = [
            (i + 1) * BLOCK_SIZE
            for i, block_id in enumerate(table.block_ids)
            if block_id in self.model.by_block and self.cache.ref_count(block_id) == 1
        ]
        return max(ends, default=0)

    def admit(self, seq_id: int, request: Request, with_ids: bool) -> bool:
        """Allocate ``request``'s prompt, write the K/V of its uncached tail; ``False`` if out of blocks."""
        tokens, n = request.tokens, len(request.tokens)
        looks_up = self.prefix_caching and with_ids
        hits = self.model.match(tokens) if looks_up else []
        hit_ids = [record.block_id for record in hits]
        fresh = blocks_for_tokens(n, BLOCK_SIZE) - len(hits)
        revived = [b for b in hit_ids if self.cache.ref_count(b) == 0]
        call = lambda: self.cache.allocate_for_sequence(seq_id, n, tokens if with_ids else None)  # noqa: E731
        if fresh + len(revived) > self.cache.num_free_blocks:
            error = fails_cleanly(self.cache, OutOfBlocksError, call)
            assert (error.needed, error.free) == (fresh + len(revived), self.cache.num_free_blocks)
            event("allocate: out of blocks")
            return False
        free_before = self.cache.snapshot().free_block_ids
        with self.others_untouched(seq_id):
            table = call()
            # The hits (revived from wherever they sit, or shared), then fresh blocks from the head.
            taken = [b for b in free_before if b not in hit_ids][:fresh]
            assert table.block_ids == hit_ids + taken and table.num_tokens == n
            assert self.cache.snapshot().free_block_ids == tuple(
                b for b in free_before if b not in table.block_ids
            )
            cached = self.cache.num_cached_tokens(seq_id)
            assert cached == len(hits) * BLOCK_SIZE
            self.took_fresh(taken)
            if looks_up:
                self.model.insert(tokens, table.block_ids, hits)
                s = self.stats
                self.stats = PrefixCacheStats(s.requests + 1, s.queries + n, s.hits + cached)
            # Prefill: only the positions the cache did not hold are computed and written.
            k, v = request.kv(self.device)
            self.cache.write_kv(seq_id, k[cached:], v[cached:], start_position=cached)
        self.live[seq_id] = request
        if hits:
            event("allocate: a prefix cache hit")
        if revived:
            event("allocate: revived a cached block from the free list")
        return True

    def drop(self, seq_id: int) -> Request:
        """Free a live sequence, checking which blocks go back; return its request."""
        freed = self.blocks_freed_by(seq_id)
        free_after = self.free_list_after(freed)
        assert self.cache.free_sequence(seq_id) == freed
        assert self.cache.snapshot().free_block_ids == free_after
        return self.live.pop(seq_id)

    # -------------------------------------------------------------------------------- the rules

    @rule(tokens=prompts, with_ids=st.sampled_from([True, True, True, False]))
    def allocate(self, tokens: list[int], with_ids: bool) -> None:
        seq_id = self.new_seq_id()
        salt = 0 if self.prefix_caching else 1_000 + seq_id
        self.admit(seq_id, Request(salt, tuple(tokens)), with_ids)

    @precondition(has_sequences)
    @rule(data=st.data(), new=st.lists(token, max_size=2 * BLOCK_SIZE + 1))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        seq_id = self.pick(data, self.live)
        n = len(new)
        table = self.cache.get_block_table(seq_id)
        shared = self.shared_blocks(table, table.num_tokens, table.num_tokens + n)
        missing = max(0, blocks_for_tokens(table.num_tokens + n, BLOCK_SIZE) - table.num_blocks)
        if len(shared) + missing > self.cache.num_free_blocks:
            fails_cleanly(self.cache, OutOfBlocksError, lambda: self.cache.append_tokens(seq_id, n))
            return
        free_before = self.cache.snapshot().free_block_ids
        grown = Request(self.live[seq_id].salt, self.live[seq_id].tokens + tuple(new))
        with self.others_untouched(seq_id):
            new_blocks = self.cache.append_tokens(seq_id, n)
            # The copies first, then the appended blocks, all from the head of the free list.
            assert new_blocks == list(free_before[: len(shared) + missing])
            assert self.cache.last_copies == self.expected_copies(table, shared, new_blocks)
            mapping = list(table.block_ids)
            for logical, copy in zip(shared, new_blocks, strict=False):
                mapping[logical] = copy
            assert self.cache.get_block_mapping(seq_id) == mapping + new_blocks[len(shared) :]
            self.took_fresh(new_blocks)
            # Decode: the new tokens' K/V are written after the old ones, in blocks now private.
            k, v = grown.kv(self.device)
            self.cache.write_kv(seq_id, k[table.num_tokens :], v[table.num_tokens :], table.num_tokens)
            assert self.cache.last_copies == []
        self.live[seq_id] = grown
        if shared:
            event("append: copy-on-write")

    @precondition(has_sequences)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data, self.live)
        child = self.new_seq_id()
        before = self.cache.snapshot()
        with self.kv_unchanged():
            assert self.cache.fork(parent, child) == before.tables[parent]
        after = self.cache.snapshot()
        assert after.tables == {**before.tables, child: before.tables[parent]}
        assert after.free_block_ids == before.free_block_ids  # nothing taken
        shared = set(before.tables[parent].block_ids)
        assert after.ref_counts == tuple(r + (b in shared) for b, r in enumerate(before.ref_counts))
        assert self.cache.num_cached_tokens(child) == 0  # a fork computed nothing, and looked nothing up
        self.live[child] = self.live[parent]

    @precondition(has_sequences)
    @rule(data=st.data())
    def reserve_a_block(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.live)
        if self.cache.num_free_blocks == 0:
            fails_cleanly(self.cache, OutOfBlocksError, lambda: self.cache.append_block_to_sequence(seq_id))
            return
        length = self.cache.sequence_length(seq_id)
        free_before = self.cache.snapshot().free_block_ids
        block_id = self.cache.append_block_to_sequence(seq_id)
        assert block_id == free_before[0] and self.cache.get_block_mapping(seq_id)[-1] == block_id
        assert self.cache.sequence_length(seq_id) == length
        self.took_fresh([block_id])

    @precondition(lambda self: any(request.tokens for request in self.live.values()))
    @rule(data=st.data())
    def overwrite(self, data: st.DataObject) -> None:
        """Write K/V from ``start`` on: a recompute of the same tokens, or a new tail run to the end.

        A new tail is what speculative decoding writes when it rejects tokens: every position from
        the first changed token on gets new K/V, since K/V depend on the whole prefix.
        """
        seq_id = data.draw(st.sampled_from(sorted(s for s, r in self.live.items() if r.tokens)))
        request = self.live[seq_id]
        length = len(request.tokens)
        start = data.draw(st.integers(0, length - 1), label="start")
        end = data.draw(st.integers(start + 1, length), label="end")
        table = self.cache.get_block_table(seq_id)
        tokens = list(request.tokens)
        if end == length:
            first = max(start, self.protected_end(table))
            size = length - first
            tokens[first:] = data.draw(st.lists(token, min_size=size, max_size=size), label="new tail")
        rewritten = Request(request.salt, tuple(tokens))
        k, v = rewritten.kv(self.device)
        shared = self.shared_blocks(table, start, end)
        write = lambda: self.cache.write_kv(seq_id, k[start:end], v[start:end], start_position=start)  # noqa: E731
        if len(shared) > self.cache.num_free_blocks:
            fails_cleanly(self.cache, OutOfBlocksError, write)
            return
        free_before = self.cache.snapshot().free_block_ids
        with self.others_untouched(seq_id):
            write()
        copies = self.expected_copies(table, shared, list(free_before[: len(shared)]))
        assert self.cache.last_copies == copies
        self.took_fresh([copy for _, copy in copies])
        # Every position of a live sequence was written when it arrived, so a cached block this
        # write lands in (not a fresh copy) is overwritten: the cache forgets its hash.
        written = self.cache.get_block_mapping(seq_id)[start // BLOCK_SIZE : (end - 1) // BLOCK_SIZE + 1]
        if self.model.evict([b for b in written if b not in {copy for _, copy in copies}]):
            event("overwrite: a cached block forgot its hash")
        self.live[seq_id] = rewritten
        if copies:
            event("overwrite: copy-on-write")

    @precondition(has_sequences)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # Only the blocks no other table holds go back; the others keep their K/V.
        self.drop(self.pick(data, self.live))

    @precondition(has_sequences)
    @rule(data=st.data())
    def preempt_by_recompute(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.live)
        self.preempted[seq_id] = self.drop(seq_id)

    @precondition(lambda self: bool(self.preempted))
    @rule(data=st.data())
    def resume_by_recompute(self, data: st.DataObject) -> None:
        """Allocate all the tokens a preempted sequence held as a new prompt: its prefix may be cached."""
        seq_id = self.pick(data, self.preempted)
        if self.admit(seq_id, self.preempted[seq_id], with_ids=True):
            del self.preempted[seq_id]
            event("resumed by recompute")

    @precondition(has_sequences)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.live)
        freed = self.blocks_freed_by(seq_id)
        free_after = self.free_list_after(freed)
        with self.kv_unchanged():
            saved = swap.swap_out(self.cache.manager, self.cache.storage, seq_id)
        assert seq_id not in self.cache
        assert self.cache.snapshot().free_block_ids == free_after
        assert saved.num_tokens == len(self.live[seq_id].tokens)
        self.swapped[seq_id] = (saved, self.live.pop(seq_id))

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.swapped)
        saved, request = self.swapped[seq_id]
        needed = blocks_for_tokens(saved.num_tokens, BLOCK_SIZE)
        call = lambda: swap.swap_in(self.cache.manager, self.cache.storage, seq_id, saved)  # noqa: E731
        if needed > self.cache.num_free_blocks:
            fails_cleanly(self.cache, OutOfBlocksError, call)
            event("swap in: out of blocks")
            return
        free_before = self.cache.snapshot().free_block_ids
        with self.others_untouched(seq_id):
            call()
        # Fresh blocks from the head of the free list, wherever the sequence was before.
        assert self.cache.get_block_mapping(seq_id) == list(free_before[:needed])
        assert self.cache.num_cached_tokens(seq_id) == 0
        self.took_fresh(list(free_before[:needed]))
        self.live[seq_id] = request
        del self.swapped[seq_id]
        event("swapped in")

    # ------------------------------------------------------------------- calls that must fail

    @rule(
        data=st.data(),
        call=st.sampled_from(["free", "append", "write", "read", "locate", "reserve", "swap out", "cached"]),
    )
    def use_an_unknown_sequence(self, data: st.DataObject, call: str) -> None:
        # Never allocated, swapped out, or preempted: none of them is in the cache.
        seq_id = data.draw(
            st.sampled_from([-1, *sorted(self.swapped), *sorted(self.preempted)]), label="seq_id"
        )
        if call == "free":  # a cancelled request: a no-op
            with unchanged(self.cache):
                assert self.cache.free_sequence(seq_id) == []
            return
        k, v = kv_of([1], self.device)
        calls = {
            "append": lambda: self.cache.append_tokens(seq_id),
            "write": lambda: self.cache.write_kv(seq_id, k, v),
            "read": lambda: self.cache.read_kv(seq_id),
            "locate": lambda: self.cache.physical_location(seq_id, 0),
            "reserve": lambda: self.cache.append_block_to_sequence(seq_id),
            "swap out": lambda: swap.swap_out(self.cache.manager, self.cache.storage, seq_id),
            "cached": lambda: self.cache.num_cached_tokens(seq_id),
        }
        fails_cleanly(self.cache, UnknownSequenceError, calls[call])

    @precondition(has_sequences)
    @rule(data=st.data())
    def use_bad_arguments(self, data: st.DataObject) -> None:
        seq_id = self.pick(data, self.live)
        other = self.pick(data, self.live)
        length = self.cache.sequence_length(seq_id)
        k, v = kv_of([0] * data.draw(st.integers(1, 3), label="extra"), self.device)
        new = self.next_seq_id
        calls = {
            "allocate a live id": (
                ValueError,
                lambda: self.cache.allocate_for_sequence(seq_id, 1, [0]),
                None,
            ),
            "fork into a live id": (ValueError, lambda: self.cache.fork(other, seq_id), "child_id"),
            "fork an unknown id": (UnknownSequenceError, lambda: self.cache.fork(-1, new), None),
            "write past the end": (ValueError, lambda: self.cache.write_kv(seq_id, k, v, length), None),
            "locate past the end": (ValueError, lambda: self.cache.physical_location(seq_id, length), None),
            "append -1 tokens": (ValueError, lambda: self.cache.append_tokens(seq_id, -1), None),
            "allocate -1 tokens": (ValueError, lambda: self.cache.allocate_for_sequence(new, -1), None),
            "too few token ids": (
                ValueError,
                lambda: self.cache.allocate_for_sequence(new, 3, [0, 1]),
                "token_ids",
            ),
        }
        if self.swapped:
            saved, _ = self.swapped[self.pick(data, self.swapped)]
            swap_in = lambda: swap.swap_in(self.cache.manager, self.cache.storage, seq_id, saved)  # noqa: E731
            calls["swap into a live id"] = (ValueError, swap_in, "already allocated")
        error, call, match = calls[data.draw(st.sampled_from(sorted(calls)), label="call")]
        fails_cleanly(self.cache, error, call, match=match)

    # ------------------------------------------------------------------------------- invariants

    @invariant()
    def a_blocks_ref_count_is_the_number_of_tables_that_hold_it(self) -> None:
        snapshot = self.cache.snapshot()
        assert set(snapshot.tables) == set(self.live), "the allocator's sequences are not the live ones"
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
        assert usage.free_blocks == self.cache.num_free_blocks
        assert usage.used_blocks == len(holders)
        assert usage.shared_blocks == sum(1 for count in holders.values() if count > 1)
        # A token in a shared block is stored once: count the distinct slots that hold a token.
        slots = {slot for s in self.live for slot in self.cache.slot_mapping(s).tolist()}
        assert usage.allocated_tokens == len(slots)
        assert usage.internal_fragmentation_tokens >= 0
        for seq_id, request in self.live.items():
            table = self.cache.get_block_table(seq_id)
            assert table.num_tokens == len(request.tokens) <= table.capacity(BLOCK_SIZE)

    @invariant()
    def every_sequence_reads_back_what_was_written(self) -> None:
        for seq_id, request in self.live.items():
            k, v = request.kv(self.device)
            read_k, read_v = self.cache.read_kv(seq_id)
            assert torch.equal(read_k, k), f"K of sequence {seq_id} differs"
            assert torch.equal(read_v, v), f"V of sequence {seq_id} differs"
        for seq_id, (saved, request) in self.swapped.items():
            (k_saved,), (v_saved,) = saved.k, saved.v
            k, v = request.kv("cpu")
            assert k_saved.device.type == "cpu" and v_saved.device.type == "cpu"
            assert torch.equal(k_saved, k) and torch.equal(v_saved, v), f"swapped-out {seq_id} differs"

    @invariant()
    def tokens_share_a_slot_only_in_a_shared_block_at_the_same_position(self) -> None:
        position_of: dict[int, int] = {}
        for seq_id in self.live:
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

    @invariant()
    def cached_blocks_hold_the_kv_of_their_prefix(self) -> None:
        assert self.cache.cached_blocks() == self.model.cached_blocks()
        stats = self.cache.prefix_cache_stats
        assert stats == self.stats and stats.hits <= stats.queries
        if not self.model.by_block:
            return
        block_ids = torch.tensor(list(self.model.by_block), dtype=torch.long, device=self.device)
        expected = [Request(0, record.prefix).kv(self.device) for record in self.model.by_block.values()]
        # A block stores (heads, block_size, head_dim); the prefix's last block_size positions.
        k = torch.stack([k[-BLOCK_SIZE:].transpose(0, 1) for k, _ in expected])
        v = torch.stack([v[-BLOCK_SIZE:].transpose(0, 1) for _, v in expected])
        assert torch.equal(self.cache.k_cache[block_ids], k), "a cached block lost its prefix's K"
        assert torch.equal(self.cache.v_cache[block_ids], v), "a cached block lost its prefix's V"


class PrefixCachingMachine(PagedCacheMachine):
    prefix_caching = True


class PagedCacheOnCUDAMachine(PagedCacheMachine):
    device = "cuda"


class PrefixCachingOnCUDAMachine(PrefixCachingMachine):
    device = "cuda"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
TestPagedCacheOnCPU = PagedCacheMachine.TestCase
TestPrefixCachingOnCPU = PrefixCachingMachine.TestCase
TestPagedCacheOnCUDA = needs_cuda(PagedCacheOnCUDAMachine.TestCase)
TestPrefixCachingOnCUDA = needs_cuda(PrefixCachingOnCUDAMachine.TestCase)

"""Checks of exercise 08: fork, copy-on-write, and the lookup of a cached prefix by chained block hash.

Tasks 1 and 2 work on the exercise's ``SharedCache`` (a ``BlockAllocator``, block tables and K/V
pools on :func:`~paged_kv.device.default_device`), whose every block starts full of distinct values,
so a K/V copy that is missing, or made the wrong way round, shows. Task 2 shares blocks by hand
(a copied table and ``add_ref``), not with the learner's ``fork``, so each task is graded on its own;
it ends with a seeded run of forks, appends and frees compared step by step with
:class:`~paged_kv.kv.cache.PagedKVCacheAllocator`. Task 3 compares the hashes with
:func:`~paged_kv.core.prefix_cache.chain_hashes`, and the lookup with the blocks the package's prefix cache
reuses for the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

import torch

from paged_kv.checks._core import Checker, task
from paged_kv.core.block import BlockTable
from paged_kv.core.prefix_cache import ROOT_HASH, block_hash, chain_hashes, full_blocks
from paged_kv.device import default_device
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator

NUM_HEADS, HEAD_DIM, BLOCK = 2, 4, 4

State = tuple[dict[Hashable, tuple[list[int], int]], tuple[int, ...], tuple[int, ...]]


def _new_cache(c: Checker, cache_class, num_blocks: int):
    """A ``SharedCache`` of ``num_blocks`` blocks of 4 on the default device, every K/V value distinct."""
    call = f"cache = SharedCache({num_blocks}, {BLOCK}, {NUM_HEADS}, {HEAD_DIM}, device)"
    device = default_device()
    cache = c.run(call, lambda: cache_class(num_blocks, BLOCK, NUM_HEADS, HEAD_DIM, device=device))
    shape = (num_blocks, NUM_HEADS, BLOCK, HEAD_DIM)
    values = torch.arange(1, num_blocks * NUM_HEADS * BLOCK * HEAD_DIM + 1, dtype=torch.float32)
    cache.k_cache.copy_(values.view(shape))
    cache.v_cache.copy_(-values.view(shape))
    return cache


def _state(cache, num_blocks: int) -> State:
    """The bookkeeping: each table as (block ids, tokens), the ref counts, the free list."""
    tables = {seq: (list(t.block_ids), t.num_tokens) for seq, t in cache.tables.items()}
    refs = tuple(cache.allocator.ref_count(b) for b in range(num_blocks))
    return tables, refs, tuple(cache.allocator.free_block_ids)


def _refs(cache, num_blocks: int) -> list[int]:
    return [cache.allocator.ref_count(b) for b in range(num_blocks)]


def _fails_cleanly(
    c: Checker, cache, num_blocks: int, call: str, thunk: Callable[[], object], error: type, hint: str
) -> None:
    """``thunk()`` raises ``error`` and changes no table, ref count, free list entry or K/V value."""
    before = _state(cache, num_blocks)
    k, v = cache.k_cache.clone(), cache.v_cache.clone()
    c.raises(call, thunk, error, hint)
    after = _state(cache, num_blocks)
    c.holds(
        f"the tables, ref counts and free list after {call}",
        after == before,
        f"unchanged: {before}",
        after,
        hint,
    )
    c.holds(
        f"cache.k_cache and cache.v_cache after {call}",
        torch.equal(cache.k_cache, k) and torch.equal(cache.v_cache, v),
        "unchanged",
        "changed",
        hint,
    )


# ------------------------------------------------------------------------------- Task 1

COPY_TABLE_HINT = (
    "give the child a copy of the parent's table (table.copy(), or BlockTable(list(ids), n)): the same "
    "BlockTable object in both entries would make the child's next token grow the parent's table too"
)
ADD_REF_HINT = (
    "add one reference to each of the parent's blocks (cache.allocator.add_ref): a block's ref count is "
    "the number of tables that hold it, and without it the first of the two to finish frees blocks the "
    "other still reads"
)
NO_BLOCK_HINT = (
    "fork takes no block and moves no K/V: the child shares the parent's blocks, and a block is copied "
    "only later, when a token is written into it (task 2)"
)


@task("08.fork", "fork a sequence: share every block", needs=("SharedCache", "fork"))
def _fork(c: Checker, cache_class, fork) -> None:
    cache = _new_cache(c, cache_class, 8)
    c.equal('cache.allocate_for_sequence("A", 10)', lambda: cache.allocate_for_sequence("A", 10), [0, 1, 2])
    k, v = cache.k_cache.clone(), cache.v_cache.clone()
    c.equal(
        'fork(cache, "A", "B")',
        lambda: fork(cache, "A", "B"),
        [0, 1, 2],
        "return the child's block ids, which are the parent's, [0, 1, 2]: " + NO_BLOCK_HINT,
    )
    c.equal(
        'cache.tables["B"].block_ids',
        lambda: list(cache.tables["B"].block_ids),
        [0, 1, 2],
        "the child's table holds the parent's block ids, in the same order",
    )
    c.equal(
        'cache.tables["B"].num_tokens',
        lambda: cache.tables["B"].num_tokens,
        10,
        "the child holds the parent's tokens: copy num_tokens too",
    )
    c.holds(
        'cache.tables["B"] is not cache.tables["A"]',
        cache.tables["B"] is not cache.tables["A"]
        and cache.tables["B"].block_ids is not cache.tables["A"].block_ids,
        "two BlockTable objects with two block_ids lists",
        "the child's table (or its block_ids list) is the parent's own object",
        COPY_TABLE_HINT,
    )
    c.equal(
        "[cache.allocator.ref_count(b) for b in range(8)]",
        lambda: _refs(cache, 8),
        [2, 2, 2, 0, 0, 0, 0, 0],
        ADD_REF_HINT,
    )
    c.equal(
        "cache.allocator.free_block_ids",
        lambda: tuple(cache.allocator.free_block_ids),
        (3, 4, 5, 6, 7),
        NO_BLOCK_HINT,
    )
    c.holds(
        "cache.k_cache and cache.v_cache after the fork",
        torch.equal(cache.k_cache, k) and torch.equal(cache.v_cache, v),
        "unchanged",
        "changed",
        NO_BLOCK_HINT,
    )
    returned = c.run('ids = fork(cache, "B", "C")', lambda: fork(cache, "B", "C"))
    c.holds(
        "type(ids)",
        isinstance(returned, list),
        "list",
        type(returned).__name__,
        "return the child's block ids as a new list",
    )
    returned.append(99)
    c.equal(
        'cache.tables["C"].block_ids after ids.append(99)',
        lambda: list(cache.tables["C"].block_ids),
        [0, 1, 2],
        "return a new list (list(table.block_ids)): the caller may change it, the table must not change",
    )
    c.equal(
        "[cache.allocator.ref_count(b) for b in range(8)]  # after a fork of the fork",
        lambda: _refs(cache, 8),
        [3, 3, 3, 0, 0, 0, 0, 0],
        "a fork of a fork shares the same blocks once more: " + ADD_REF_HINT,
    )
    for seq, expected in (("A", []), ("B", []), ("C", [0, 1, 2])):
        c.equal(
            f'cache.free_sequence("{seq}")',
            lambda seq=seq: cache.free_sequence(seq),
            expected,
            "a shared block goes back to the free list only when its last holder frees it: " + ADD_REF_HINT,
        )

    cache = _new_cache(c, cache_class, 8)
    c.run('cache.allocate_for_sequence("A", 10)', lambda: cache.allocate_for_sequence("A", 10))
    c.run('cache.allocate_for_sequence("B", 3)', lambda: cache.allocate_for_sequence("B", 3))
    _fails_cleanly(
        c,
        cache,
        8,
        'fork(cache, "ghost", "X")',
        lambda: fork(cache, "ghost", "X"),
        KeyError,
        "the parent must exist: cache.tables[parent_id] raises KeyError for an unknown id",
    )
    for parent, child in (("A", "B"), ("A", "A")):
        _fails_cleanly(
            c,
            cache,
            8,
            f'fork(cache, "{parent}", "{child}")',
            lambda parent=parent, child=child: fork(cache, parent, child),
            ValueError,
            f'"{child}" is already allocated: raise ValueError before you add any reference (forking '
            "into a live id would overwrite its table and leak its blocks)",
        )
    c.equal('cache.allocate_for_sequence("E", 0)', lambda: cache.allocate_for_sequence("E", 0), [])
    c.equal('fork(cache, "E", "F")', lambda: fork(cache, "E", "F"), [], "an empty parent shares no block")
    c.equal('cache.tables["F"].num_tokens', lambda: cache.tables["F"].num_tokens, 0)


# ------------------------------------------------------------------------------- Task 2

BOUNDARY_HINT = (
    "a sequence of n tokens takes a fresh block for its next token exactly when its blocks are full, "
    "n == len(block_ids) * block_size (lesson 04); otherwise the token lands in block_ids[n // block_size]"
)
COPY_ONE_HINT = (
    "copy only the block the new token lands in, when it is shared (ref count above 1): full blocks "
    "take no new token, so they stay shared"
)
REPLACE_HINT = (
    "the copy takes the shared block's place in the writer's table; the other holders keep the shared "
    "block, so their tables do not change"
)
DROP_REF_HINT = (
    "the writer no longer holds the shared block: drop one reference to it (cache.allocator.free), or "
    "its ref count stays 2 for ever and the block is never freed (a leak)"
)
DATA_HINT = (
    "copy the shared block's K and V into the new block (cache.k_cache[new] = cache.k_cache[old], and "
    "the same for v_cache): a fresh block holds stale data, and the writer would lose its prefix"
)
DIRECTION_HINT = (
    "copy from the shared block into the new one, not the other way round: the shared block's K/V "
    "must stay as they are for its other holders"
)
IN_PLACE_HINT = (
    "a block with one holder is the writer's own: write in place and take nothing (after B's copy, "
    "block 2 is A's alone)"
)


def _share(c: Checker, cache, parent: str, child: str) -> None:
    """``child`` shares every block of ``parent``, set up by hand: a copied table and one more reference."""

    def share() -> None:
        table = cache.tables[parent]
        cache.tables[child] = BlockTable(list(table.block_ids), table.num_tokens)
        for block_id in table.block_ids:
            cache.allocator.add_ref(block_id)

    c.run(f"share {parent}'s blocks with {child} by hand (a copied table and add_ref)", share)


@task(
    "08.copy_on_write", "append a token, copying a shared block first", needs=("SharedCache", "append_token")
)
def _copy_on_write(c: Checker, cache_class, append_token) -> None:
    cache = _new_cache(c, cache_class, 8)
    c.run('cache.allocate_for_sequence("S", 5)', lambda: cache.allocate_for_sequence("S", 5))
    c.equal(
        '[append_token(cache, "S") for _ in range(4)]  # S holds 5 tokens in [0, 1]',
        lambda: [append_token(cache, "S") for _ in range(4)],
        [None, None, None, 2],
        "tokens 6, 7 and 8 fit in block 1 (return None), token 9 takes a fresh block, 2. " + BOUNDARY_HINT,
    )
    c.equal(
        'cache.tables["S"].num_tokens', lambda: cache.tables["S"].num_tokens, 9, "each call adds one token"
    )

    cache = _new_cache(c, cache_class, 8)
    c.run('cache.allocate_for_sequence("A", 10)', lambda: cache.allocate_for_sequence("A", 10))
    _share(c, cache, "A", "B")
    k, v = cache.k_cache.clone(), cache.v_cache.clone()
    c.equal(
        'append_token(cache, "B")  # A and B share [0, 1, 2], 10 tokens',
        lambda: append_token(cache, "B"),
        3,
        "B's 11th token lands in block 2, which A also holds: copy it into a fresh block (3, the head of "
        "the free list) and return the copy's id; " + COPY_ONE_HINT,
    )
    c.equal(
        'cache.tables["B"].block_ids', lambda: list(cache.tables["B"].block_ids), [0, 1, 3], COPY_ONE_HINT
    )
    c.equal('cache.tables["A"].block_ids', lambda: list(cache.tables["A"].block_ids), [0, 1, 2], REPLACE_HINT)
    c.equal(
        '(cache.tables["A"].num_tokens, cache.tables["B"].num_tokens)',
        lambda: (cache.tables["A"].num_tokens, cache.tables["B"].num_tokens),
        (10, 11),
        "only the sequence that appends grows",
    )
    c.equal(
        "[cache.allocator.ref_count(b) for b in range(8)]",
        lambda: _refs(cache, 8),
        [2, 2, 1, 1, 0, 0, 0, 0],
        DROP_REF_HINT,
    )
    c.holds(
        "cache.k_cache[2] and cache.v_cache[2] after the copy",
        torch.equal(cache.k_cache[2], k[2]) and torch.equal(cache.v_cache[2], v[2]),
        "unchanged: A's K/V",
        "changed",
        DIRECTION_HINT,
    )
    c.holds(
        "cache.k_cache[3] and cache.v_cache[3] after the copy",
        torch.equal(cache.k_cache[3], k[2]) and torch.equal(cache.v_cache[3], v[2]),
        "block 2's K and V",
        "something else",
        DATA_HINT,
    )
    others = [0, 1, 4, 5, 6, 7]
    c.holds(
        "the K/V of blocks 0, 1, 4, 5, 6 and 7 after the copy",
        torch.equal(cache.k_cache[others], k[others]) and torch.equal(cache.v_cache[others], v[others]),
        "unchanged",
        "changed",
        "copy one block: the shared block the token lands in, into the new block",
    )
    c.equal('append_token(cache, "A")', lambda: append_token(cache, "A"), None, IN_PLACE_HINT)
    c.equal(
        'cache.tables["A"].block_ids', lambda: list(cache.tables["A"].block_ids), [0, 1, 2], IN_PLACE_HINT
    )
    c.equal(
        "[cache.allocator.ref_count(b) for b in range(8)]",
        lambda: _refs(cache, 8),
        [2, 2, 1, 1, 0, 0, 0, 0],
        IN_PLACE_HINT,
    )

    cache = _new_cache(c, cache_class, 8)
    c.run('cache.allocate_for_sequence("P", 8)', lambda: cache.allocate_for_sequence("P", 8))
    _share(c, cache, "P", "Q")
    k, v = cache.k_cache.clone(), cache.v_cache.clone()
    full_hint = (
        "Q's 9th token starts a third block: take a fresh one at the boundary (2) and copy nothing. "
        + COPY_ONE_HINT
    )
    c.equal(
        'append_token(cache, "Q")  # P and Q share [0, 1], two full blocks',
        lambda: append_token(cache, "Q"),
        2,
        full_hint,
    )
    c.equal('cache.tables["Q"].block_ids', lambda: list(cache.tables["Q"].block_ids), [0, 1, 2], full_hint)
    c.equal(
        "[cache.allocator.ref_count(b) for b in range(8)]",
        lambda: _refs(cache, 8),
        [2, 2, 1, 0, 0, 0, 0, 0],
        full_hint,
    )
    c.holds(
        "cache.k_cache and cache.v_cache after Q's 9th token",
        torch.equal(cache.k_cache, k) and torch.equal(cache.v_cache, v),
        "unchanged",
        "changed",
        full_hint,
    )

    cache = _new_cache(c, cache_class, 3)
    c.run('cache.allocate_for_sequence("A", 10)', lambda: cache.allocate_for_sequence("A", 10))
    _share(c, cache, "A", "B")
    out_hint = (
        "the copy needs a free block and none is free: raise OutOfBlocksError before changing anything "
        "(no reference dropped, no table changed, no token counted)"
    )
    _fails_cleanly(
        c,
        cache,
        3,
        'append_token(cache, "B")  # no block free',
        lambda: append_token(cache, "B"),
        OutOfBlocksError,
        out_hint,
    )
    cache = _new_cache(c, cache_class, 3)
    c.run('cache.allocate_for_sequence("A", 12)', lambda: cache.allocate_for_sequence("A", 12))
    _fails_cleanly(
        c,
        cache,
        3,
        'append_token(cache, "A")  # 3 full blocks, no block free',
        lambda: append_token(cache, "A"),
        OutOfBlocksError,
        "token 13 needs a fresh block and none is free: raise OutOfBlocksError, change nothing",
    )
    _fails_cleanly(
        c,
        cache,
        3,
        'append_token(cache, "ghost")',
        lambda: append_token(cache, "ghost"),
        KeyError,
        "an unknown sequence: cache.tables[seq_id] raises KeyError",
    )

    _against_the_package(c, cache_class, append_token)


def _against_the_package(c: Checker, cache_class, append_token) -> None:
    """Seeded forks, appends and frees on the learner's cache and on the package's, compared step by step."""
    rng = random.Random(7)
    cache = _new_cache(c, cache_class, 24)
    twin = PagedKVCacheAllocator(24, BLOCK, NUM_HEADS, HEAD_DIM, device=default_device())
    twin.k_cache.copy_(cache.k_cache)
    twin.v_cache.copy_(cache.v_cache)
    calls = ["cache.allocate_for_sequence(0, 6)"]
    c.run(calls[-1], lambda: cache.allocate_for_sequence(0, 6))
    twin.allocate_for_sequence(0, 6)
    next_id = 1
    for _ in range(60):
        live = list(twin.seq_ids)
        roll = rng.random()
        if roll < 0.15 and len(live) < 5:
            parent = rng.choice(live)
            calls.append(f"fork {parent} into {next_id} by hand")
            _share(c, cache, parent, next_id)
            twin.fork(parent, next_id)
            next_id += 1
        elif roll < 0.22 and len(live) > 1:
            seq = rng.choice(live)
            calls.append(f"cache.free_sequence({seq})")
            c.run(calls[-1], lambda seq=seq: cache.free_sequence(seq))
            twin.free_sequence(seq)
        else:
            seq = rng.choice(live)
            if twin.needs_new_block(seq) and not twin.num_free_blocks:
                continue
            calls.append(f"append_token(cache, {seq})")
            taken = twin.append_tokens(seq, 1)
            expected = taken[0] if taken else None
            c.equal(
                "; ".join(calls[-4:]),
                lambda seq=seq: append_token(cache, seq),
                expected,
                "the package's append_tokens took " + (f"block {expected}" if taken else "no block"),
            )
        tables = {seq: (twin.get_block_mapping(seq), twin.sequence_length(seq)) for seq in twin.seq_ids}
        refs = tuple(twin.ref_count(b) for b in range(24))
        got = _state(cache, 24)
        c.holds(
            f"the tables, ref counts and free list after {len(calls)} calls (the last: {calls[-1]})",
            got == (tables, refs, twin.snapshot().free_block_ids),
            str((tables, refs, twin.snapshot().free_block_ids)),
            got,
            "a seeded run of forks, appends and frees must leave your cache as the package's: "
            + COPY_ONE_HINT,
        )
        for seq in twin.seq_ids:
            expected_k, expected_v = twin.read_kv(seq)
            got_k, got_v = _read(cache, seq)
            c.holds(
                f"the K/V of sequence {seq} after {len(calls)} calls (the last: {calls[-1]})",
                torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v),
                "the package's",
                "different K/V",
                DATA_HINT,
            )


def _read(cache, seq: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V a sequence's table reads from the learner's pools, as ``(tokens, heads, head_dim)``."""
    table = cache.tables[seq]
    index = torch.tensor(table.block_ids, dtype=torch.long, device=cache.k_cache.device)

    def gather(pool: torch.Tensor) -> torch.Tensor:
        blocks = pool[index].transpose(1, 2)  # (blocks, block_size, heads, head_dim)
        return blocks.reshape(-1, NUM_HEADS, HEAD_DIM)[: table.num_tokens]

    return gather(cache.k_cache), gather(cache.v_cache)


# ------------------------------------------------------------------------------- Task 3

FULL_ONLY_HINT = (
    "hash full blocks only: a partly full last block is still being written and is not shared while "
    "it fills, so "
    "[1, 2, 3] in blocks of 4 has no hash"
)
CHAIN_HINT = (
    "chain the hashes: h_0 = block_hash(ROOT_HASH, tokens of block 0), h_i = block_hash(h_{i-1}, "
    "tokens of block i); hashing a block without its parent gives two equal blocks after different "
    "prefixes the same hash, though their K/V differ"
)
TUPLE_HINT = "hash each block's tokens as a tuple: block_hash(parent_hash, tuple(block_tokens))"
LAST_TOKEN_HINT = (
    "at most len(token_ids) - 1 tokens come from the cache: the model must still compute the last "
    "prompt token to sample the first new one, so a prompt of exactly 3 cached full blocks reuses 2 "
    "(at most (len(token_ids) - 1) // block_size blocks)"
)
FIRST_MISS_HINT = (
    "the first miss ends the run: a block's K/V depend on every block before it, so a cached block is "
    "only useful after its whole prefix"
)
VERIFY_HINT = (
    "compare the stored token ids with the prompt's block: a hash is only a hint, and two different "
    "blocks can hash alike; trusting the hash alone would share another prompt's K/V"
)


def _entries(token_ids: list[int], first_block: int) -> dict[int, tuple[tuple[int, ...], int]]:
    """The exercise's cache entries for the full blocks of a prompt stored in blocks ``first_block, ...``."""
    blocks = full_blocks(token_ids, BLOCK)
    return {
        h: (tokens, first_block + i)
        for i, (tokens, h) in enumerate(zip(blocks, chain_hashes(blocks), strict=True))
    }


@task(
    "08.prefix_lookup",
    "chained block hashes and the cached prefix of a prompt",
    needs=("block_hashes", "cached_prefix"),
)
def _prefix_lookup(c: Checker, block_hashes, cached_prefix) -> None:
    c.equal("block_hashes([], 4)", lambda: list(block_hashes([], 4)), [], "an empty prompt has no block")
    c.equal("block_hashes([1, 2, 3], 4)", lambda: list(block_hashes([1, 2, 3], 4)), [], FULL_ONLY_HINT)
    one = block_hash(ROOT_HASH, (1, 2, 3, 4))
    c.equal(
        "block_hashes([1, 2, 3, 4], 4)",
        lambda: list(block_hashes([1, 2, 3, 4], 4)),
        [one],
        "the first block's parent is ROOT_HASH: [block_hash(ROOT_HASH, (1, 2, 3, 4))]. " + TUPLE_HINT,
    )
    prompt = [1, 2, 3, 4, 9, 9, 9, 9, 7]
    c.equal(
        f"block_hashes({prompt}, 4)",
        lambda: list(block_hashes(prompt, 4)),
        [one, block_hash(one, (9, 9, 9, 9))],
        CHAIN_HINT + "; the last token, 7, is in no full block",
    )
    call = "block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)[1] != block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)[1]"
    differ = c.run(
        call,
        lambda: (
            list(block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4))[1]
            != list(block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4))[1]
        ),
    )
    c.holds(
        call,
        differ,
        "different hashes: the same tokens after different prefixes",
        "the same hash",
        CHAIN_HINT,
    )
    rng = random.Random(3)
    for block_size in (1, 2, 4, 16):
        for length in (0, block_size - 1, block_size, 3 * block_size + 1, 50):
            tokens = [rng.randrange(50) for _ in range(length)]
            c.equal(
                f"block_hashes({tokens}, {block_size})",
                lambda tokens=tokens, block_size=block_size: list(block_hashes(tokens, block_size)),
                chain_hashes(full_blocks(tokens, block_size)),
                CHAIN_HINT,
            )

    r0 = list(range(100, 115))
    cache = _entries(r0, 0)
    c.equal(
        "cached_prefix(r0, 4, {})  # r0 = [100, ..., 114]",
        lambda: list(cached_prefix(r0, 4, {})),
        [],
        "an empty cache holds nothing",
    )
    c.equal(
        "cached_prefix(r0, 4, cache)  # cache: r0's 3 full blocks in blocks 0, 1, 2",
        lambda: list(cached_prefix(r0, 4, cache)),
        [0, 1, 2],
        "r0's 3 full blocks are all cached: return their block ids, in order",
    )
    r1 = [*r0[:10], 200, 201, 202, 203]
    c.equal(
        "cached_prefix([100, ..., 109, 200, 201, 202, 203], 4, cache)",
        lambda: list(cached_prefix(r1, 4, cache)),
        [0, 1],
        "the third block, (108, 109, 200, 201), matches r0's in 2 of 4 tokens only: its hash differs, a miss",
    )
    c.equal(
        "cached_prefix(r0[:12], 4, cache)",
        lambda: list(cached_prefix(r0[:12], 4, cache)),
        [0, 1],
        LAST_TOKEN_HINT,
    )
    c.equal(
        "cached_prefix(r0[:13], 4, cache)",
        lambda: list(cached_prefix(r0[:13], 4, cache)),
        [0, 1, 2],
        "13 tokens: 12 may come from the cache, and the 13th is computed. " + LAST_TOKEN_HINT,
    )
    c.equal(
        "cached_prefix(r0[:4], 4, cache)", lambda: list(cached_prefix(r0[:4], 4, cache)), [], LAST_TOKEN_HINT
    )
    c.equal(
        "cached_prefix(r0[:3], 4, cache)", lambda: list(cached_prefix(r0[:3], 4, cache)), [], FULL_ONLY_HINT
    )
    h0, h1, h2 = chain_hashes(full_blocks(r0, 4))
    holey = {h0: cache[h0], h2: cache[h2]}
    c.equal(
        "cached_prefix(r0, 4, cache without r0's second block)",
        lambda: list(cached_prefix(r0, 4, holey)),
        [0],
        FIRST_MISS_HINT,
    )
    forged = {**cache, h1: ((9, 9, 9, 9), 5)}
    c.equal(
        "cached_prefix(r0, 4, cache where r0's second hash names block 5 holding (9, 9, 9, 9))",
        lambda: list(cached_prefix(r0, 4, forged)),
        [0],
        VERIFY_HINT,
    )
    forged = {h0: ((7, 7, 7, 7), 6), h1: cache[h1], h2: cache[h2]}
    c.equal(
        "cached_prefix(r0, 4, cache where r0's first hash names block 6 holding (7, 7, 7, 7))",
        lambda: list(cached_prefix(r0, 4, forged)),
        [],
        VERIFY_HINT + "; " + FIRST_MISS_HINT,
    )
    _lookup_against_the_package(c, cached_prefix)


def _lookup_against_the_package(c: Checker, cached_prefix) -> None:
    """Seeded prompts sharing prefixes: the blocks the package's prefix cache reuses, prompt after prompt.

    The pool is large enough that no cached block is ever evicted, so the exercise's dict, grown
    from every block the package caches, is exactly the package's cache.
    """
    rng = random.Random(11)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    twin = PagedKVCacheAllocator(512, BLOCK, 1, 1, enable_prefix_caching=True)
    cache: dict[int, tuple[tuple[int, ...], int]] = {}
    for seq in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        twin.allocate_for_sequence(seq, len(prompt), prompt)
        reused = twin.get_block_mapping(seq)[: twin.num_cached_tokens(seq) // BLOCK]
        c.equal(
            f"cached_prefix({prompt}, 4, cache)  # prompt {seq} of a seeded run",
            lambda prompt=prompt: list(cached_prefix(prompt, 4, cache)),
            reused,
            "the package's prefix cache reuses these blocks for this prompt: " + LAST_TOKEN_HINT,
        )
        cached = twin.cached_blocks()
        blocks = full_blocks(prompt, BLOCK)
        mapping = twin.get_block_mapping(seq)
        for index, (tokens, h) in enumerate(zip(blocks, chain_hashes(blocks), strict=True)):
            if cached.get(mapping[index]) == tokens:
                cache.setdefault(h, (tokens, mapping[index]))
        if rng.random() < 0.3:
            twin.free_sequence(seq)

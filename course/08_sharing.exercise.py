# %% [markdown]
# # Exercise 08 · Sharing
#
# In this exercise you build the three mechanisms of lesson 08: `fork`, which lets a new sequence
# share every block of an existing one; copy-on-write, which gives a sequence its own copy of a
# shared block just before it writes into it; and the lookup of a prompt's cached prefix by chained
# block hash. Each task says what to build and how it is checked; the cell after it runs the check
# and prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished versions live in `paged_kv/kv/cache.py` (`fork`,
# `append_tokens`, `_copy_on_write`) and `paged_kv/core/prefix_cache.py`; try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/08_sharing.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from collections.abc import Hashable

import torch

import paged_kv
from paged_kv import BlockAllocator, BlockTable, OutOfBlocksError, blocks_for_tokens
from paged_kv.checks import check
from paged_kv.core.prefix_cache import ROOT_HASH, block_hash

device = paged_kv.default_device()

# %% [markdown]
# ## The cache you work on
#
# Tasks 1 and 2 work on `SharedCache`, a small paged KV cache written for you. Its state is what
# lessons 02 and 03 built:
#
# * `allocator`, the package's `BlockAllocator`: `allocate()` takes the head of the free list with
#   ref count 1 (or raises `OutOfBlocksError`), `add_ref(b)` adds a holder to a block in use, `free(b)`
#   drops one and returns `True` when the block went back to the free list, `ref_count(b)`,
#   `can_allocate(n)`, `num_free_blocks` and `free_block_ids`;
# * `tables`, a dict from sequence id to its `BlockTable` (`block_ids` and `num_tokens`);
# * `k_cache` and `v_cache`, the K/V pools, of shape `(num_blocks, num_heads, block_size, head_dim)`:
#   `k_cache[b]` is all of block `b`.
#
# `allocate_for_sequence` and `free_sequence` are written: `free_sequence` drops one reference to
# each block of the sequence, so a block that another sequence shares stays in use.


# %%
class SharedCache:
    """A small paged KV cache whose sequences can share blocks: a BlockAllocator, block tables, K/V pools."""

    def __init__(self, num_blocks: int, block_size: int, num_heads: int = 1, head_dim: int = 1, device="cpu"):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[Hashable, BlockTable] = {}
        shape = (num_blocks, num_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, device=device)
        self.v_cache = torch.zeros(shape, device=device)

    def allocate_for_sequence(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its prompt, all or nothing, and return their ids."""
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = blocks_for_tokens(num_tokens, self.block_size)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed, self.allocator.num_free_blocks)
        block_ids = [self.allocator.allocate() for _ in range(needed)]
        self.tables[seq_id] = BlockTable(block_ids, num_tokens)
        return list(block_ids)

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Drop the sequence and one reference to each of its blocks; return those back on the free list."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return []
        return [block_id for block_id in table.block_ids if self.allocator.free(block_id)]


# %% [markdown]
# ## Task 1 · Fork
#
# Write `fork(cache, parent_id, child_id)`: start the sequence `child_id` as a copy of `parent_id`
# that shares all of its blocks, as a parallel sample or a beam does.
#
# * The child gets a **copy** of the parent's table: the same block ids in the same order and the
#   same `num_tokens`, in a new `BlockTable` (`table.copy()`), never the parent's own object.
# * Each of those blocks gains one reference (`cache.allocator.add_ref`): a block's ref count is the
#   number of tables that hold it.
# * Nothing else changes: no block is taken from the free list and no K/V moves. Copying waits until
#   a sequence writes into a shared block (task 2).
# * Return the child's block ids, as a new list.
#
# Errors, raised before anything changes: a `KeyError` when `parent_id` is not allocated, a
# `ValueError` when `child_id` is (the parent itself included).
#
# **Checked:** in a pool of 8 blocks of 4, `A` holds 10 tokens in `[0, 1, 2]`; `fork(cache, "A",
# "B")` returns `[0, 1, 2]`, `B`'s table holds `[0, 1, 2]` and 10 tokens in its own `BlockTable`,
# the ref counts become `[2, 2, 2, 0, 0, 0, 0, 0]`, and the free list and the K/V pools do not
# change; changing the list `fork` returns does not change the table; a fork of the fork gives ref
# counts of 3; freeing `A`, then `B`, returns `[]` twice, and freeing the last one, `[0, 1, 2]`; an
# unknown parent, a child that exists and a child equal to its parent raise and change nothing; a
# fork of an empty sequence shares no block.


# %%
def fork(cache: SharedCache, parent_id: Hashable, child_id: Hashable) -> list[int]:
    """Start child_id sharing every block of parent_id; return the child's block ids."""
    ### BEGIN SOLUTION: look the parent up (KeyError) and refuse a live child_id (ValueError) first; then store a copy of the parent's table under child_id and add_ref each of its blocks
    parent = cache.tables[parent_id]
    if child_id in cache.tables:
        raise ValueError(f"child_id {child_id!r} is already allocated")
    for block_id in parent.block_ids:
        cache.allocator.add_ref(block_id)
    cache.tables[child_id] = parent.copy()
    return list(parent.block_ids)
    ### END SOLUTION


# %%
check("08.fork", SharedCache, fork)

# %% [markdown]
# ## Task 2 · Copy-on-write
#
# Write `append_token(cache, seq_id)`: grow the sequence by one token, with copy-on-write. The
# sequence holds `n = num_tokens` tokens; its new token goes to position `n`, in logical block
# `n // block_size`.
#
# * **Blocks full** (`n == len(block_ids) * block_size`): take a fresh block (`allocate()`) and
#   append it to the table, as in lesson 04. Return its id.
# * **The token lands in a shared block** (the block `block_ids[n // block_size]` has a ref count
#   above 1): the sequence must not write into it, since the other holders read it. Take a fresh
#   block, copy the **whole** shared block's K and V into it (`k_cache[new] = k_cache[old]`, and the
#   same for `v_cache`), put the new block in the shared block's place in this sequence's table
#   (and only this one), and drop this sequence's reference to the shared block
#   (`cache.allocator.free(old)`), which stays in use with its other holders. Return the new block's
#   id.
# * **Otherwise** the token lands in a block of its own: take nothing and return `None`.
#
# In every case `num_tokens` grows by one. Only the block the token lands in can be copied: full
# blocks take no new token, so they stay shared. Errors, raised before anything changes: a
# `KeyError` for an unknown sequence, and `OutOfBlocksError(needed=1, free=0)` when a block is
# needed and none is free.
#
# **Checked** (the checks share blocks by hand, with a copied table and `add_ref`, not with your
# `fork`): a sequence of 5 tokens in `[0, 1]` that shares nothing returns `None` three times, then
# `2`; `A` and `B` sharing `[0, 1, 2]` with 10 tokens: `append_token(cache, "B")` returns `3`, `B`
# holds `[0, 1, 3]` and 11 tokens, `A` still `[0, 1, 2]` and 10, the ref counts are `[2, 2, 1, 1,
# 0, 0, 0, 0]`, block 3 holds block 2's K and V, and block 2 and every other block are unchanged;
# then `A`'s next token returns `None`; a fork of two full blocks takes a fresh block and copies
# nothing; no free block and an unknown sequence raise and change nothing; and a seeded run of 60
# steps (forks, appends and frees) leaves your tables, ref counts, free list and K/V as the
# package's `PagedKVCacheAllocator` leaves its own.


# %%
def append_token(cache: SharedCache, seq_id: Hashable) -> int | None:
    """Grow the sequence by one token; return the block it took (fresh, or a copy of a shared one), else None."""
    ### BEGIN SOLUTION: find the block position n lands in; full blocks: allocate and append; a shared block (ref count > 1): allocate, copy its K and V, replace it in this table, free the old one; else None. Raise before changing anything
    table = cache.tables[seq_id]
    n = table.num_tokens
    if n == len(table.block_ids) * cache.block_size:
        new_block = cache.allocator.allocate()  # raises OutOfBlocksError before anything changes
        table.block_ids.append(new_block)
        table.num_tokens += 1
        return new_block
    logical = n // cache.block_size
    old_block = table.block_ids[logical]
    if cache.allocator.ref_count(old_block) == 1:
        table.num_tokens += 1
        return None
    new_block = cache.allocator.allocate()
    cache.k_cache[new_block] = cache.k_cache[old_block]
    cache.v_cache[new_block] = cache.v_cache[old_block]
    table.block_ids[logical] = new_block
    cache.allocator.free(old_block)  # it keeps its other holders
    table.num_tokens += 1
    return new_block
    ### END SOLUTION


# %%
check("08.copy_on_write", SharedCache, append_token)

# %% [markdown]
# ## Task 3 · Chained hashes and the cached prefix
#
# A prefix cache recognises a full block by a **chained hash** of its tokens and its parent's hash
# (lesson 08, section 3). `block_hash(parent_hash, token_ids)` from `paged_kv.core.prefix_cache` hashes one
# block (`token_ids` a tuple), and `ROOT_HASH` is the parent hash of a prompt's first block. Write:
#
# * `block_hashes(token_ids, block_size)`: the hash of each **full** block of the prompt, in order,
#   `h_0 = block_hash(ROOT_HASH, block_0)` and `h_i = block_hash(h_{i-1}, block_i)`, where `block_i`
#   is the tuple `tuple(token_ids[i * block_size : (i + 1) * block_size])`. A partly full last block
#   has no hash.
# * `cached_prefix(token_ids, block_size, cache)`: which cached blocks a new prompt reuses. `cache`
#   is a dict from a block hash to `(token_ids, block_id)`: the tokens a cached block holds (a tuple)
#   and the physical block that holds their K/V. Return the block ids of the longest run of the
#   prompt's **leading** full blocks found in the cache, in order. Block `i` is found when `cache`
#   has its hash **and** the stored tokens equal the prompt's block `i` (a hash is only a hint); the
#   first block not found ends the run. At most `len(token_ids) - 1` tokens may come from the cache,
#   so at most `(len(token_ids) - 1) // block_size` blocks: the model must still compute the last
#   prompt token.
#
# The package's cache also checks that each block found follows the very block found before it
# (lesson 08, section 3); this exercise leaves that out.
#
# **Checked:** `block_hashes` of an empty prompt, of `[1, 2, 3]` (no full block) and of `[1, 2, 3, 4]`
# in blocks of 4; `[1, 2, 3, 4, 9, 9, 9, 9, 7]` gives two chained hashes; the block `9 9 9 9` after
# `1 2 3 4` and after `5 6 7 8` hashes differently; random prompts in blocks of 1, 2, 4 and 16 against
# `paged_kv.core.prefix_cache.chain_hashes`. Then, with `r0` the 15 tokens `100 ... 114` cached in blocks
# 0, 1 and 2: `r0` reuses `[0, 1, 2]`; a prompt sharing its first 10 tokens reuses `[0, 1]`; `r0[:12]`
# reuses `[0, 1]` (the last-token rule), `r0[:13]` `[0, 1, 2]`, `r0[:4]` and `r0[:3]` nothing; a
# cache missing `r0`'s second block gives `[0]`; hashes that name blocks holding other tokens are
# misses; and 30 seeded prompts sharing prefixes reuse exactly the blocks the package's prefix cache
# reuses.


# %%
def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block of the prompt."""
    ### BEGIN SOLUTION: walk the full blocks only (len(token_ids) // block_size of them), hashing each tuple of tokens with the previous block's hash, ROOT_HASH for the first
    hashes = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = block_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes
    ### END SOLUTION


def cached_prefix(token_ids: list[int], block_size: int, cache: dict) -> list[int]:
    """The block ids of the longest cached run of the prompt's leading full blocks (at most len - 1 tokens)."""
    ### BEGIN SOLUTION: for each of the first (len(token_ids) - 1) // block_size hashes, look it up and compare the stored tokens with the block's; stop at the first miss
    hits = []
    limit = max(0, (len(token_ids) - 1) // block_size)
    for i, h in enumerate(block_hashes(token_ids, block_size)[:limit]):
        entry = cache.get(h)
        if entry is None or tuple(entry[0]) != tuple(token_ids[i * block_size : (i + 1) * block_size]):
            break
        hits.append(entry[1])
    return hits
    ### END SOLUTION


# %%
check("08.prefix_lookup", block_hashes, cached_prefix)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, this forks a 10-token sequence into two samples that each generate a
# few tokens, then looks up a prompt in a cache built from the first one. Which block does each
# sample copy, and which blocks stay shared? Try a prompt of exactly 8 tokens: how many does the
# cache serve?

# %%
torch.manual_seed(0)
cache = SharedCache(num_blocks=12, block_size=4, num_heads=2, head_dim=8, device=device)
cache.allocate_for_sequence("prompt", 10)
cache.k_cache.normal_()
cache.v_cache.normal_()
for sample in ("s1", "s2"):
    fork(cache, "prompt", sample)
for step in range(3):
    for sample in ("s1", "s2"):
        taken = append_token(cache, sample)
        print(f"step {step}: {sample} takes {taken}, table {cache.tables[sample].block_ids}")
print("ref counts:", [cache.allocator.ref_count(b) for b in range(12)])
print("free the prompt ->", cache.free_sequence("prompt"))

tokens = list(range(100, 110))
stored = {h: (tuple(tokens[i * 4 : (i + 1) * 4]), i) for i, h in enumerate(block_hashes(tokens, 4))}
for prompt in (tokens, tokens[:8], [*tokens[:6], 1, 2, 3, 4]):
    print(f"{len(prompt)}-token prompt reuses blocks {cached_prefix(prompt, 4, stored)}")

# %% [markdown]
# # Exercise 02 · The allocator
#
# In this exercise you build the allocator of lesson 02 in three layers. First `BlockAllocator`, the
# pool's bookkeeping: a FIFO free list and a ref count per block. Then `SequenceAllocator`, which
# gives each sequence a block table on top of your `BlockAllocator`: the bookkeeping half of
# `paged_kv.PagedKVCacheAllocator`. Last, `PagedKVCacheAllocator` itself: a `SequenceAllocator` that
# owns the memory, the `k_cache` and `v_cache` tensors, allocated once. Each task says what to build
# and how it is checked; the cell after it runs the check and prints a tick, or tells you which call
# gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished versions live in `paged_kv/core/block_allocator.py` and
# `paged_kv/kv/cache.py`; try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/02_the_allocator.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from collections import deque
from collections.abc import Hashable

import torch

import paged_kv
from paged_kv import BlockTable, OutOfBlocksError, blocks_for_tokens
from paged_kv.checks import check

device = paged_kv.default_device()

# %% [markdown]
# ## Task 1 · BlockAllocator
#
# Write `BlockAllocator(num_blocks)`, a pool of blocks `0` to `num_blocks - 1`:
#
# * the **free list** is a `deque` of the free ids, initially all of them in order;
#   `free_block_ids` returns it as a tuple, head first, and `num_free_blocks` its length;
# * `can_allocate(n)` says whether `n` blocks are free right now;
# * `allocate()` takes the id at the **head** of the free list, sets its ref count to 1 and returns
#   it; with no free block it raises `OutOfBlocksError(needed=1, free=0)`;
# * `add_ref(block_id)` adds a holder to a block in use and returns the new ref count;
# * `free(block_id)` drops one holder; when the ref count reaches 0 the block goes to the **tail** of
#   the free list and `free` returns `True`, otherwise it returns `False`;
# * `ref_count(block_id)` is the number of holders, 0 for a free block.
#
# Errors: `ValueError` for an id outside `0 .. num_blocks - 1` (a negative id too), for `free` of a
# block that is already free (a double free), and for `add_ref` of a free block. A call that raises
# changes nothing. `_check_id` is there to share the range check between the methods.
#
# **Checked:** a new pool of 5 (free list `(0, 1, 2, 3, 4)`, `can_allocate` of 0, 5 and 6); three
# allocations give `[0, 1, 2]`; freeing 0 then 2 puts them at the tail, so the next four
# allocations give `[3, 4, 0, 2]`; then `OutOfBlocksError` with `needed == 1` and `free == 0`; a
# block with two holders stays in use after one `free`; a double free and `add_ref` of a free block
# raise `ValueError` and change nothing; ids 3 and -1 in a pool of 3 raise `ValueError`.


# %%
class BlockAllocator:
    """A pool of num_blocks physical blocks with a FIFO free list and a ref count per block."""

    def __init__(self, num_blocks: int) -> None:
        ### BEGIN SOLUTION: keep num_blocks, the free list deque(range(num_blocks)) and a ref count per block, all 0
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        ### END SOLUTION

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        ### BEGIN SOLUTION: the length of the free list
        return len(self._free)
        ### END SOLUTION

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free list in order: the first id is the one allocate() returns next."""
        ### BEGIN SOLUTION: the free list as a tuple
        return tuple(self._free)
        ### END SOLUTION

    def can_allocate(self, n: int) -> bool:
        """Whether n blocks are free right now."""
        ### BEGIN SOLUTION: compare n with the number of free blocks
        return n <= len(self._free)
        ### END SOLUTION

    def allocate(self) -> int:
        """Take the block at the head of the free list, give it ref count 1 and return its id.

        Raises:
            OutOfBlocksError: no block is free (needed=1, free=0).
        """
        ### BEGIN SOLUTION: raise OutOfBlocksError(needed=1, free=0) when the free list is empty; else popleft()
        if not self._free:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id
        ### END SOLUTION

    def add_ref(self, block_id: int) -> int:
        """Record one more holder of a block in use and return its new ref count.

        Raises:
            ValueError: block_id is out of range, or the block is free.
        """
        ### BEGIN SOLUTION: check the id, refuse a free block, then add 1 to its ref count
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: there is no holder to share it with")
        self._ref_counts[block_id] += 1
        return self._ref_counts[block_id]
        ### END SOLUTION

    def free(self, block_id: int) -> bool:
        """Drop one holder; return True when the block went back to the tail of the free list.

        Raises:
            ValueError: block_id is out of range, or the block is already free (a double free).
        """
        ### BEGIN SOLUTION: check the id, refuse a block with ref count 0, subtract 1; when it reaches 0, append to the free list
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (a double free)")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)
            return True
        return False
        ### END SOLUTION

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has; 0 when it is free."""
        ### BEGIN SOLUTION: check the id, then return its ref count
        self._check_id(block_id)
        return self._ref_counts[block_id]
        ### END SOLUTION

    def _check_id(self, block_id: int) -> None:
        """Raise ValueError unless 0 <= block_id < num_blocks."""
        ### BEGIN SOLUTION: compare with 0 and num_blocks; a negative index would silently read from the end
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in 0 .. {self.num_blocks - 1}, got {block_id}")
        ### END SOLUTION


# %%
check("02.block_allocator", BlockAllocator)

# %% [markdown]
# ## Task 2 · SequenceAllocator
#
# Write `SequenceAllocator(num_blocks, block_size)`, which gives sequences block tables on top of your
# `BlockAllocator`. `__init__` is written: it creates `self.allocator`, a `BlockAllocator`, and
# `self.tables`, a dict from sequence id to `paged_kv.BlockTable`.
#
# * `allocate_for_sequence(seq_id, num_prompt_tokens)` takes `ceil(num_prompt_tokens / block_size)`
#   blocks (`blocks_for_tokens`), records a `BlockTable` for the sequence and returns the block ids.
#   It is **all or nothing**: a duplicate `seq_id` raises `ValueError`, too few free blocks raise
#   `OutOfBlocksError(needed, free)`, and a call that raises takes no block and records no table.
#   Check first, then take.
# * `free_sequence(seq_id)` drops the table, frees each of its blocks once, and returns the ids of
#   the blocks that went back to the free list, in table order. A block with another holder stays in
#   use and is not in the list. An unknown id is a no-op that returns `[]`: a request may be
#   cancelled before it was ever allocated.
# * `get_block_mapping(seq_id)` returns a copy of the sequence's block ids; an unknown id raises
#   `KeyError`.
#
# **Checked:** in a pool of 5 blocks of 16, `req-a` with 33 tokens gets `[0, 1, 2]` and `req-b` with
# 16 tokens gets `[3]`; allocating `req-a` again raises `ValueError` and changes nothing; `req-c` with
# 17 tokens raises `OutOfBlocksError` with `needed == 2` and `free == 1`, after which block 4 is still
# the only free block and `req-c` has no table; the mapping is a copy; freeing `req-a` returns
# `[0, 1, 2]` and puts them at the tail; freeing it again, or an id never seen, returns `[]`; `req-c`
# with 40 tokens then gets `[4, 0, 1]`; and when block 4 has a second holder, freeing `req-c`
# returns only `[0, 1]`.


# %%
class SequenceAllocator:
    """Block tables for many sequences on one BlockAllocator: a paged cache's bookkeeping, without tensors."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[Hashable, BlockTable] = {}

    def allocate_for_sequence(self, seq_id: Hashable, num_prompt_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its prompt and return their ids, all or nothing.

        Raises:
            ValueError: seq_id is already allocated.
            OutOfBlocksError: too few blocks are free.
        """
        ### BEGIN SOLUTION: refuse a known id, then check can_allocate(needed); only then take the blocks and record the table
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed=needed, free=self.allocator.num_free_blocks)
        block_ids = [self.allocator.allocate() for _ in range(needed)]
        self.tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)
        ### END SOLUTION

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Drop the sequence and free its blocks; return the ids that went back to the free list.

        An unknown seq_id is a no-op that returns [].
        """
        ### BEGIN SOLUTION: pop the table (None for an unknown id), free each block, keep those for which free() is True
        table = self.tables.pop(seq_id, None)
        if table is None:
            return []
        return [block_id for block_id in table.block_ids if self.allocator.free(block_id)]
        ### END SOLUTION

    def get_block_mapping(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's physical block ids, logical block 0 first.

        Raises:
            KeyError: seq_id is not allocated.
        """
        ### BEGIN SOLUTION: look the table up in self.tables (an unknown id raises KeyError) and copy its block_ids
        return list(self.tables[seq_id].block_ids)
        ### END SOLUTION


# %%
check("02.sequence_allocator", SequenceAllocator)

# %% [markdown]
# ## Task 3 · The cache's memory, allocated once
#
# Write `PagedKVCacheAllocator(num_blocks, block_size, num_heads, head_dim, dtype, device)`, a
# `SequenceAllocator` that also owns the KV cache. Its `__init__`:
#
# * calls `super().__init__(num_blocks, block_size)`, which sets up the free list (`self.allocator`)
#   and the block tables (`self.tables`);
# * **preallocates** the physical cache, once, as two tensors `self.k_cache` and `self.v_cache` of
#   shape `(num_blocks, num_heads, block_size, head_dim)`, with the given `dtype` and `device`
#   (`torch.zeros(shape, dtype=dtype, device=device)`): block first, then its heads, then the token's
#   offset in the block, then the dimensions of a head.
#
# That is all the memory the cache will ever use. Allocating and freeing sequences (the methods it
# inherits) only moves block ids between the free list and the tables; token `p` of a sequence will
# live in `k_cache[block_ids[p // block_size], :, p % block_size, :]`, which lesson 03 fills in.
#
# **Checked:** a cache of 6 blocks of 4 tokens, 3 heads of dimension 5, in float16: the shape of both
# tensors, `(6, 3, 4, 5)`, and their dtype; that K and V are two tensors, not one; a free list of all
# six blocks and no tables; a cache on the `meta` device (a device with no memory, which shows where
# the tensors were made); and that allocating and freeing sequences keeps the very tensors (and the K
# written into them) that `__init__` made.


# %%
class PagedKVCacheAllocator(SequenceAllocator):
    """A SequenceAllocator that owns the KV cache: k_cache and v_cache, preallocated once."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        ### BEGIN SOLUTION: super().__init__(num_blocks, block_size), then k_cache and v_cache: two torch.zeros of shape (num_blocks, num_heads, block_size, head_dim) with dtype and device
        super().__init__(num_blocks, block_size)
        shape = (num_blocks, num_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        ### END SOLUTION


# %%
check("02.kv_cache", PagedKVCacheAllocator)

# %% [markdown]
# ## Putting it together
#
# With the three tasks done, this replays the lesson's trace on your classes: `req-a` in a pool of 5,
# then `req-b`, then `req-a` finishes and `req-c` gets scattered blocks, all in a cache of the size the
# lesson uses. Try running the pool dry: is the free list the same before and after the refused
# call? And how much memory did the cache take, and when?

# %%
seqs = PagedKVCacheAllocator(5, 16, num_heads=8, head_dim=64, dtype=torch.float16, device=device)
cache_bytes = 2 * seqs.k_cache.numel() * seqs.k_cache.element_size()
print("k_cache and v_cache:", tuple(seqs.k_cache.shape), "each,", cache_bytes // 1024, "KiB in all")
print("req-a:", seqs.allocate_for_sequence("req-a", 33), "free list", seqs.allocator.free_block_ids)
print("req-b:", seqs.allocate_for_sequence("req-b", 16), "free list", seqs.allocator.free_block_ids)
print("freed:", seqs.free_sequence("req-a"), "free list", seqs.allocator.free_block_ids)
print("req-c:", seqs.allocate_for_sequence("req-c", 40), "free list", seqs.allocator.free_block_ids)
try:
    seqs.allocate_for_sequence("req-d", 40)
except OutOfBlocksError as error:
    print("OutOfBlocksError:", error)
print("free list after the refused call:", seqs.allocator.free_block_ids)

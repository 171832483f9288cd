# %% [markdown]
# # Exercise 01 · Block and BlockTable
#
# In this exercise you write the two data structures of lesson 01: `Block`, the handle to one
# physical block, and `BlockTable`, a sequence's page table. Then you use a table to answer the
# question every later lesson asks: which physical block holds token position `p`? Each task says
# what to build and how it is checked; the cell after it runs the check and prints a tick, or tells
# you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished versions are `paged_kv.Block` and `paged_kv.BlockTable`;
# try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/01_block_and_block_table.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from dataclasses import dataclass

from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · Block
#
# Write `Block` as a dataclass with two fields, in this order:
#
# * `block_id: int`, the block's index along dimension 0 of `k_cache` and `v_cache`;
# * `ref_count: int`, how many block tables hold the block, 0 by default (a new block is free).
#
# The allocator of lesson 02 changes `ref_count` in place, so the dataclass must not be frozen.
# Until you write the fields, running the cell raises `NotImplementedError`.
#
# **Checked:** `Block(3)` has `block_id == 3` and `ref_count == 0`; `Block(3, 2)` and keyword
# arguments set both fields; `Block` is a dataclass, so `Block(3) == Block(3)` and
# `Block(3) != Block(3, 1)`; and `ref_count` can be increased.


# %%
@dataclass
class Block:
    """A handle to one physical block of the KV cache."""

    ### BEGIN SOLUTION: declare the two fields: block_id: int, then ref_count: int = 0
    block_id: int
    ref_count: int = 0
    ### END SOLUTION


# %%
check("01.block", Block)

# %% [markdown]
# ## Task 2 · BlockTable
#
# Write `BlockTable`, a sequence's page table: logical block `i` lives in physical block
# `block_ids[i]`.
#
# * `BlockTable(block_ids=None, num_tokens=0)` stores `block_ids` (a new, empty list when it is
#   `None`) and `num_tokens`. Why not `block_ids=[]`? Python creates a default value once, when the
#   `def` runs, so every table made without `block_ids` would share that one list (lesson 01,
#   section 6).
# * `append_block(block_id)` adds a physical block at the end of the table (the next logical block);
#   it does not change `num_tokens`.
# * `num_blocks` (a property) is the number of blocks the table holds.
# * `capacity(block_size)` is how many tokens those blocks hold.
# * `copy()` returns a new `BlockTable` with the same blocks and tokens that shares nothing with this
#   one: appending to the copy leaves the original as it was.
#
# **Checked:** req-a's table, `BlockTable(block_ids=[0, 1, 2], num_tokens=33)`, has 3 blocks and a
# capacity of 48 in blocks of 16; `BlockTable()` is empty; two new tables do not share a list;
# `append_block` appends in order; the capacity of an empty table, of one full block, of a table whose
# last block is still empty, and with blocks of 1; and that a copy has the same blocks and tokens but
# shares no list with the original.


# %%
class BlockTable:
    """A sequence's page table: logical block i lives in physical block block_ids[i]."""

    def __init__(self, block_ids: list[int] | None = None, num_tokens: int = 0) -> None:
        ### BEGIN SOLUTION: store self.block_ids (a new [] when block_ids is None) and self.num_tokens
        self.block_ids = [] if block_ids is None else block_ids
        self.num_tokens = num_tokens
        ### END SOLUTION

    def append_block(self, block_id: int) -> None:
        """Add a physical block at the end of the table (the next logical block)."""
        ### BEGIN SOLUTION: append block_id to self.block_ids
        self.block_ids.append(block_id)
        ### END SOLUTION

    @property
    def num_blocks(self) -> int:
        """How many blocks the table holds."""
        ### BEGIN SOLUTION: the length of self.block_ids
        return len(self.block_ids)
        ### END SOLUTION

    def capacity(self, block_size: int) -> int:
        """How many tokens fit in the blocks the table holds."""
        ### BEGIN SOLUTION: every block the table holds has block_size slots
        return len(self.block_ids) * block_size
        ### END SOLUTION

    def copy(self) -> "BlockTable":
        """An independent copy: changing it never changes this table."""
        ### BEGIN SOLUTION: a new BlockTable around a new list, list(self.block_ids)
        return BlockTable(list(self.block_ids), self.num_tokens)
        ### END SOLUTION

    def __repr__(self) -> str:
        return f"BlockTable(block_ids={self.block_ids}, num_tokens={self.num_tokens})"


# %%
check("01.block_table", BlockTable)

# %% [markdown]
# ## Task 3 · Which physical block holds a position?
#
# Write `physical_block(table, position, block_size)`: the id of the physical block that holds token
# `position` of the sequence that `table` describes. Two steps, as in a page table: the logical block
# is `position // block_size`, and the table maps it to a physical block. (Lesson 03 adds the offset
# inside the block and does it for tensors of positions.)
#
# The table holds positions `0` to `table.num_tokens - 1`. For any other position, raise
# `ValueError`: a position past the last token, even one that has a slot in the last block, and a
# negative position, which Python would otherwise read from the end of the list.
#
# **Checked:** positions 0 and 32 of req-a (`[0, 1, 2]`, 33 tokens); positions 0, 15, 16, 31, 32 and
# 39 of a scattered table `[7, 2, 5]` holding 40 tokens; a block size of 4; that the result is an
# `int`; and `ValueError` for positions 40, 48 and -1 of the scattered table. The check builds its
# tables with `paged_kv.BlockTable`, so this task does not depend on task 2.


# %%
def physical_block(table: BlockTable, position: int, block_size: int) -> int:
    """The physical block that holds token `position` of the sequence `table` describes."""
    ### BEGIN SOLUTION: raise ValueError unless 0 <= position < table.num_tokens, then return table.block_ids[position // block_size]
    if not 0 <= position < table.num_tokens:
        raise ValueError(
            f"position {position} is outside the table: it holds positions 0 to {table.num_tokens - 1}"
        )
    return table.block_ids[position // block_size]
    ### END SOLUTION


# %%
check("01.physical_block", physical_block)

# %% [markdown]
# ## Putting it together
#
# With the three tasks done, this builds req-a's table, lets it grow past its third block, and
# follows a few positions to their physical blocks. Try other tables: what happens at position 48
# before and after the fourth block arrives?

# %%
req_a = BlockTable(block_ids=[0, 1, 2], num_tokens=33)
print(req_a, "capacity", req_a.capacity(16))
grown = req_a.copy()
grown.append_block(7)
grown.num_tokens = 49
print(grown, "capacity", grown.capacity(16))
for position in (0, 16, 32, 48):
    print(f"position {position:>2} -> physical block {physical_block(grown, position, 16)}")
print("req_a is unchanged:", req_a)

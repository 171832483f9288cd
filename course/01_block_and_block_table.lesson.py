# %% [markdown]
# # Lesson 01 · Block and BlockTable
#
# Lesson 00 showed that a KV cache cut into fixed-size blocks wastes less than one block per request.
# Paging rests on two data structures: a **block**, which names one physical block of the cache
# tensors, and a **block table**, one per sequence, which lists the physical blocks holding that
# sequence's tokens in order. Everything the rest of the course builds (the allocator, the address
# translation, the attention kernel, sharing between sequences) reads or changes these two, so this
# lesson takes them apart first.
#
# **By the end of this lesson you can**
#
# 1. explain what a `Block` stands for and what its `ref_count` counts;
# 2. build a `BlockTable` and find the physical block that holds a token position, the way a page
#    table maps a virtual page to a physical frame;
# 3. compute a table's capacity, `num_blocks * block_size`, and the empty tail of its last block
#    (15 slots for a 33-token request in blocks of 16);
# 4. show why the blocks of one sequence end up scattered across the pool, and why the look-up does
#    not care;
# 5. explain why two block tables must never share one list, and make a copy that is independent.

# %%
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import Block, BlockTable, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.pictures.plots import plot_block_tables

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. A block is an index into the cache tensors
#
# The cache is two tensors allocated once, `k_cache` and `v_cache`, of shape
# `(num_blocks, num_heads, block_size, head_dim)`. Dimension 0 numbers the **physical blocks**, so
# physical block `b` is simply the slice `k_cache[b]` (and `v_cache[b]`): room for the keys and values
# of `block_size` tokens, for every head. Here is a small cache of 12 blocks of 16 token slots:

# %%
cache = PagedKVCacheAllocator(num_blocks=12, block_size=16, num_heads=2, head_dim=8, device=device)
print("k_cache:   ", tuple(cache.k_cache.shape), "= (num_blocks, num_heads, block_size, head_dim)")
print("k_cache[5]:", tuple(cache.k_cache[5].shape), "= (num_heads, block_size, head_dim)")

# %% [markdown]
# The bookkeeping never moves that data around; it passes the integer `b`. A `Block` is a handle to one
# physical block: its `block_id` (the index along dimension 0) and a `ref_count`, the number of block
# tables that hold it.
#
# * `ref_count == 0`: no sequence holds the block; it is free.
# * `ref_count == 1`: one sequence owns it.
# * `ref_count > 1`: several sequences share it (a forked sequence, or a common prompt prefix; lesson 08).
#
# A new block starts free. It holds no tensor and no sequence id: only what the allocator of lesson 02
# needs to decide whether the block can be handed out.

# %%
block = Block(5)
print(block)
print("free:", block.ref_count == 0)

# %% [markdown]
# ## 2. A block table lists a sequence's blocks in order
#
# A sequence's tokens are numbered by **position**, 0, 1, 2 and so on. Cut those positions into runs of
# `block_size`: with blocks of 16, **logical block** 0 holds positions 0 to 15, logical block 1 holds
# 16 to 31, and so on. The block table says where each logical block lives:
#
# $$\text{logical block } i \;\longrightarrow\; \text{physical block } \texttt{block\_ids}[i]$$
#
# It also records `num_tokens`, how many tokens the sequence holds. The running example of the course
# is a request `req-a` with a 33-token prompt. In blocks of 16 it needs `ceil(33 / 16) = 3` blocks, and
# in an empty pool the allocator hands it blocks 0, 1 and 2:

# %%
req_a = BlockTable(block_ids=[0, 1, 2], num_tokens=33)
print(req_a)
print("num_blocks:", req_a.num_blocks)
for logical, physical in enumerate(req_a.block_ids):
    first = logical * 16
    last = min(first + 16, req_a.num_tokens) - 1
    print(f"logical block {logical} (positions {first:>2} to {last:>2}) -> physical block {physical}")

# %% [markdown]
# The last block holds a single token, position 32. While a sequence lives, its table only grows at the
# end: when the sequence needs another block, the allocator picks a free one and `append_block` adds
# it as the next logical block. Suppose `req-a` has grown to 48 tokens, filling its three blocks, and
# the allocator gives it physical block 7 for its 49th token:

# %%
grown = BlockTable(block_ids=[0, 1, 2], num_tokens=48)
grown.append_block(7)
grown.num_tokens = 49
print(grown)
print("logical block 3 -> physical block", grown.block_ids[3])

# %% [markdown]
# ## 3. A block table is a page table
#
# Operating systems solved this problem for process memory. A process sees one contiguous range of
# **virtual addresses**, cut into fixed-size **pages** (often 4 KiB). Physical memory is cut into
# **frames** of the same size, and the process's **page table** says which frame holds each page. To
# read an address, the hardware splits it into a page number, `address // page_size`, and an offset
# inside the page, `address % page_size`; it looks the page number up in the page table and keeps the
# offset. A paged KV cache is the same design with tokens in place of bytes:
#
# | operating system | paged KV cache |
# |---|---|
# | process | sequence (a request) |
# | virtual address | token position |
# | page, page size | logical block, `block_size` tokens |
# | physical frame | physical block, a slice `k_cache[b]` |
# | page table | block table |
# | free frame list | free block list (lesson 02) |
#
# So the physical block that holds position `p` is `block_ids[p // block_size]`. Lesson 03 adds the
# offset inside the block, `p % block_size`, and translates whole tensors of positions at once; here
# the block alone is enough.
#
# **Predict, then run.** A sequence holds 40 tokens in the table `[7, 2, 5]`, with blocks of 16. Which
# physical block holds position 0? Position 15? 16? 32? 39?


# %%
def physical_block(table: BlockTable, position: int, block_size: int) -> int:
    """The physical block that holds token `position` of the sequence `table` describes."""
    if not 0 <= position < table.num_tokens:
        raise ValueError(
            f"position {position} is outside the table: it holds positions 0 to {table.num_tokens - 1}"
        )
    return table.block_ids[position // block_size]


table = BlockTable(block_ids=[7, 2, 5], num_tokens=40)
for position in (0, 15, 16, 32, 39):
    block_id = physical_block(table, position, 16)
    print(f"position {position:>2} -> logical block {position // 16} -> physical block {block_id}")

# %% [markdown]
# Positions 0 to 15 share physical block 7, position 16 is the first token of logical block 1, and so
# on. The range check at the top of `physical_block` matters. Position 40 has a slot (the last block
# has room up to position 47) but holds no token yet. And without the check, a negative position would
# not fail at all: Python reads `block_ids[-1]` as the *last* entry of the list.

# %%
for position in (40, -1):
    try:
        physical_block(table, position, 16)
    except ValueError as error:
        print("ValueError:", error)
print("without the check, position -1 would read physical block", table.block_ids[-1 // 16])

# %% [markdown]
# ## 4. Capacity and the empty tail
#
# A table with `num_blocks` blocks has room for `num_blocks * block_size` tokens: its **capacity**. The
# allocator keeps `num_tokens <= capacity` at all times, so every token has a slot. The difference,
# `capacity - num_tokens`, is the empty tail of the last block. It is the only memory paging wastes,
# always fewer than `block_size` slots per sequence (lesson 00).
#
# **Predict, then run.** `req-a` holds 33 tokens in 3 blocks of 16. How many more tokens can it take
# before it needs a fourth block?

# %%
print("capacity:  ", req_a.capacity(16))
print("empty tail:", req_a.capacity(16) - req_a.num_tokens)
for num_tokens in (33, 47, 48, 49):
    print(f"{num_tokens} tokens need {blocks_for_tokens(num_tokens, 16)} blocks")

# %% [markdown]
# Fifteen: up to 48 tokens the three blocks suffice, and the 49th token needs a new block. A sequence
# therefore asks the allocator for a block only once every 16 tokens; lesson 04 builds on that rule.

# %% [markdown]
# ## 5. Why a sequence's blocks end up scattered
#
# Requests arrive and finish in any order. When one finishes, its blocks go back to the free list, and
# the next request takes whichever blocks are free, wherever they are. Watch it happen in the cache of
# section 1: four requests take the blocks in order, then `A` and `C` finish.

# %%
for seq_id, num_tokens in [("A", 33), ("B", 20), ("C", 40), ("D", 17)]:
    print(seq_id, cache.allocate_for_sequence(seq_id, num_tokens))
cache.free_sequence("A")
cache.free_sequence("C")
free = list(cache.snapshot().free_block_ids)
print("A and C finished; free blocks:", free)

# %% [markdown]
# Eight blocks are free, but in three separate runs of neighbours: 10 and 11, then 0 to 2, then 5 to 7.


# %%
def longest_run(block_ids: list[int]) -> int:
    """The length of the longest run of consecutive ids in `block_ids`."""
    longest, run, previous = 0, 0, None
    for block_id in sorted(block_ids):
        run = run + 1 if block_id - 1 == previous else 1  # continue the run, or start a new one
        longest = max(longest, run)
        previous = block_id
    return longest


print("free blocks:", len(free), "- longest run of neighbours:", longest_run(free))

# %% [markdown]
# **Predict, then run.** Request `E` arrives with 90 tokens, so it needs 6 blocks. A contiguous layout
# would need 6 neighbouring blocks and refuse it: the longest run is 3, although 8 blocks are free
# (external fragmentation, lesson 00). A paged cache takes any 6 free blocks. Which ones does `E` get?

# %%
print("E", cache.allocate_for_sequence("E", 90))
print("ref counts:", list(cache.snapshot().ref_counts))

# %% [markdown]
# `E` gets `[10, 11, 0, 1, 2, 5]`: first the blocks that were never used, then the ones `A` and `C`
# returned, in the order they came back (lesson 02 explains the order). The ref counts show the
# `Block.ref_count` rule at work: 1 for each block some table holds, 0 for the two free blocks, 6 and 7.
#
# The picture draws the physical pool on top, blocks 0 to 11, and the block tables underneath: each
# sequence's logical blocks from left to right, filled up to the tokens it holds (the empty tail
# hatched), each marked with the physical block it names. Every arrow is one entry of a block table.

# %%
plot_block_tables(cache.snapshot(), title="block tables as arrows into the pool")
plt.show()

# %% [markdown]
# Nothing in the look-up cares whether the blocks are neighbours. Position 40 of `E` lies in logical
# block `40 // 16 = 2`, which is physical block 0; the package's own translation,
# `physical_location` (lesson 03), returns that block and the offset inside it.

# %%
table_e = cache.get_block_table("E")
print(table_e)
print("physical_block(E, 40):     ", physical_block(table_e, 40, 16))
print("cache.physical_location(E, 40):", cache.physical_location("E", 40))

# %% [markdown]
# ## 6. Each table owns its list
#
# Block tables change in place: `append_block` grows the list. If two tables shared one Python list,
# appending a block to one would append it to the other, and the second sequence would read K/V that
# belongs to the first. Two ordinary Python habits produce exactly that.
#
# **A mutable default argument.** Python evaluates a default value once, when the `def` runs, so a
# default of `[]` is a single list that every call without the argument receives:


# %%
class NaiveTable:
    def __init__(self, block_ids=[], num_tokens=0):  # noqa: B006 - the bug on purpose
        self.block_ids = block_ids
        self.num_tokens = num_tokens


first, second = NaiveTable(), NaiveTable()
first.block_ids.append(7)
print("second table's blocks:", second.block_ids)
print("one list for both:    ", first.block_ids is second.block_ids)

# %% [markdown]
# `BlockTable` is a dataclass whose field is declared `block_ids: list[int] = field(default_factory=list)`:
# the factory runs for every new table. A dataclass refuses a plain `= []` default outright, with a
# `ValueError` that points to `default_factory`:

# %%
first, second = BlockTable(), BlockTable()
first.append_block(7)
print("second table's blocks:", second.block_ids)
print("one list for both:    ", first.block_ids is second.block_ids)

try:

    @dataclass
    class BadTable:
        block_ids: list = []  # noqa: RUF008 - the bug on purpose

except ValueError as error:
    print("ValueError, mentions default_factory:", "default_factory" in str(error))

# %% [markdown]
# **A copy that is not one.** The cache hands out its tables (`get_block_table`) and takes snapshots of
# them, and a caller that changes what it got must not change the cache. `copy()` therefore builds a
# new list, `BlockTable(list(self.block_ids), self.num_tokens)`. Passing `self.block_ids` itself would
# give a second table object around the *same* list:

# %%
original = BlockTable(block_ids=[0, 1, 2], num_tokens=33)
not_a_copy = BlockTable(original.block_ids, original.num_tokens)  # a new table, the same list
not_a_copy.append_block(9)
print("original after changing BlockTable(original.block_ids, ...):", original.block_ids)

original = BlockTable(block_ids=[0, 1, 2], num_tokens=33)
independent = original.copy()
independent.append_block(9)
print("original after changing original.copy():                  ", original.block_ids)
print("same list:", independent.block_ids is original.block_ids)

# %% [markdown]
# The cache itself only ever hands out copies, so nothing a caller does to them reaches its tables:

# %%
view = cache.get_block_table("E")
view.append_block(6)
print("the copy:  ", view.block_ids)
print("the cache: ", cache.get_block_mapping("E"))

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. A block is a `KVCacheBlock` of the scheduler's block pool, and a
# request's block table exists twice: as a list of blocks in the scheduler's KV cache manager, and as
# a row of integers in the worker, which the attention kernels read.
#
# * `vllm/v1/core/kv_cache_utils.py`: `KVCacheBlock` is this course's `Block`: `block_id`, the index
#   into every layer's cache, `ref_cnt`, the number of requests holding it (this course's
#   `ref_count`), and `block_hash`, set once the block is full and cached (lesson 08). It also carries
#   the free list's links, `prev_free_block` and `next_free_block` (lesson 02).
# * `vllm/v1/core/single_type_kv_cache_manager.py`: `SingleTypeKVCacheManager.req_to_blocks` maps
#   each request id to its `KVCacheBlock`s in logical order: the scheduler's block table.
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheBlocks` is what the manager hands the scheduler, a
#   request's `blocks` per KV cache group; `get_block_ids` turns them into lists of block ids, which
#   travel to the worker.
# * `vllm/v1/worker/gpu/block_table.py`: `BlockTables`, in Model Runner V2 (the worker's default
#   runner in 0.33.0), is the worker's tables for the whole batch: for each KV cache group a buffer of
#   32-bit integers, one row per request (`block_tables`); `append_block_ids` adds a request's new
#   block ids to its rows and `num_blocks` counts them; each step `gather_block_tables` copies the
#   batch's rows into the tables the attention kernels read. A model that mixes full and
#   sliding-window attention layers has a group, and so a table, for each kind.
# * `vllm/v1/worker/block_table.py`: the V1 runner, still in the tree as the fallback, keeps the same
#   rows in a `BlockTable` per group (`append_row`, `num_blocks_per_row`) under a
#   `MultiGroupBlockTable`.
# * `vllm/v1/core/block_pool.py`: `null_block` is block 0, taken off the free list when the pool is
#   built and never handed out: a placeholder for table entries that hold nothing.
#
# What the course leaves out or does differently: this course's `BlockTable` counts its own tokens;
# vLLM's tables are lists of block ids only, and a request's token counts live on the request
# (`num_computed_tokens` in `vllm/v1/request.py`). The course hands out block 0 like any other and
# keeps one table per sequence, with no KV cache groups.

# %% [markdown]
# ## Recap
#
# * A `Block` names one physical block, `k_cache[block_id]` and `v_cache[block_id]`; its `ref_count` is
#   the number of block tables holding it (0 means free).
# * A `BlockTable` is a sequence's page table: logical block `i` lives in physical block `block_ids[i]`,
#   so position `p` lives in block `block_ids[p // block_size]`. `req-a`: 33 tokens in `[0, 1, 2]`.
# * Capacity is `num_blocks * block_size`; the empty tail of the last block (15 of 48 slots for `req-a`)
#   is the only waste, and the 49th token is the first to need a new block.
# * Blocks scatter as sequences come and go (`E` got `[10, 11, 0, 1, 2, 5]`); any free block fits, so 6
#   blocks were found where a contiguous layout saw a longest run of 3.
# * Every table owns its list: no shared default `[]`, and `copy()` copies the list.
#
# **Next, lesson 02:** the allocator that hands out the blocks, with its free list, its ref counts and
# errors that leave the state unchanged. The exercise for this lesson,
# `exercises/01_block_and_block_table.ipynb`, has you write `Block`, `BlockTable` and the position
# look-up yourself.

# %% [markdown]
# # Exercise 03 · Logical to physical
#
# In this exercise you write the translation of lesson 03 yourself, on plain lists and tensors, with
# no allocator: a position to its physical block and offset, the slots of many positions at once,
# and the scatter and gather of K/V through a block table. Each task says what to build and how it
# is checked; the cell after it runs the check and prints a tick, or tells you which call gave which
# wrong answer.
#
# The checks of Task 3 fill K with `100·t + 10·h + d` (token `t`, head `h`, dimension `d`) and V
# with its negative, and start from caches filled with `0.5`, so a failure can tell you which token
# landed where. The tensors live on `paged_kv.default_device()`: the CPU, or a GPU when there is one.
# The package has its own versions (`PagedKVCacheAllocator.physical_location`, `slot_mapping`,
# `write_kv`, `read_kv`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/03_logical_to_physical.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
import torch

import paged_kv
from paged_kv.checks import check

device = paged_kv.default_device()

# %% [markdown]
# ## Task 1 · A position's physical block and offset
#
# Write `physical_location(block_table, position, block_size)` for a block table given as a list of
# physical block ids. Return the pair `(physical_block_id, offset)` as two ints, in three steps: the
# logical block is `position // block_size`, the offset `position % block_size`, and the table turns
# the logical block into the physical one. A position outside the table's capacity (negative, or
# `len(block_table) * block_size` and above) raises `ValueError`.
#
# **Checked:** positions 0, 1, 3, 4, 6, 9 and 11 of the table `[5, 2, 7]` with blocks of 4 (the
# lesson's sequence), a block size of 16 and of 1, that the results are ints, and a `ValueError` for
# positions 12 and -1.


# %%
def physical_location(block_table: list[int], position: int, block_size: int) -> tuple[int, int]:
    """(physical block id, offset) of a logical position."""
    ### BEGIN SOLUTION: check 0 <= position < len(block_table) * block_size, then use // and %
    if not 0 <= position < len(block_table) * block_size:
        raise ValueError(f"position {position} is outside the table's {len(block_table) * block_size} slots")
    logical_block_idx = position // block_size
    offset = position % block_size
    return block_table[logical_block_idx], offset
    ### END SOLUTION


# %%
check("03.physical_location", physical_location)

# %% [markdown]
# ## Task 2 · The slot mapping, vectorised
#
# Write `slot_mapping(block_table, positions, block_size)`: `block_table` is a 1-D integer tensor of
# physical block ids, `positions` a 1-D `LongTensor` of positions in any order. Return the flat slot
# `physical_block_id * block_size + offset` of every position, as a `LongTensor` on the positions'
# device. Use tensor operations on the whole `positions` tensor: no Python loop over tokens, and no
# `.tolist()` or `.item()` (on a GPU, each one waits for the device). You need not check the range
# here.
#
# **Checked:** the 11 positions of the lesson's sequence (slots 20 to 23, 8 to 11, 28 to 30),
# positions out of order, the dtype and device, an `int32` block table (what `block_tables_tensor`
# gives), no positions, four scattered tables with shuffled positions against a loop, and that 800
# positions take no more tensor operations than 8.


# %%
def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat slot of every position, computed for all of them at once."""
    ### BEGIN SOLUTION: index block_table with the whole tensor positions // block_size; then * block_size + the offsets
    return block_table[positions // block_size] * block_size + positions % block_size
    ### END SOLUTION


# %%
check("03.slot_mapping", slot_mapping)

# %% [markdown]
# ## Task 3 · Write and gather K/V through a block table
#
# Now the data. `k_cache` and `v_cache` have shape `(num_blocks, num_heads, block_size, head_dim)`;
# `k` and `v` have shape `(num_tokens, num_heads, head_dim)`; `block_table` is a 1-D `LongTensor`
# on the caches' device.
#
# * `write_kv(k_cache, v_cache, block_table, k, v, start_position)` stores token `i` of `k` and `v`
#   at position `start_position + i`, in place, and returns nothing.
# * `read_kv(k_cache, v_cache, block_table, num_tokens)` returns `(k, v)` for positions `0` to
#   `num_tokens - 1`, in that order, each of shape `(num_tokens, num_heads, head_dim)`.
#
# Compute the physical blocks and offsets of all positions at once, as in Task 2, and index the
# caches with both: `k_cache[block_ids, :, offsets]` pairs `block_ids[i]` with `offsets[i]` and keeps
# the heads and dimensions, so it has the shape of `k`. Mind the `:`: the heads axis sits between
# block and offset.
#
# **Checked:** writing the lesson's 11 tokens into blocks `[5, 2, 7]`, and 10 tokens into a cache
# with as many heads as block slots (where mixing up the two axes raises no error); writing a prompt,
# then one token at a time from a start position; reading 11, 5 and 0 tokens back from both caches;
# and that 200 tokens take no more tensor operations than 4. Every slot is compared, so a token
# written to the wrong place, or K written to `v_cache`, shows.


# %%
def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_position: int = 0,
) -> None:
    """Scatter k and v, of shape (num_tokens, num_heads, head_dim), into the caches."""
    ### BEGIN SOLUTION: positions = start_position + arange(len(k)); k_cache[block_ids, :, offsets] = k (and v)
    block_size = k_cache.shape[2]
    positions = torch.arange(start_position, start_position + k.shape[0], device=k_cache.device)
    block_ids = block_table[positions // block_size]
    offsets = positions % block_size
    k_cache[block_ids, :, offsets] = k
    v_cache[block_ids, :, offsets] = v
    ### END SOLUTION


def read_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather positions 0 .. num_tokens - 1 back into contiguous (num_tokens, num_heads, head_dim)."""
    ### BEGIN SOLUTION: the same block_ids and offsets for arange(num_tokens); return k_cache[block_ids, :, offsets] and v's
    block_size = k_cache.shape[2]
    positions = torch.arange(num_tokens, device=k_cache.device)
    block_ids = block_table[positions // block_size]
    offsets = positions % block_size
    return k_cache[block_ids, :, offsets], v_cache[block_ids, :, offsets]
    ### END SOLUTION


# %%
check("03.write_read_kv", write_kv, read_kv)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, your functions work on the package's cache too. This cell rebuilds the
# lesson's sequence `s` in blocks `[5, 2, 7]`, writes its K/V with your `write_kv` straight into
# `cache.k_cache` and `cache.v_cache`, and asks the package to read them back. Try a block size of 16,
# or free the other requests in another order.

# %%
cache = paged_kv.PagedKVCacheAllocator(num_blocks=8, block_size=4, num_heads=2, head_dim=4, device=device)
for i in range(8):
    cache.allocate_for_sequence(f"r{i}", 3)
for finished in ("r5", "r2", "r7"):
    cache.free_sequence(finished)
table = cache.allocate_for_sequence("s", 11)
block_table = torch.tensor(table.block_ids, device=device)

k = torch.randn(11, 2, 4, device=device)
v = torch.randn(11, 2, 4, device=device)
write_kv(cache.k_cache, cache.v_cache, block_table, k, v, 0)
k_back, v_back = cache.read_kv("s")
print("block table:", table.block_ids)
print("position 6 ->", physical_location(table.block_ids, 6, 4))
print("slots:", slot_mapping(block_table, torch.arange(11, device=device), 4).tolist())
print("the package reads back your K and V:", torch.equal(k_back, k) and torch.equal(v_back, v))

# %% [markdown]
# # Lesson 02 · The allocator
#
# Lesson 01's block tables say where a sequence's tokens live. Something must decide which block a
# sequence gets next, take the blocks back when it finishes, and say no cleanly when the pool is
# empty: the **block allocator**, the counterpart of an operating system's free frame list. It runs
# for every new request and again whenever a sequence fills its last block, so it must be fast, and
# it must never lose a block or hand one block to two sequences by mistake.
#
# **By the end of this lesson you can**
#
# 1. explain the free list: `allocate` takes the block at its head, `free` puts a block at its tail,
#    both O(1) with a `deque`;
# 2. trace the running example: in a pool of 5 blocks, a 33-token request takes blocks `[0, 1, 2]`
#    and leaves `[3, 4]` free;
# 3. use ref counts to share a block, and show that it returns to the pool only when its last holder
#    frees it;
# 4. show the error rules (double free, duplicate id, out of blocks, unknown id) and that a call that
#    fails changes nothing;
# 5. explain why allocation must be all or nothing, and what a naive loop leaks when it is not;
# 6. tell the cache's block manager (bookkeeping, no tensors) from its storage (the K/V tensors), and
#    say why a model needs one manager for all its layers.

# %%
from collections import deque

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import BlockAllocator, OutOfBlocksError, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.pictures.plots import plot_free_list_steps

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. The free list
#
# The allocator must answer one question quickly: which block can I hand out next? It keeps the ids of
# the free blocks in a queue, the **free list**. `allocate` takes the id at the head of the queue;
# `free` puts an id back at the tail. A Python `deque` does both in constant time, whatever the size of
# the pool (a plain `list` would not: `pop(0)` shifts every remaining element). This is the whole
# mechanism:

# %%
free_list = deque(range(5))  # a new pool of 5 blocks: all free, in order
print("free list:", list(free_list))
taken = [free_list.popleft() for _ in range(3)]  # allocate three blocks from the head
print("taken:    ", taken)
free_list.append(1)  # free block 1: back at the tail
print("free list:", list(free_list))

# %% [markdown]
# `paged_kv.BlockAllocator` wraps that queue with a ref count per block and error checks. Its
# `free_block_ids` shows the free list, head first. The running example of the course starts here: a
# pool of 5 blocks and a request `req-a` whose 33-token prompt needs `ceil(33 / 16) = 3` blocks.

# %%
pool = BlockAllocator(5)
print("free_block_ids:", list(pool.free_block_ids))
req_a = [pool.allocate() for _ in range(blocks_for_tokens(33, 16))]
print("req-a takes:   ", req_a)
print("free_block_ids:", list(pool.free_block_ids))

# %% [markdown]
# **Predict, then run.** Free block 1, then block 0. What does the free list look like, and which block
# does the next `allocate()` return?

# %%
pool.free(1)
pool.free(0)
print("free_block_ids:", list(pool.free_block_ids))
print("next allocate: ", pool.allocate())
print("free_block_ids:", list(pool.free_block_ids))

# %% [markdown]
# Block 3: freed blocks queue up behind the blocks that were already free, first in, first out. Any
# free block would be correct, since every block has the same size, but the order has two
# consequences. Blocks that come back are the last to be reused, which matters once a freed block
# still holds useful K/V (prefix caching, lesson 08). And as requests come and go, a new request gets
# blocks from all over the pool, as section 4 shows.

# %% [markdown]
# ## 2. Ref counts: a block is free when nobody holds it
#
# Each block has a **ref count**, the number of holders (block tables) it has. `allocate` sets it to 1.
# `add_ref` records one more holder: that is how two sequences share a block, for instance a forked
# sequence and its parent sharing their prompt (lesson 08). `free` drops one holder and returns `True`
# only when the count reaches 0 and the block goes back on the free list; otherwise it returns `False`
# and the block stays in use.

# %%
pool = BlockAllocator(4)
shared = pool.allocate()
print(f"allocate()   -> block {shared}, ref count {pool.ref_count(shared)}")
print(f"add_ref({shared})   -> ref count {pool.add_ref(shared)}")
for _ in range(2):
    returned = pool.free(shared)
    print(
        f"free({shared})      -> {returned!s:<5}  ref count {pool.ref_count(shared)}, "
        f"free list {list(pool.free_block_ids)}"
    )

# %% [markdown]
# The first `free` only dropped a holder: block 0 stayed off the free list, because the other holder
# may still read it. The second `free` returned it to the tail.
#
# **Predict, then run.** Block 0 is free now. What should a third `free(0)` do?

# %%
try:
    pool.free(shared)
except ValueError as error:
    print("ValueError:", error)
print("free list:", list(pool.free_block_ids))

# %% [markdown]
# It refuses, and the free list is untouched. A **double free** means two parts of the program think
# they hold the same block. Accepting it would put the block on the free list twice, and the allocator
# would later hand it to two sequences that overwrite each other's K/V. This is what a free list that
# simply appended would do:

# %%
naive_free_list = deque(pool.free_block_ids)
naive_free_list.append(shared)  # a double free accepted without a check
print("free list:       ", list(naive_free_list))
print("next five blocks:", [naive_free_list.popleft() for _ in range(5)])

# %% [markdown]
# ## 3. The cache allocator: blocks for sequences
#
# `PagedKVCacheAllocator` is what an inference engine talks to. It joins two parts that know
# nothing of each other:
#
# * its **block manager**, `cache.manager`: a `BlockAllocator` for the free list and the ref counts,
#   and one `BlockTable` per sequence, keyed by a sequence id. Plain Python on block ids, no tensor;
# * its **storage**, `cache.storage`: the K/V tensors `k_cache` and `v_cache`, allocated once with
#   shape `(num_blocks, num_heads, block_size, head_dim)`; lesson 03 writes keys and values into
#   them.
#
# `allocate_for_sequence(seq_id, num_prompt_tokens)` takes `ceil(num_prompt_tokens / block_size)`
# blocks and records the table; `get_block_mapping(seq_id)` returns the table's block ids;
# `free_sequence(seq_id)` drops the table and frees its blocks. Here is the running example again, now
# with tensors behind it:

# %%
cache = PagedKVCacheAllocator(num_blocks=5, block_size=16, num_heads=2, head_dim=8, device=device)
print("k_cache, v_cache:", tuple(cache.k_cache.shape), tuple(cache.v_cache.shape))
trace = [("new pool", cache.snapshot())]
print("free_block_ids:  ", list(cache.snapshot().free_block_ids))

print(cache.allocate_for_sequence("req-a", 33))
trace.append(("req-a: 33 tokens", cache.snapshot()))
print("get_block_mapping('req-a'):", cache.get_block_mapping("req-a"))
print("free_block_ids:  ", list(cache.snapshot().free_block_ids))

# %% [markdown]
# Allocating touched no tensor: it moved three ids off the free list and recorded a table. The slots of
# blocks 0 to 2 hold nothing useful until the engine writes K/V into them.
#
# That split is why a real model needs one manager, not one per layer. Every layer of a transformer
# stores K and V for the same tokens, so one block id can name the same slots in every layer's
# tensors: the manager decides once per block, and the storage simply holds one `k_cache` and
# `v_cache` per layer. vLLM is built this way: the scheduler's `KVCacheManager`
# (`vllm/v1/core/kv_cache_manager.py`, over a `BlockPool` in `vllm/v1/core/block_pool.py`) hands out
# block ids and never touches a tensor, and the worker's model runner (Model Runner V2's
# `vllm/v1/worker/gpu/model_runner.py`, the default in 0.33.0) holds the per-layer `kv_caches`.

# %%
manager, storage = cache.manager, cache.storage
tensors = [name for name, value in vars(manager).items() if isinstance(value, torch.Tensor)]
print(f"{type(manager).__name__}: tensors {tensors}")
print(f"{type(storage).__name__}: {storage.num_layers} layer, k_cache {tuple(cache.k_cache.shape)}")
model_storage = paged_kv.KVStorage(num_layers=32, num_blocks=5, block_size=16, num_kv_heads=2, head_dim=8)
print(f"a 32-layer model's block: {model_storage.bytes_per_block // 1024} KiB in all, one allocation")

# %% [markdown]
# `usage()` measures the pool with the metrics of lesson 00. Three blocks of 16 reserve 48 slots for 33
# tokens:

# %%
usage = cache.usage()
print("used / free blocks:", usage.used_blocks, "/", usage.free_blocks)
print("tokens held:       ", usage.allocated_tokens)
print("slots reserved:    ", usage.reserved_tokens)
print("slots wasted:      ", usage.internal_fragmentation_tokens)
print(f"utilization:        {usage.block_utilization:.1%}")

# %% [markdown]
# ## 4. Freed blocks go to the tail, so later sequences scatter
#
# A second request, `req-b`, takes one block for its 16 tokens. Then `req-a` finishes, and
# `free_sequence` returns its blocks, which it also lists:

# %%
print(cache.allocate_for_sequence("req-b", 16))
trace.append(("req-b: 16 tokens", cache.snapshot()))
print("free_sequence('req-a'):", cache.free_sequence("req-a"))
trace.append(("req-a finishes", cache.snapshot()))
print("free_block_ids:", list(cache.snapshot().free_block_ids))

# %% [markdown]
# **Predict, then run.** `req-c` arrives with 40 tokens, so it needs 3 blocks. Which blocks does it get?

# %%
print(cache.allocate_for_sequence("req-c", 40))
trace.append(("req-c: 40 tokens", cache.snapshot()))
print("free_block_ids:", list(cache.snapshot().free_block_ids))

# %% [markdown]
# `[4, 0, 1]`: block 4 was waiting at the head, and `req-a`'s blocks queued behind it. `req-c`'s
# logical blocks are not neighbours in memory, and lesson 01 showed that the block table makes that
# harmless. The picture replays the trace, one row per step: a used block in its sequence's colour, a
# free block white, with its place in the free list underneath (`#1` is the block `allocate` hands out
# next).

# %%
plot_free_list_steps(trace, title="the pool after each step (5 blocks of 16 slots)")
plt.show()

# %% [markdown]
# The same steps as an animation. `PagedKVCacheAllocator(..., record=True)` keeps a frame of the new
# pool, then one after every successful call, and `AllocationPlayer` plays them back with the whole
# picture: the pool, each block table, the free list in order and a usage gauge. Press **Play**, drag
# the slider, or step with the arrows of the frame number; the blocks a step touched are outlined.
# The animation runs in the browser, so it also plays in this notebook exported to HTML.

# %%
from paged_kv.pictures.widgets import AllocationPlayer, AllocatorPlayground

replay = PagedKVCacheAllocator(num_blocks=5, block_size=16, num_heads=1, head_dim=1, record=True)
replay.allocate_for_sequence("req-a", 33)
replay.allocate_for_sequence("req-b", 16)
replay.free_sequence("req-a")
replay.allocate_for_sequence("req-c", 40)
AllocationPlayer(replay.trace)

# %% [markdown]
# ## 5. Errors that change nothing
#
# Requests are refused for ordinary reasons: the pool is full, a client retries with an id that is
# already in use, a request is cancelled before it was ever scheduled. The rules, the same throughout
# the package:
#
# | situation | what happens |
# |---|---|
# | `allocate_for_sequence` with an id that is already allocated | `ValueError` |
# | too few free blocks | `OutOfBlocksError`, a `RuntimeError` that says how many blocks were needed and how many are free |
# | `free_sequence` of an unknown id | nothing; it returns `[]` (a cancelled request) |
# | `get_block_mapping` of an unknown id | `UnknownSequenceError`, a `KeyError` |
# | any call that raises | the allocator's state is exactly what it was |
#
# The last rule is what lets the caller carry on: a scheduler that catches `OutOfBlocksError` waits,
# or preempts another request (lesson 11), and it can only do that if the failed call left nothing
# half done. The pool now holds `req-b` in block 3 and `req-c` in blocks 4, 0 and 1; one block is
# free. `snapshot()` records the whole state (free list in order, ref counts, every table), so
# comparing a snapshot from before the failed calls with one from after shows whether anything moved.

# %%
before = cache.snapshot()

try:
    cache.allocate_for_sequence("req-b", 5)
except ValueError as error:
    print("ValueError:", error)

try:
    cache.allocate_for_sequence("req-d", 40)
except OutOfBlocksError as error:
    print("OutOfBlocksError:", error)
    print(
        "  a RuntimeError:", isinstance(error, RuntimeError), "| needed:", error.needed, "| free:", error.free
    )

print("free_sequence('req-x'):", cache.free_sequence("req-x"))

try:
    cache.get_block_mapping("req-x")
except KeyError as error:
    print(f"{type(error).__name__} (a KeyError): {error}")

print("state unchanged:", cache.snapshot() == before)

# %% [markdown]
# ## 6. All or nothing
#
# Why could a failed allocation change anything in the first place? Because the natural way to take
# `n` blocks is a loop of `allocate()` calls, and when the pool runs dry halfway, the loop stops with
# some blocks already taken. Here is that naive version, which also records the table before it
# starts filling it:


# %%
def naive_allocate_for_sequence(pool, tables, seq_id, num_tokens, block_size=16):
    """Take the blocks one at a time. Wrong: see below."""
    tables[seq_id] = []
    for _ in range(blocks_for_tokens(num_tokens, block_size)):
        tables[seq_id].append(pool.allocate())  # raises when the pool is empty
    return tables[seq_id]


pool, tables = BlockAllocator(5), {}
print("req-a:", naive_allocate_for_sequence(pool, tables, "req-a", 33))
print("free blocks:", pool.num_free_blocks)

# %% [markdown]
# **Predict, then run.** `req-b` asks for 40 tokens, 3 blocks, and only 2 are free. The call fails. How
# many blocks are free afterwards, and what does `tables` hold?

# %%
try:
    naive_allocate_for_sequence(pool, tables, "req-b", 40)
except OutOfBlocksError as error:
    print("OutOfBlocksError:", error)
print("free blocks:", pool.num_free_blocks)
print("tables:     ", tables)
print("ref counts: ", [pool.ref_count(b) for b in range(5)])

# %% [markdown]
# No block is free, and `req-b` has a **half-built table**: two blocks for 40 tokens, so positions 32
# to 39 have no slot. The error even reports the wrong need, 1 block, because it came from the single
# `allocate()` that failed. And a caller that cleans up by deleting `req-b`'s table does not get the
# blocks back: blocks 3 and 4 keep a ref count of 1 with no table holding them, **leaked** for as long
# as the server runs.
#
# The cure is to check everything first and change anything only once nothing can fail any more: is
# the id new, is the count valid, are `n` blocks free? `BlockAllocator.allocate_blocks(n)` does the
# block part, and `PagedKVCacheAllocator.allocate_for_sequence` checks the id before it.

# %%
pool = BlockAllocator(5)
print("req-a:", pool.allocate_blocks(blocks_for_tokens(33, 16)))
try:
    pool.allocate_blocks(blocks_for_tokens(40, 16))
except OutOfBlocksError as error:
    print("OutOfBlocksError:", error)
print("free_block_ids:", list(pool.free_block_ids))

# %% [markdown]
# The same request is refused with the right numbers, 3 needed and 2 free, and blocks 3 and 4 are
# still on the free list for a request that fits.

# %% [markdown]
# ## 7. Explore: the allocator playground
#
# The playground is a live allocator of 16 blocks of 4 slots. Choose a prompt length and add
# sequences; a decode step adds one token to every sequence; finish a sequence and watch its blocks
# join the tail of the free list; reset to start over. Things to try:
#
# * fill the pool, then add one more sequence: the allocation is refused with the numbers, and
#   nothing changes;
# * finish a sequence in the middle, then add a longer one: its blocks are not neighbours;
# * decode until a step cannot get the blocks it needs.
#
# Unlike the player, the playground's buttons run Python, so it needs a running kernel.

# %%
AllocatorPlayground(num_blocks=16, block_size=4)

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. The allocator is the scheduler's `BlockPool`, which owns every block,
# its ref count and the free list, under one `KVCacheManager` for all the layers:
#
# * `vllm/v1/core/block_pool.py`: `BlockPool` holds every `KVCacheBlock` (`blocks`) and the
#   `free_block_queue`: this course's `BlockAllocator`, and with prefix caching this course's
#   `CachingBlockAllocator` too (`cached_block_hash_to_block`, lesson 08).
# * `vllm/v1/core/block_pool.py`: `get_new_blocks` takes blocks from the head of the free queue and
#   raises each one's `ref_cnt` from 0 to 1; asked for more than `get_num_free_blocks` it raises a
#   `ValueError`, so the manager checks the count first, all or nothing.
# * `vllm/v1/core/block_pool.py`: `free_blocks` lowers `ref_cnt`, and a block that reaches 0 goes back
#   to the queue: to the front when it has no hash, to be reused first, to the back when it is
#   cached, to be evicted last. `touch` is the way back: a hit on a cached free block takes it off
#   the queue and counts a holder.
# * `vllm/v1/core/kv_cache_utils.py`: `FreeKVCacheBlockQueue` is the doubly linked free list, threaded
#   through the blocks' own `prev_free_block` and `next_free_block`, between two sentinels,
#   `fake_free_list_head` and `fake_free_list_tail`, so that `popleft`, `remove` and `append` are
#   O(1) with no special case for an empty list; `prepend_n` and `append_n` put a request's freed
#   blocks back in one splice, and `num_free_blocks` counts the queue.
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager` is this course's `BlockManager`, one for the
#   model: `allocate_slots` (lesson 04) and `free` work on block ids and never touch a tensor.
# * `vllm/v1/worker/gpu/model_runner.py`: Model Runner V2's `GPUModelRunner.initialize_kv_cache`
#   keeps `kv_caches`, one tensor per layer: the storage, this course's `KVStorage`. They are views
#   of one backing buffer (`allocate_kv_cache`, in `vllm/v1/worker/utils.py`). The V1 runner,
#   `vllm/v1/worker/gpu_model_runner.py`, still in the tree as the fallback, keeps its own.
#
# What the course leaves out or does differently: with prefix caching off, vLLM 0.33.0 puts every
# freed block at the front of the free queue, so the next request reuses it first, where this course
# appends freed blocks to the tail (section 4); vLLM keeps block 0 back as `null_block`, and running
# out is `allocate_slots` returning `None`, not an `OutOfBlocksError`. The course's `FreeKVCacheBlockQueue`
# is a ring through one sentinel, with its links in two arrays rather than on the blocks.

# %% [markdown]
# ## Recap
#
# * The free list is a FIFO queue: `allocate` pops the head, `free` appends to the tail, both O(1) with
#   a `deque`. Running example: a pool of 5, `req-a` (33 tokens) takes `[0, 1, 2]`, leaving `[3, 4]`.
# * The package's cache is a block manager (tables, ref counts, free list; no tensors) and a storage
#   (the K/V tensors); a model keeps one manager for all its layers, as vLLM's `KVCacheManager` does.
# * A block's ref count is its number of holders; `add_ref` shares it, `free` returns it to the pool
#   only when the count reaches 0, and freeing a free block is a `ValueError` (a double free).
# * Freed blocks queue behind the free ones, so `req-c` (40 tokens) got the scattered `[4, 0, 1]`.
# * Errors: a duplicate id is a `ValueError`, too few blocks an `OutOfBlocksError` with `needed` and
#   `free`, an unknown id a no-op for `free_sequence` (it returns `[]`) and a `KeyError` for look-ups,
#   and a call that fails leaves the snapshot equal.
# * Allocation is all or nothing: check, then take. A loop that takes blocks one by one leaks them and
#   leaves half-built tables when the pool runs out.
#
# **Next, lesson 03:** from a token position to its slot in `k_cache` and `v_cache`, and writing and
# reading K/V through the block table. The exercise for this lesson, `exercises/02_the_allocator.ipynb`,
# has you build the block allocator, the sequence bookkeeping on top of it, and the cache's `k_cache`
# and `v_cache`, allocated once when the allocator is built.

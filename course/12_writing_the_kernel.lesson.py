# %% [markdown]
# # Lesson 12 · Writing the kernel
#
# Lesson 05 computed paged attention with PyTorch operations: gather the blocks into one piece, or
# read them in place with batched products. A serving engine does neither. It hands one kernel the
# whole cache and the block tables, and every program of that kernel does lesson 03's address
# translation itself, loading the block ids it needs and the keys and values they point to, and
# merging the blocks with lesson 05's online softmax. And it serves a whole engine step in one launch:
# decodes, fresh prompts and chunks of prompts packed together (lesson 06's packed batch, lesson 10's
# token budget), causal inside each sequence. This lesson writes that kernel in Triton, the language
# of vLLM's Triton attention backend and of PyTorch's FlexAttention kernels. Triton's interpreter
# runs a kernel on the CPU with numpy, so everything below runs without a GPU, and the same code is
# compiled on one.
#
# **By the end of this lesson you can**
#
# 1. explain how a kernel's launch grid splits a packed step into programs, one per (sequence, KV
#    head, tile of query tokens), and show which blocks of the pool each program reads;
# 2. compute the address of any key in the cache from its strides, for this course's layout and for
#    vLLM v1's, tokens before heads with K and V side by side, and read both with one kernel;
# 3. build the kernel's loop: a block id loaded from the table, the last block's tail masked, a causal
#    mask per query token, the blocks merged with the online softmax, and show it equals the gather;
# 4. compute what the kernel reads per step and explain why the block size matters to it;
# 5. find vLLM's own Triton attention kernel, say how its grid serves prefill and decode in one
#    launch, and name what it adds to this one.

# %% [markdown]
# ## 0. Triton, in the mode this machine can run
#
# Triton decides once, when it is first imported, whether it compiles kernels or interprets them:
# it reads the environment variable `TRITON_INTERPRET`. So the variable must be set *before* anything
# imports triton. `paged_kv.attention.triton_language` does it: where there is no CUDA device it sets
# `TRITON_INTERPRET=1`, then imports `triton.language`, the module every kernel calls `tl` (the package's kernel imports it
# from there). With a GPU it
# leaves the variable alone and Triton compiles. Triton publishes Linux wheels only: on macOS and
# Windows `MISSING` says so, and the cells that run a kernel print that line instead.

# %%
import inspect

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import PagedKVCacheAllocator
from paged_kv.attention import paged_attention_varlen
from paged_kv.attention.triton_decode import query_tile_for
from paged_kv.attention.triton_language import MISSING  # first: importing it fixes Triton's mode
from paged_kv.pictures.plots import WASTE, colour

KERNELS = not MISSING  # whether this machine can run a Triton kernel
if KERNELS:
    from paged_kv.attention.triton_decode import triton_interpreted
    from paged_kv.attention.triton_kernel import paged_attention_kernel

    print("Triton", "interprets" if triton_interpreted() else "compiles", "kernels here")
else:
    print(MISSING)
device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
TOL = {"atol": 1e-5, "rtol": 1e-5}

# %% [markdown]
# ## 1. From the four-step translation to a kernel
#
# Lesson 03 found position `p` of a sequence in four steps: the logical block `p // block_size`, the
# offset `p % block_size`, the physical block `block_table[p // block_size]`, and the key at
# `k_cache[physical_block, head, offset, :]`. Lesson 05 did those steps for all positions at once, with
# tensor indexing, on the host. A kernel does the same steps, but inside the GPU program that needs the
# key, with integer arithmetic on addresses: nothing is gathered first, and no index tensor is built.
#
# The cache below holds three sequences of 11, 10 and 16 tokens in blocks of 4, scattered over a pool
# of 12 blocks (taken, then given back in a shuffled order, so the free list hands them out mixed).
# The K/V heads are 2 and the query heads 4: grouped-query attention, two query heads per K/V head.
# This step computes 1 query token of sequence 0 (a decode), all 10 of sequence 1 (a fresh prompt)
# and the last 5 of sequence 2 (a chunk after 11 cached tokens): 16 query tokens, packed one
# sequence after another. As in vLLM, `query_start_loc` says where each sequence's rows start, and
# `seq_lens` how many tokens each sequence holds, its query tokens included.

# %%
BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 4, 2, 4, 8
cache = PagedKVCacheAllocator(12, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)
for block in range(12):
    cache.allocate_for_sequence(("old", block), 1)
for block in torch.randperm(12).tolist():
    cache.free_sequence(("old", block))
cache.k_cache.copy_(torch.randn(cache.k_cache.shape))  # stale data in every slot
cache.v_cache.copy_(torch.randn(cache.v_cache.shape))
lengths, query_lens = [11, 10, 16], [1, 10, 5]
for seq_id, length in enumerate(lengths):
    cache.allocate_for_sequence(seq_id, length)
    cache.write_kv(seq_id, *torch.randn(2, length, NUM_KV_HEADS, HEAD_DIM, device=device))
tables = cache.block_tables_tensor(range(len(lengths)))
seq_lens = torch.tensor(lengths, device=device)
query_start_loc = torch.tensor([0, 1, 11, 16], device=device)  # 0, then the running sum of query_lens
query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=device)
print("block tables (padded with -1):", tables.tolist())
print("seq_lens:", lengths, " query_lens:", query_lens, " query_start_loc:", query_start_loc.tolist())

# %% [markdown]
# ## 2. Programs and the launch grid
#
# A GPU kernel runs as many **programs** (CUDA calls them thread blocks), all executing the same code
# on different data; each learns which piece is its own from `tl.program_id(axis)`. The launch says how
# many programs run, as a **grid**: `kernel[(batch, num_kv_heads, tiles)](...)` starts `batch *
# num_kv_heads * tiles` programs. Program `(seq, kv_head, tile)` computes, for sequence `seq`, the
# query heads that read K/V head `kv_head` and a **tile** of `QUERY_TILE` of the sequence's query
# tokens: tokens `tile * QUERY_TILE` to `tile * QUERY_TILE + QUERY_TILE - 1`. With `GROUP = num_heads //
# num_kv_heads`, those heads are `kv_head * GROUP` to `kv_head * GROUP + GROUP - 1` (lesson 05's rule:
# query head `q` reads K/V head `q // GROUP`).
#
# A program's work is a small matrix of **rows**, one per (query token, query head) pair: row `r` is
# query token `tile * QUERY_TILE + r // GROUP` and query head `kv_head * GROUP + r % GROUP`. Every row
# meets every block the program loads, so a block's K and V are loaded once for all of them: once
# per KV head rather than once per query head, and once per tile rather than once per query token.
# The launcher fits 16 rows in a tile, as vLLM does: `QUERY_TILE = 16 // GROUP`, here 8 tokens
# (fewer when no sequence has that many), and 1 for a step of decodes only. The tiles are counted
# from the longest query, so a sequence with fewer query tokens has programs with nothing to do:
# they return at once. A decode has one token, one tile, and its rows are just its query heads.
#
# Programs run independently and in any order; none waits for another. That is why the grid follows
# the sequences, the heads and the query tokens: no two programs compute the same output row.
#
# **Predict, then run.** How many programs does this step launch, and how many of them return at once?

# %%
GROUP = NUM_HEADS // NUM_KV_HEADS
QUERY_TILE = query_tile_for(max(query_lens), GROUP)  # the launcher's rule: 16 // GROUP, here 8
tiles = -(-max(query_lens) // QUERY_TILE)
grid = (len(lengths), NUM_KV_HEADS, tiles)
print("grid:", grid, "->", grid[0] * grid[1] * grid[2], "programs")
for seq, new in enumerate(query_lens):
    for tile in range(tiles):
        tokens = range(tile * QUERY_TILE, min(new, (tile + 1) * QUERY_TILE))
        what = (
            f"query tokens {tokens.start}..{tokens.stop - 1}" if len(tokens) else "nothing: returns at once"
        )
        print(f"sequence {seq}, tile {tile}: {what} (x {NUM_KV_HEADS} KV heads)")

# %% [markdown]
# Causality saves reading too. Query token `i` of a sequence sits at position `context_len + i`,
# where `context_len = seq_len - query_len` tokens came before the step's query tokens; it sees
# positions up to its own. So a tile's last token sees `kv_len = min(context_len + (tile + 1) *
# QUERY_TILE, seq_len)` positions, and the program loads only the blocks that hold them. The picture
# shows the pool's 12 blocks across and the programs with work down (each stands for its two KV
# heads, which read the same blocks, each its own head of them): a program reads the blocks marked
# in its row, in the order of the numbers (the loop step `j`, the logical block). The hatched part of
# a block is what the program never loads: the tail of a last block, past the sequence's tokens.
# Tile 0 of the prompt stops after two blocks: its tokens 0 to 7 see nothing after position 7.


# %%
def kv_lens(lengths, query_lens, query_tile):
    """What each program with work sees: {(seq, tile): kv_len}, the positions its last token sees."""
    seen = {}
    for seq, (length, new) in enumerate(zip(lengths, query_lens, strict=True)):
        for tile in range(-(-new // query_tile)):
            seen[seq, tile] = min(length - new + (tile + 1) * query_tile, length)
    return seen


def plot_program_reads(tables, lengths, query_lens, block_size, num_blocks, query_tile):
    """Which blocks each program (sequence, tile) reads, in which step; the unloaded tails hatched."""
    seen = kv_lens(lengths, query_lens, query_tile)
    _, ax = plt.subplots(figsize=(9, 2.8))
    for row, ((seq, _), kv_len) in enumerate(seen.items()):
        for j, block in enumerate(tables[seq, : -(-kv_len // block_size)].tolist()):
            live = min(block_size, lengths[seq] - j * block_size) / block_size
            ax.add_patch(plt.Rectangle((block, row), live, 0.8, facecolor=colour(seq), edgecolor="white"))
            if live < 1:
                ax.add_patch(plt.Rectangle((block + live, row), 1 - live, 0.8, **WASTE))
            ax.text(block + live / 2, row + 0.4, str(j), ha="center", va="center", color="white", fontsize=9)
    ax.set_xlim(0, num_blocks)
    ax.set_ylim(len(seen), -0.2)
    ax.set_xticks([b + 0.5 for b in range(num_blocks)], [str(b) for b in range(num_blocks)])
    ax.set_yticks([r + 0.4 for r in range(len(seen))], [f"sequence {s}, tile {t}" for s, t in seen])
    ax.set_xlabel("physical block of the pool (the number: the loop step j that reads it)")
    ax.set_title("Which program reads which blocks (each row: both KV heads)")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return ax


plot_program_reads(tables, lengths, query_lens, BLOCK_SIZE, cache.num_blocks, QUERY_TILE)
plt.show()

# %% [markdown]
# ## 3. Pointer arithmetic into the cache, through strides
#
# A kernel receives a tensor as a **pointer** to its first element, and nothing else: no shape, no
# indexing. To reach element `[block, head, slot, dim]` it adds the index along each axis times that
# axis's **stride**, the distance in elements between neighbours along it:
#
# `k_cache_ptr + block * k_stride_block + head * k_stride_head + slot * k_stride_slot + dim * k_stride_dim`
#
# PyTorch gives the strides (`tensor.stride()`), and the launcher passes them to the kernel as plain
# integers. This is lesson 03's step 4 written as arithmetic. Below, the formula on the flat memory of
# the cache finds the same number as indexing does.

# %%
k_stride_block, k_stride_head, k_stride_slot, k_stride_dim = cache.k_cache.stride()
print("k_cache shape", tuple(cache.k_cache.shape), "strides", cache.k_cache.stride())
seq, p, kv_head, dim = 0, 9, 1, 3
block = int(tables[seq, p // BLOCK_SIZE])
offset = (
    block * k_stride_block + kv_head * k_stride_head + (p % BLOCK_SIZE) * k_stride_slot + dim * k_stride_dim
)
memory = cache.k_cache.flatten()  # the cache as the kernel sees it: one run of numbers
print(f"position {p} of sequence {seq}: block {block}, slot {p % BLOCK_SIZE}, element offset {offset}")
print(
    "the formula reads what indexing reads:",
    bool(memory[offset] == cache.k_cache[block, kv_head, p % BLOCK_SIZE, dim]),
)

# %% [markdown]
# ## 4. Loading a block id from the table
#
# The block id is itself data in memory: entry `j` of row `seq` of the block table, at
# `block_tables_ptr + seq * table_stride_seq + j * table_stride_entry`. The kernel loads it at each step
# of its loop with `tl.load`, the only way a program reads memory, and only then can it compute the
# addresses of that block's keys. The row stride is the table's width; a program that used another
# sequence's row would read another sequence's keys, with no error, just a wrong answer.
#
# The slots of one block are consecutive along the slot axis, so a program loads a whole block of
# its head at once: `tl.arange(0, BLOCK_SIZE)` is the vector of slots `0 .. BLOCK_SIZE - 1`, and
# `slots[:, None] * k_stride_slot + dims[None, :] * k_stride_dim` is a `(BLOCK_SIZE, HEAD_DIM)` grid of
# addresses, loaded in one `tl.load`.

# %%
table_stride_seq, table_stride_entry = tables.stride()
flat_table = tables.flatten()
print("table strides:", tables.stride())
for j in range(-(-lengths[2] // BLOCK_SIZE)):
    print(
        f"program of sequence 2, step {j}: block id {int(flat_table[2 * table_stride_seq + j * table_stride_entry])}"
    )

# %% [markdown]
# ## 5. Two masks: the last block's tail, and causality
#
# Sequence 0 holds 11 tokens in three blocks of 4: its last block has 3 live slots, and the fourth
# holds stale data from an earlier sequence. The kernel's loop runs over whole blocks, so at each step
# it computes, for every slot `s`, the position `kv_pos = j * BLOCK_SIZE + s` and whether it is below
# `seq_len`. That vector of booleans is a **mask**: `tl.load(ptrs, mask=live, other=0.0)` does not
# read the masked slots (it gives `0.0` instead). Not reading them matters: stale memory may hold
# anything, NaN included, and a NaN times a zero weight is still NaN. The same mechanism hides the
# padding that `tl.arange` needs: its length must be a power of two, so a block of 6 slots or a head
# dimension of 80 is padded to 8 or 128 and masked.
#
# The second mask is per row: a live slot is **visible** to a row when `kv_pos <= query_pos`, the
# position of the row's query token, itself included. `tl.where(visible, scores, -inf)` gives the
# others a score whose weight is `exp(-inf) = 0`. For a decode, `query_pos = seq_len - 1` and the
# two masks say the same thing; for a chunk they do not. Below, the chunk of sequence 2 (query tokens
# at positions 11 to 15) against the block that holds positions 12 to 15: a staircase.

# %%
for j in range(3):
    live = [int(j * BLOCK_SIZE + s < lengths[0]) for s in range(BLOCK_SIZE)]
    print(f"sequence 0, step {j}: live slots {live}")
context_len = lengths[2] - query_lens[2]
for token in range(query_lens[2]):
    query_pos = context_len + token
    visible = [int(3 * BLOCK_SIZE + s <= query_pos) for s in range(BLOCK_SIZE)]
    print(f"sequence 2, query token {token} (position {query_pos}), step 3: visible slots {visible}")

# %% [markdown]
# ## 6. Lesson 05's online softmax as the kernel's loop
#
# Everything comes together in the loop. Before it, the program loads its sequence's first row,
# `query_start = query_start_loc[seq]`, and its query length, returns if its tile has no token, and
# loads its rows' queries from rows `query_start + token` of the packed batch. Then, for each
# logical block `j`: load the block id, build the live mask, load K, score every row against it,
# mask what a row may not see, update the online softmax of lesson 05 (the running maximum `m`, the
# running `total` of `exp(score - m)`, the accumulator `acc`, both rescaled by `exp(m_old - m_new)`
# when a block raises the maximum), load V and add its weighted sum. After the last block the
# program stores `acc / total` for its rows. Every quantity is kept in float32, whatever the cache's
# dtype. Every row sees position 0, so the first block already gives each row a finite maximum.
# Here is the package's kernel, a plain Python function in Triton's language; `triton.jit` makes it
# a kernel, the package's `TRITON_ATTN` backend launches it over the step's `seq_lens` and
# `query_start_loc`, and `paged_attention_varlen(..., backend="TRITON_ATTN")` hands it this lesson's
# batch, as do `paged_prefill_attention` (which takes the query lengths) and `paged_attention` (a
# step of decodes) with that backend. Its two trailing constexpr
# parameters, `SLIDING_WINDOW` and `SOFTCAP` (defaults: none), serve lesson 13's sliding-window and
# soft-capped layers and change nothing here.

# %%
source = inspect.getsource(paged_attention_kernel) if KERNELS else MISSING
print(source[source.index("    seq = tl.program_id(0)") :] if KERNELS else source)

# %% [markdown]
# **Predict, then run.** The unused slots of the pool hold random numbers, and the padding entries of
# the table are `-1`, which names no block. Will the kernel equal the `GATHER` backend exactly, only
# roughly, or not at all? And if those slots held NaN?

# %%
if KERNELS:
    args = (tables, seq_lens, query_start_loc)
    out = paged_attention_varlen(query, cache.k_cache, cache.v_cache, *args, backend="TRITON_ATTN")
    gathered = paged_attention_varlen(query, cache.k_cache, cache.v_cache, *args, backend="GATHER")
    print("the kernel equals the gather:", torch.allclose(out, gathered, **TOL))
    poisoned_k, poisoned_v = cache.k_cache.clone(), cache.v_cache.clone()
    last_block = int(tables[0, 2])
    poisoned_k[last_block, :, 3:], poisoned_v[last_block, :, 3:] = float("nan"), float("nan")
    again = paged_attention_varlen(query, poisoned_k, poisoned_v, *args, backend="TRITON_ATTN")
    print("with NaN in sequence 0's masked tail, the same output:", torch.equal(again, out))
else:
    print(MISSING)

# %% [markdown]
# Equal within float32 rounding (the kernel adds in another order), and unchanged by NaN in the tail:
# a masked slot is never loaded, so its value cannot matter. The `-1` entries are never loaded
# either: the loop stops at `ceil(context_len / BLOCK_SIZE)` blocks.
#
# ## 7. What the kernel reads per step, and why the block size matters
#
# One step of a program's loop loads one block id (a few bytes) and then `2 * BLOCK_SIZE * HEAD_DIM`
# numbers of K and V, contiguous along the head dimension, for all its rows at once: `GROUP` query
# heads of one decode token, or of up to `QUERY_TILE` tokens of a chunk, which is why a prompt costs
# far fewer loads per token than a decode. A decode of `n` tokens takes `ceil(n / BLOCK_SIZE)` steps.
# The block size trades three things:
#
# * **work per step.** Each step has a fixed cost: the dependent load of the block id (the address of K
#   is unknown until it arrives), the rescaling of `total` and `acc`, and the loop itself. Bigger blocks
#   spread it over more tokens.
# * **the width of each load.** A GPU reads memory efficiently in wide, aligned transactions; a block of
#   16 slots of 128 float16 numbers is 4 KiB of one head's keys in one run.
# * **the masked tail.** The last block's unused slots are masked, not read, but the program's vector
#   lanes for them idle, and in the pool they are lesson 00's internal fragmentation, up to
#   `BLOCK_SIZE - 1` slots per sequence.
#
# vLLM's default is 16 slots: few enough that the tail wastes little, many enough that each step loads
# a sizeable contiguous piece. (Its Triton kernel goes further and loads tiles of *keys* that may span
# several blocks, loading a block id per key: the key tile and the block size become independent.)
#
# **Predict, then run.** For a context of 1,000 tokens with 8 K/V heads of dimension 128 in float16,
# how many steps does one program take with blocks of 8, 16 and 32, and how many bytes does each step
# read?

# %%
context, kv_heads, head_dim, element_bytes = 1000, 8, 128, 2
for block_size in (8, 16, 32):
    steps = -(-context // block_size)
    per_step = 2 * block_size * head_dim * element_bytes
    tail = steps * block_size - context
    print(
        f"block size {block_size:2d}: {steps:3d} steps per program, {per_step:5d} bytes of K and V per step, "
        f"{tail:2d} masked tail slots, {kv_heads} programs per sequence"
    )

# %% [markdown]
# ## 8. This course's layout beside vLLM v1's
#
# This course keeps K and V in two tensors of axes `(num_blocks, num_kv_heads, block_size, head_dim)`:
# one head's slots of a block are contiguous. vLLM 0.33.0 keeps one buffer per layer, and in its
# default layout that layer's memory is `(num_blocks, block_size, num_kv_heads, 2 × head_size)`:
# within a block, one slot's heads sit together, each with its K and V side by side. Its attention
# backends receive a *view* of it with the heads before the slots, `(num_blocks, num_kv_heads,
# block_size, 2 × head_size)`, which is this course's axis order over vLLM's memory; K is the first
# `head_size` numbers of the last axis and V the rest. The kernel does not care: it takes every axis's
# stride, so the two halves of that view are read in place, with no copy. Only the strides differ.

# %%
vllm_layer = torch.cat([cache.k_cache, cache.v_cache], dim=-1).transpose(1, 2).contiguous()
print(
    "vLLM's memory, one layer:",
    tuple(vllm_layer.shape),
    "= (num_blocks, block_size, num_kv_heads, 2 x head_dim)",
)
kv_view = vllm_layer.transpose(1, 2)  # the view the backend receives: heads before slots
k_view, v_view = kv_view[..., :HEAD_DIM], kv_view[..., HEAD_DIM:]
print("course k_cache strides:", cache.k_cache.stride())
print("vLLM K, as a view:     ", k_view.stride(), "contiguous:", k_view.is_contiguous())
if KERNELS:
    from_vllm = paged_attention_varlen(query, k_view, v_view, *args, backend="TRITON_ATTN")
    print("the kernel reads vLLM's layout in place, same output:", torch.allclose(from_vllm, out, **TOL))
else:
    print(MISSING)

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. vLLM's Triton attention is the `TRITON_ATTN` backend (named in
# `vllm/v1/attention/backends/registry.py`), whose kernel is this lesson's kernel grown up, and it too
# serves a whole step, prefill chunks and decodes, in one launch:
#
# * `vllm/v1/attention/backends/triton_attn.py`: `TritonAttentionImpl.forward` takes the layer's
#   `kv_cache` view, splits it into `key_cache` and `value_cache` and calls `unified_attention` with
#   the `block_table`, `cu_seqlens_q` (the step's `query_start_loc`), `seqused_k` (the `seq_lens`)
#   and `max_seqlen_q` (the `max_query_len`).
# * `vllm/v1/attention/ops/triton_unified_attention.py`: `unified_attention` launches
#   `kernel_unified_attention` on `grid = (total_num_q_blocks, num_kv_heads)`. A program's rows are
#   `BLOCK_M` (16) (query token, query head) pairs, so it takes
#   `BLOCK_Q = BLOCK_M // num_queries_per_kv` query tokens, this lesson's `QUERY_TILE`; the first
#   axis runs over every sequence's blocks of query tokens at once,
#   `total_num_q_blocks = q.shape[0] // BLOCK_Q + num_seqs`, an upper bound that needs no query
#   length read back from the GPU.
# * `vllm/v1/attention/ops/triton_unified_attention.py`: in `kernel_unified_attention`,
#   `kv_head_idx = tl.program_id(1)`, and this lesson's rows are
#   `query_pos = q_block_local_idx * BLOCK_Q + offs_m // num_queries_per_kv` (the token) and
#   `query_offset_1 = kv_head_idx * num_queries_per_kv + offs_m % num_queries_per_kv` (the head);
#   `context_len = seq_len - cur_batch_query_len`, and a program returns when
#   `q_block_local_idx * BLOCK_Q >= cur_batch_query_len`.
# * `vllm/v1/attention/ops/triton_attention_helpers.py`: `resolve_seq_and_query_len` finds a
#   program's sequence by a binary search over `query_start_len_ptr` (`find_seq_idx`), where this
#   lesson's grid has a sequence axis; `compute_tile_loop_bounds` stops the loop at
#   `max_seq_prefix_len`, this lesson's `kv_len`; `compute_kv_seq_mask` is the causal mask,
#   `seq_offset[None, :] <= query_abs_pos`; `softmax_step` is the online softmax of section 6.
# * `vllm/v1/attention/ops/triton_unified_attention.py`: its loop loads `physical_block_idx` from
#   `block_tables_ptr`, once per token of a tile (`seq_offset // BLOCK_SIZE`), so a tile of
#   `TILE_SIZE` tokens may span several blocks, and reaches K and V through four strides each,
#   `stride_k_cache_0` to `stride_k_cache_3`. With `IS_3D`, a third grid axis splits a long context
#   into segments run by separate programs, and `reduce_segments` merges them (flash-decoding), so
#   that a small batch of decodes still fills the GPU.
#
# What the course leaves out or does differently: a grid sized from the longest query, with a
# sequence axis and idle programs, where vLLM's is packed and found by search; one whole block per
# loop step; products as sums over broadcasts where vLLM uses `tl.dot`; and none of sliding windows,
# ALiBi, soft-capping, attention sinks, fp8 or per-token-head quantised caches, or segments.

# %% [markdown]
# ## Recap
#
# * One kernel serves a packed step: program `(seq, kv_head, tile)` takes `QUERY_TILE` query tokens of
#   a sequence (8 here, 1 for decodes) for the `GROUP` query heads of a K/V head; its rows are
#   (token, head) pairs. Here 3 x 2 x 2 = 12 programs, 4 of which return at once.
# * A program finds a key by pointer arithmetic: `block * stride_block + head * stride_head + slot *
#   stride_slot + dim * stride_dim`, lesson 03's translation, with the block id loaded from
#   `seq * table_stride_seq + j * table_stride_entry` of the table, and its queries at rows
#   `query_start_loc[seq] + token` of the packed batch.
# * Two masks: the last block's tail is never loaded (NaN there changes nothing), and a query at
#   `context_len + token` sees positions up to its own; a tile loads only the blocks its last token sees.
# * The loop is lesson 05's online softmax, in float32: `m`, `total`, `acc`, rescaled by
#   `exp(m_old - m_new)`; the result equals the `GATHER` backend within 1e-5.
# * The package runs this kernel as its `TRITON_ATTN` backend (vLLM's name), the platform's default
#   on a GPU with triton; `CPU_ATTN`, the CPU's default, is the same loop in C.
# * One step reads `2 * BLOCK_SIZE * HEAD_DIM` numbers for all of a tile's rows; 1,000 tokens take
#   125, 63 or 32 steps with blocks of 8, 16 or 32, at 4 KiB, 8 KiB or 16 KiB per step in float16
#   with head dimension 128.
# * Strides make the layout a detail: the same kernel reads, in place, the K and V halves of vLLM
#   0.33.0's per-layer view `(num_blocks, num_kv_heads, block_size, 2 × head_size)`.
#
# **Next:** the exercise, `exercises/12_writing_the_kernel.ipynb`, has you write the kernel's body; the
# grader runs it in Triton's interpreter and names the classic mistakes: a position off by one, the
# tail unmasked, the causal mask off by one or missing, a query's position counted from 0, the wrong
# row of the packed batch, the maximum not rescaled, the wrong K/V head, the wrong row of the table.

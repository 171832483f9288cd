# %% [markdown]
# # Lesson 12 · Writing the kernel
#
# Lesson 05 computed paged attention with PyTorch operations: gather the blocks into one piece, or
# read them in place with batched products. A serving engine does neither. It hands one kernel the
# whole cache and the block tables, and every program of that kernel does lesson 03's address
# translation itself, loading the block ids it needs and the keys and values they point to, and
# merging the blocks with lesson 05's online softmax. This lesson writes that kernel in Triton, the
# language of vLLM's Triton attention backend and of PyTorch's FlexAttention kernels. Triton's
# interpreter runs a kernel on the CPU with numpy, so everything below runs without a GPU, and the
# same code is compiled on one.
#
# **By the end of this lesson you can**
#
# 1. explain how a kernel's launch grid splits decode attention into programs, one per (sequence,
#    KV head), and show which blocks of the pool each program reads;
# 2. compute the address of any key in the cache from its strides, for this course's layout and for
#    vLLM v1's, tokens before heads with K and V side by side, and read both with one kernel;
# 3. build the kernel's loop: a block id loaded from the table, the last block's tail masked, the
#    blocks merged with the online softmax, and show it equals the gather strategy;
# 4. compute what the kernel reads per step and explain why the block size matters to it;
# 5. find vLLM's own Triton attention kernel and name what it adds to this one.

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
from paged_kv import PagedKVCacheAllocator, paged_attention
from paged_kv.attention.triton_language import MISSING  # first: importing it fixes Triton's mode
from paged_kv.pictures.plots import WASTE, colour

KERNELS = not MISSING  # whether this machine can run a Triton kernel
if KERNELS:
    from paged_kv.attention.triton_decode import triton_interpreted
    from paged_kv.attention.triton_kernel import paged_decode_kernel

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
# The cache below holds three sequences of 11, 6 and 16 tokens in blocks of 4, scattered over a pool
# of 12 blocks (taken, then given back in a shuffled order, so the free list hands them out mixed).
# The K/V heads are 2 and the query heads 4: grouped-query attention, two query heads per K/V head.

# %%
BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 4, 2, 4, 8
cache = PagedKVCacheAllocator(12, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)
for block in range(12):
    cache.allocate_for_sequence(("old", block), 1)
for block in torch.randperm(12).tolist():
    cache.free_sequence(("old", block))
cache.k_cache.copy_(torch.randn(cache.k_cache.shape))  # stale data in every slot
cache.v_cache.copy_(torch.randn(cache.v_cache.shape))
lengths = [11, 6, 16]
for seq_id, length in enumerate(lengths):
    cache.allocate_for_sequence(seq_id, length)
    cache.write_kv(seq_id, *torch.randn(2, length, NUM_KV_HEADS, HEAD_DIM, device=device))
tables = cache.block_tables_tensor(range(len(lengths)))
context_lens = torch.tensor(lengths, device=device)
query = torch.randn(len(lengths), NUM_HEADS, HEAD_DIM, device=device)
print("block tables (padded with -1):", tables.tolist())
print("context lengths:", lengths)

# %% [markdown]
# ## 2. Programs and the launch grid
#
# A GPU kernel runs as many **programs** (CUDA calls them thread blocks), all executing the same code
# on different data; each learns which piece is its own from `tl.program_id(axis)`. The launch says how
# many programs run, as a **grid**: `kernel[(batch, num_kv_heads)](...)` starts `batch * num_kv_heads`
# programs, and program `(seq, kv_head)` computes the attention of sequence `seq` for the query heads
# that read K/V head `kv_head`. With `GROUP = num_heads // num_kv_heads`, those are the query heads
# `kv_head * GROUP`, ..., `kv_head * GROUP + GROUP - 1` (lesson 05's rule: query head `q` reads K/V head
# `q // GROUP`). A program per query head would work too, but it would load every block of K and V
# `GROUP` times; one per K/V head loads each once and scores all its query heads against it.
#
# Programs run independently and in any order; none waits for another. That is why the grid follows
# the sequences and the heads: the attention of one sequence and one head needs nothing from another.
#
# **Predict, then run.** How many programs does this batch launch, and how many blocks does the
# program of sequence 0 read?

# %%
GROUP = NUM_HEADS // NUM_KV_HEADS
grid = (len(lengths), NUM_KV_HEADS)
print("grid:", grid, "->", grid[0] * grid[1], "programs")
for seq, length in enumerate(lengths):
    steps = -(-length // BLOCK_SIZE)
    heads = [f"{kv_head * GROUP}..{kv_head * GROUP + GROUP - 1}" for kv_head in range(NUM_KV_HEADS)]
    print(f"sequence {seq}: {steps} blocks {tables[seq, :steps].tolist()}, query heads {heads} per program")

# %% [markdown]
# Each program reads its sequence's blocks, one per step of its loop, and only its own K/V head of
# each. The picture shows the pool's 12 blocks across and the six programs down: a program reads the
# blocks marked in its row, in the order of the numbers (the loop step `j`, the logical block). The
# hatched part of a last block is its tail, the slots past the context length: masked, never read.
# Both programs of a sequence read the same blocks, each its own head of them.


# %%
def plot_program_reads(tables, lengths, block_size, num_blocks, num_kv_heads):
    """Which blocks each program (sequence, KV head) reads, in which step; the masked tails hatched."""
    _, ax = plt.subplots(figsize=(9, 3.4))
    rows = [(seq, kv_head) for seq in range(len(lengths)) for kv_head in range(num_kv_heads)]
    for row, (seq, _) in enumerate(rows):
        steps = -(-lengths[seq] // block_size)
        for j, block in enumerate(tables[seq, :steps].tolist()):
            live = min(block_size, lengths[seq] - j * block_size) / block_size
            ax.add_patch(plt.Rectangle((block, row), live, 0.8, facecolor=colour(seq), edgecolor="white"))
            if live < 1:
                ax.add_patch(plt.Rectangle((block + live, row), 1 - live, 0.8, **WASTE))
            ax.text(block + live / 2, row + 0.4, str(j), ha="center", va="center", color="white", fontsize=9)
    ax.set_xlim(0, num_blocks)
    ax.set_ylim(len(rows), -0.2)
    ax.set_xticks([b + 0.5 for b in range(num_blocks)], [str(b) for b in range(num_blocks)])
    ax.set_yticks([r + 0.4 for r in range(len(rows))], [f"program ({s}, {h})" for s, h in rows])
    ax.set_xlabel("physical block of the pool (the number: the loop step j that reads it)")
    ax.set_title("Which program reads which blocks")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return ax


plot_program_reads(tables, lengths, BLOCK_SIZE, cache.num_blocks, NUM_KV_HEADS)
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
# ## 5. Masks for the last block's tail
#
# Sequence 0 holds 11 tokens in three blocks of 4: its last block has 3 live slots, and the fourth
# holds stale data from an earlier sequence. The kernel's loop runs over whole blocks, so at the last
# step it computes, for every slot `s`, whether position `j * BLOCK_SIZE + s` is below the context
# length. That vector of booleans is a **mask**: `tl.load(ptrs, mask=live, other=0.0)` does not read the
# masked slots (it gives `0.0` instead), and `tl.where(live, scores, -inf)` gives them a score whose
# weight is `exp(-inf) = 0`. Without it, the stale slot would join the softmax. The same mechanism hides
# the padding that `tl.arange` needs: its length must be a power of two, so a block of 6 slots or a head
# dimension of 80 is padded to 8 or 128 and masked.

# %%
for j in range(3):
    live = [int(j * BLOCK_SIZE + s < lengths[0]) for s in range(BLOCK_SIZE)]
    print(f"sequence 0, step {j}: live slots {live}")

# %% [markdown]
# ## 6. Lesson 05's online softmax as the kernel's loop
#
# Everything comes together in the loop: for each logical block `j`, load the block id, build the
# live mask, load K, score the group's queries against it, update the online softmax of lesson 05 (the
# running maximum `m`, the running `total` of `exp(score - m)`, the accumulator `acc`, both rescaled by
# `exp(m_old - m_new)` when a block raises the maximum), load V and add its weighted sum. After the
# last block the program stores `acc / total` for its query heads. Every quantity is kept in float32,
# whatever the cache's dtype. Here is the package's kernel, a plain Python function in Triton's
# language; `triton.jit` makes it a kernel, and `paged_attention(..., strategy="triton")` launches it.

# %%
source = inspect.getsource(paged_decode_kernel) if KERNELS else MISSING
print(source[source.index("    seq = tl.program_id(0)") :] if KERNELS else source)

# %% [markdown]
# **Predict, then run.** The unused slots of the pool hold random numbers, and the padding entries of
# the table are `-1`, which names no block. Will the kernel equal the gather strategy exactly, only
# roughly, or not at all? And if those slots held NaN?

# %%
if KERNELS:
    out = paged_attention(query, cache.k_cache, cache.v_cache, tables, context_lens, strategy="triton")
    gathered = paged_attention(query, cache.k_cache, cache.v_cache, tables, context_lens, strategy="gather")
    print("the kernel equals the gather:", torch.allclose(out, gathered, **TOL))
    poisoned_k, poisoned_v = cache.k_cache.clone(), cache.v_cache.clone()
    last_block = int(tables[0, 2])
    poisoned_k[last_block, :, 3:], poisoned_v[last_block, :, 3:] = float("nan"), float("nan")
    again = paged_attention(query, poisoned_k, poisoned_v, tables, context_lens, strategy="triton")
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
# numbers of K and V, contiguous along the head dimension, for `GROUP` query heads at once. A sequence
# of `n` tokens takes `ceil(n / BLOCK_SIZE)` steps. The block size trades three things:
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
# a sizeable contiguous piece. (Its Triton kernel goes further and loads *tiles* of tokens that may span
# several blocks, loading a block id per token: the tile size and the block size become independent.)
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
    from_vllm = paged_attention(query, k_view, v_view, tables, context_lens, strategy="triton")
    print("the kernel reads vLLM's layout in place, same output:", torch.allclose(from_vllm, out, **TOL))
else:
    print(MISSING)

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. vLLM's Triton attention is the `TRITON_ATTN` backend (named in
# `vllm/v1/attention/backends/registry.py`), whose kernel is this lesson's kernel grown up:
#
# * `vllm/v1/attention/backends/triton_attn.py`: `TritonAttentionImpl.forward` takes the layer's
#   `kv_cache` view, splits it into `key_cache` and `value_cache` (it moves the slots before the
#   heads, then cuts the last axis in two) and calls `unified_attention` with the `block_table`,
#   `seqused_k` (the lengths) and `cu_seqlens_q` (where each request's query tokens start).
# * `vllm/v1/attention/ops/triton_unified_attention.py`: `unified_attention` picks the grid and
#   launches `kernel_unified_attention`; `num_queries_per_kv` is the course's `GROUP`.
# * `vllm/v1/attention/ops/triton_unified_attention.py`: in `kernel_unified_attention`,
#   `kv_head_idx = tl.program_id(1)` is this kernel's second grid axis, and the rows of a program's
#   tile are the query heads of that K/V head, `query_offset_1`; `tl.program_id(0)` runs over
#   blocks of query tokens, so the one kernel does prefill, chunked prefill and decode.
# * `vllm/v1/attention/ops/triton_unified_attention.py`: its loop loads `physical_block_idx` from
#   `block_tables_ptr`, once per token of a tile (`seq_offset // BLOCK_SIZE`), so a tile of
#   `TILE_SIZE` tokens may span several blocks, and reaches K and V through four strides each,
#   `stride_k_cache_0` to `stride_k_cache_3`.
# * `vllm/v1/attention/ops/triton_attention_helpers.py`: `softmax_step` is the online softmax of
#   section 6: the running maximum `M`, the sum `L`, and `alpha`, the factor the kernel rescales its
#   accumulator by.
# * `vllm/v1/attention/ops/triton_unified_attention.py`: with `IS_3D`, a third grid axis splits a long
#   context into segments run by separate programs, and `reduce_segments` merges their partial
#   results (flash-decoding), so that a small batch still fills the GPU.
#
# What the course leaves out or does differently: the kernel here decodes only (one query token per
# sequence, a program per (sequence, K/V head)) and loads one whole block per step; vLLM's adds query
# tiles with a causal mask, sliding windows, ALiBi, soft-capping, attention sinks, fp8 and
# per-token-head quantised caches, and the split into segments.

# %% [markdown]
# ## Recap
#
# * A decode kernel runs one program per (sequence, K/V head): `grid = (batch, num_kv_heads)`, here 3 x
#   2 = 6 programs; a program scores its `GROUP` query heads (2 here) against each block it loads once.
# * A program finds a key by pointer arithmetic: `block * stride_block + head * stride_head + slot *
#   stride_slot + dim * stride_dim`, lesson 03's translation, with the block id loaded from
#   `seq * table_stride_seq + j * table_stride_entry` of the table.
# * The last block's tail is masked: not loaded, scored `-inf`; NaN there changes nothing.
# * The loop is lesson 05's online softmax, in float32: `m`, `total`, `acc`, rescaled by
#   `exp(m_old - m_new)`; the result equals the gather strategy within 1e-5.
# * One step reads `2 * BLOCK_SIZE * HEAD_DIM` numbers; 1,000 tokens take 125, 63 or 32 steps with
#   blocks of 8, 16 or 32, at 4 KiB, 8 KiB or 16 KiB per step in float16 with head dimension 128.
# * Strides make the layout a detail: the same kernel reads, in place, the K and V halves of vLLM
#   0.33.0's per-layer view `(num_blocks, num_kv_heads, block_size, 2 × head_size)`, whose memory
#   keeps a block's tokens before its heads.
#
# **Next:** the exercise, `exercises/12_writing_the_kernel.ipynb`, has you write the kernel's body; the
# grader runs it in Triton's interpreter and names the classic mistakes: a position off by one, the
# tail unmasked, the maximum not rescaled, the wrong K/V head, the wrong row of the table.

# %% [markdown]
# # Lesson 06 · Attention at scale
#
# Lesson 05 built paged attention and showed it exact: gather a batch's blocks through padded block
# tables, mask what lies past each sequence's length, and the answer is SDPA's on the same tokens. A
# server asks more of it. Its batches are large, so *how* the blocks are read decides the cost of
# every decode step. Its models share K/V heads between query heads, so the cache holds fewer heads
# than the attention computes. And not every sequence brings one new token: a prompt computed in
# chunks, or the rest of a prompt after a prefix-cache hit, brings several at once, at an offset.
# This lesson takes the attention of lesson 05 through all three.
#
# **By the end of this lesson you can**
#
# 1. compare the package's attention backends, `GATHER`, `IN_PLACE`, `FLEX_ATTENTION` and
#    `CPU_ATTN`: what each reads, what each costs on your machine against SDPA on contiguous K/V,
#    and which one `paged_attention` picks by default, and why;
# 2. explain grouped-query and multi-query attention, compute what they save in the cache, and pair
#    each query head with the K/V head the model was trained with;
# 3. compute the attention of a prompt chunk of several new tokens that attends causally to the
#    tokens already cached, and show that it equals the last rows of causal SDPA on the whole
#    sequence;
# 4. pack decodes and prompt chunks of different lengths into one call, as an engine's step does.
#
# Run the cells in order; two of them time the backends (about 5 s each on this course's quiet 2-core
# CPU, 8 s with two busy processes beside it, longer on a busier machine).

# %%
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import paged_kv
from paged_kv import PagedKVCacheAllocator, paged_attention, paged_prefill_attention
from paged_kv.attention import registry
from paged_kv.pictures.plots import colour
from paged_kv.timing import compare_times, how_fast

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# The batch of lesson 05, rebuilt: a pool of 16 blocks of 4 slots whose blocks have all served
# earlier requests (shuffled free list, stale K/V in every slot), and five sequences of 11, 4, 16, 6
# and 1 tokens, each with its keys, values and the query of its new token. `expected` is SDPA run on
# each sequence's K/V read back with `read_kv`, one sequence at a time: the reference of the lesson.

# %%
NUM_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 8, 4, 16
TOL = {"atol": 1e-5, "rtol": 1e-5}
gen = torch.Generator().manual_seed(0)


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's attention for one query: q (heads, dim) against k, v (tokens, heads, dim)."""
    out = F.scaled_dot_product_attention(
        q[None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    )
    return out[0, :, 0, :]  # (heads, head_dim)


cache = PagedKVCacheAllocator(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, device=device)
for block in range(NUM_BLOCKS):  # earlier requests, one block each, finished in a random order
    cache.allocate_for_sequence(f"old{block}", BLOCK_SIZE)
for block in torch.randperm(NUM_BLOCKS, generator=gen).tolist():
    cache.free_sequence(f"old{block}")
cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=gen))  # the K/V they left behind
cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=gen))

batch = ["a", "b", "c", "d", "e"]
for seq_id, length in zip(batch, [11, 4, 16, 6, 1], strict=True):
    cache.allocate_for_sequence(seq_id, length)
    cache.write_kv(seq_id, *torch.randn(2, length, NUM_HEADS, HEAD_DIM, generator=gen).to(device))
block_tables = cache.block_tables_tensor(batch)  # (batch, max_blocks), padded with -1
seq_lens = torch.tensor([cache.sequence_length(s) for s in batch], device=device)
query = torch.randn(len(batch), NUM_HEADS, HEAD_DIM, generator=gen).to(device)
expected = torch.stack([sdpa_one(query[i], *cache.read_kv(s)) for i, s in enumerate(batch)])
print("block tables:", block_tables.tolist())
print("context lengths:", seq_lens.tolist())

# %% [markdown]
# ## 1. The package's backends: ways to read the blocks
#
# `paged_kv.paged_attention` hands the batch to an **attention backend**, named with `backend=` as
# the package's registry (`paged_kv.attention.registry`) names it; vLLM names its own backends the
# same way. The answer is the same whichever reads the blocks; what differs is how much memory
# traffic it costs.
#
# * **`"GATHER"`** is lesson 05's batched function. `k_cache[blocks]` copies every row's blocks, padding
#   included, into a contiguous `(batch, heads, max_blocks × block_size, dim)` tensor, and the same
#   for V; then one masked attention runs over the copy. Every block is read to copy it, the copy is
#   written, and then read again to attend: three passes over K and V, and a second copy of the
#   batch's K and V in memory, just to put the blocks in table order.
# * **`"IN_PLACE"`** never copies K or V. Each physical block is read by one row of the batch, so it
#   gives every block its reader's query, and one batched product over `k_cache`, in the pool's own
#   order, gives the scores of every block with its reader: each block read once, where it lies. Only
#   the scores, `block_size` numbers per block and head, move into each row's table order, where the
#   mask and the softmax run; the weights move back, and a second batched product with `v_cache` and
#   a sum per row give the output. (A block several rows share, after a fork or from a prefix cache,
#   lesson 08, is copied once and meets every row's query.) The price: the products run over the
#   whole pool, so blocks nobody reads cost as much as the others.
# * **`"FLEX_ATTENTION"`** hands the work to PyTorch's FlexAttention (`torch.nn.attention.flex_attention`,
#   torch 2.5 and later). The keys are the whole pool viewed as one long sequence (a view, no copy),
#   the queries are the batch's new tokens, and a *mask function* says whether query `b` may see pool
#   slot `kv`: yes when block `kv // block_size` is in row `b` of the block tables and the slot's
#   logical position is below `seq_lens[b]`. From it, `create_block_mask` builds a *block mask*
#   that lets the kernel skip every tile of the pool that a query cannot see. Compiled with
#   `torch.compile` on a GPU, this is one fused kernel that reads each block in place, like vLLM's;
#   anywhere else FlexAttention runs unfused, scoring every query against the whole pool.
# * **`"CPU_ATTN"`** is lesson 05's online softmax as a compiled kernel, in C: one task per sequence
#   and K/V head walks its block table, reads each block where it lies (only the slots its query
#   sees, the next block fetched ahead while the current one is computed), and keeps the running
#   maximum, sum and accumulator in float32. It reads what the batch reads, once, as SDPA over
#   contiguous K/V does. It is built once with your machine's C compiler (a second or so, quiet)
#   and kept; vLLM's CPU backend has the same name and the same loop, in C++.
#
# (`"TRITON_ATTN"`, the same loop as a Triton kernel, is lesson 12's.) Without `backend=`, the
# platform picks, as vLLM's platforms do: on a CPU, `CPU_ATTN` when its kernel can be built here
# and `GATHER` otherwise (a machine with no C compiler); on a GPU, the Triton kernel when triton is
# installed.
#
# First, all of them must be exact. Each is checked against SDPA, sequence by sequence, on the batch
# above. (On a CPU, FlexAttention warns that it runs unfused; we know, so the cell silences that
# one warning. On a GPU the first `"FLEX_ATTENTION"` call compiles its kernel, which takes a while.)

# %%
BACKENDS = ("GATHER", "IN_PLACE", "FLEX_ATTENTION", "CPU_ATTN")
for name in BACKENDS:
    why_not = registry.BACKENDS[name].unavailable(device, torch.float32, torch.float32)
    if why_not:  # CPU_ATTN off the CPU or without a C compiler
        print(f"backend {name!r:>16} cannot run here: {why_not}")
        continue
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = paged_attention(query, cache.k_cache, cache.v_cache, block_tables, seq_lens, backend=name)
    print(f"backend {name!r:>16} equals SDPA on all five sequences:", torch.allclose(out, expected, **TOL))

# %% [markdown]
# **Predict, then run.** Now the cost, on a batch the size of a small server's: 32 sequences of 512
# tokens, 8 heads of dimension 64, blocks of 16, scattered over a pool they fill. The baseline is
# SDPA on the same tokens held contiguously, the fused attention a contiguous cache would use. How
# much slower than it is each backend, roughly? Does any of them come close?
#
# Timing on a laptop that is doing other things is noisy, so the cell follows the rules of
# `paged_kv.timing`, the course's one timer: torch runs on one thread, every contender is called
# twice before the clock starts, then the contenders take turns, round after round (a burst of load
# slows all of them in the same round), and each ratio is the median over 7 rounds. The course's
# tests do not compare this cell's output.

# %%
# NBVAL_IGNORE_OUTPUT
BIG_BATCH, BIG_CONTEXT, BIG_BLOCK = 32, 512, 16
BIG_POOL = BIG_BATCH * BIG_CONTEXT // BIG_BLOCK  # 1,024 blocks, all of them used
big = PagedKVCacheAllocator(BIG_POOL, BIG_BLOCK, 8, 64, device=device)
for block in range(BIG_POOL):  # a busy server's shuffled free list, as above
    big.allocate_for_sequence(f"old{block}", BIG_BLOCK)
for block in torch.randperm(BIG_POOL, generator=torch.Generator().manual_seed(0)).tolist():
    big.free_sequence(f"old{block}")
big.k_cache.normal_()
big.v_cache.normal_()
for s in range(BIG_BATCH):
    big.allocate_for_sequence(s, BIG_CONTEXT)  # 32 blocks each, scattered over the pool
big_tables = big.block_tables_tensor(range(BIG_BATCH))
big_lens = torch.full((BIG_BATCH,), BIG_CONTEXT, device=device)
big_query = torch.randn(BIG_BATCH, 8, 64, device=device)
kv = [big.read_kv(s) for s in range(BIG_BATCH)]  # the same tokens, contiguous: (32, heads, 512, dim)
k_contig = torch.stack([k.transpose(0, 1) for k, _ in kv])
v_contig = torch.stack([v.transpose(0, 1) for _, v in kv])
DEFAULT = registry.default_backend(device, torch.float32)  # CPU_ATTN on a CPU with a C compiler


def big_paged(backend, rows=BIG_BATCH):
    """paged_attention on the first `rows` sequences of the big pool, in one backend."""
    return paged_attention(
        big_query[:rows], big.k_cache, big.v_cache, big_tables[:rows], big_lens[:rows], backend=backend
    )


timed = dict.fromkeys(["GATHER", "IN_PLACE", "FLEX_ATTENTION", DEFAULT])  # in order, once each
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    timings = compare_times(
        {"SDPA": lambda: F.scaled_dot_product_attention(big_query[:, :, None], k_contig, v_contig)}
        | {name: (lambda name=name: big_paged(name)) for name in timed},
        repeats=7,
        threads=1,
        device=device,
    )
print("the default backend here:", DEFAULT)
for name in timed:
    print(f"{name:>14}: {how_fast(timings.ratio(name, 'SDPA'))} SDPA on contiguous K/V")

# %% [markdown]
# The cell printed one factor per backend for this run of it. On the 2-core CPU this course was
# written on, it ran 9 times (`bench/lesson_ratios.py`): 5 on a quiet machine and 4 with two more
# processes computing on both cores. **GATHER** came out 16 to 17 times slower than SDPA (15 to 18
# with the two processes), unfused **FLEX_ATTENTION** 35 to 39 times slower (34 to 38), **IN_PLACE**
# 1.3 times slower (1.2 to 1.4), and **CPU_ATTN** 1.4 to 1.5 times slower, quiet or busy. With other
# work beside it your factors can fall outside these ranges, either way; what held in every run is
# the gather and unfused FlexAttention far behind the other two. `IN_PLACE` and `CPU_ATTN` both read
# K and V once, as SDPA does, but not alike: `IN_PLACE` streams the whole pool in its own order, where `CPU_ATTN` reads one block of one head, 4 KiB here,
# from wherever it lies, and asks for the next one while it computes. That request matters: made
# into the smallest cache, the L1, it stalled the very loads it was meant to help, and the kernel
# came out twice as slow as SDPA; made into the L2, as now, it gives the figures above (one
# thread), and 0.9 to 1.2 times SDPA with two threads on `bench/bench_attention.py`'s batch (quiet).
#
# The copy is the gap between the gather and the others: it moves the batch's whole K and V twice
# more than attention needs, and on a CPU moving memory is what decode attention spends its time
# on, so avoiding it brings a kernel within a small factor of the fused contiguous one. That is
# what the vLLM paper's dedicated kernel does on a GPU, where its 20 to 26 % overhead comes from the
# look-ups, not from copies. Unfused FlexAttention is slower still because, without a compiled
# kernel, its mask cannot skip anything: it scores each of the 32 queries against all 16,384 slots
# of the pool, 32 times the work. On a GPU, compiled, its block mask lets the kernel skip the tiles
# a query cannot see, which is what it is for. (This course has not timed it on a GPU: run this
# cell on one to see; the first `"FLEX_ATTENTION"` call above paid for the compilation.)
#
# Why not always read in place, then, as `IN_PLACE` does? Because it pays for the whole pool. The
# next cell decodes only 2 of the 32 sequences, which read 1/16 of the pool, and times in place
# against the gather, and the default backend beside them.

# %%
# NBVAL_IGNORE_OUTPUT
FEW = 2
read_by_few = big_tables[:FEW].unique().numel()
print(f"{FEW} sequences read {read_by_few} of {big.num_blocks} blocks")
few = compare_times(
    {
        name: (lambda name=name: big_paged(name, FEW))
        for name in dict.fromkeys(["GATHER", "IN_PLACE", DEFAULT])
    },
    repeats=7,
    number=2,  # calls of a few milliseconds: two per sample
    threads=1,
    device=device,
)
print(f"reading in place is {how_fast(few.ratio('IN_PLACE', 'GATHER'))} gathering, for {FEW} sequences")
print(f"the default, {DEFAULT}, is {how_fast(few.ratio(DEFAULT, 'GATHER'))} gathering")

# %% [markdown]
# Here the copy is small (two sequences' blocks) while the in-place products still cover all 1,024
# blocks. The cell printed this run's factors; in the same 9 runs, in place came out 3.3 to 3.5
# times slower than the gather for the two sequences, quiet or busy, and `CPU_ATTN` 2.4 to 2.6
# times faster than the gather (2.3 to 2.9 with the two processes), the copy saved and nothing else
# read. Beside other work a run can print factors outside these ranges; in place behind the gather
# and `CPU_ATTN` ahead of it held in all 9. When this lesson was first written, in place and the
# gather cost about the same for 4 of the 32 sequences, an eighth of the pool. A kernel has no such
# trade-off: it follows each row's block table and reads only those blocks, in place.

# %% [markdown]
# ## 2. Grouped-query and multi-query attention
#
# Until now every query head had its own K/V head. Many models served today do not (Llama 3,
# Mistral and Qwen2 among them). In **grouped-query attention** (GQA) the query heads come in
# groups, and all the heads of a group share one key head and one value head; **multi-query
# attention** (MQA) is the extreme case, one K/V head shared by every query head. Ordinary
# multi-head attention (MHA) is the other end, groups of one. The model still computes `num_heads`
# queries per token; it computes, and keeps, fewer keys and values.
#
# The KV cache cares because it stores only what is kept: the queries are computed afresh for the
# new token at every step and thrown away, while K and V stay for the rest of the sequence. So the
# cache holds `num_kv_heads` heads, not `num_heads`. Llama-3-8B has 32 layers, each with 32 query
# heads over 8 KV heads of 128 dimensions; in 16 bits one token of its KV cache takes
# 2 (K and V) · 32 layers · 8 heads · 128 dims · 2 bytes:

# %%
LAYERS, Q_HEADS, KV_HEADS, DIMS, BYTES = 32, 32, 8, 128, 2  # Llama-3-8B, 16-bit K/V
per_token = 2 * LAYERS * KV_HEADS * DIMS * BYTES
without_gqa = 2 * LAYERS * Q_HEADS * DIMS * BYTES
print(f"KV cache per token: {per_token:,} bytes = {per_token // 1024} KiB")
print(f"with a K/V head per query head: {without_gqa // 1024} KiB, {without_gqa // per_token} times as much")

# %% [markdown]
# A quarter of the memory per token means four times the tokens in the same pool: the same lever as
# paging (lesson 00), pulled from the model's side. The block manager does not change at all (a
# block still holds `block_size` tokens, and a table still lists blocks); only the pools are
# `(num_blocks, num_kv_heads, block_size, head_dim)`, and the attention kernel must know which K/V
# head each query head reads.
#
# The rule is the one the models are trained with: with `group = num_heads // num_kv_heads`, query
# head `h` reads K/V head `h // group`, so the heads of one group are consecutive. It is what
# Hugging Face's `repeat_kv` builds (each K/V head repeated `group` times,
# `torch.repeat_interleave(k, group, dim=heads)`) and what SDPA computes with `enable_gqa=True`.
# The picture shows 8 query heads over 8, 2 and 1 K/V heads; each line is the K/V head a query
# head reads, in that head's colour.

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 2.4))
for ax, (title, kv_heads) in zip(
    axes, [("MHA: 8 over 8", 8), ("GQA: 8 over 2", 2), ("MQA: 8 over 1", 1)], strict=True
):
    group = 8 // kv_heads
    for j in range(kv_heads):  # the K/V heads, centred under their group
        x = (j + 0.5) * group - 0.5
        ax.add_patch(plt.Rectangle((x - 0.4, -0.4), 0.8, 0.8, facecolor=colour(j), edgecolor="#333333"))
        ax.text(x, -0.5, f"kv{j}", ha="center", va="top", fontsize=7)
    for h in range(8):  # the query heads, each joined to K/V head h // group
        ax.add_patch(plt.Rectangle((h - 0.4, 1.6), 0.8, 0.8, facecolor="white", edgecolor=colour(h // group)))
        ax.text(h, 2, f"q{h}", ha="center", va="center", fontsize=7)
        ax.plot([h, (h // group + 0.5) * group - 0.5], [1.6, 0.4], color=colour(h // group), linewidth=1.2)
    ax.set_xlim(-0.7, 7.7)
    ax.set_ylim(-1.0, 2.6)
    ax.set_title(title, fontsize=10)
    ax.axis("off")
fig.tight_layout()
plt.show()

# %% [markdown]
# Now in code: a pool whose blocks hold 2 K/V heads, and 8 query heads per token, groups of 4. The
# cache is the same `PagedKVCacheAllocator` as before, created with 2 heads, and its sequences are
# written and read exactly as in lesson 05. The reference repeats each sequence's K/V to 8 heads
# (`repeat_interleave`) and runs SDPA, one sequence at a time; `paged_attention` takes the 8-head
# queries and the 2-head caches directly, in every backend.

# %%
GQA_Q_HEADS, GQA_KV_HEADS = 8, 2
GROUP = GQA_Q_HEADS // GQA_KV_HEADS
gen = torch.Generator().manual_seed(5)
gqa = PagedKVCacheAllocator(NUM_BLOCKS, BLOCK_SIZE, GQA_KV_HEADS, HEAD_DIM, device=device)
gqa_lengths = [11, 4, 16, 6, 1]  # the same lengths as the batch above
for seq, length in enumerate(gqa_lengths):
    gqa.allocate_for_sequence(seq, length)
    k, v = torch.randn(2, length, GQA_KV_HEADS, HEAD_DIM, generator=gen).to(device)
    gqa.write_kv(seq, k, v)
gqa_tables = gqa.block_tables_tensor(range(len(gqa_lengths)))
gqa_lens = torch.tensor(gqa_lengths, device=device)
gqa_query = torch.randn(len(gqa_lengths), GQA_Q_HEADS, HEAD_DIM, generator=gen).to(device)
print("k_cache:", tuple(gqa.k_cache.shape), "| query:", tuple(gqa_query.shape))


def repeated_reference(q, k, v):
    """SDPA of q (q_heads, dim) over k, v (tokens, kv_heads, dim), each K/V head repeated for its group."""
    group = q.shape[0] // k.shape[1]
    return sdpa_one(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


gqa_expected = torch.stack(
    [repeated_reference(gqa_query[s], *gqa.read_kv(s)) for s in range(len(gqa_lengths))]
)
for name in BACKENDS:
    if registry.BACKENDS[name].unavailable(device, torch.float32, torch.float32):
        continue  # CPU_ATTN off the CPU or without a C compiler, as above
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = paged_attention(gqa_query, gqa.k_cache, gqa.v_cache, gqa_tables, gqa_lens, backend=name)
    print(
        f"backend {name!r:>16}: output {tuple(out.shape)}, equals repeat + SDPA:",
        torch.allclose(out, gqa_expected, **TOL),
    )
k0, v0 = (t.transpose(0, 1)[None] for t in gqa.read_kv(0))
sdpa_gqa = F.scaled_dot_product_attention(gqa_query[0][None, :, None], k0, v0, enable_gqa=True)[0, :, 0]
print("SDPA's own enable_gqa agrees on sequence 0:", torch.allclose(sdpa_gqa, gqa_expected[0], **TOL))

# %% [markdown]
# The output has one row per query head, `(batch, 8, head_dim)`, from a cache that holds 2. The
# package never builds the repeated K/V of the reference, which would be `GROUP` = 4 copies of every
# block: it views each token's 8 query heads as `(2 K/V heads, 4 heads per group)`, and the products
# with K and V broadcast over the group, so each block is still read once, for four queries at a
# time.
#
# **Predict, then run.** Suppose a kernel paired the heads the other way round, query head `h` with
# K/V head `h % num_kv_heads` (q0, q2, q4, q6 on kv0), as repeating the whole set of K/V heads with
# `k.repeat(1, GROUP, 1)` would. Same heads, same numbers of each: does it still equal the reference?

# %%
interleaved = torch.stack(
    [
        sdpa_one(gqa_query[s], *(t.repeat(1, GROUP, 1) for t in gqa.read_kv(s)))
        for s in range(len(gqa_lengths))
    ]
)
print("h % num_kv_heads equals the reference:", torch.allclose(interleaved, gqa_expected, **TOL))
same_heads = [h for h in range(GQA_Q_HEADS) if torch.allclose(interleaved[:, h], gqa_expected[:, h], **TOL)]
print("query heads that still agree:", same_heads)

# %% [markdown]
# No. Only the query heads that land on the same K/V head either way still agree: q0 and q2 (kv0
# both ways), q5 and q7 (kv1). Both pairings are attention, but the model's weights were trained with one of them, and
# the wrong one silently mixes each query with another group's keys, exactly like a wrong block in a
# table. Consecutive groups (`h // group`) are the convention of Hugging Face's models and of vLLM.
# In vLLM the attention backends are built with both counts: `FlashAttentionImpl` in
# `vllm/v1/attention/backends/flash_attn.py` takes `num_heads` and `num_kv_heads` (its
# `num_queries_per_kv` is their quotient), its cache holds `num_kv_heads` heads per token, and the
# kernel maps each query head to its K/V head itself, as this course's `paged_attention` does.

# %% [markdown]
# ## 3. Several new tokens at once: a prompt chunk over the cache
#
# Decode brings one new token per sequence. A prompt brings many, and they do not always start at
# position 0. Sequence `p` below holds 13 tokens: the first 8 are already in the cache, and a chunk of
# 5 new tokens, positions 8 to 12, is computed now. Its K/V are written into the cache first (lesson
# 03's slots), then each new token attends to the cached positions and to the new ones up to its own,
# **causally**: the query at position `8 + i` sees positions `0 .. 8 + i`, never a later one. Two
# situations of a serving engine produce exactly this query of `q` tokens at an offset:
#
# * **chunked prefill.** A long prompt is split into chunks that fit a step's token budget; each chunk
#   attends to the earlier chunks, which earlier steps left in the cache.
# * **a prefix-cache hit** (lesson 08). The first blocks of the prompt are found already computed, in
#   blocks another request filled; only the rest is computed, attending to them.
#
# A fresh prompt is the case of an offset of 0, and decode the case of `q = 1`: one function covers all
# three. The package's is `paged_prefill_attention`: the new queries packed one sequence after another,
# the block tables, each sequence's length (new tokens included) and its number of new tokens. The
# reference is SDPA with `is_causal=True` on the whole sequence held contiguously, of which the chunk
# is the last 5 rows.

# %%
CACHED, CHUNK = 8, 5  # 8 tokens already in the cache, a chunk of 5 new ones
gen = torch.Generator().manual_seed(7)
q_p, k_p, v_p = torch.randn(3, CACHED + CHUNK, NUM_HEADS, HEAD_DIM, generator=gen).to(device)
cache.allocate_for_sequence("p", CACHED)  # the earlier chunk, or the blocks of a prefix-cache hit
cache.write_kv("p", k_p[:CACHED], v_p[:CACHED])
cache.append_tokens("p", CHUNK)  # the chunk's slots...
cache.write_kv("p", k_p[CACHED:], v_p[CACHED:], start_position=CACHED)  # ...and its K/V, before attention
print("block table of p:", cache.get_block_mapping("p"), "| length", cache.sequence_length("p"))

out_chunk = paged_prefill_attention(
    q_p[CACHED:], cache.k_cache, cache.v_cache, cache.block_tables_tensor(["p"]), [13], [CHUNK]
)
whole = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q_p, k_p, v_p)), is_causal=True)
print("chunk output:", tuple(out_chunk.shape), "= (new tokens, heads, head_dim)")
print(
    "equals the last 5 rows of causal SDPA on all 13:",
    torch.allclose(out_chunk, whole.transpose(0, 1)[CACHED:], **TOL),
)

# %% [markdown]
# **Predict, then run.** Two ways to get it wrong: attend over the chunk alone, as if it were a fresh
# prompt, or over all 13 positions without the causal mask. Which of the 5 rows still agree in each
# case?

# %%
expected_chunk = whole.transpose(0, 1)[CACHED:]
alone = F.scaled_dot_product_attention(*(t[CACHED:].transpose(0, 1) for t in (q_p, k_p, v_p)), is_causal=True)
no_mask = F.scaled_dot_product_attention(
    q_p[CACHED:].transpose(0, 1), k_p.transpose(0, 1), v_p.transpose(0, 1)
)
for name, wrong in [("the chunk alone", alone), ("no causal mask", no_mask)]:
    rows = [torch.allclose(wrong.transpose(0, 1)[i], expected_chunk[i], **TOL) for i in range(CHUNK)]
    print(f"{name:>15}: rows that agree {rows}")

# %% [markdown]
# The chunk alone is wrong everywhere: every new token misses the 8 cached ones. Without the mask only
# the last row agrees, because position 12, the last, may see all 13 anyway; every earlier row also
# sees tokens that come after it, which a causal model never sees in training.
#
# One call takes a whole batch of such queries, of any mix of lengths. Below, `a` decodes (1 new
# token, its query in `query[0]`, over its 11) while `p` computes its chunk; the rows are packed `a`'s
# first, then `p`'s, and each row comes out as in its own call.

# %%
mixed = paged_prefill_attention(
    torch.cat([query[:1], q_p[CACHED:]]),  # 1 + 5 query rows, one sequence after the other
    cache.k_cache,
    cache.v_cache,
    cache.block_tables_tensor(["a", "p"]),
    seq_lens=[11, 13],
    query_lens=[1, CHUNK],
)
print("packed rows:", mixed.shape[0])
print("row 0, a's decode, equals its SDPA:", torch.allclose(mixed[0], expected[0], **TOL))
print("rows 1 to 5, p's chunk, equal its own call above:", torch.allclose(mixed[1:], out_chunk, **TOL))

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. The backends of `vllm/v1/attention/backends/` take every query token
# of a step, decodes and prompt chunks packed together, in one call per layer:
#
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionImpl.forward` takes the step's
#   `query`, every scheduled token of every request, packed, with `num_heads` query heads over the
#   cache's `num_kv_heads`; `num_queries_per_kv` is their quotient, the GQA group of section 2, and
#   the kernel maps each query head to its K/V head itself.
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionMetadata` carries `query_start_loc`,
#   where each request's queries start in the packed batch (the running sum of this course's
#   `query_lens`), beside `seq_lens` (the lengths, new tokens included, by the same name here),
#   `block_table`, `max_query_len` and `max_seq_len`: what this course's `paged_prefill_attention`
#   takes in section 3.
# * `vllm/v1/attention/backend.py`: `AttentionImpl.forward(layer, query, key, value, kv_cache,
#   attn_metadata, output)` is every backend's one entry, and `CommonAttentionMetadata` the batch
#   every backend's metadata builder reads (`query_start_loc`, `query_start_loc_cpu`, `seq_lens`,
#   `block_table_tensor`, `slot_mapping`); the course's backends have the same `forward`, without
#   the `layer` and `output` arguments.
# * `vllm/v1/attention/backends/registry.py`: `AttentionBackendEnum` names the backends;
#   `FLEX_ATTENTION`, `TRITON_ATTN` and `CPU_ATTN` are this lesson's names for the same ideas.
# * `vllm/v1/attention/backends/flex_attention.py`: `FlexAttentionImpl`, the FlexAttention backend,
#   this course's `"FLEX_ATTENTION"` grown up: the keys are the whole pool, and
#   `physical_to_logical_mapping` inverts the block tables so that a mask function can ask where a
#   pool slot sits in a request.
# * `vllm/v1/attention/backends/cpu_attn.py`: `CPUAttentionBackendImpl`, vLLM's backend on the CPU,
#   takes the packed step to `cpu_attention_with_kv_cache`, its C++ kernel, with the step's
#   `query_start_loc`, `seq_lens`, `block_table` and the layer's `sliding_window` and
#   `logits_soft_cap`: the course's `CPU_ATTN` in C++, with a variant per instruction set.
# * `vllm/platforms/cpu.py`: `CpuPlatform.get_attn_backend_cls` gives `CPU_ATTN` on every CPU (MLA
#   models aside), as the course's platform default does where a compiler is found;
#   `vllm/platforms/cuda.py` tries `FLASH_ATTN`, `FLASHINFER`, `TRITON_ATTN` and `FLEX_ATTENTION` in
#   turn, `FLASHINFER` first on compute capability 10 (B200) (`_get_backend_priorities`).
# * `vllm/v1/attention/backends/triton_attn.py`: `TritonAttentionImpl.forward` splits the cache's
#   view into K and V and calls `unified_attention`, the Triton kernel lesson 12 reads.
#
# What the course leaves out or does differently: the kernels vLLM runs are compiled and fused, so
# none has the gather's copies or the in-place products' price for the whole pool; the course's
# `paged_attention` takes one new token per sequence and `paged_prefill_attention` any number, where
# every vLLM backend takes the packed step (the course's backends do too, through their `forward`).

# %% [markdown]
# ## Recap
#
# * `paged_attention(..., backend=)` names the backend, as vLLM's registry names its own: `"GATHER"`
#   copies every block (three passes over K and V), `"IN_PLACE"` reads each block once where it lies
#   but pays for the whole pool, `"FLEX_ATTENTION"` is FlexAttention with a block mask, fast only
#   compiled on a GPU, and `"CPU_ATTN"` is lesson 05's online softmax compiled in C, reading only
#   the blocks the batch reads, in place. All of them equal SDPA. On this course's 2-core CPU, 32
#   sequences of 512 tokens, one thread, 9 runs quiet and busy: gather 15 to 18 times slower than
#   SDPA on contiguous K/V, in place 1.2 to 1.4 times, `CPU_ATTN` 1.4 to 1.5 times (a run beside
#   other work can fall outside). Without `backend=`
#   a CPU gets `CPU_ATTN` where a C compiler is found, `GATHER` elsewhere.
# * Grouped-query attention shares each K/V head among a group of query heads (Llama-3-8B: 32 over
#   8), multi-query attention shares one among all; the cache holds only the K/V heads, 128 KiB per
#   token for Llama-3-8B in 16 bits instead of 512 KiB. Query head `h` reads K/V head
#   `h // (num_heads // num_kv_heads)`, as `repeat_kv` and SDPA's `enable_gqa` pair them; every
#   backend of `paged_attention` takes such caches without repeating K/V.
# * A prompt chunk of `q` new tokens at an offset (chunked prefill, or the rest of a prompt after a
#   prefix-cache hit) attends causally to the cached positions and its own: `paged_prefill_attention`
#   equals the last `q` rows of causal SDPA on the whole sequence (5 of 13 here). The chunk alone is
#   wrong in every row; without the causal mask only the last row is right.
# * One call packs decodes (one query row each) and chunks of any length, one sequence after the
#   other, as vLLM's backends take a step's tokens.
#
# **Next, lesson 07:** a concurrent workload, many sequences arriving and finishing at different
# times, and how much memory paging saves there against contiguous reservations. The exercise for this
# lesson, `exercises/06_attention_at_scale.ipynb`, has you write grouped-query decode attention and
# the attention of prompt chunks over the cache yourself.

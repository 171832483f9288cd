# %% [markdown]
# # Exercise 12 · Writing the kernel
#
# In this exercise you write the body of lesson 12's paged decode kernel in Triton: one program per
# (sequence, KV head) finds its query heads, walks its sequence's block table, loads each block's K
# and V through the cache's strides, masks the tail of the last block, and combines the blocks with
# the online softmax of lesson 05. You write a plain Python function in Triton's language; the check
# turns it into a kernel with `triton.jit`, the way `paged_kv.attention.triton_decode` does with the
# package's own, and launches it with the package's launcher. Without a GPU, Triton's interpreter
# runs it on the CPU with numpy; with one, Triton compiles it.
#
# Triton publishes Linux wheels only. On macOS or Windows the first cell says so, and the check fails
# with that reason: do this exercise on Linux (WSL on Windows counts).
#
# Work top to bottom. Replace the `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The package's kernel, `paged_kv/attention/triton_kernel.py`, is the
# finished version: try without looking first. Grade the whole exercise from a terminal in the
# repository: `.venv/bin/python -m paged_kv.grade my_course/exercises/12_writing_the_kernel.ipynb`.

# %%
import torch

import paged_kv
from paged_kv.attention.paged import paged_attention
from paged_kv.attention.triton_decode import triton_decode, triton_interpreted
from paged_kv.attention.triton_language import MISSING, tl  # sets Triton's mode, then imports it
from paged_kv.checks import check

print(MISSING or f"Triton {'interprets' if triton_interpreted() else 'compiles'} kernels here")

# %% [markdown]
# ## Task 1 · The paged decode kernel
#
# Write the body of `paged_decode_kernel`. The launcher calls it with `grid = (batch, num_kv_heads)`,
# so `tl.program_id(0)` is the sequence and `tl.program_id(1)` the KV head; the first lines, given,
# make the index vectors. Then, in this order:
#
# 1. **The query heads.** The program handles the `GROUP` query heads that read its KV head:
#    `kv_head * GROUP + members`. Load their queries, `(GROUP_PADDED, HEAD_DIM_PADDED)`, masked where
#    `members >= GROUP` or `dims >= HEAD_DIM` (the padding to powers of two), as float32.
# 2. **The running state**, per query head: `m` (the running maximum score, `-inf`), `total` (the
#    running sum of `exp(score - m)`, 0) and `acc` (the running sum of weights times V, 0).
# 3. **The loop** over logical blocks `j` in `range(0, tl.cdiv(context_len, BLOCK_SIZE))`, with
#    `context_len = tl.load(context_lens_ptr + seq)`:
#    * the physical block id: entry `j` of row `seq` of the table, `block_tables_ptr + seq *
#      table_stride_seq + j * table_stride_entry`, as `tl.int64` (offsets can exceed 2**31);
#    * the live slots: `slots < BLOCK_SIZE` and `j * BLOCK_SIZE + slots < context_len`;
#    * K of the block, `(BLOCK_PADDED, HEAD_DIM_PADDED)`, at `k_cache_ptr + block * k_stride_block +
#      kv_head * k_stride_head + slots * k_stride_slot + dims * k_stride_dim` (broadcast `slots[:,
#      None]` and `dims[None, :]`), masked to live slots, as float32;
#    * the scores, `(GROUP_PADDED, BLOCK_PADDED)`: `tl.sum(q[:, None, :] * k[None, :, :], axis=2) *
#      scale`, `-inf` where a slot is not live;
#    * the online-softmax update: `m_new = tl.maximum(m, tl.max(scores, axis=1))`, `rescale =
#      tl.exp(m - m_new)`, `weights = tl.exp(scores - m_new[:, None])`, then `total` and `acc`
#      rescaled and the block's terms added (V loaded like K), and `m = m_new`.
# 4. **The output**: store `acc / total[:, None]`, cast to `out_ptr.dtype.element_ty`, at the query
#    heads' rows of `out`, masked like the query.
#
# **Checked:** against `paged_attention(..., strategy="gather")` within `atol=rtol=1e-5`, on scattered
# blocks of a pool full of stale data: one sequence of one full block, a partly full last block,
# several blocks, a batch of three sequences, grouped-query attention (2 KV heads, 2 query heads
# each), and vLLM v1's cache layout read through its strides. A wrong output is compared with the
# classic mistakes: a token position off by one, a live mask written `<= context_len`, the tail of
# the last block not masked, the block loop one block short (`tl.cdiv(context_len, BLOCK_SIZE) - 1`
# or `context_len // BLOCK_SIZE`), K or V read one slot after or before its own, the running maximum
# not rescaled, a query head reading the wrong KV head, a block id read from the wrong row. In
# Triton's interpreter the check also records the table entries your kernel reads: only those of
# each sequence's own blocks, which a block loop one block too long oversteps (its output is right).


# %%
def paged_decode_kernel(
    out_ptr,  # (batch, num_heads, head_dim), the query's dtype
    query_ptr,  # (batch, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, num_kv_heads, block_size, head_dim), any strides
    v_cache_ptr,  # the same axes as k_cache, its own strides
    block_tables_ptr,  # (batch, max_blocks), integer block ids
    context_lens_ptr,  # (batch,), contiguous, each >= 1
    scale,
    out_stride_seq,
    out_stride_head,
    out_stride_dim,
    q_stride_seq,
    q_stride_head,
    q_stride_dim,
    k_stride_block,
    k_stride_head,
    k_stride_slot,
    k_stride_dim,
    v_stride_block,
    v_stride_head,
    v_stride_slot,
    v_stride_dim,
    table_stride_seq,
    table_stride_entry,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PADDED: tl.constexpr,  # the three sizes rounded up to powers of two (tl.arange's rule)
    BLOCK_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """Program ``(seq, kv_head)``: attention of query heads ``kv_head * GROUP ...`` of sequence ``seq``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    members = tl.arange(0, GROUP_PADDED)  # this program's query heads: kv_head * GROUP + members
    slots = tl.arange(0, BLOCK_PADDED)  # offsets within a block
    dims = tl.arange(0, HEAD_DIM_PADDED)
    ### BEGIN SOLUTION: the query heads and their queries, the running m, total and acc, the loop over the table's blocks (block id, live slots, K, scores, online-softmax update, V), then store acc / total
    heads = kv_head * GROUP + members
    real = (members < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]  # not padding: (group, dim)

    q_ptrs = query_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :] * q_stride_dim
    q = tl.load(q_ptrs, mask=real, other=0.0).to(tl.float32)
    context_len = tl.load(context_lens_ptr + seq)
    table_row = block_tables_ptr + seq * table_stride_seq

    m = tl.full((GROUP_PADDED,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((GROUP_PADDED,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PADDED, HEAD_DIM_PADDED), dtype=tl.float32)
    for j in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(table_row + j * table_stride_entry).to(tl.int64)
        live = (slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < context_len)
        loaded = live[:, None] & (dims < HEAD_DIM)[None, :]
        k_ptrs = (
            k_cache_ptr
            + block * k_stride_block
            + kv_head * k_stride_head
            + slots[:, None] * k_stride_slot
            + dims[None, :] * k_stride_dim
        )
        k = tl.load(k_ptrs, mask=loaded, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(live[None, :], scores, float("-inf"))

        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)
        weights = tl.exp(scores - m_new[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        v_ptrs = (
            v_cache_ptr
            + block * v_stride_block
            + kv_head * v_stride_head
            + slots[:, None] * v_stride_slot
            + dims[None, :] * v_stride_dim
        )
        v = tl.load(v_ptrs, mask=loaded, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out_ptrs = (
        out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :] * out_stride_dim
    )
    tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=real)
    ### END SOLUTION


# %%
check("12.paged_decode_kernel", paged_decode_kernel)

# %% [markdown]
# ## Your kernel at work
#
# Your kernel, launched by the package's launcher on three sequences of a cache with 4 query heads
# reading 2 KV heads, against the gather strategy. Try other lengths, block sizes and head counts.

# %%
if MISSING:
    print(MISSING)
else:
    device = paged_kv.default_device()
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 2, 8, 16, device=device)  # 10 blocks, 2 KV heads, 8 slots, dim 16
    query = torch.randn(3, 4, 16, device=device)
    tables = torch.tensor([[7, 2, 5], [0, 9, -1], [3, -1, -1]], device=device)
    lengths = torch.tensor([20, 9, 1], device=device)
    mine = triton_decode(query, k_cache, v_cache, tables, lengths, None, kernel=paged_decode_kernel)
    gathered = paged_attention(query, k_cache, v_cache, tables, lengths, strategy="gather")
    print("your kernel equals the gather:", torch.allclose(mine, gathered, atol=1e-5, rtol=1e-5))

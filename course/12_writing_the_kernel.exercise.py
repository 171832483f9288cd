# %% [markdown]
# # Exercise 12 · Writing the kernel
#
# In this exercise you write the body of lesson 12's paged attention kernel in Triton: one kernel for
# a whole engine step, decodes and prompt chunks packed together. A program per (sequence, KV head,
# tile of query tokens) finds its rows, the (query token, query head) pairs it computes, walks its
# sequence's block table, loads each block's K and V through the cache's strides, masks the tail of
# the last block and every position after a row's own (causal), and combines the blocks with the
# online softmax of lesson 05. You write a plain Python function in Triton's language; the check
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
from paged_kv.attention.paged import paged_prefill_attention
from paged_kv.attention.triton_decode import triton_attention, triton_interpreted
from paged_kv.attention.triton_language import MISSING, tl  # sets Triton's mode, then imports it
from paged_kv.checks import check
from paged_kv.checks.lesson12 import compare_with_gather, fill_stale

print(MISSING or f"Triton {'interprets' if triton_interpreted() else 'compiles'} kernels here")

# %% [markdown]
# ## Task 1 · The paged attention kernel
#
# Write the body of `paged_attention_kernel`. The launcher calls it with `grid = (batch, num_kv_heads,
# tiles)`, so `tl.program_id(0)` is the sequence, `tl.program_id(1)` the KV head and
# `tl.program_id(2)` the tile: query tokens `tile * QUERY_TILE` to `tile * QUERY_TILE + QUERY_TILE - 1`
# of the sequence. The first lines, given, make the index vectors. Then, in this order:
#
# 1. **The sequence's query tokens.** `query_start = tl.load(query_start_loc_ptr + seq)` is its first
#    row of the packed batch and `query_len` the next entry minus it; a program whose tile starts at
#    or past `query_len` returns at once. `seq_len = tl.load(seq_lens_ptr + seq)` counts the
#    sequence's tokens, query tokens included, so `context_len = seq_len - query_len` came before.
# 2. **The rows.** Row `r` is query token `token = tile * QUERY_TILE + r // GROUP` and query head
#    `kv_head * GROUP + r % GROUP`; the token's position is `query_pos = context_len + token`. A row
#    is real when `r < QUERY_TILE * GROUP` and `token < query_len`. Load the queries, `(ROWS_PADDED,
#    HEAD_DIM_PADDED)`, from row `query_start + token` of `query`, masked to real rows and `dims <
#    HEAD_DIM`, as float32.
# 3. **The running state**, per row: `m` (the running maximum score, `-inf`), `total` (the running sum
#    of `exp(score - m)`, 0) and `acc` (the running sum of weights times V, 0).
# 4. **The loop** over logical blocks `j` in `range(0, tl.cdiv(kv_len, BLOCK_SIZE))`, where `kv_len =
#    tl.minimum(context_len + (tile + 1) * QUERY_TILE, seq_len)` is what the tile's last token sees:
#    * the physical block id: entry `j` of row `seq` of the table, `block_tables_ptr + seq *
#      table_stride_seq + j * table_stride_entry`, as `tl.int64` (offsets can exceed 2**31);
#    * the positions `kv_pos = j * BLOCK_SIZE + slots` and the live slots: `slots < BLOCK_SIZE` and
#      `kv_pos < seq_len` (the tail of the last block holds no token: never load it);
#    * K of the block, `(BLOCK_PADDED, HEAD_DIM_PADDED)`, at `k_cache_ptr + block * k_stride_block +
#      kv_head * k_stride_head + slots * k_stride_slot + dims * k_stride_dim` (broadcast `slots[:,
#      None]` and `dims[None, :]`), masked to live slots, as float32;
#    * the scores, `(ROWS_PADDED, BLOCK_PADDED)`: `tl.sum(q[:, None, :] * k[None, :, :], axis=2) *
#      scale`, `-inf` where a slot is not **visible**: live, and `kv_pos <= query_pos` of the row
#      (causal: a query sees its own token and those before it);
#    * the online-softmax update: `m_new = tl.maximum(m, tl.max(scores, axis=1))`, `rescale =
#      tl.exp(m - m_new)`, `weights = tl.exp(scores - m_new[:, None])`, then `total` and `acc`
#      rescaled and the block's terms added (V loaded like K), and `m = m_new`.
# 5. **The output**: store `acc / total[:, None]`, cast to `out_ptr.dtype.element_ty`, at row
#    `query_start + token` and the rows' heads of `out`, masked like the queries.
#
# **Checked:** against `paged_prefill_attention(..., backend="GATHER")` within `atol=rtol=1e-5`, on
# scattered blocks of a pool full of stale data: one decode in one full block, a partly full last
# block, several blocks, a batch of decodes, grouped-query attention (2 KV heads, 2 query heads
# each), vLLM v1's cache layout read through its strides, a fresh prompt, a chunk after 7 cached
# tokens, a prompt longer than one tile, a packed step of decodes, a prompt, a chunk and a sequence
# with no query token, a prompt with 3 query heads per KV head (a tile of 5 tokens is 15 rows, padded
# to 16), and a decode, a chunk and a prompt in vLLM's layout. In each last block the slots
# past its sequence's end hold NaN from the second on (in the last case from the first), so a kernel
# that loads them fails. A wrong output is compared with the classic mistakes: the live mask off by
# one or written `<= seq_len`, the tail not masked, the block loop one block short (`tl.cdiv(kv_len,
# BLOCK_SIZE) - 1` or `kv_len // BLOCK_SIZE`), K or V read one slot after or before its own, the
# running maximum not rescaled, a query head reading the wrong KV head, a block id read from the
# wrong row; the causal mask leaving out the query's own token (`<` for `<=`) or missing, a query's
# position counted from 0, a query read from the wrong row of the packed batch, a row's token and
# head swapped, every tile computing the first tile's tokens. In Triton's interpreter the check also
# records the table entries your kernel reads: only those of each sequence's own blocks, which a
# block loop one block too long oversteps (its output is right). It records the rows each program
# stores, too: only its own, the tile's real rows (`r < QUERY_TILE * GROUP`, `token < query_len`). A
# program that writes a row of another tile or sequence (a mask written `<=`) leaves a right output in
# the interpreter, which runs the programs one after another, so the owner overwrites it; on a GPU
# they run at once and race. On any device the check sees a row stored past the batch's first or last.


# %%
def paged_attention_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim), the query's dtype
    query_ptr,  # (num_tokens, num_heads, head_dim): every sequence's query tokens, packed in order
    k_cache_ptr,  # (num_blocks, num_kv_heads, block_size, head_dim), any strides
    v_cache_ptr,  # the same axes as k_cache, its own strides
    block_tables_ptr,  # (batch, max_blocks), integer block ids
    seq_lens_ptr,  # (batch,): the tokens each sequence holds, its query tokens included
    query_start_loc_ptr,  # (batch + 1,): sequence b's query tokens are rows [b] .. [b + 1] - 1
    scale,
    out_stride_token,
    out_stride_head,
    out_stride_dim,
    q_stride_token,
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
    QUERY_TILE: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS_PADDED: tl.constexpr,  # QUERY_TILE * GROUP, BLOCK_SIZE and HEAD_DIM rounded up to powers of two
    BLOCK_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """Program ``(seq, kv_head, tile)``: query tokens ``tile * QUERY_TILE ...`` of sequence ``seq``,
    for query heads ``kv_head * GROUP ...``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    rows = tl.arange(0, ROWS_PADDED)  # (query token, query head) pairs, GROUP heads per token
    slots = tl.arange(0, BLOCK_PADDED)  # offsets within a block
    dims = tl.arange(0, HEAD_DIM_PADDED)
    ### BEGIN SOLUTION: the sequence's query tokens (return when the tile has none), each row's token, head and position, the queries, the running m, total and acc, the loop over the blocks the tile sees (block id, live slots, K, scores with the causal mask, online-softmax update, V), then store acc / total
    query_start = tl.load(query_start_loc_ptr + seq)  # the sequence's first row of the packed batch
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile * QUERY_TILE >= query_len:  # the sequence has no query token in this tile
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # the tokens before the query tokens, cached by earlier steps
    token = tile * QUERY_TILE + rows // GROUP  # which query token of the sequence each row is
    heads = kv_head * GROUP + rows % GROUP
    query_pos = context_len + token  # its position in the sequence
    real = ((rows < QUERY_TILE * GROUP) & (token < query_len))[:, None] & (dims < HEAD_DIM)[None, :]

    q_ptrs = (
        query_ptr
        + (query_start + token)[:, None] * q_stride_token
        + heads[:, None] * q_stride_head
        + dims[None, :] * q_stride_dim
    )
    q = tl.load(q_ptrs, mask=real, other=0.0).to(tl.float32)  # (rows, dim)
    table_row = block_tables_ptr + seq * table_stride_seq
    kv_len = tl.minimum(context_len + (tile + 1) * QUERY_TILE, seq_len)  # what the tile's last token sees

    m = tl.full((ROWS_PADDED,), float("-inf"), dtype=tl.float32)  # running maximum score
    total = tl.zeros((ROWS_PADDED,), dtype=tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((ROWS_PADDED, HEAD_DIM_PADDED), dtype=tl.float32)  # running sum of weights * V
    for j in range(0, tl.cdiv(kv_len, BLOCK_SIZE)):  # the logical blocks the tile's queries see
        block = tl.load(table_row + j * table_stride_entry).to(tl.int64)  # physical block id
        kv_pos = j * BLOCK_SIZE + slots  # the positions the block's slots hold
        # Slots at or past the sequence's length (the tail of the last block) hold no token.
        live = (slots < BLOCK_SIZE) & (kv_pos < seq_len)
        loaded = live[:, None] & (dims < HEAD_DIM)[None, :]  # (slot, dim)
        k_ptrs = (
            k_cache_ptr
            + block * k_stride_block
            + kv_head * k_stride_head
            + slots[:, None] * k_stride_slot
            + dims[None, :] * k_stride_dim
        )
        k = tl.load(k_ptrs, mask=loaded, other=0.0).to(tl.float32)  # (slot, dim)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (rows, slot)
        # Causal: a query sees the live positions up to its own, itself included.
        visible = live[None, :] & (kv_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        # Every row sees position 0 in the first block, so m_new is finite from then on.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)  # what the earlier blocks' terms shrink by; 0 on the first
        weights = tl.exp(scores - m_new[:, None])  # (rows, slot), 0 where not visible
        total = total * rescale + tl.sum(weights, axis=1)
        v_ptrs = (
            v_cache_ptr
            + block * v_stride_block
            + kv_head * v_stride_head
            + slots[:, None] * v_stride_slot
            + dims[None, :] * v_stride_dim
        )
        v = tl.load(v_ptrs, mask=loaded, other=0.0).to(tl.float32)  # (slot, dim)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out_ptrs = (
        out_ptr
        + (query_start + token)[:, None] * out_stride_token
        + heads[:, None] * out_stride_head
        + dims[None, :] * out_stride_dim
    )
    tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=real)
    ### END SOLUTION


# %%
check("12.paged_decode_kernel", paged_attention_kernel)

# %% [markdown]
# ## Your kernel at work
#
# Your kernel, launched by the package's launcher on one engine step: a decode, a fresh prompt of 6
# tokens and a chunk of 4 tokens after 9 cached ones, packed into 11 query rows, with 4 query heads
# reading 2 KV heads, against the `GATHER` backend. The gather runs first, on the clean pool; then
# `fill_stale` writes NaN into every slot that holds no token (the tail of each last block, the blocks
# no sequence holds), as a pool's stale memory may hold anything. Random stale data would not do: the
# causal mask gives those slots a weight of 0, which cancels any finite value but not NaN. So a kernel
# that loads them prints `False` and the rows they spoil. Try other lengths, block sizes and head counts.

# %%
if MISSING:
    print(MISSING)
else:
    device = paged_kv.default_device()
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 2, 8, 16, device=device)  # 10 blocks, 2 KV heads, 8 slots, dim 16
    tables = torch.tensor([[7, 2, 5], [0, -1, -1], [3, 9, -1]], device=device)
    seq_lens = torch.tensor([20, 6, 13], device=device)
    query_lens = torch.tensor([1, 6, 4], device=device)
    query = torch.randn(int(query_lens.sum()), 4, 16, device=device)
    query_start_loc = torch.tensor([0, 1, 7, 11], device=device)
    gathered = paged_prefill_attention(
        query, k_cache, v_cache, tables, seq_lens, query_lens, backend="GATHER"
    )
    fill_stale(k_cache, v_cache, tables, seq_lens)  # NaN in every slot that holds no token
    mine = triton_attention(
        query, k_cache, v_cache, tables, seq_lens, query_start_loc, 6, None, kernel=paged_attention_kernel
    )
    print(compare_with_gather(mine, gathered, query_start_loc))

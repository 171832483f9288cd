# %% [markdown]
# # Exercise 06 · Attention at scale
#
# In this exercise you take lesson 05's paged attention through two things a server needs, as
# lesson 06 did: grouped-query attention, where a cache of few K/V heads serves many query heads,
# and several new tokens per sequence, a prompt chunk that attends causally to the tokens already
# cached. First a decode batch with grouped heads, then one sequence's chunk, then a packed batch of
# decodes and chunks in one call, as an engine's step has them. Each task says what to build and
# how it is checked; the cell after it runs the check and prints a tick, or tells you which call
# gave which wrong answer.
#
# The checks run your code on sequences stored in scattered blocks of a pool whose other slots hold
# stale random data, so reading a wrong slot shows. Outputs are compared with
# `torch.nn.functional.scaled_dot_product_attention` (SDPA) on each sequence's K/V read back with
# `cache.read_kv`, every K/V head repeated for its group of query heads, using
# `torch.allclose(atol=1e-5, rtol=1e-5)`. A wrong output is compared with the classic mistakes, run
# on every case of the task, and the hint names the one your code behaves like.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished package has its own versions, `paged_kv.paged_attention`
# (task 1) and `paged_kv.paged_prefill_attention` (tasks 2 and 3), and SDPA is what the checks
# compare with: try without looking, and compute by hand with `torch.einsum`, a mask and
# `torch.softmax` (while your code runs, the checks make those three raise, and the package's
# `decode_attention` too). Lesson 05's gather is yours to reuse.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/06_attention_at_scale.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
import torch

import paged_kv
from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · Decode attention with grouped-query heads
#
# Write `gqa_decode_attention(query, k_cache, v_cache, block_tables, seq_lens)`, lesson 05's
# `paged_decode_attention` for a cache of fewer K/V heads than the query has:
#
# * `query` has shape `(batch, num_heads, head_dim)`, one new token per sequence;
# * `k_cache` and `v_cache` have shape `(num_blocks, num_kv_heads, block_size, head_dim)`, with
#   `num_kv_heads` dividing `num_heads`: `group = num_heads // num_kv_heads` query heads share each
#   K/V head, and **query head `h` reads K/V head `h // group`** (the heads of a group are
#   consecutive, as Hugging Face's `repeat_kv` and SDPA's `enable_gqa` pair them);
# * `block_tables` is a `(batch, max_blocks)` integer tensor padded with `-1`, `seq_lens` a
#   `(batch,)` integer tensor: sequence `b` attends to its first `seq_lens[b]` positions;
# * the scale is `1 / sqrt(head_dim)`; return `(batch, num_heads, head_dim)`.
#
# The point is to do it **without repeating K and V** for every query head, as section 2 of the
# lesson says the package does: `repeat_interleave` would make `group` copies of every block the
# batch reads. View the query as `(batch, num_kv_heads, group, head_dim)` instead, and write the two
# products so that they broadcast over the group axis (`torch.einsum("bkgd,bkpd->bkgp", ...)`); then
# mask, softmax, and flatten the `(num_kv_heads, group)` axes back into `num_heads`. The check
# compares outputs only, so it cannot tell whether you repeated K/V: that part is on your honour.
#
# **Checked:** against SDPA per sequence, K/V repeated to the query heads: one sequence in two full
# blocks with 4 query heads over 2 K/V heads; groups of 4 with a partly filled last block; a batch
# of six with padded rows and partial blocks, 6 heads over 3; multi-query attention (8 heads over
# 1); groups of 1 (lesson 05's case); and 8 heads over 4. A wrong output is compared with query head
# `h` reading K/V head `h % num_kv_heads` (what `k.repeat(1, group, 1)` pairs), with K/V head
# `h // num_kv_heads` (the group computed the other way round), and with the positions past
# `seq_len` not masked.


# %%
def gqa_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    """Paged decode attention, query head h reading KV head h // group: (batch, num_heads, head_dim)."""
    ### BEGIN SOLUTION: gather (batch, kv_heads, positions, dim) as in lesson 05, view the query as (batch, kv_heads, group, dim), einsum 'bkgd,bkpd->bkgp', mask positions >= seq_len, softmax, einsum with V, flatten back to num_heads
    batch, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(batch, num_kv_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    grouped = query.view(batch, num_kv_heads, group, head_dim)  # query head h is (h // group, h % group)
    scores = torch.einsum("bkgd,bkpd->bkgp", grouped, k) * head_dim**-0.5
    beyond = torch.arange(num_positions, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgp,bkpd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(batch, num_heads, head_dim)
    ### END SOLUTION


# %%
check("06.gqa_decode_attention", gqa_decode_attention)

# %% [markdown]
# ## Task 2 · A prompt chunk over the cache
#
# Write `chunk_attention(query, k_cache, v_cache, block_table, seq_len)` for one sequence that
# holds `seq_len` tokens, of which the last `q = query.shape[0]` are new: a chunk of its prompt
# (chunked prefill), the rest of a prompt after a prefix-cache hit, a fresh prompt (`q ==
# seq_len`) or a decode (`q == 1`). Their K/V are already written into the cache.
#
# * `query` has shape `(q, num_heads, head_dim)`: row `i` is the query of position
#   `seq_len - q + i`;
# * `block_table` is the sequence's row of block ids, a 1-D integer tensor that may be padded with
#   `-1` past the `ceil(seq_len / block_size)` entries it needs; the caches are as in task 1,
#   grouped heads included;
# * **causal**: query `i` sees positions `0 .. seq_len - q + i`, the cached ones and the new ones
#   up to its own, and no later one;
# * the scale is `1 / sqrt(head_dim)`; return `(q, num_heads, head_dim)`.
#
# Gather the sequence's `seq_len` positions (lesson 05's `gather_kv` does it, with the heads
# second), compute the `(q, seq_len)` scores for every head, and set to `-inf` every score whose
# position lies past its query's: with `i` a column of `torch.arange(q)` and `p` a row of
# `torch.arange(seq_len)`, the mask is `p > seq_len - q + i`. Mind the offset: SDPA's
# `is_causal=True` on `q` queries and more keys lines them up at position 0, which is not this.
#
# **Checked:** against SDPA with the causal mask over the sequence's K/V: a fresh prompt of 6
# tokens; 8 tokens cached and a chunk of 5 (the lesson's); a chunk of one token (a decode); a
# chunk of 7 that starts and ends inside blocks, its row padded with `-1`; and 8 query heads over 2
# K/V heads. A wrong output is compared with a chunk that attends over itself alone, no causal mask,
# a mask one position off either way, a chunk masked as if it started at position 0, and task 1's
# `h % num_kv_heads` pairing.


# %%
def chunk_attention(query, k_cache, v_cache, block_table, seq_len):
    """Causal attention of a sequence's last q positions over its seq_len cached ones: (q, heads, dim)."""
    ### BEGIN SOLUTION: gather the sequence's seq_len positions, scores (kv_heads, group, q, positions), -inf where position > seq_len - q + i, softmax over positions, weighted sum of V
    q, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    needed = -(-seq_len // block_size)
    blocks = torch.as_tensor(block_table, device=query.device).long()[:needed]

    def gather(cache):  # (kv_heads, seq_len, head_dim)
        return cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]

    k, v = gather(k_cache), gather(v_cache)
    grouped = query.view(q, num_kv_heads, group, head_dim)
    scores = torch.einsum("ikgd,kpd->kgip", grouped, k) * head_dim**-0.5
    own = seq_len - q + torch.arange(q, device=query.device)[:, None]  # each query's position
    later = torch.arange(seq_len, device=query.device)[None, :] > own  # (q, positions)
    scores = scores.masked_fill(later, float("-inf"))
    out = torch.einsum("kgip,kpd->ikgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(q, num_heads, head_dim)
    ### END SOLUTION


# %%
check("06.chunk_attention", chunk_attention)

# %% [markdown]
# ## Task 3 · Decodes and chunks packed into one call
#
# Write `packed_attention(query, k_cache, v_cache, block_tables, seq_lens, query_lens)`: one
# engine step's attention, for a batch whose sequences each bring `query_lens[b]` new tokens (1 for
# a decode, more for a chunk or a fresh prompt), their queries packed one sequence after another.
#
# * `query` has shape `(sum(query_lens), num_heads, head_dim)`; **sequence `b`'s rows start at
#   `sum(query_lens[:b])`**, the running sum of the query lengths before it (vLLM's
#   `query_start_loc`), and there are `query_lens[b]` of them;
# * `block_tables` is `(batch, max_blocks)` padded with `-1`; `seq_lens` and `query_lens` are
#   `(batch,)` integer tensors, with `1 <= query_lens[b] <= seq_lens[b]`;
# * each sequence's rows attend exactly as task 2's chunk: the last `query_lens[b]` of its
#   `seq_lens[b]` positions, causally;
# * return `(sum(query_lens), num_heads, head_dim)`, packed like `query`.
#
# A loop over the sequences that slices each one's rows and calls your `chunk_attention` is all it
# takes. (The package pads the rows to the longest query length instead and runs one masked
# attention for the whole batch; try that once the loop passes.)
#
# **Checked:** against SDPA per sequence as in task 2: one sequence (task 2's chunk); three decodes;
# a decode then a chunk (the lesson's); two fresh prompts then a chunk; a mix of four; and 4 query
# heads over 2 K/V heads. A wrong output is compared with rows split by `seq_lens` instead of
# `query_lens`, one query row assumed per sequence, each sequence's rows starting one row off, and
# task 2's mistakes (no causal mask, an offset of 0, the chunk alone, the `h % num_kv_heads`
# pairing).


# %%
def packed_attention(query, k_cache, v_cache, block_tables, seq_lens, query_lens):
    """Each sequence's packed query rows attend as a chunk of its last query_lens[b] positions."""
    ### BEGIN SOLUTION: for each sequence b, its rows start at the sum of the query_lens before it: slice them, call chunk_attention with its table row and seq_len, and concatenate the outputs in order
    outputs, start = [], 0
    for row, seq_len, num_new in zip(block_tables, seq_lens.tolist(), query_lens.tolist(), strict=True):
        outputs.append(chunk_attention(query[start : start + num_new], k_cache, v_cache, row, seq_len))
        start += num_new
    return torch.cat(outputs)
    ### END SOLUTION


# %%
check("06.packed_attention", packed_attention)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, this stores three sequences in a shuffled pool with 2 K/V heads and
# runs one step of an engine over them with 8 query heads: `a` decodes, `b` computes a chunk of 5
# after 8 cached tokens, and `c` is a fresh prompt of 3. The packed call must equal, row for row,
# the decode of task 1 for `a` and the chunks of task 2 for `b` and `c`. Try other lengths, or a
# group of 1 (8 K/V heads).

# %%
device = paged_kv.default_device()
torch.manual_seed(0)
cache = paged_kv.PagedKVCacheAllocator(num_blocks=12, block_size=4, num_heads=2, head_dim=8, device=device)
for block in range(12):  # take every block, then give them back in a shuffled order
    cache.allocate_for_sequence(("old", block), 1)
for block in torch.randperm(12).tolist():
    cache.free_sequence(("old", block))
lengths, new_tokens = [11, 13, 3], [1, 5, 3]
for seq_id, length in enumerate(lengths):
    cache.allocate_for_sequence(seq_id, length)
    cache.write_kv(seq_id, *torch.randn(2, length, 2, 8, device=device))

tables = cache.block_tables_tensor(range(3))
query = torch.randn(sum(new_tokens), 8, 8, device=device)  # 8 query heads over the cache's 2
packed = packed_attention(
    query,
    cache.k_cache,
    cache.v_cache,
    tables,
    torch.tensor(lengths, device=device),
    torch.tensor(new_tokens, device=device),
)
decode = gqa_decode_attention(
    query[:1], cache.k_cache, cache.v_cache, tables[:1], torch.tensor([11], device=device)
)
chunks = [chunk_attention(query[1:6], cache.k_cache, cache.v_cache, tables[1], 13)]
chunks.append(chunk_attention(query[6:], cache.k_cache, cache.v_cache, tables[2], 3))
print("block tables:", tables.tolist())
print("packed rows:", packed.shape[0], "for query_lens", new_tokens)
print("row 0 equals the decode:", torch.allclose(packed[:1], decode, atol=1e-5, rtol=1e-5))
print("rows 1-8 equal the two chunks:", torch.allclose(packed[1:], torch.cat(chunks), atol=1e-5, rtol=1e-5))

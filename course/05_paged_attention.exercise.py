# %% [markdown]
# # Exercise 05 · Paged attention
#
# In this exercise you write the attention of lesson 05 yourself: gather one sequence's keys and
# values from the paged cache through its block table, compute decode attention by hand, then compute
# it for a whole batch at once, reading through padded block tables with a mask. Each task says what
# to build and how it is checked; the cell after it runs the check and prints a tick, or tells you
# which call gave which wrong answer.
#
# The checks run your code on sequences stored in scattered blocks of a pool whose other slots hold
# stale random data, so reading a wrong slot shows. Gathered K and V must be exactly equal to
# `cache.read_kv`; attention outputs are compared with `torch.nn.functional.scaled_dot_product_attention`
# (SDPA) using `torch.allclose(atol=1e-5, rtol=1e-5)`.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished package has its own version of task 3,
# `paged_kv.paged_attention`; try without looking first (the check will not let your code call it).
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/05_paged_attention.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
import torch

import paged_kv
from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · Gather one sequence's K and V
#
# Write `gather_kv(k_cache, v_cache, block_table, seq_len)`.
#
# * `k_cache` and `v_cache` have shape `(num_blocks, num_heads, block_size, head_dim)`.
# * `block_table` lists the sequence's physical blocks in logical order, as a list of ints or a 1-D
#   integer tensor (`int32`, like a row of `cache.block_tables_tensor(...)`). It may be longer than the
#   sequence needs: entries past the first `ceil(seq_len / block_size)` are padding (`-1`) and must
#   not end up in the result.
# * Return `(k, v)`, each of shape `(seq_len, num_heads, head_dim)`: position `p` in row `p`,
#   exactly like `cache.read_kv`.
#
# One expression per tensor is enough: `k_cache[blocks]` picks whole blocks, `(blocks, num_heads,
# block_size, head_dim)`; then put the block and offset axes next to each other, merge them into
# positions, and cut at `seq_len`. Mind the order of the axes: the result has the tokens first
# and the heads second, unlike the heads-first gather of the lesson.
#
# **Checked:** an 8-token sequence in two full blocks, an 11-token sequence whose last block holds 3
# tokens, and a 5-token sequence given as a padded `int32` row; K and V each against `cache.read_kv`,
# exactly. A wrong answer is compared with the classic mistakes: K and V swapped, blocks in sorted order
# instead of table order, a reshape without the transpose, positions past `seq_len` kept, and the
# heads-first layout.


# %%
def gather_kv(k_cache, v_cache, block_table, seq_len):
    """One sequence's K and V from the paged cache, each (seq_len, num_heads, head_dim)."""
    ### BEGIN SOLUTION: take the table's first ceil(seq_len / block_size) entries, gather whole blocks, bring block and offset axes together, merge them, cut at seq_len
    _, num_heads, block_size, head_dim = k_cache.shape
    needed = -(-seq_len // block_size)
    blocks = torch.as_tensor(block_table, device=k_cache.device).long()[:needed]

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(-1, num_heads, head_dim)[:seq_len]

    return gather(k_cache), gather(v_cache)
    ### END SOLUTION


# %%
check("05.gather_kv", gather_kv)

# %% [markdown]
# ## Task 2 · Decode attention for one sequence
#
# Write `decode_attention(q, k, v, scale=None)` for the new token of one sequence:
#
# * `q` has shape `(num_heads, head_dim)`; `k` and `v` have shape `(num_tokens, num_heads, head_dim)`,
#   the layout `gather_kv` returns;
# * for each head, the scores are `q · k` times `scale` (`1 / sqrt(head_dim)` when `scale` is `None`),
#   the weights are a softmax of the scores over the tokens, and the output is the weighted sum of V;
# * return a tensor of shape `(num_heads, head_dim)`.
#
# Write it by hand with `torch.einsum` (or `@` and `sum`) and `torch.softmax`; SDPA is what the check
# compares with, so the check makes it raise while your code runs. If you write the softmax yourself,
# subtract the largest score before `exp`.
#
# **Checked:** against SDPA for one token (the output is then `v[0]`), for seven tokens with three heads,
# with a given `scale=0.5`, and with scores large enough to overflow a naive `exp`. A wrong answer is
# compared with K and V swapped, no scale, a scale of `1 / head_dim`, a softmax over the heads instead
# of the tokens, and an ignored `scale`.


# %%
def decode_attention(q, k, v, scale=None):
    """Attention of one query q (heads, dim) over k, v (tokens, heads, dim): (heads, dim)."""
    ### BEGIN SOLUTION: scores = einsum('hd,thd->ht', q, k) * scale, softmax over t (dim=-1), then einsum('ht,thd->hd', weights, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("ht,thd->hd", weights, v)
    ### END SOLUTION


# %%
check("05.decode_attention", decode_attention)

# %% [markdown]
# ## Task 3 · Paged decode attention for a batch
#
# Write `paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens)`:
#
# * `query` has shape `(batch, num_heads, head_dim)`, one new token per sequence;
# * `block_tables` is a `(batch, max_blocks)` integer tensor, one row per sequence, the shorter rows
#   padded on the right; the padding is usually `-1` but may be any value;
# * `seq_lens` is a `(batch,)` integer tensor: sequence `b` attends to its first
#   `seq_lens[b]` positions, at least 1;
# * the scale is `1 / sqrt(head_dim)`; return `(batch, num_heads, head_dim)`, row `b` equal to SDPA
#   of `query[b]` over the first `seq_lens[b]` tokens of sequence `b`.
#
# Write it for the whole batch at once, with no Python loop, as section 3 of the lesson does:
#
# 1. clamp `block_tables` to `0 .. num_blocks - 1`, so that the padding names a real block (`.long()`
#    first, to index with it);
# 2. gather: `k_cache[blocks]` is `(batch, max_blocks, heads, block_size, dim)`; bring the heads before
#    the blocks and merge blocks and offsets into `max_blocks * block_size` positions;
# 3. scores with `torch.einsum("bhd,bhpd->bhp", ...)`; then set to `-inf` every position at or past
#    its sequence's length: `torch.arange(num_positions, device=query.device)[None, :] >=
#    seq_lens[:, None]` is a `(batch, positions)` mask for `masked_fill`;
# 4. a softmax over the positions, and the weighted sum of V.
#
# The check compares results only, so a loop over the batch that calls your `gather_kv` and
# `decode_attention` would pass too; write the vectorised version anyway, since it is what a GPU needs.
# Your code may not call `paged_kv.paged_attention`: the check uses it as the answer.
#
# **Checked:** against SDPA per sequence over `cache.read_kv`, in this order: one sequence in two full
# blocks; full blocks with a padded row (`-1` would read the last block of the cache); one sequence
# whose last block is partly filled; a batch of six with lengths 1, exact multiples of the block size
# and partial blocks; and the same batch on the CPU with the padding set to a million, far past any
# block id. A wrong answer is compared with K and V swapped, a missing or `1 / head_dim` scale, a
# softmax over the heads, no mask (with and without the clamp), a mask of the padding blocks only, and
# blocks in sorted order.


# %%
def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    """Decode attention for a batch, reading K/V through the block tables: (batch, heads, dim)."""
    ### BEGIN SOLUTION: clamp the tables, gather (batch, heads, positions, dim), einsum the scores, mask positions >= seq_len with -inf, softmax, einsum with V
    batch, num_heads, head_dim = query.shape
    num_blocks, _, block_size, _ = k_cache.shape
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5
    beyond = torch.arange(num_positions, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)
    ### END SOLUTION


# %%
check("05.paged_decode_attention", paged_decode_attention)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, this stores three sequences in a shuffled pool, then computes their
# attention twice: one sequence at a time with `gather_kv` and `decode_attention`, and the whole batch
# at once with `paged_decode_attention`. Try other lengths and block sizes, or pass `seq_lens`
# below the sequences' lengths (to both computations) to attend to a prefix only.

# %%
device = paged_kv.default_device()
torch.manual_seed(0)
cache = paged_kv.PagedKVCacheAllocator(num_blocks=12, block_size=4, num_heads=2, head_dim=8, device=device)
for block in range(12):  # take every block, then give them back in a shuffled order
    cache.allocate_for_sequence(("old", block), 1)
for block in torch.randperm(12).tolist():
    cache.free_sequence(("old", block))
lengths = [7, 12, 2]
for seq_id, length in enumerate(lengths):
    cache.allocate_for_sequence(seq_id, length)
    cache.write_kv(seq_id, *torch.randn(2, length, 2, 8, device=device))

query = torch.randn(3, 2, 8, device=device)
tables = cache.block_tables_tensor(range(3))
one_by_one = torch.stack(
    [
        decode_attention(query[b], *gather_kv(cache.k_cache, cache.v_cache, tables[b], n))
        for b, n in enumerate(lengths)
    ]
)
batched = paged_decode_attention(
    query, cache.k_cache, cache.v_cache, tables, torch.tensor(lengths, device=device)
)
print("block tables:", tables.tolist())
print("one at a time equals the batch:", torch.allclose(one_by_one, batched, atol=1e-5, rtol=1e-5))

# %% [markdown]
# # Lesson 05 · Paged attention
#
# Lessons 03 and 04 put every sequence's keys and values into blocks scattered over a shared pool.
# That only pays off if attention, the one operation that reads them, can work from the blocks where
# they lie. At every decode step each sequence has one new query, and it must attend to all the keys
# and values the sequence holds, which are nowhere contiguous in memory. This lesson builds attention
# that reads K and V through the block tables, the idea that gives vLLM's PagedAttention its name, and
# shows that it computes exactly what ordinary attention computes on the same tokens held in one piece.
#
# **By the end of this lesson you can**
#
# 1. compute decode attention for one sequence by hand and show it equals PyTorch's
#    `scaled_dot_product_attention` (SDPA);
# 2. gather a sequence's K and V from `k_cache` and `v_cache` through its block table, cut at its
#    context length, and show that attention over them is unchanged;
# 3. build the batched, vectorised version, with the padding clamped and the positions past each
#    context length masked, which is `paged_kv.paged_attention`, and run it for grouped-query
#    attention, where several query heads share one cached K/V head, and for a prompt chunk of
#    several new tokens that attends causally to the tokens already cached;
# 4. explain what goes wrong without the mask, and why the padding value does not matter with it;
# 5. explain how a dedicated kernel differs (it reads each block in place and can merge the blocks
#    with an online softmax; the vLLM paper measures a 20 to 26 % overhead, which larger batches more
#    than repay), and compare the package's three strategies, gather, in place and FlexAttention:
#    what each reads, what each costs on your machine, and which one `paged_attention` picks, and why.

# %%
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import paged_kv
from paged_kv import PagedKVCacheAllocator, paged_attention, paged_prefill_attention
from paged_kv.pictures.plots import colour, plot_padded_block_tables, plot_weights_by_block
from paged_kv.timing import compare_times, how_fast

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Decode attention for one sequence
#
# During decode, a sequence produces one token per step. That token's query `q` has one vector per
# head, shape `(num_heads, head_dim)`. Its key and value were just written to the cache, so the
# sequence now holds `T` tokens of K and V, each of shape `(T, num_heads, head_dim)`, and the new
# token attends to all of them. For every head `h`, separately:
#
# 1. **scores**: `scores[h, t] = q[h] · k[t, h] / sqrt(head_dim)`, one number per token;
# 2. **weights**: a softmax over the tokens turns the scores into positive weights that sum to 1;
# 3. **output**: `out[h] = Σ_t weights[h, t] · v[t, h]`, a weighted average of the values.
#
# The division by `sqrt(head_dim)` keeps the scores in a range where the softmax is not all on one
# token. Below, `torch.einsum` writes each step as the indices it combines: `"hd,thd->ht"` multiplies
# `q[h, d]` by `k[t, h, d]` and sums over `d`, leaving one score per head and token.
#
# Our sequence `a` holds 11 tokens, with 2 heads of dimension 8 (tiny, so that everything prints;
# a 7B model has 32 heads of dimension 128).

# %%
NUM_HEADS, HEAD_DIM = 2, 8
SCALE = HEAD_DIM**-0.5  # 1 / sqrt(head_dim)

k_a = torch.randn(11, NUM_HEADS, HEAD_DIM, device=device)  # (tokens, heads, head_dim)
v_a = torch.randn(11, NUM_HEADS, HEAD_DIM, device=device)
q_a = torch.randn(NUM_HEADS, HEAD_DIM, device=device)  # (heads, head_dim): the new token's query

scores = torch.einsum("hd,thd->ht", q_a, k_a) * SCALE  # (heads, tokens)
weights = torch.softmax(scores, dim=-1)  # over the tokens, separately for each head
out_by_hand = torch.einsum("ht,thd->hd", weights, v_a)  # (heads, head_dim)

print("scores: ", tuple(scores.shape))
print(
    "weights:",
    tuple(weights.shape),
    "| each head's weights sum to 1:",
    torch.allclose(weights.sum(-1), torch.ones(NUM_HEADS, device=device)),
)
print("output: ", tuple(out_by_hand.shape))

# %% [markdown]
# PyTorch has this operation built in: `torch.nn.functional.scaled_dot_product_attention`, SDPA for
# short, which dispatches to fused kernels on a GPU. It expects `(batch, heads, queries, head_dim)` for
# the query and `(batch, heads, tokens, head_dim)` for K and V, so we add a batch axis of 1, a query
# axis of 1, and move the heads in front of the tokens. It is the reference we compare with for the
# rest of the lesson.
#
# Two computations that add the same numbers in a different order can differ in the last bits, so we
# compare with `torch.allclose` at a tolerance of `1e-5`, the same everywhere in this lesson.

# %%
TOL = {"atol": 1e-5, "rtol": 1e-5}


def sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's attention for one query: q (heads, dim) against k, v (tokens, heads, dim)."""
    out = F.scaled_dot_product_attention(
        q[None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    )
    return out[0, :, 0, :]  # (heads, head_dim)


out_sdpa = sdpa_one(q_a, k_a, v_a)
print("SDPA output:", tuple(out_sdpa.shape))
print("by hand equals SDPA:", torch.allclose(out_by_hand, out_sdpa, **TOL))

# %% [markdown]
# ## 2. The same sequence, stored in blocks
#
# Now `a` lives in a paged cache, the way lessons 03 and 04 stored it. We make the pool look like a
# busy server's: every block has already served an earlier request, those requests finished in a
# random order, so the free list is shuffled, and their keys and values are still in the blocks
# (freeing a block does not clear it). With stale data in every slot, reading a wrong slot gives a
# wrong answer, as it would on a real server.
#
# Blocks of 4 token slots keep the pictures small; vLLM uses 16.

# %%
BLOCK_SIZE, NUM_BLOCKS = 4, 16
cache = PagedKVCacheAllocator(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_DIM, device=device)
for block in range(NUM_BLOCKS):  # earlier requests, one block each...
    cache.allocate_for_sequence(f"old{block}", BLOCK_SIZE)
for block in torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist():
    cache.free_sequence(f"old{block}")  # ...finished in a random order
cache.k_cache.normal_()  # the K/V they left behind
cache.v_cache.normal_()

cache.allocate_for_sequence("a", 11)
cache.write_kv("a", k_a, v_a)
print("block table of a:", cache.get_block_mapping("a"))
print("k_cache:", tuple(cache.k_cache.shape), "= (num_blocks, num_heads, block_size, head_dim)")

# %% [markdown]
# An attention kernel never receives `k_a` and `v_a`. It receives what the engine has: the whole
# `k_cache` and `v_cache`, the sequence's block table, and its **context length**, the number of
# tokens it holds (11). From these it must find the tokens itself.
#
# The simplest way is to gather a contiguous copy, using the translation of lesson 03 one whole block
# at a time:
#
# * `k_cache[table]` picks the sequence's blocks in table order: `(blocks, heads, block_size, dim)`;
# * `transpose(0, 1)` puts the heads first: `(heads, blocks, block_size, dim)`;
# * `reshape` merges blocks and offsets into positions: `(heads, blocks × block_size, dim)`, where
#   position `p` comes from block `table[p // block_size]` at offset `p % block_size`;
# * `[:, :context_len]` drops the positions past the last token: the three blocks have room for 12
#   tokens but hold 11.

# %%
table_a = torch.tensor(cache.get_block_mapping("a"), device=device)
context_len = cache.sequence_length("a")

per_block = cache.k_cache[table_a]
by_head = per_block.transpose(0, 1)
positions = by_head.reshape(NUM_HEADS, -1, HEAD_DIM)
k_gathered = positions[:, :context_len]
print("k_cache[table]:    ", tuple(per_block.shape))
print("transpose(0, 1):   ", tuple(by_head.shape))
print("reshape:           ", tuple(positions.shape))
print("[:, :context_len]: ", tuple(k_gathered.shape))
print("equal to k_a with the heads first:", torch.equal(k_gathered, k_a.transpose(0, 1)))

# %% [markdown]
# The gathered keys are exactly `k_a`, heads first. We wrap the gather in a function, and write
# attention for this heads-first layout: the same three steps as in section 1, with the einsum indices
# `p` for positions.


# %%
def gather(cache_tensor: torch.Tensor, table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's K (or V) from the pool, in position order: (heads, context_len, dim)."""
    blocks = cache_tensor[table]  # (blocks, heads, block_size, dim)
    heads, dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(heads, -1, dim)[:, :context_len]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q (heads, dim) over k, v (heads, positions, dim)."""
    weights = torch.softmax(torch.einsum("hd,hpd->hp", q, k) * SCALE, dim=-1)
    return torch.einsum("hp,hpd->hd", weights, v)


out_paged = attend(q_a, gather(cache.k_cache, table_a, 11), gather(cache.v_cache, table_a, 11))
print("paged equals SDPA over read_kv:", torch.allclose(out_paged, sdpa_one(q_a, *cache.read_kv("a")), **TOL))
print("paged equals section 1:        ", torch.allclose(out_paged, out_sdpa, **TOL))

# %% [markdown]
# The reference here is SDPA over `cache.read_kv("a")`, the package's own gather of lesson 03, so the
# comparison does not rely on our copy of `k_a`: the same data, read two different ways, gives the same
# attention.
#
# **Predict, then run.** The gather produced 12 positions for 11 tokens. What does position 11 hold,
# and how much does it matter if we forget to cut it off?

# %%
all_12 = gather(cache.k_cache, table_a, 12)
print("position 11 is one of a's keys:", any(torch.equal(all_12[:, 11], k_a[t]) for t in range(11)))
out_uncut = attend(q_a, all_12, gather(cache.v_cache, table_a, 12))
print("attention over 12 positions equals SDPA:", torch.allclose(out_uncut, out_sdpa, **TOL))

# %% [markdown]
# Position 11 holds whatever the block's earlier owner left there. Attending to it adds a twelfth key
# with its own weight, which takes weight away from the eleven real ones and mixes a stale value into
# the output: the answer is wrong, and nothing raises an error.
#
# The order of the blocks matters for the same reason. Attention itself treats its keys as a set
# (where a token sits in the sentence is already encoded in its `q` and `k`, by rotary embeddings for
# instance), so shuffling whole positions, K and V together, changes nothing. What needs the order is
# the cut at `context_len`: it must fall in the *last logical* block. Gather the blocks by sorted id
# instead of table order and the cut removes the wrong slot:

# %%
shuffle = torch.randperm(11, generator=torch.Generator().manual_seed(2)).to(device)
print(
    "a's positions shuffled, K and V together, equals SDPA:",
    torch.allclose(sdpa_one(q_a, k_a[shuffle], v_a[shuffle]), out_sdpa, **TOL),
)

sorted_table = torch.sort(table_a).values
print("table order:", table_a.tolist(), "| sorted:", sorted_table.tolist())
out_sorted = attend(q_a, gather(cache.k_cache, sorted_table, 11), gather(cache.v_cache, sorted_table, 11))
print("sorted blocks, cut at 11, equals SDPA:", torch.allclose(out_sorted, out_sdpa, **TOL))

# %% [markdown]
# ## 3. A batch of sequences
#
# A server decodes many sequences in the same step, so the kernel takes a batch. Four more sequences
# join `a`, of 4, 16, 6 and 1 tokens, and each gets its own keys, values and new query. The kernel
# receives the block tables as one `(batch, max_blocks)` integer tensor, the shorter rows padded with
# `-1` (lesson 03), and the context lengths as a `(batch,)` tensor.

# %%
batch = ["a", "b", "c", "d", "e"]
for seq_id, length in zip(batch[1:], [4, 16, 6, 1], strict=True):
    cache.allocate_for_sequence(seq_id, length)
    k, v = torch.randn(2, length, NUM_HEADS, HEAD_DIM, device=device)
    cache.write_kv(seq_id, k, v)

block_tables = cache.block_tables_tensor(batch)  # (batch, max_blocks), padded with -1
context_lens = torch.tensor([cache.sequence_length(s) for s in batch], device=device)
query = torch.cat([q_a[None], torch.randn(len(batch) - 1, NUM_HEADS, HEAD_DIM, device=device)])
print("query:", tuple(query.shape), "| block_tables:", tuple(block_tables.shape), block_tables.dtype)
for seq_id, row, length in zip(batch, block_tables.tolist(), context_lens.tolist(), strict=True):
    print(f"  {seq_id}: {row}  context_len {length:>2}")

# %% [markdown]
# A loop over the batch, calling `gather` and `attend` for each row, would work, but a GPU wants one
# operation over the whole batch, not five small ones. To do everything at once, every row must have
# the same shape, so every sequence gathers `max_blocks × block_size` = 16 positions. That raises two
# problems, and each has a one-line fix:
#
# * **the padding is not a block.** `-1` names no block. `clamp(0, num_blocks - 1)` replaces it by a
#   real block, any one; its data will not be used.
# * **positions past the context length do not exist.** Those of the last block's empty tail, and now
#   those of the padding blocks too. Before the softmax, we set their scores to `-inf`: `exp(-inf)` is
#   exactly 0, so they get no weight at all, and the weights of the real positions still sum to 1.
#   Every sequence holds at least one token, so no row is all `-inf` (which would give `NaN`).
#
# The mask compares each position with its sequence's length, `positions[None, :] >= context_lens[:,
# None]`: a `(batch, positions)` table of booleans, built with broadcasting and no loop.


# %%
def paged_attention_by_hand(query, k_cache, v_cache, block_tables, context_lens, mask=True):
    """Decode attention for a batch, reading K/V through the block tables: (batch, heads, dim)."""
    batch, num_heads, head_dim = query.shape
    num_blocks, _, block_size, _ = k_cache.shape
    # 1. Padding becomes a real block (any one); the mask hides it in step 3.
    blocks = block_tables.long().clamp(0, num_blocks - 1)  # (batch, max_blocks)
    num_positions = blocks.shape[1] * block_size
    # 2. Gather every row's blocks in table order: (batch, heads, positions, dim).
    k = k_cache[blocks].transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)
    v = v_cache[blocks].transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5
    # 3. Positions at or past the context length get a score of -inf.
    if mask:
        beyond = torch.arange(num_positions, device=query.device)[None, :] >= context_lens[:, None]
        scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
    # 4. Softmax over positions, then the weighted sum of V.
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)


out_batch = paged_attention_by_hand(query, cache.k_cache, cache.v_cache, block_tables, context_lens)
print("output:", tuple(out_batch.shape))

# %% [markdown]
# The reference is SDPA run separately on each sequence, over its K/V read back with `read_kv`. We
# print whether the largest difference over the whole batch is below the tolerance.

# %%
expected = torch.stack([sdpa_one(query[i], *cache.read_kv(seq_id)) for i, seq_id in enumerate(batch)])
difference = (out_batch - expected).abs().max().item()
print(f"max |by hand - SDPA| < 1e-5 -> {difference < 1e-5}")
print("each sequence:", [torch.allclose(out_batch[i], expected[i], **TOL) for i in range(len(batch))])

packaged = paged_attention(query, cache.k_cache, cache.v_cache, block_tables, context_lens)
print("paged_kv.paged_attention agrees:", torch.allclose(packaged, expected, **TOL))

# %% [markdown]
# All five sequences match. `paged_kv.paged_attention` computes the same thing, with input checks and
# float32 arithmetic for half-precision caches added. With `strategy="gather"` it is this very function;
# by default it may read the blocks another way, with the same result, which section 6 explains.
#
# **Predict, then run.** Run the same batch without the mask. Which of the five sequences still get
# the right answer? (Their lengths are 11, 4, 16, 6 and 1; their rows are printed above.)

# %%
unmasked = paged_attention_by_hand(
    query, cache.k_cache, cache.v_cache, block_tables, context_lens, mask=False
)
print("without the mask, allclose:", torch.allclose(unmasked, expected, **TOL))
print("each sequence:", [torch.allclose(unmasked[i], expected[i], **TOL) for i in range(len(batch))])

# %% [markdown]
# Only `c` survives: its 16 tokens fill all four of its blocks exactly, so it has neither an empty
# tail nor padding. Every other sequence attends to stale slots, either the tail of its last block or
# the block that its clamped padding points to.
#
# **Predict, then run.** With the mask in place, does the padding value matter? Replace every `-1` by
# `0`, by random block ids, or by a number far past the pool, and compare the outputs.

# %%
padding = block_tables == -1
garbage = {
    "0": torch.zeros_like(block_tables),
    "random ids": torch.randint(0, NUM_BLOCKS, block_tables.shape, device=device, dtype=block_tables.dtype),
    "1000": torch.full_like(block_tables, 1000),
}
for name, filler in garbage.items():
    other = torch.where(padding, filler, block_tables)
    same = torch.equal(
        paged_attention_by_hand(query, cache.k_cache, cache.v_cache, other, context_lens), out_batch
    )
    print(f"padding {name:>10}: same output -> {same}")
print(
    "without the clamp, -1 reads the last block:",
    torch.equal(cache.k_cache[-1], cache.k_cache[NUM_BLOCKS - 1]),
)
try:
    cache.k_cache.cpu()[torch.tensor([1000])]  # on a CPU copy: a bad index on a GPU breaks the session
except IndexError as error:
    print("without the clamp, 1000 raises", type(error).__name__)

# %% [markdown]
# The output is identical whatever the padding holds: the clamp makes any value a valid block id, and
# the mask throws away whatever that block contains. The last two lines show why the clamp is there
# even though `-1` happens to run: PyTorch reads index `-1` as "the last block", silently, and `1000`
# is an error. In a hand-written GPU kernel, either would read memory the cache does not own.
#
# One more test of the idea. An operating system may move a page to another frame; as long as it
# updates the page table, the program never notices. Here we move *every* block of the pool to a new,
# random place, rewrite the block tables to match, and run attention again.

# %%
new_place = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).to(device)
moved_k, moved_v = torch.empty_like(cache.k_cache), torch.empty_like(cache.v_cache)
moved_k[new_place], moved_v[new_place] = cache.k_cache, cache.v_cache  # block b moves to new_place[b]
moved_tables = torch.where(
    padding, block_tables, new_place[block_tables.long().clamp(min=0)].to(block_tables.dtype)
)
print("a's table before:", block_tables[0].tolist(), "| after:", moved_tables[0].tolist())

out_moved = paged_attention(query, moved_k, moved_v, moved_tables, context_lens)
difference = (out_moved - expected).abs().max().item()
print(f"after moving every block: max |paged - SDPA| < 1e-5 -> {difference < 1e-5}")

# %% [markdown]
# ## 4. Where the attention goes
#
# The picture shows both halves of the story for sequence `a`. On the left, the block tables of the
# batch as the kernel receives them: `a`'s row in colour, the padding hatched. On the right, the
# weights that head 0 of `a`'s query gives to each of its positions, each bar in the colour of the
# physical block the position lives in. Position 11 exists in the block but not in the sequence: it
# is masked (hatched), and its weight is exactly 0.

# %%
all_k = gather(cache.k_cache, table_a, 3 * BLOCK_SIZE)  # all 12 slots of a's blocks
scores_a = torch.einsum("hd,hpd->hp", q_a, all_k) * SCALE
scores_a[:, context_len:] = float("-inf")
weights_a = torch.softmax(scores_a, dim=-1)[0].cpu()  # head 0
print("position 11 gets a weight of exactly 0:", weights_a[11].item() == 0.0)

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [1, 2]})
plot_padded_block_tables(block_tables.tolist(), batch, highlight=0, ax=left)
plot_weights_by_block(
    weights_a, table_a.tolist(), BLOCK_SIZE, context_len, ax=right, ylabel="attention weight (head 0)"
)
right.set_xlabel("position in a")
right.set_title("a's weights, coloured by physical block", loc="left", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# The weights run over the positions in order, as if `a` were contiguous; only the colours, the
# physical blocks, jump around the pool. That is the whole trick: the block table changes *where* each
# key is read from, never *which* keys the softmax sees.

# %% [markdown]
# ## 5. What a real kernel does differently
#
# Our version is correct but wasteful in two ways, and a dedicated paged attention kernel avoids them.
#
# **It copies.** `k_cache[blocks]` builds a contiguous copy of every sequence's K and V, padding
# included, before attention starts: K and V are read to copy them, the copy is written, then read again
# to attend. That is three passes over K and V where one would do, and the speed of decode attention is
# set by how fast it moves K and V through memory. A real kernel reads each block *in place*, where it
# lies, and follows the block table to the next. No copy exists.
#
# How a block lies in memory depends on the layout. In this course's, `(num_blocks, num_heads,
# block_size, head_dim)`, one head's block is `block_size × head_dim` numbers stored contiguously
# (16 tokens of 128 dimensions in 16 bits: 4 KiB in one run), which was also the layout of vLLM's
# original PagedAttention kernel.

# %%
one_block = cache.k_cache[table_a[0], 0]  # block table_a[0], head 0
print("one block of one head:", tuple(one_block.shape), "| contiguous:", one_block.is_contiguous())
print(
    "a view into k_cache, not a copy:",
    one_block.untyped_storage().data_ptr() == cache.k_cache.untyped_storage().data_ptr(),
)

# %% [markdown]
# vLLM v1's FlashAttention backend lays a block out the other way round: token first. Its default
# layout keeps one layer's cache, in memory, as `(num_blocks, block_size, num_kv_heads, 2 × head_size)`,
# K and V side by side in the last axis, so what sits together is one token's heads. The backend
# receives a *view* with the heads before the tokens, `(num_blocks, num_kv_heads, block_size,
# 2 × head_size)`, and K is its first `head_size` numbers, V the rest. One head's block is then
# `block_size` runs of `head_dim` numbers, a fixed stride apart: not contiguous, and read in place all
# the same, through the strides (lesson 12's kernel reads this very view).

# %%
vllm_memory = torch.cat([cache.k_cache, cache.v_cache], dim=-1).transpose(1, 2).contiguous()
vllm_view = vllm_memory.transpose(1, 2)  # (num_blocks, num_kv_heads, block_size, 2 * head_size)
vllm_block = vllm_view[table_a[0], 0, :, :HEAD_DIM]  # the K of block table_a[0], head 0
print("in memory: ", tuple(vllm_memory.shape), "| the view:", tuple(vllm_view.shape))
print("one block of one head:", tuple(vllm_block.shape), "| contiguous:", vllm_block.is_contiguous())
print("its strides:", vllm_block.stride(), "= (num_kv_heads x 2 x head_size, 1)")
print("the same keys as the course's block:", torch.equal(vllm_block, one_block))

# %% [markdown]
# **It materialises all the scores.** A softmax needs the maximum and the sum over *all* positions,
# which seems to require every score before any weight. The way out is an **online softmax**: process
# the blocks one at a time and keep, for each head, three running quantities:
#
# * `running_max`, the largest score seen so far (subtracting it keeps every `exp` at most 1, so
#   nothing overflows);
# * `running_sum`, the sum of `exp(score - running_max)` over the positions seen so far;
# * `acc`, the sum of `exp(score - running_max) · v` over the same positions.
#
# When a new block brings a larger maximum `new_max`, everything accumulated so far was computed
# relative to the old one, so `running_sum` and `acc` are multiplied by `exp(running_max - new_max)`
# before the block's own terms are added. After the last block, the output is `acc / running_sum`.
# Only one block's scores exist at any time. (vLLM's first PagedAttention kernel instead kept one
# sequence's scores in the GPU's fast on-chip memory; its second version, and the FlashAttention-style
# kernels vLLM uses today, merge pieces of the context with this same rescaling.)
#
# Here it is for sequence `a`, as a loop over its blocks (a kernel runs this loop for every sequence
# and head in parallel; the loop is over blocks, never over tokens).


# %%
def online_softmax_attention(q, k_cache, v_cache, table, context_len):
    """Attention of q (heads, dim) reading one block at a time, never holding all the scores."""
    heads, dim = q.shape
    block_size = k_cache.shape[2]
    running_max = torch.full((heads,), float("-inf"), device=q.device)
    running_sum = torch.zeros(heads, device=q.device)
    acc = torch.zeros(heads, dim, device=q.device)
    for logical, block in enumerate(table.tolist()):
        n = min(block_size, context_len - logical * block_size)  # tokens in this block
        k_block, v_block = k_cache[block, :, :n], v_cache[block, :, :n]  # read in place: (heads, n, dim)
        s = torch.einsum("hd,hnd->hn", q, k_block) * SCALE
        new_max = torch.maximum(running_max, s.max(dim=-1).values)
        rescale = torch.exp(running_max - new_max)  # 0 on the first block, where running_max is -inf
        p = torch.exp(s - new_max[:, None])
        running_sum = running_sum * rescale + p.sum(dim=-1)
        acc = acc * rescale[:, None] + torch.einsum("hn,hnd->hd", p, v_block)
        running_max = new_max
    return acc / running_sum[:, None]


# %% [markdown]
# **Predict, then run.** The first block's terms are computed before the kernel has seen the scores
# of the other two blocks, and the last block is read only up to its 3 real tokens, with no mask.
# Will the result equal SDPA, only roughly, or not at all?

# %%
out_online = online_softmax_attention(q_a, cache.k_cache, cache.v_cache, table_a, context_len)
print("online softmax over blocks equals SDPA:", torch.allclose(out_online, out_sdpa, **TOL))
print("and the gathered version:              ", torch.allclose(out_online, out_paged, **TOL))

# %% [markdown]
# Equal. The rescaling makes the running sums exactly what they would have been had the final maximum
# been known from the start, so the only differences are rounding. This is the same technique as
# FlashAttention (a fused attention kernel that works through the keys one tile at a time), applied
# across the blocks of a block table.
#
# **What it costs.** The block-table look-ups, the branches for a partly filled last block and the
# varying lengths in a batch are not free: the vLLM paper measures its paged attention kernel at
# 20 to 26 % higher latency than the kernel of FasterTransformer (NVIDIA's optimised inference
# library) on contiguous memory. Attention is only a part of each step, though, and paging lets many
# more sequences share the same memory (lesson 00): the larger batches are where the paper's 2 to 4
# times higher serving throughput comes from.

# %% [markdown]
# ## 6. The package's three ways to read the blocks
#
# `paged_kv.paged_attention` computes the same attention in three ways, chosen with `strategy=`; the
# answer is the same, what differs is how much memory traffic it costs.
#
# * **`"gather"`** is section 3's function. `k_cache[blocks]` copies every row's blocks, padding
#   included, into a contiguous `(batch, heads, max_blocks × block_size, dim)` tensor, and the same
#   for V; then one masked attention runs over the copy. Every block is read to copy it, the copy is
#   written, and then read again to attend: three passes over K and V, and a second copy of the
#   batch's K and V in memory, just to put the blocks in table order.
# * **`"in_place"`** never copies K or V. Each physical block is read by one row of the batch, so it
#   gives every block its reader's query, and one batched product over `k_cache`, in the pool's own
#   order, gives the scores of every block with its reader: each block read once, where it lies. Only
#   the scores, `block_size` numbers per block and head, move into each row's table order, where the
#   mask and the softmax run; the weights move back, and a second batched product with `v_cache` and
#   a sum per row give the output. (A block several rows share, after a fork or from a prefix cache,
#   lesson 08, is copied once and meets every row's query.) The price: the products run over the
#   whole pool, so blocks nobody reads cost as much as the others.
# * **`"flex"`** hands the work to PyTorch's FlexAttention (`torch.nn.attention.flex_attention`,
#   torch 2.5 and later). The keys are the whole pool viewed as one long sequence (a view, no copy),
#   the queries are the batch's new tokens, and a *mask function* says whether query `b` may see pool
#   slot `kv`: yes when block `kv // block_size` is in row `b` of the block tables and the slot's
#   logical position is below `context_lens[b]`. From it, `create_block_mask` builds a *block mask*
#   that lets the kernel skip every tile of the pool that a query cannot see. Compiled with
#   `torch.compile` on a GPU, this is one fused kernel that reads each block in place, like vLLM's;
#   anywhere else FlexAttention runs unfused, scoring every query against the whole pool.
#
# The default, **`"auto"`**, reads in place when three things hold and gathers otherwise: the caches
# are float32 (in place computes in the caches' dtype, so half-precision caches are gathered into
# float32); the batch reads at least half of the pool (in place pays for the whole pool, gather only
# for what the batch reads); and shared blocks, if any, are shared by enough rows to be worth meeting
# every query. It never picks `"flex"`, which only pays on a GPU, compiled.
#
# First, all three must be exact. Each is checked against SDPA, sequence by sequence, on the batch of
# section 3. (On a CPU, FlexAttention warns that it runs unfused; we know, so the cell silences that
# one warning. On a GPU the first `"flex"` call compiles its kernel, which takes a while.)

# %%
for strategy in ("gather", "in_place", "flex"):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = paged_attention(
            query, cache.k_cache, cache.v_cache, block_tables, context_lens, strategy=strategy
        )
    print(
        f"strategy {strategy!r:>10} equals SDPA on all five sequences:", torch.allclose(out, expected, **TOL)
    )

# %% [markdown]
# **Predict, then run.** Now the cost, on a batch the size of a small server's: 32 sequences of 512
# tokens, 8 heads of dimension 64, blocks of 16, scattered over a pool they fill. The baseline is
# SDPA on the same tokens held contiguously, the fused attention a contiguous cache would use. How
# much slower than it is each strategy, roughly? Does in place come close?
#
# Timing on a laptop that is doing other things is noisy, so the cell follows the rules of
# `paged_kv.timing`, the course's one timer: torch runs on one thread, every contender is called
# twice before the clock starts, then the contenders take turns, round after round (a burst of load
# slows all of them in the same round), and each ratio is the median over 11 rounds. The course's
# tests do not compare this cell's output.

# %%
# NBVAL_IGNORE_OUTPUT
BIG_BATCH, BIG_CONTEXT, BIG_BLOCK = 32, 512, 16
BIG_POOL = BIG_BATCH * BIG_CONTEXT // BIG_BLOCK  # 1,024 blocks, all of them used
big = PagedKVCacheAllocator(BIG_POOL, BIG_BLOCK, 8, 64, device=device)
for block in range(BIG_POOL):  # a busy server's shuffled free list, as in section 2
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


def big_paged(strategy, rows=BIG_BATCH):
    """paged_attention on the first `rows` sequences of the big pool, with one strategy."""
    return paged_attention(
        big_query[:rows], big.k_cache, big.v_cache, big_tables[:rows], big_lens[:rows], strategy=strategy
    )


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    timings = compare_times(
        {
            "SDPA": lambda: F.scaled_dot_product_attention(big_query[:, :, None], k_contig, v_contig),
            "gather": lambda: big_paged("gather"),
            "in_place": lambda: big_paged("in_place"),
            "flex": lambda: big_paged("flex"),
        },
        repeats=11,
        threads=1,
        device=device,
    )
for strategy in ("gather", "in_place", "flex"):
    print(f"{strategy:>8}: {how_fast(timings.ratio(strategy, 'SDPA'))} SDPA on contiguous K/V")

# %% [markdown]
# On the 2-core CPU this course was written on, this cell ran 19 times: 5 on a quiet machine, the
# others while other programs wanted both cores (load averages up to 8). **Gather** came out 13 to
# 27 times slower than SDPA, and unfused **flex** 29 to 78 times slower. **In place** ranged from 2
# times slower to, once, 1.3 times *faster* (SDPA on one thread suffers from a busy machine too);
# on the quiet runs alone, gather was 15 to 19 times slower, in place 1.3 to 1.5, flex 35 to 40.
# Your numbers will differ with the machine and with what else it is doing, but gather and flex
# stay far behind, and in place within a small factor of SDPA.
#
# The copy is the gap between gather and in place: it moves the batch's whole K and V twice more
# than attention needs, and on a CPU moving memory is what decode attention spends its time on, so
# avoiding it brings in place within a small factor of the fused contiguous kernel. That is what the
# vLLM paper's dedicated kernel does on a GPU, where its 20 to 26 % overhead comes from the
# look-ups, not from copies. Unfused flex is slower still because, without a compiled kernel, its
# mask cannot skip anything: it scores each of the 32 queries against all 16,384 slots of the pool,
# 32 times the work. On a GPU, compiled, its block mask lets the kernel skip the tiles a query
# cannot see, which is what it is for. (This course has not timed it on a GPU: run this cell on one
# to see; the first `"flex"` call above paid for the compilation.)
#
# Why does `"auto"` not always read in place? Because in place pays for the whole pool. The next cell
# decodes only 2 of the 32 sequences, which read 1/16 of the pool, and times in place against gather.

# %%
# NBVAL_IGNORE_OUTPUT
FEW = 2
read_by_few = big_tables[:FEW].unique().numel()
choice = "reads in place" if 2 * read_by_few >= big.num_blocks else "gathers"
print(f"{FEW} sequences read {read_by_few} of {big.num_blocks} blocks: auto {choice} (in place needs half)")
few = compare_times(
    {"gather": lambda: big_paged("gather", FEW), "in_place": lambda: big_paged("in_place", FEW)},
    repeats=11,
    number=3,  # calls of a few milliseconds: three per sample
    threads=1,
    device=device,
)
print(f"reading in place is {how_fast(few.ratio('in_place', 'gather'))} gathering, for {FEW} sequences")

# %% [markdown]
# Here the copy is small (two sequences' blocks) while the in-place products still cover all 1,024
# blocks: in the same 19 runs, in place came out 1.5 to 8 times slower than gather for the two
# sequences (3.5 to 3.9 on the quiet runs). The two cost about the same when the batch read about
# an eighth of the pool (4 of the 32 sequences); `"auto"` draws its line at half, on the safe side,
# where in place was already two and a half to four times as fast as gather. A real
# engine's kernel has no such trade-off: it follows each row's block table and reads only those
# blocks, in place.

# %% [markdown]
# ## 7. Grouped-query and multi-query attention
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
# written and read exactly as in section 2. The reference repeats each sequence's K/V to 8 heads
# (`repeat_interleave`) and runs SDPA, one sequence at a time; `paged_attention` takes the 8-head
# queries and the 2-head caches directly, with every strategy.

# %%
GQA_Q_HEADS, GQA_KV_HEADS = 8, 2
GROUP = GQA_Q_HEADS // GQA_KV_HEADS
gen = torch.Generator().manual_seed(5)
gqa = PagedKVCacheAllocator(NUM_BLOCKS, BLOCK_SIZE, GQA_KV_HEADS, HEAD_DIM, device=device)
gqa_lengths = [11, 4, 16, 6, 1]  # the same lengths as section 3's batch
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
for strategy in ("gather", "in_place", "flex"):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out = paged_attention(gqa_query, gqa.k_cache, gqa.v_cache, gqa_tables, gqa_lens, strategy=strategy)
    print(
        f"strategy {strategy!r:>10}: output {tuple(out.shape)}, equals repeat + SDPA:",
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
# ## 8. Several new tokens at once: a prompt chunk over the cache
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
# token, its query of section 1, over its 11) while `p` computes its chunk; the rows are packed `a`'s
# first, then `p`'s, and each row comes out as in its own call.

# %%
mixed = paged_prefill_attention(
    torch.cat([q_a[None], q_p[CACHED:]]),  # 1 + 5 query rows, one sequence after the other
    cache.k_cache,
    cache.v_cache,
    cache.block_tables_tensor(["a", "p"]),
    context_lens=[11, 13],
    query_lens=[1, CHUNK],
)
print("packed rows:", mixed.shape[0])
print("row 0, a's decode, equals section 1's SDPA:", torch.allclose(mixed[0], out_sdpa, **TOL))
print("rows 1 to 5, p's chunk, equal its own call above:", torch.allclose(mixed[1:], out_chunk, **TOL))

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Attention over the paged cache lives in the attention backends,
# `vllm/v1/attention/backends/`, one per kernel family, each handed one layer's cache and the batch's
# metadata:
#
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionImpl.forward` takes the step's
#   `query` (every scheduled token of every request, packed) and one layer's `kv_cache`, a view of
#   shape `[num_blocks, num_kv_heads, block_size, 2 * head_size]`; it splits it into `key_cache` and
#   `value_cache` and calls the kernel once for the whole batch. `num_queries_per_kv` is the GQA group.
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionMetadata` carries what this lesson's
#   functions take: `block_table` (this course's `block_tables`), `seq_lens` (the lengths, new tokens
#   included: this course's `context_lens`), and `query_start_loc`, where each request's queries start in the packed
#   batch (the running sum of `query_lens`), with `max_query_len` and `max_seq_len`.
# * `vllm/v1/kv_cache_layout.py`: `KVCacheLayout` names the order in memory of a cache's axes
#   (layer, block, head, token, content); `LBNHC` puts a block's tokens before its heads, so one
#   head's block is strided (section 5). It is the first of `_DEFAULT_LAYOUT_PREFERENCE` in
#   `vllm/v1/attention/backends/utils.py`, which `resolve_kv_cache_layout` follows when the
#   backends, FlashAttention's among them, state no preference.
# * `vllm/v1/kv_cache_interface.py`: `create_kv_cache_views` turns one flat buffer into a view per
#   layer, with the strides `compute_layout_strides` works out for the layout.
# * `vllm/v1/attention/ops/paged_attn.py`: `PagedAttention.split_kv_cache` still views a cache in the
#   original PagedAttention kernel's layout, heads before tokens, so that one head's block is
#   contiguous, as in this course.
# * `vllm/v1/attention/backends/flex_attention.py`: the FlexAttention backend, this course's `"flex"`
#   strategy grown up: the keys are the whole pool, and `physical_to_logical_mapping` inverts the
#   block tables so that a mask function can ask where a pool slot sits in a request.
# * `vllm/v1/attention/backends/triton_attn.py`: `TritonAttentionImpl.forward` splits the same view
#   into K and V and calls `unified_attention`, the Triton kernel lesson 12 reads.
#
# What the course leaves out or does differently: the kernels vLLM runs are compiled CUDA (FlashAttention)
# or Triton, fused and reading blocks in place, where this course's strategies are PyTorch operations;
# the course keeps K and V in two tensors, heads before tokens, and runs decode (`paged_attention`) and
# prefill (`paged_prefill_attention`) as two calls, where vLLM's backends take every query token of a
# step, decode and prefill mixed, in one.

# %% [markdown]
# ## Recap
#
# * Decode attention for one sequence: `softmax(q · kᵀ / sqrt(head_dim))` over its tokens, then the
#   weighted sum of V, for each head; by hand it equals `scaled_dot_product_attention` (within `1e-5`).
# * A paged kernel gets `k_cache`, `v_cache`, the block tables and the context lengths, never a
#   contiguous K or V. `k_cache[table]` → `transpose` → `reshape` gives `(heads, blocks × block_size,
#   dim)` in position order; the positions from `context_len` on must go.
# * For a batch, rows padded with `-1` are clamped to a real block and every position at or past its
#   `context_len` gets a score of `-inf`. Without the mask, 4 of our 5 sequences were wrong; with it,
#   the padding value does not matter, and moving every block (with the tables updated) changes
#   nothing. This is `paged_kv.paged_attention`.
# * The order of the blocks matters only through the cut at `context_len`: gathering in sorted block
#   order put a stale slot among `a`'s 11 positions.
# * A dedicated kernel reads each block in place (in this course's layout one head's block is
#   contiguous; in vLLM v1's FlashAttention layout, tokens before heads, it is strided) and can
#   merge the blocks with an online softmax (a running max, a running sum and an accumulator,
#   rescaled when the max grows); the vLLM paper measures its kernel 20 to 26 % slower than
#   contiguous attention, and paging repays that with much larger batches.
# * `paged_attention(..., strategy=)`: `"gather"` copies every block (three passes over K and V;
#   13 to 27 times SDPA on a 2-core CPU), `"in_place"` reads each block once where it lies (within
#   a factor of 2 of SDPA) but pays for the whole pool, `"flex"` is FlexAttention with a block mask, fast only
#   compiled on a GPU. `"auto"` reads in place when the batch reads at least half the pool, in
#   float32, and gathers otherwise. All of them equal SDPA.
# * Grouped-query attention shares each K/V head among a group of query heads (Llama-3-8B: 32 over
#   8), multi-query attention shares one among all; the cache holds only the K/V heads, 128 KiB per
#   token for Llama-3-8B in 16 bits instead of 512 KiB. Query head `h` reads K/V head
#   `h // (num_heads // num_kv_heads)`, as `repeat_kv` and SDPA's `enable_gqa` pair them; every
#   strategy of `paged_attention` takes such caches without repeating K/V.
# * A prompt chunk of `q` new tokens at an offset (chunked prefill, or the rest of a prompt after a
#   prefix-cache hit) attends causally to the cached positions and its own: `paged_prefill_attention`
#   equals the last `q` rows of causal SDPA on the whole sequence (5 of 13 here). The chunk alone is
#   wrong in every row; without the causal mask only the last row is right.
#
# **Next, lesson 07:** a concurrent workload, many sequences arriving and finishing at different
# times, and how much memory paging saves there against contiguous reservations. The exercise for this lesson,
# `exercises/05_paged_attention.ipynb`, has you write the gather, decode attention and the batched,
# masked paged attention yourself.

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
#    length, and show that attention over them is unchanged;
# 3. build the batched, vectorised version, with the padding clamped and the positions past each
#    sequence's length masked, which is `paged_kv.paged_attention`'s reference backend;
# 4. explain what goes wrong without the mask, and why the padding value does not matter with it;
# 5. explain how a dedicated kernel differs from the gather: it reads each block in place, where it
#    lies, and merges the blocks with an online softmax; the vLLM paper measures a 20 to 26 %
#    overhead for it, which larger batches more than repay.
#
# Lesson 06 takes the same attention to a real server's sizes: what each way of reading the blocks
# costs, grouped-query attention, and several new tokens per sequence.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import paged_kv
from paged_kv import PagedKVCacheAllocator, paged_attention
from paged_kv.pictures.plots import plot_padded_block_tables, plot_weights_by_block

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
# `k_cache` and `v_cache`, the sequence's block table, and its **length** `seq_len`, the number of
# tokens it holds (11; vLLM's name for the batch's lengths is `seq_lens`). From these it must find
# the tokens itself.
#
# The simplest way is to gather a contiguous copy, using the translation of lesson 03 one whole block
# at a time:
#
# * `k_cache[table]` picks the sequence's blocks in table order: `(blocks, heads, block_size, dim)`;
# * `transpose(0, 1)` puts the heads first: `(heads, blocks, block_size, dim)`;
# * `reshape` merges blocks and offsets into positions: `(heads, blocks × block_size, dim)`, where
#   position `p` comes from block `table[p // block_size]` at offset `p % block_size`;
# * `[:, :seq_len]` drops the positions past the last token: the three blocks have room for 12
#   tokens but hold 11.

# %%
table_a = torch.tensor(cache.get_block_mapping("a"), device=device)
seq_len = cache.sequence_length("a")

per_block = cache.k_cache[table_a]
by_head = per_block.transpose(0, 1)
positions = by_head.reshape(NUM_HEADS, -1, HEAD_DIM)
k_gathered = positions[:, :seq_len]
print("k_cache[table]:    ", tuple(per_block.shape))
print("transpose(0, 1):   ", tuple(by_head.shape))
print("reshape:           ", tuple(positions.shape))
print("[:, :seq_len]: ", tuple(k_gathered.shape))
print("equal to k_a with the heads first:", torch.equal(k_gathered, k_a.transpose(0, 1)))

# %% [markdown]
# The gathered keys are exactly `k_a`, heads first. We wrap the gather in a function, and write
# attention for this heads-first layout: the same three steps as in section 1, with the einsum indices
# `p` for positions.


# %%
def gather(cache_tensor: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's K (or V) from the pool, in position order: (heads, seq_len, dim)."""
    blocks = cache_tensor[table]  # (blocks, heads, block_size, dim)
    heads, dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(heads, -1, dim)[:, :seq_len]


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
# the cut at `seq_len`: it must fall in the *last logical* block. Gather the blocks by sorted id
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
# `-1` (lesson 03), and the lengths as a `(batch,)` tensor, `seq_lens`.

# %%
batch = ["a", "b", "c", "d", "e"]
for seq_id, length in zip(batch[1:], [4, 16, 6, 1], strict=True):
    cache.allocate_for_sequence(seq_id, length)
    k, v = torch.randn(2, length, NUM_HEADS, HEAD_DIM, device=device)
    cache.write_kv(seq_id, k, v)

block_tables = cache.block_tables_tensor(batch)  # (batch, max_blocks), padded with -1
seq_lens = torch.tensor([cache.sequence_length(s) for s in batch], device=device)
query = torch.cat([q_a[None], torch.randn(len(batch) - 1, NUM_HEADS, HEAD_DIM, device=device)])
print("query:", tuple(query.shape), "| block_tables:", tuple(block_tables.shape), block_tables.dtype)
for seq_id, row, length in zip(batch, block_tables.tolist(), seq_lens.tolist(), strict=True):
    print(f"  {seq_id}: {row}  seq_len {length:>2}")

# %% [markdown]
# A loop over the batch, calling `gather` and `attend` for each row, would work, but a GPU wants one
# operation over the whole batch, not five small ones. To do everything at once, every row must have
# the same shape, so every sequence gathers `max_blocks × block_size` = 16 positions. That raises two
# problems, and each has a one-line fix:
#
# * **the padding is not a block.** `-1` names no block. `clamp(0, num_blocks - 1)` replaces it by a
#   real block, any one; its data will not be used.
# * **positions past a sequence's length do not exist.** Those of the last block's empty tail, and now
#   those of the padding blocks too. Before the softmax, we set their scores to `-inf`: `exp(-inf)` is
#   exactly 0, so they get no weight at all, and the weights of the real positions still sum to 1.
#   Every sequence holds at least one token, so no row is all `-inf` (which would give `NaN`).
#
# The mask compares each position with its sequence's length, `positions[None, :] >= seq_lens[:,
# None]`: a `(batch, positions)` table of booleans, built with broadcasting and no loop.


# %%
def paged_attention_by_hand(query, k_cache, v_cache, block_tables, seq_lens, mask=True):
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
    # 3. Positions at or past the sequence's length get a score of -inf.
    if mask:
        beyond = torch.arange(num_positions, device=query.device)[None, :] >= seq_lens[:, None]
        scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
    # 4. Softmax over positions, then the weighted sum of V.
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)


out_batch = paged_attention_by_hand(query, cache.k_cache, cache.v_cache, block_tables, seq_lens)
print("output:", tuple(out_batch.shape))

# %% [markdown]
# The reference is SDPA run separately on each sequence, over its K/V read back with `read_kv`. We
# print whether the largest difference over the whole batch is below the tolerance.

# %%
expected = torch.stack([sdpa_one(query[i], *cache.read_kv(seq_id)) for i, seq_id in enumerate(batch)])
difference = (out_batch - expected).abs().max().item()
print(f"max |by hand - SDPA| < 1e-5 -> {difference < 1e-5}")
print("each sequence:", [torch.allclose(out_batch[i], expected[i], **TOL) for i in range(len(batch))])

packaged = paged_attention(query, cache.k_cache, cache.v_cache, block_tables, seq_lens)
print("paged_kv.paged_attention agrees:", torch.allclose(packaged, expected, **TOL))

# %% [markdown]
# All five sequences match. `paged_kv.paged_attention` computes the same thing, with input checks and
# float32 arithmetic for half-precision caches added. It hands the batch to an **attention backend**,
# named in a registry as vLLM names its own: with `backend="GATHER"`, the course's reference, it is
# this very function; by default it runs the platform's backend (on a CPU with a C compiler,
# `CPU_ATTN`, which reads the blocks in place, as section 5 describes), with the same result.
# Lesson 06 compares them.
#
# **Predict, then run.** Run the same batch without the mask. Which of the five sequences still get
# the right answer? (Their lengths are 11, 4, 16, 6 and 1; their rows are printed above.)

# %%
unmasked = paged_attention_by_hand(query, cache.k_cache, cache.v_cache, block_tables, seq_lens, mask=False)
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
        paged_attention_by_hand(query, cache.k_cache, cache.v_cache, other, seq_lens), out_batch
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

out_moved = paged_attention(query, moved_k, moved_v, moved_tables, seq_lens)
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
scores_a[:, seq_len:] = float("-inf")
weights_a = torch.softmax(scores_a, dim=-1)[0].cpu()  # head 0
print("position 11 gets a weight of exactly 0:", weights_a[11].item() == 0.0)

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [1, 2]})
plot_padded_block_tables(block_tables.tolist(), batch, highlight=0, ax=left)
plot_weights_by_block(
    weights_a, table_a.tolist(), BLOCK_SIZE, seq_len, ax=right, ylabel="attention weight (head 0)"
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
def online_softmax_attention(q, k_cache, v_cache, table, seq_len):
    """Attention of q (heads, dim) reading one block at a time, never holding all the scores."""
    heads, dim = q.shape
    block_size = k_cache.shape[2]
    running_max = torch.full((heads,), float("-inf"), device=q.device)
    running_sum = torch.zeros(heads, device=q.device)
    acc = torch.zeros(heads, dim, device=q.device)
    for logical, block in enumerate(table.tolist()):
        n = min(block_size, seq_len - logical * block_size)  # tokens in this block
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
out_online = online_softmax_attention(q_a, cache.k_cache, cache.v_cache, table_a, seq_len)
print("online softmax over blocks equals SDPA:", torch.allclose(out_online, out_sdpa, **TOL))
print("and the gathered version:              ", torch.allclose(out_online, out_paged, **TOL))

# %% [markdown]
# Equal. The rescaling makes the running sums exactly what they would have been had the final maximum
# been known from the start, so the only differences are rounding. This is the same technique as
# FlashAttention (a fused attention kernel that works through the keys one tile at a time), applied
# across the blocks of a block table.
#
# The package has this loop as a kernel: its `CPU_ATTN` backend is about 250 lines of C
# (`paged_kv/attention/csrc/cpu_attn.c`), compiled once with your machine's C compiler the first
# time it runs (about a second on this course's quiet 2-core machine) and kept on disk. One task
# per sequence and K/V head follows the block table, reads each block where it lies, only the
# slots the query sees, and keeps the same
# three running quantities in float32; the tasks are spread over the CPU's cores. It is what
# `paged_kv.paged_attention` runs by default on a CPU with a C compiler (`default_backend` in
# `paged_kv.attention` says which backend your machine gets); lesson 06 measures it against SDPA.
#
# **What it costs.** The block-table look-ups, the branches for a partly filled last block and the
# varying lengths in a batch are not free: the vLLM paper measures its paged attention kernel at
# 20 to 26 % higher latency than the kernel of FasterTransformer (NVIDIA's optimised inference
# library) on contiguous memory. Attention is only a part of each step, though, and paging lets many
# more sequences share the same memory (lesson 00): the larger batches are where the paper's 2 to 4
# times higher serving throughput comes from.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Attention over the paged cache lives in the attention backends,
# `vllm/v1/attention/backends/`, one per kernel family, each handed one layer's cache and the batch's
# metadata:
#
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionImpl.forward` takes the step's
#   `query` and one layer's `kv_cache`, a view of shape
#   `[num_blocks, num_kv_heads, block_size, 2 * head_size]`; it splits it into `key_cache` and
#   `value_cache` and calls the kernel once for the whole batch, which reads each block in place.
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionMetadata` carries what this lesson's
#   functions take: `block_table` (this course's `block_tables`) and `seq_lens` (the same name
#   here), with `max_seq_len`.
# * `vllm/v1/attention/backends/cpu_attn.py`: `CPUAttentionBackendImpl.forward`, vLLM's attention on
#   the CPU, splits the layer's cache into `key_cache` and `value_cache` and calls
#   `cpu_attention_with_kv_cache`, a C++ kernel that reads the blocks in place with an online
#   softmax, over the step's `query_start_loc`, `seq_lens` and `block_table`: what this course's
#   `CPU_ATTN` does in C.
# * `vllm/v1/attention/backends/registry.py`: `AttentionBackendEnum` names every backend
#   (`FLASH_ATTN`, `TRITON_ATTN`, `FLEX_ATTENTION`, `CPU_ATTN`, ...); the course's registry uses
#   vLLM's names for vLLM's ideas and names its own two: the course's `GATHER` (this lesson's
#   batched function) and the course's `IN_PLACE` (lesson 06).
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
#
# What the course leaves out or does differently: the kernels vLLM runs are compiled CUDA
# (FlashAttention), Triton or C++ with a variant per instruction set (AMX, AVX-512, NEON), fused,
# reading blocks in place with an online softmax, where this lesson's batched function gathers with
# PyTorch operations and the course's C kernel is one portable loop; the course keeps K and V in two
# tensors, heads before tokens.

# %% [markdown]
# ## Recap
#
# * Decode attention for one sequence: `softmax(q · kᵀ / sqrt(head_dim))` over its tokens, then the
#   weighted sum of V, for each head; by hand it equals `scaled_dot_product_attention` (within `1e-5`).
# * A paged kernel gets `k_cache`, `v_cache`, the block tables and the lengths (`seq_lens`), never a
#   contiguous K or V. `k_cache[table]` → `transpose` → `reshape` gives `(heads, blocks × block_size,
#   dim)` in position order; the positions from `seq_len` on must go.
# * For a batch, rows padded with `-1` are clamped to a real block and every position at or past its
#   `seq_len` gets a score of `-inf`. Without the mask, 4 of our 5 sequences were wrong; with it,
#   the padding value does not matter, and moving every block (with the tables updated) changes
#   nothing. This is `paged_kv.paged_attention`.
# * The order of the blocks matters only through the cut at `seq_len`: gathering in sorted block
#   order put a stale slot among `a`'s 11 positions.
# * A dedicated kernel reads each block in place (in this course's layout one head's block is
#   contiguous; in vLLM v1's FlashAttention layout, tokens before heads, it is strided) and merges
#   the blocks with an online softmax (a running max, a running sum and an accumulator, rescaled
#   when the max grows), equal to SDPA; the vLLM paper measures its kernel 20 to 26 % slower than
#   contiguous attention, and paging repays that with much larger batches. The package's `CPU_ATTN`
#   backend is that loop in C, the default on a CPU with a C compiler.
# * `paged_kv.paged_attention(..., backend=)` names the backend that reads the blocks, as vLLM's
#   registry names its own; `"GATHER"` is this lesson's batched function.
#
# **Next, lesson 06:** attention at scale: the package's backends, the ways to read the blocks, and
# what each costs at a server's sizes, grouped-query attention, and prompt chunks of several new tokens over
# the cache. The exercise for this lesson, `exercises/05_paged_attention.ipynb`, has you write the
# gather, decode attention and the batched, masked paged attention yourself.

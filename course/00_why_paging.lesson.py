# %% [markdown]
# # Lesson 00 · Why paging?
#
# An LLM server keeps, for every request it is serving, the keys and values of every token it has
# seen so far: the **KV cache**. That cache, not the model weights, decides how many requests fit on
# a GPU at once. This lesson measures how badly the simple way of storing it wastes memory, and why
# cutting it into fixed-size **blocks**, the idea behind vLLM's PagedAttention, fixes most of that.
#
# **By the end of this lesson you can**
#
# 1. compute how many bytes of KV cache one token costs for a given model, and explain why
#    grouped-query attention makes it smaller;
# 2. explain why a server that reserves one contiguous slot per request must reserve the *maximum*
#    length, and compute what that wastes;
# 3. compute what a paged cache wastes instead: less than one block per request;
# 4. reproduce the fragmentation benchmark of six requests (117 tokens held, 176 slots reserved
#    with blocks against 246 with contiguous slots) and read its metrics;
# 5. tell reservation, internal and external fragmentation apart, and say what a block's size
#    trades.
#
# Nothing here needs a GPU. Run the cells in order; the ones marked **Predict, then run** ask you to
# guess the answer before you look.

# %%
import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import PagedKVCacheAllocator, blocks_for_tokens, contiguous_baseline, fragmentation_report
from paged_kv.pictures.plots import PALETTE, plot_reservations

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. What the KV cache holds, and what it costs
#
# In a decoder, each new token attends to every token before it. Recomputing the keys and values of
# all those earlier tokens at every step would be wasteful, so the engine stores them: per layer,
# per KV head, one key vector and one value vector of `head_dim` numbers for every token. The cost of
# one token is therefore
#
# $$\text{bytes per token} = 2 \times \text{layers} \times \text{kv heads} \times \text{head dim} \times \text{bytes per number}$$
#
# where the 2 counts K and V. For a 7B-parameter model in the style of Llama 2 (32 layers, 32 KV
# heads of dimension 128, 16-bit numbers):


# %%
def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_number: int = 2) -> int:
    """Bytes of K and V that one token occupies in the cache, across all layers."""
    return 2 * layers * kv_heads * head_dim * bytes_per_number


per_token = kv_bytes_per_token(layers=32, kv_heads=32, head_dim=128)
print(f"one token:            {per_token:>13,} bytes = {per_token / 2**20:.2f} MiB")
print(f"a 2,048-token request: {2048 * per_token:>12,} bytes = {2048 * per_token / 2**30:.2f} GiB")

# %% [markdown]
# Half a megabyte per token, a gigabyte per long request. An 80 GB GPU that holds 14 GB of weights
# has room for the KV cache of roughly 60 such requests, and the number of requests served at once
# is what makes a server fast. So every wasted slot of the cache is a request that waits.

# %% [markdown]
# ### Fewer KV heads: grouped-query and multi-query attention
#
# The formula counts **KV heads**, not attention heads, because the cache holds only keys and
# values: a query is used once, by the token that makes it, and never stored. In Llama 2's
# multi-head attention each query head has a key head and a value head of its own, so the two
# counts are equal. Later models share them. With **grouped-query attention** (GQA) a group of
# query heads reads one K/V head: Llama-3-8B's 32 query heads read 8 KV heads, four each.
# **Multi-query attention** (MQA) is the extreme, one K/V head for all the query heads (Falcon-7B:
# 71 query heads, 1 KV head). The attention still computes every query head; only the cache
# shrinks (lesson 06 shows the attention side).
#
# **Predict, then run.** Llama-3-8B has Llama 2's 32 layers and head size of 128, with 8 KV heads
# instead of 32. What does one token of it cost?

# %%
from paged_kv.kv.sizing import format_bytes

models = [  # name, layers, query heads, KV heads, head dim
    ("Llama-2-7B", 32, 32, 32, 128),
    ("Llama-3-8B (GQA)", 32, 32, 8, 128),
    ("Falcon-7B (MQA)", 32, 71, 1, 64),
    ("SmolLM2-135M (GQA)", 30, 9, 3, 64),
]
print(f"{'model':<20}{'layers':>7}{'q heads':>9}{'kv heads':>10}{'head dim':>10}{'per token':>11}")
for name, layers, query_heads, kv_heads, head_dim in models:
    cost = format_bytes(kv_bytes_per_token(layers, kv_heads, head_dim))
    print(f"{name:<20}{layers:>7}{query_heads:>9}{kv_heads:>10}{head_dim:>10}{cost:>11}")

# %% [markdown]
# Same layers and head size, a quarter of the KV heads, a quarter of the bytes: 128 KiB per token,
# so the same GPU holds four times as many tokens of Llama-3-8B as of Llama-2-7B. Falcon-7B's single
# KV head makes it 8 KiB. SmolLM2-135M, a small model of the Llama family (30 layers, 9 query heads
# over 3 KV heads of 64), costs 22.5 KiB. `format_bytes` writes a byte count in binary units
# (1 KiB = 1,024 bytes, 1 MiB = 1,024 KiB).

# %% [markdown]
# The cache is also a real tensor. The package's `PagedKVCacheAllocator` allocates it once, up front,
# with the shape `(num_blocks, num_heads, block_size, head_dim)` that the rest of the course uses:

# %%
cache = PagedKVCacheAllocator(num_blocks=64, block_size=16, num_heads=4, head_dim=32, device=device)
print("k_cache shape:", tuple(cache.k_cache.shape))
print("token slots:  ", cache.num_blocks * cache.block_size)
print("bytes (K + V):", 2 * cache.k_cache.numel() * cache.k_cache.element_size())

# %% [markdown]
# ## 2. The simple way: one contiguous slot per request
#
# When a request arrives, the engine knows its prompt but not how long the answer will be. If every
# request must live in one contiguous region, that region has to be large enough for the longest
# answer the server allows, so the engine reserves the **maximum length** for everyone.
#
# Take three requests served with an 8,000-token maximum:
#
# | request | prompt | generated | tokens held | reserved |
# |---|---:|---:|---:|---:|
# | A | 200 | 100 | 300 | 8,000 |
# | B | 4,000 | 1,000 | 5,000 | 8,000 |
# | C | 50 | 20 | 70 | 8,000 |
#
# **Predict, then run.** What fraction of the 24,000 reserved slots holds a token? Make a guess,
# then run the cell.

# %%
held = [300, 5000, 70]
baseline = contiguous_baseline(held, slot_tokens=8000)
print("reserved:", baseline.reserved_tokens, "tokens")
print("held:    ", sum(held), "tokens")
print("wasted:  ", baseline.internal_fragmentation_tokens, "tokens")
print(f"used:     {baseline.utilization:.1%}")

# %% [markdown]
# Under a quarter. The PagedAttention paper, which introduced vLLM, names three kinds of waste, and
# contiguous allocation suffers from all of them:
#
# * **reservation**: slots set aside for tokens a request *will* generate, idle until then. They
#   are used in the end, but while the request runs no other request can use them;
# * **internal fragmentation**: slots reserved beyond the request's final length, never used at
#   all, because the request stops before the maximum (almost all of A's and C's 8,000);
# * **external fragmentation**: when regions of different sizes come and go, the free memory splits
#   into holes, none big enough for the next request even when their sum would be.
#
# The three requests above are finished, so nothing more is to come: all 18,630 wasted slots are
# internal fragmentation. While they were still generating, part of the same slots was reservation.
# The paper measured that in earlier serving systems only 20.4 % to 38.2 % of the KV cache memory
# held actual token states, against 96.3 % with vLLM; lesson 07 measures the same split with a
# serving simulator.

# %% [markdown]
# ## 3. The paged way: fixed-size blocks, allocated on demand
#
# Operating systems solved the same problem for process memory decades ago with **paging**: memory is
# cut into fixed-size pages, a process gets pages one at a time as it grows, and a *page table* maps
# the process's contiguous addresses to pages scattered anywhere in physical memory.
#
# A paged KV cache does exactly this. The cache is cut into **blocks** of `block_size` token slots
# (vLLM's default is 16). A request takes blocks only as its tokens need them, and a **block table**
# records which physical block holds each run of `block_size` tokens. Three consequences:
#
# * almost no reservation: a request holding `n` tokens holds `ceil(n / block_size)` blocks, no
#   more, so the only slots it keeps for tokens to come are the rest of its last block;
# * internal fragmentation shrinks to the part of that last block beyond the final length, fewer
#   than `block_size` slots per request;
# * no external fragmentation: every block is the same size, so any free block fits any request.
#
# **Predict, then run.** With blocks of 16 tokens, how many blocks do requests of 0, 1, 16, 17 and
# 33 tokens need?

# %%
for tokens in (0, 1, 16, 17, 33):
    print(f"{tokens:>2} tokens -> {blocks_for_tokens(tokens, 16)} blocks")

# %% [markdown]
# The rule is a ceiling division, `ceil(n / block_size)`, which integer arithmetic computes as
# `-(-n // block_size)` or `(n + block_size - 1) // block_size`, with no floating point.

# %% [markdown]
# ## 4. The fragmentation benchmark
#
# Now six requests of 9, 17, 33, 5, 41 and 12 tokens, in a pool of 64 blocks of 16 tokens. The paged
# cache gives each one whole blocks; the contiguous baseline gives each one a slot as long as the
# longest request, 41 tokens. The picture shows what each request holds (colour) and what it reserves
# but leaves empty (hatched).

# %%
requests = [9, 17, 33, 5, 41, 12]
fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
plot_reservations(
    requests, slot_tokens=max(requests), ax=top, title="contiguous: one 41-token slot per request"
)
plot_reservations(requests, block_size=16, ax=bottom, title="paged: whole blocks of 16 tokens")
fig.tight_layout()
plt.show()

# %% [markdown]
# Request by request, the paged cache reserves the next multiple of 16:
#
# | request | tokens | blocks | reserved | wasted | used |
# |---|---:|---:|---:|---:|---:|
# | A | 9 | 1 | 16 | 7 | 56.3 % |
# | B | 17 | 2 | 32 | 15 | 53.1 % |
# | C | 33 | 3 | 48 | 15 | 68.8 % |
# | D | 5 | 1 | 16 | 11 | 31.3 % |
# | E | 41 | 3 | 48 | 7 | 85.4 % |
# | F | 12 | 1 | 16 | 4 | 75.0 % |
#
# `fragmentation_report` allocates the six requests in a real `PagedKVCacheAllocator` and reads its
# `usage()`; it also computes the contiguous baseline. The same report is printed as JSON by the
# command `python -m paged_kv fragmentation --block-size 16 --total-blocks 64 --request-tokens
# 9,17,33,5,41,12`.

# %%
report = fragmentation_report(requests, block_size=16, total_blocks=64)
paged, contiguous = report["block_usage"], report["contiguous_fixed_slot_baseline"]
print(f"{'':<32}{'paged':>8}{'contiguous':>12}")
print(f"{'tokens held':<32}{paged['allocated_tokens']:>8}{sum(requests):>12}")
print(f"{'slots reserved':<32}{paged['reserved_tokens']:>8}{contiguous['reserved_tokens']:>12}")
print(
    f"{'slots wasted':<32}{paged['internal_fragmentation_tokens']:>8}{contiguous['internal_fragmentation_tokens']:>12}"
)
print(f"{'utilization':<32}{paged['block_utilization']:>8.1%}{contiguous['utilization']:>12.1%}")
print(f"{'blocks used / free':<32}{paged['used_blocks']:>4} / {paged['free_blocks']}")
print("tokens saved by paging:", report["fragmentation_tokens_saved_vs_contiguous"])

# %% [markdown]
# **Watch it happen.** The same six requests, allocated one after another in a smaller pool of 16
# blocks. `record=True` makes the allocator keep a picture of the empty pool and one after every
# call, and `AllocationPlayer` plays them back: the pool (each used block in its request's colour,
# filled as far as its tokens go, the empty tail hatched), each request's block table, the free list
# and a usage gauge. Press **Play**, drag the slider, or step with the arrows of the frame number; the
# blocks a step touched are outlined. The animation runs in the browser, so it also plays in a copy of
# this notebook exported to HTML.

# %%
from paged_kv.pictures.widgets import AllocationPlayer

recorded = PagedKVCacheAllocator(num_blocks=16, block_size=16, num_heads=1, head_dim=1, record=True)
for name, tokens in zip("ABCDEF", requests, strict=True):
    recorded.allocate_for_sequence(name, tokens)
AllocationPlayer(recorded.trace)

# %% [markdown]
# The metrics, which the rest of the course keeps using:
#
# | metric | meaning |
# |---|---|
# | `used_blocks`, `free_blocks` | blocks held by some request, blocks on the free list |
# | `allocated_tokens` | tokens the requests actually hold |
# | `reserved_tokens` | slots in the used blocks, `used_blocks * block_size` |
# | `internal_fragmentation_tokens` | reserved slots with no token, `reserved - allocated`: the requests are done, so all of it is internal fragmentation |
# | `block_utilization` | `allocated / reserved` |
#
# Paging saves 70 slots here, about 28 % of the contiguous reservation, and that is the *kind* case
# for the baseline: it reserved only 41 tokens because it knew the longest request in advance. A real
# server must reserve its maximum length (thousands of tokens), which is how the earlier systems of
# section 2 ended up using only 20.4 % to 38.2 % of their KV cache.

# %% [markdown]
# ## 5. How big should a block be?
#
# The worst case wastes `block_size - 1` slots per request, so smaller blocks waste less. But each
# block is one more entry in every block table and one more separate read for the attention kernel,
# and tiny blocks make those reads inefficient on a GPU. vLLM's default is 16 tokens.
#
# **Predict, then run.** For the six requests above, how does the waste change from blocks of 1 to
# blocks of 64 tokens? Sketch the curve before you look.

# %%
sizes = [1, 2, 4, 8, 16, 32, 64]
wasted = [sum(blocks_for_tokens(t, size) * size - t for t in requests) for size in sizes]
for size, waste in zip(sizes, wasted, strict=True):
    print(f"block_size {size:>2}: {waste:>3} slots wasted")

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(sizes, wasted, marker="o", color=PALETTE[0], label="paged")
ax.axhline(
    contiguous["internal_fragmentation_tokens"],
    color=PALETTE[5],
    ls="--",
    label="contiguous (41-token slots)",
)
ax.set_xscale("log", base=2)
ax.set_xticks(sizes, [str(s) for s in sizes])
ax.set_xlabel("block size (tokens)")
ax.set_ylabel("slots wasted")
ax.legend(frameon=False)
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# With blocks of 32 or 64 tokens the paged cache wastes more than the contiguous baseline: when blocks are
# as large as the requests, every request pays for a mostly empty block. Block size is a trade-off between
# fragmentation and bookkeeping. The PagedAttention authors found 16 large enough to use the GPU
# efficiently and small enough to avoid significant internal fragmentation in most workloads, which is
# why it is vLLM's default.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0.
#
# * `vllm/v1/kv_cache_interface.py`: `AttentionSpec.page_size_bytes` is section 1's formula for one
#   layer's block of `block_size` tokens: the K/V heads times the tokens times `head_size +
#   head_size_v` (a key and a value, which may differ in size) times the bytes of `dtype`;
#   `FullAttentionSpec` is the spec of a layer that attends to every token.
# * `vllm/config/cache.py`: `CacheConfig.block_size`, with `DEFAULT_BLOCK_SIZE` (16) when neither you
#   nor the attention backend picks another (lesson 14).
# * `vllm/v1/core/kv_cache_utils.py`: `KVCacheBlock`, one block of the pool (lesson 01).
#
# What the course leaves out or does differently: the paper's numbers (20.4 % to 38.2 % of the
# cache holding tokens in earlier systems, 96.3 % with vLLM) are quoted, not measured; lesson 07
# measures the same split on a simulated workload. How a real engine decides how many blocks fit on
# a GPU waits for lesson 14, once KV-cache groups (lesson 13) and the token budget (lesson 10) are
# known.

# %% [markdown]
# ## Recap
#
# * The KV cache costs `2 × layers × kv heads × head dim × bytes` per token: 512 KiB for Llama-2-7B
#   in 16 bits, so its layout decides how many requests fit at once. Only the KV heads are cached:
#   Llama-3-8B's 32 query heads share 8 KV heads (grouped-query attention), 128 KiB per token.
# * Contiguous slots must be reserved at the maximum length; the unused part is lost to
#   reservation (slots kept for tokens still to come), internal fragmentation (slots beyond the
#   final length, never used) and external fragmentation (holes too small for the next request).
# * A paged cache hands out fixed-size blocks on demand; a request wastes at most `block_size - 1`
#   slots, in its last block, and any free block fits anyone.
# * On the six-request benchmark: 117 tokens held, 176 slots reserved with 16-token blocks (59 wasted,
#   66.5 % used) against 246 with 41-token contiguous slots (129 wasted, 47.6 % used).
# * A block's size trades waste (at most `block_size - 1` slots a request) against bookkeeping;
#   with blocks as large as the requests, paging wastes more than the contiguous baseline.
#
# **Next, lesson 01:** the two data structures that make paging work, `Block` and `BlockTable`, and
# how a block table works like a page table. The exercise for this lesson, `exercises/00_why_paging.ipynb`,
# has you write the waste arithmetic yourself. How many blocks a real GPU holds, and how vLLM works
# it out when it starts, is lesson 14's.

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
# 5. tell reservation, internal and external fragmentation apart;
# 6. size a KV cache from a GPU's memory the way vLLM does at start-up, read the two lines it logs
#    and its errors, and compute what `max_num_batched_tokens`, fp8 and tensor parallelism change.
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
# ## 6. How many blocks fit on a GPU
#
# A serving engine does not ask you for a number of blocks: it works it out when it starts, from
# the GPU's memory, and logs the result in two lines every vLLM user has seen. vLLM 0.33.0 does it in
# five steps.
#
# 1. **The memory it may use**: the GPU's total memory times `gpu_memory_utilization`, rounded up
#    (0.92 by default; the examples here take 0.9). The rest of the card is left to everything else.
# 2. **Less what a profiling run measured.** With the weights loaded, vLLM runs one forward pass over
#    a dummy batch as large as any it will schedule, `max_num_batched_tokens` tokens (2,048 unless
#    the engine picks another), then the sampler. Torch's memory statistics give the **activation
#    peak**, the most that pass held at once beyond the weights; vLLM also counts the memory that
#    appeared outside torch (the attention backend's workspaces).
# 3. **Less the CUDA graphs** the decode steps are recorded as, estimated by capturing the first two.
# 4. **Divided by the bytes of one block**, rounded down: `block_size` times the bytes per token of
#    section 1, all layers at once, because every layer keeps its K and V of a block at the same
#    block id. That is the pool.
# 5. **A check, then a line**: one request of `max_model_len` tokens must fit besides the **null
#    block**, which the pool keeps back for good (lesson 13 uses it). The line gives the pool in
#    tokens and as a *maximum concurrency*: how many requests of `max_model_len` it holds at once.
#
# $$\text{blocks} = \left\lfloor \frac{\lceil\text{total} \times \text{utilization}\rceil - \text{weights} - \text{activation peak} - \text{non-torch} - \text{CUDA graphs}}{\text{block size} \times \text{bytes per token}} \right\rfloor$$
#
# `kv_cache_report(config, gpu_memory_bytes=..., max_model_len=...)` does the five steps in integers
# and returns every number on the way. It reads the layers, heads and head size from a model config,
# here the published `config.json` of each model as a dict (a `transformers` config works too). A GPU
# measures the activation peak (the package's `measure_activation_peak` does it as vLLM does); here
# the report estimates it from the model's shape, and counts the weights from the shapes: 8,030,261,248
# parameters of 2 bytes for Llama-3-8B. The memory outside torch and the CUDA graphs are 0 unless
# given (`non_torch_bytes`, `cudagraph_bytes`, from a vLLM log). The GPUs are taken as 24, 80 and 141
# GiB; `device_memory(device)` reads what a real one reports, a little under its label.
#
# **Predict, then run.** Llama-3-8B's weights take 15 GiB. On the 24 GB card, how many tokens of KV
# cache fit: thousands, tens of thousands, or millions?

# %%
from paged_kv import kv_cache_report
from paged_kv.kv.sizing import KVCacheSpec

GiB = 2**30
llama_3_8b = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336)
llama_3_8b |= dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, torch_dtype="bfloat16")
llama = kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=8192)
print(llama.summary())
spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
print("a block is KVCacheSpec's too:", llama.bytes_per_block == spec.bytes_per_block(16))

# %% [markdown]
# Of the 21.6 GiB requested, the weights take 15 GiB and the activation peak a third of a GiB,
# which leaves 6.32 GiB: 3,238 blocks of 2 MiB. One request of 8,192 tokens needs 512 of them, so the
# pool holds 6.32 such requests at once, which vLLM also writes as 51,808 tokens (6.32 × 8,192, rounded
# down). The two 6.32 agree only because such a request takes exactly 1 GiB of Llama-3-8B's cache. The
# null block is among the 3,238: vLLM 0.33.0 reserves it when it checks that one request fits, and
# counts it in the line. `KVCacheSpec(num_layers, num_kv_heads, head_dim, dtype)` is the block's
# arithmetic alone.
#
# The same for three models on three GPUs: SmolLM2-135M, Llama-3-8B, and Gemma 3 27B, a hybrid model
# whose 62 layers attend through a sliding window of 1,024 tokens but for every sixth (lesson 13).
# Each is given its own context length.

# %%
smollm2 = llama_3_8b | dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, vocab_size=49152)
smollm2 |= dict(num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
gemma_3_27b = dict(model_type="gemma3_text", num_hidden_layers=62, hidden_size=5376, intermediate_size=21504)
gemma_3_27b |= dict(num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208)
gemma_3_27b |= dict(sliding_window=1024, sliding_window_pattern=6, torch_dtype="bfloat16")
configs = {"SmolLM2-135M": smollm2, "Llama-3-8B": llama_3_8b, "Gemma 3 27B": gemma_3_27b}
lengths = {"SmolLM2-135M": 8192, "Llama-3-8B": 8192, "Gemma 3 27B": 131072}
for name, config in configs.items():
    for gpu in (24, 80, 141):
        try:
            line = kv_cache_report(config, gpu_memory_bytes=gpu * GiB, max_model_len=lengths[name]).lines[1]
        except ValueError as error:
            line = str(error).split(".")[0]
        print(f"{name:<13}{gpu:>4} GB  {line.removeprefix('GPU KV cache size: ')}")

# %% [markdown]
# SmolLM2-135M is so small that nearly all the budget is cache: a million tokens on the 24 GB card,
# 121 requests of its whole context. Llama-3-8B pays its 15 GiB of weights on every card, so the 80 GB
# one holds 9 times the tokens of the 24 GB one for 3.3 times the memory. Gemma 3 27B's 50 GiB of
# weights do not fit in 21.6 GiB: vLLM stops with its first error. On the 80 GB card a block of its
# pool holds 10 layers (its KV-cache groups of ten, lesson 13), and one request of 131,072 tokens
# needs 8,192 blocks in the full-attention group but only 321 in each sliding group: the window, the
# tokens in flight (two steps of 2,048 under vLLM's default async scheduling) and one block because a
# window seldom starts at a block's edge.
#
# **Predict, then run.** On an H100, vLLM's `LLM` class takes a `max_num_batched_tokens` of 16,384,
# eight times the 2,048 above. What happens to Llama-3-8B's tokens on the 24 GB card as the budget
# grows from 512 to 32,768? And to Gemma 3 27B's on the 80 GB card as `max_model_len` grows?

# %%
print(f"{'budget':>7}{'peak':>11}{'blocks':>8}{'tokens':>8}")
for b in (512, 2048, 8192, 16384, 32768):
    r = kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=8192, max_num_batched_tokens=b)
    print(f"{b:>7,}{format_bytes(r.activation_peak_bytes):>11}{r.num_gpu_blocks:>8,}{r.kv_cache_tokens:>8,}")
for length in (8192, 32768, 131072):
    r = kv_cache_report(gemma_3_27b, gpu_memory_bytes=80 * GiB, max_model_len=length)
    print(f"Gemma 3 27B, max_model_len {length:>7,}: {r.blocks_per_request:>6,} blocks a request, ", end="")
    print(f"{r.num_gpu_blocks:,} in the pool, {r.kv_cache_tokens:,} tokens")

# %% [markdown]
# The profiling run holds more the more tokens it pushes through at once, and every byte of its peak
# is a byte the cache does not get: at 32,768 tokens the estimate passes 3 GiB and Llama-3-8B keeps
# about half its tokens. A large budget makes long prompts prefill in fewer steps (lesson 10), so it
# is a trade: faster prefill against fewer requests at once.
#
# `max_model_len` leaves Gemma 3 27B's pool alone, 17,329 blocks, but changes what one request needs,
# and the line counts the pool in requests of that length. A longer request pays for every token only
# in the full-attention group, while its sliding groups stop at the window, so the tokens the line
# reports grow with `max_model_len`. For a model that attends fully everywhere they stay near
# blocks × 16 whatever the length.
#
# ### When one request does not fit
#
# Llama-3.1-8B is Llama-3-8B's shape with a context of 131,072 tokens, and vLLM's `max_model_len`
# defaults to the model's context. On the 24 GB card:

# %%
import textwrap

try:
    kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=131072)
except ValueError as error:
    for paragraph in str(error).split("\n"):
        print(textwrap.fill(paragraph, 100))

# %% [markdown]
# The first paragraph is vLLM 0.33.0's, word for word: 16 GiB for one request of 131,072 tokens,
# 6.32 GiB available once the null block is set aside, and the longest `max_model_len` that would
# fit, 51,792 tokens (3,237 blocks of 16), which vLLM finds by binary search. The fixes after it are
# this course's, in the order to try them: a shorter `max_model_len` costs nothing when your requests
# are shorter anyway; a higher `gpu_memory_utilization` only takes what nothing else on the card
# needs; an fp8 cache halves every block for a small loss of accuracy (the exercise computes it);
# tensor parallelism takes more GPUs; a smaller `max_num_batched_tokens` shrinks only the activation
# peak, and slows prefill.
#
# Users still paste the older wording, from vLLM's V0 engine: "The model's max seq len (131072) is
# larger than the maximum number of tokens that can be stored in KV cache (93936). Try increasing
# `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine." It is the
# same check, counted in tokens. When the weights and the activations take everything, vLLM stops
# before it, with "No available memory for the cache blocks" (Gemma 3 27B on 24 GB above): then
# neither a shorter `max_model_len` nor fp8 can help.
#
# ### Tensor parallelism in numbers
#
# With `tensor_parallel_size` GPUs, vLLM splits every layer's heads between them: each GPU keeps
# `num_kv_heads / tp` of the K/V heads of every block, so a block costs it `1/tp` of the bytes, and
# about `1/tp` of the weights. Both leave its cache more room, so the tokens grow faster than the
# GPUs. Past one K/V head a GPU (Llama-3-8B's 8 heads at tp 16) vLLM replicates the heads, and a size
# that splits them unevenly is refused.

# %%
print(f"{'tp':>3}{'K/V heads':>11}{'block':>9}{'weights':>10}{'tokens':>14}")
for tp in (1, 2, 4, 8):
    r = kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=8192, tensor_parallel_size=tp)
    sizes = [format_bytes(r.bytes_per_block), format_bytes(r.weight_bytes)]
    print(f"{tp:>3}{r.num_kv_heads_per_gpu:>11}{sizes[0]:>9}{sizes[1]:>10}{r.kv_cache_tokens:>14,}")

# %% [markdown]
# Every GPU holds the same tokens, a slice of each one's heads, so the tokens in the line are the
# whole cluster's. Eight 24 GB cards hold 1,281,600 tokens of Llama-3-8B, 25 times one card's: eight
# times from the smaller blocks, and three more from the 13 GiB of weights each card no longer holds.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. vLLM sizes its pool of blocks once, when the engine starts, from a
# profiling run of the model on the GPU; the package's `kv_cache_report` follows it step by step.
#
# * `vllm/v1/worker/gpu_worker.py`: `Worker.init_device` takes `requested_memory` from
#   `request_memory` (`vllm/v1/worker/utils.py`, rounded up) once the CUDA context, NCCL and cuBLAS
#   are up; `Worker.determine_available_memory` runs `profile_run` (`vllm/v1/worker/gpu_model_runner.py`:
#   the dummy forward, then `_dummy_sampler_run`) and `profile_cudagraph_memory`, subtracts both and
#   logs "Available KV cache memory".
# * `vllm/utils/mem_utils.py`: `memory_profiling` measures `non_kv_cache_memory = total_consumed +
#   transient_peak_headroom`, the weights and the memory outside torch plus the activation peak
#   (`torch_peak - torch_allocated`); `format_gib` writes the GiB of every message.
# * `vllm/config/scheduler.py`: `SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS` (2,048) and
#   `DEFAULT_MAX_NUM_SEQS`; `EngineArgs.get_batch_defaults` in `vllm/engine/arg_utils.py` picks
#   larger ones by GPU (16,384 for vLLM's LLM class on an H100).
# * `vllm/config/cache.py`: `CacheConfig.gpu_memory_utilization` (0.92 by default),
#   `CacheDType` (the strings `cache_dtype` takes; "fp8" is "fp8_e4m3"), `kv_cache_memory_bytes` (the
#   budget in bytes, skipping the profiling) and `num_gpu_blocks_override`.
# * `vllm/config/model.py`: `ModelConfig.get_num_kv_heads`, `max(1, total_num_kv_heads //
#   tensor_parallel_size)`, and `verify_with_parallel_config`, which refuses a size that does not
#   divide the attention heads.
# * `vllm/v1/core/kv_cache_planning.py`: `get_kv_cache_configs` reserves the null block's bytes,
#   runs `_check_enough_kv_cache_memory` (both errors of section 6, with
#   `_estimate_max_model_len_from_groups`' binary search) and divides the memory by
#   `_get_kv_cache_bytes_per_block`, the largest group's layers' pages.
# * `vllm/v1/kv_cache_interface.py`: `AttentionSpec.page_size_bytes`, one layer's block (this
#   course's `KVCacheSpec.bytes_per_block` over the layers); `FullAttentionSpec.max_memory_usage_bytes`
#   and `SlidingWindowSpec.max_admission_blocks_per_request`, a request's need in each group.
# * `vllm/v1/core/kv_cache_utils.py`: `get_max_concurrency_for_kv_cache_config` (the pool's blocks,
#   null block included, over one request's), `get_kv_cache_capacity` (the tokens) and
#   `update_kv_cache_capacity`, which logs the line; `EngineCore._initialize_kv_caches`
#   (`vllm/v1/engine/core.py`) calls them in that order.
#
# What the course leaves out or does differently: on the CPU the activation peak is an estimate from
# the model's shape, the memory outside torch and the CUDA graphs are 0 unless given, and the weights
# are counted from the config's shapes, without vLLM's padding of the vocabulary to a multiple of 64.

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
# * An engine sizes its cache when it starts: (⌈total × `gpu_memory_utilization`⌉ − weights −
#   activation peak − CUDA graphs) // bytes per block, one request of `max_model_len` checked besides
#   the null block. At 0.9, Llama-3-8B gets 3,238 blocks of 2 MiB on a 24 GB GPU: "GPU KV cache size:
#   51,808 tokens, Maximum concurrency for 8,192 tokens per request: 6.32x". A larger
#   `max_num_batched_tokens` shrinks it, fp8 doubles it, and eight such GPUs hold 25 times the tokens.
#
# **Next, lesson 01:** the two data structures that make paging work, `Block` and `BlockTable`, and
# how a block table works like a page table. The exercise for this lesson, `exercises/00_why_paging.ipynb`,
# has you write the waste arithmetic yourself, then vLLM's block bytes and start-up line.

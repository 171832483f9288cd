# %% [markdown]
# # Lesson 13 · Hybrid models
#
# Every lesson so far gave every layer of a model the same block table: a block id named the same
# tokens in all layers, and a request kept the K/V of all its tokens until it finished. Most new open
# models break that assumption. They mix **full-attention** layers, whose token at position `p`
# attends to every position before it, with **sliding-window** layers of window `W`, whose token at
# `p` attends only to `p - W + 1 .. p`. A sliding layer never reads a token again once it has left
# the window, so keeping its K/V is pure waste. This lesson shows how vLLM stops paying for it
# without giving up one pool of fixed-size blocks.
#
# **By the end of this lesson you can**
#
# 1. compute what one request's KV cache costs a hybrid model when every layer keeps every token,
#    and when its sliding layers keep only their window: 15.5 GiB against 3.9 GiB for Gemma 3 27B
#    at 32k tokens;
# 2. compute which tokens and which blocks a window skips, and explain why the **null block** takes
#    the freed blocks' places in the table;
# 3. explain how vLLM groups a model's layers into **KV-cache groups** of one size over one pool, and
#    why an attention and Mamba hybrid gets blocks of hundreds of tokens;
# 4. show how prefix caching finds the hit that every group agrees on;
# 5. serve a tiny Gemma 3 with the engine, with Hugging Face's tokens, and count the blocks it holds
#    against treating every layer as full attention.
#
# Nothing here needs a GPU.

# %%
import random
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch
import transformers

import paged_kv
from paged_kv.core.kv_cache_coordinator import peak_blocks
from paged_kv.core.kv_cache_groups import SlidingWindowSpec, kv_cache_groups, layer_tensors, num_tensors
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.kv.sizing import format_bytes
from paged_kv.pictures.hybrid import HybridRecorder
from paged_kv.pictures.plots import PALETTE
from paged_kv.pictures.widgets import AllocationPlayer
from paged_kv.serving.engine import Engine, EngineRequest

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny model of section 6 has operations too small to share between threads
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Hybrid models, and what their sliding layers cost
#
# A sliding window bounds what a layer reads, so its attention costs the same at token 100,000 as
# at token 2,000, and the full-attention layers beside it keep the long-range view. The mix varies:
#
# * Mistral 7B (v0.1) slides in every layer, with a window of 4,096 tokens;
# * Gemma 2 alternates sliding layers of 4,096 tokens with full ones;
# * Gemma 3 runs five sliding layers of 1,024 tokens for each full one;
# * Qwen2's configuration can make the layers from `max_window_layers` on slide
#   (`use_sliding_window`), off in its released models;
# * gpt-oss alternates sliding layers of 128 tokens with full ones.
#
# Take Gemma 3 27B's published shape: 62 layers, every sixth one full (10 full, 52 sliding), 16 K/V
# heads of size 128, a window of 1,024, bfloat16. One token costs 8 KiB of K and V per layer, so a
# block of 16 tokens costs 128 KiB per layer, what vLLM calls a **page**. If every layer keeps every
# token, a request holds `ceil(tokens / 16)` blocks of all 62 layers.
#
# A sliding layer needs only the `W - 1` tokens before the next one, plus the tokens a step is
# computing. vLLM bounds what a sliding group of layers holds per request by
# `ceil((W - 1 + tokens in flight) / block_size) + 1` blocks (`SlidingWindowSpec.max_admission_blocks_per_request`;
# the `+ 1` because the window need not start at a block's edge). Under a token budget of 2,048
# (lesson 10; vLLM's API server takes it by default on a GPU under 70 GB, 8,192 on an H100), that is
# 193 blocks; once the prompt is in and a step computes one token, 65. The package's `peak_blocks(groups, tokens, max_in_flight_tokens)` adds it
# up over the groups of section 3; for now, trust that a block of this model's groups costs the
# pages of 10 layers.

# %%
GEMMA3_27B = [None if (layer + 1) % 6 == 0 else 1024 for layer in range(62)]  # None: full attention
PAGE = 2 * 16 * 128 * 2 * 16  # K and V, 16 heads of 128, 2 bytes, 16 tokens: one layer's block
hybrid = kv_cache_groups(GEMMA3_27B, block_size=16)
every_layer_full = kv_cache_groups([None] * 62, block_size=16)
window = SlidingWindowSpec(block_size=16, sliding_window=1024)
most = window.max_admission_blocks_per_request(max_in_flight_tokens=2048, max_model_len=32768)
print(f"a page: {format_bytes(PAGE)}; a sliding group holds at most {most} blocks")
print(f"{'tokens':>8}{'every layer full':>18}{'per group':>11}{'less':>7}{'decoding':>10}")
for tokens in (32_768, 131_072):
    full_bytes = peak_blocks(every_layer_full, tokens, 2048) * num_tensors(every_layer_full) * PAGE
    group_bytes = peak_blocks(hybrid, tokens, 2048) * num_tensors(hybrid) * PAGE
    decoding = peak_blocks(hybrid, tokens, 1) * num_tensors(hybrid) * PAGE  # one token in flight
    print(
        f"{tokens:>8,}{format_bytes(full_bytes):>18}{format_bytes(group_bytes):>11}"
        f"{full_bytes / group_bytes:>6.1f}x{format_bytes(decoding):>10}"
    )

# %% [markdown]
# At 32k tokens, 15.5 GiB for one request if every layer keeps everything, 3.9 GiB if the sliding
# layers keep their window: four times less, and 3.0 GiB once the request decodes. At 128k tokens,
# 62 GiB against 11.4 GiB: the full layers' share grows with the request, the sliding layers' does
# not. That factor multiplies the requests a GPU can hold at once at long context. The rest of the
# lesson is how a paged cache collects it. vLLM collects it only while its hybrid KV-cache manager
# is on; with it off (`--disable-hybrid-kv-cache-manager`, or vLLM's own choice when
# `--kv-transfer-config` names a KV connector that does not support it), every layer caches every
# token, the left column, and vLLM warns that the "Hybrid KV cache manager is disabled for this
# hybrid model" (In vLLM, below).

# %% [markdown]
# ## 2. The skipped tokens and the null block
#
# When `n` tokens of a request are computed, the next token sits at position `n` and reads positions
# `n - W + 1 .. n`. Every later token reads later positions still. So the leading tokens
#
# $$\text{skipped}(n) = \max(0,\; n - W + 1)$$
#
# are never read again by this layer (vLLM: `get_num_skipped_tokens`). With `W = 4` and 7 tokens
# computed, the next token reads positions 4 to 7, and 4 tokens are skipped.
#
# The cache frees blocks, not tokens, so only blocks lying **wholly** before the window go: the first
# `skipped(n) // block_size` entries of the table. A block that still holds the window's first
# position stays. Each freed block goes back to the pool's free list (with prefix caching, still
# cached, lesson 08), and something must fill its entry in the table.
#
# Why not drop the entry? Then logical block `j` would no longer be entry `j`: every slot computation
# (lesson 03: `block_ids[p // block_size] * block_size + p % block_size`) would need a per-request
# offset, and the tables handed to the kernel would shift under it. vLLM instead keeps the table's
# length and writes the **null block** into the entry: block 0, which vLLM takes out of every pool
# when the pool is built, hybrid model or not, and never allocates nor frees (`BlockPool.null_block`).
# Lesson 07 set it aside in every engine's pool; here is what it is for. Every position keeps its
# slot, and the attention never reads those entries, because it starts at the window's first block
# (the package's kernel of lesson 12, given `SLIDING_WINDOW = W`, starts its loop at the block of
# position `first query position - W + 1`). An operating
# system does the same with a page it has taken back: the page-table entry stays, marked not present.
#
# The package keeps these rules in the engine's memory, lesson 09's `KVCacheManager`, the same class
# for every model: given the model's KV-cache groups, it holds one block table per request in each
# group, over one pool whose block 0 is the null block. Below, Gemma 2's two kinds of layer, window
# 8 and full attention, in blocks of 4, and one request of a 6-token prompt. The manager is given the
# request itself, as vLLM's is, and reads only its `request_id`. Each decode step asks
# `allocate_slots` for one token; as in vLLM, it first gives back the sliding blocks that left the
# window, then takes a block where the token starts one.
#
# **Predict, then run.** After 14 decode steps the request holds 20 tokens and the next token sits at
# position 20. How many null entries does the sliding table have, and how many real blocks?

# %%
memory = KVCacheManager(16, kv_cache_groups=kv_cache_groups([8, None], block_size=4))
a = SimpleNamespace(request_id="a")  # what the manager reads of a request
memory.allocate_slots(a, 6)
for _ in range(14):  # 14 decode steps, one token each
    memory.allocate_slots(a, 1)
sliding_ids, full_ids = memory.get_block_ids("a")
print("tokens:", memory.num_tokens("a"))
print("sliding table:", sliding_ids, " full table:", full_ids)
print("free blocks:", memory.num_free_blocks, "of 15 (block 0 is the null block)")

# %% [markdown]
# Three null entries and two blocks. The next token reads positions 13 to 20, so 13 tokens are
# skipped, and `13 // 4 = 3` whole blocks: entries 0 to 2 (positions 0 to 11) are null. Entry 3
# holds positions 12 to 15; position 12 is skipped, but 13 to 15 are in the window, so its block
# stays. The full table holds all five blocks. Both tables have five entries, so position 13's slot
# is in entry 3 of either.
#
# **Watch it happen.** `HybridRecorder` drives a manager step by step and keeps a frame after
# each call, which the course's player plays (`paged_kv.pictures.hybrid`). The tables are named by
# group and request, `sw·a` and `full·a`, so the colour is the request's in both. The null block is
# grey and labelled `null`, in the pool and in the table; the gauge leaves it out, as vLLM's
# `get_usage` does. Step through: a block taken in both groups at each boundary, and from token 12
# on, one sliding block freed every four tokens.

# %%
recorder = HybridRecorder(KVCacheManager(16, kv_cache_groups=kv_cache_groups([8, None], block_size=4)))
recorder.allocate("a", 6)
recorder.decode("a", 22)
recorder.free("a")
AllocationPlayer(recorder.frames)

# %% [markdown]
# In the fullest frame, token 25, the full table holds 7 blocks and the sliding one 3, behind four
# null entries: the sliding group never holds more than 3 blocks (`ceil((8 - 1 + 1) / 4) + 1`),
# however long the request grows. The freed blocks go to the tail of the free list, and either
# group may take them again later: one pool serves both.

# %% [markdown]
# ## 3. KV-cache groups: one pool, blocks of one size
#
# A block table is shared by every layer that frees the same blocks at the same time: layers with the
# same **spec** (full attention, or a sliding window of one size). vLLM calls such a set of layers a
# **KV-cache group** (`KVCacheGroupSpec`) and gives each group its own table per request.
#
# All groups draw from one pool, and any free block may go to any group, so a block must be the same
# number of bytes in every group. vLLM makes every group hold the same number of layers: a block is
# then `group_size` layers' pages, and in block `b` the pages of layer slot `t` hold layer `t` of
# whichever group owns block `b`. The rule (`_get_kv_cache_groups_uniform_page_size`): put the layers in buckets by
# spec; the group size is the smallest bucket's count (or the largest's, when it is under 1.5 times
# the smallest, to pad less); split each bucket into `ceil(count / group_size)` groups, group `i`
# taking layers `i, i + n, i + 2n, ...`; a group short of layers is padded, its padding counting in
# every block's bytes. The package's `kv_cache_groups(layer_windows, block_size)` follows it, and
# `layer_tensors(groups)` says which tensor each layer reads.

# %%
models = {
    "Gemma 2, 4 layers": [8, None, 8, None],
    "Gemma 3, 6 layers": [8] * 5 + [None],
    "Gemma 3 27B": GEMMA3_27B,
}
for name, windows in models.items():
    groups = kv_cache_groups(windows, block_size=16)
    sizes = [f"{'full' if g.spec.sliding_window is None else 'sw'} {len(g.layers)}" for g in groups]
    tensors = num_tensors(groups)
    padding = len(groups) * tensors - len(windows)
    print(f"{name}: {len(groups)} groups ({', '.join(sizes)}); {tensors} tensor(s), {padding} padding")
gemma2 = kv_cache_groups([8, None, 8, None], block_size=16)
print("Gemma 2's groups:", [g.layers for g in gemma2], " tensor of each layer:", layer_tensors(gemma2))

# %% [markdown]
# Gemma 2 has two groups of two layers, so two tensors: layers 0 and 1 read tensor 0, layers 2 and
# 3 tensor 1. A block the sliding group holds stores layer 0 in tensor 0 and layer 2 in tensor 1;
# the same block, once the full group takes it, stores layers 1 and 3 there. Gemma 3's 5:1 gives six
# groups of one layer. Gemma 3
# 27B's 10 full layers set the group size to 10; its 52 sliding layers make 6 groups (9, 9, 9, 9, 8
# and 8 layers), so every block costs 10 pages and 8 of the 70 layer slots are padding. That
# padding is why, with no token budget (a whole 32k prompt in one step), the grouped cache would peak
# at 17.5 GiB, above the 15.5 of every layer full: the windows pay off only once blocks leave them.
#
# One request, several groups, one pool: `allocate_slots` asks every group how many free blocks it
# would take before it takes any, and takes them all or none (vLLM's manager asks its
# `KVCacheCoordinator`, which asks each group). A request that fits in the sliding group but not in
# the full one takes nothing.

# %%
memory = KVCacheManager(8, kv_cache_groups=kv_cache_groups([16, None], block_size=4))  # 7 to give
a, b = SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")
print("a, 12 tokens:", memory.allocate_slots(a, 12), "free:", memory.num_free_blocks)
print("b, 4 tokens:", memory.allocate_slots(b, 4), "free:", memory.num_free_blocks)
print("b holds blocks:", "b" in memory)

# %% [markdown]
# ## 4. Why hybrid models get large blocks
#
# Groups of one size make a page the same in every group only when every layer's page is the same.
# When it is not (other head sizes, say), vLLM's `unify_kv_cache_spec_page_size` multiplies the block
# size of the smaller pages' layers until their page equals the largest (or pads their page, when it
# does not divide the largest).
#
# Models that mix attention with **Mamba** or linear-attention layers push this further. Such a layer
# keeps no K/V per token: it keeps one state per request, of fixed size, and a "block" of its group
# holds one whole state. An attention page must be at least that large, so vLLM raises the attention
# block size (`Platform._align_hybrid_block_size`) to the smallest multiple of the kernel's block
# alignment whose attention page holds a state,
# `alignment * ceil(state page / (alignment * bytes per token))`, then pads the state page to match.
#
# Qwen3-Next-80B-A3B, from its published configuration: 48 layers, every fourth one gated attention
# (12 layers, 2 K/V heads of size 256), the other 36 Gated DeltaNet layers (16 key heads and 32 value
# heads of size 128, a convolution of width 4), bfloat16. In vLLM 0.33.0's code at tensor-parallel
# size 1, without prefix caching, the alignment is the attention backend's: its FlashAttention
# backend takes any multiple of 16 tokens, but asks for pages of 128 where it runs its FlashAttention
# 4 kernel for heads of 256.

# %%
attention_per_token = 2 * 2 * 256 * 2  # K and V, 2 heads of 256, bfloat16
conv_state = (4 - 1) * (2 * 16 * 128 + 32 * 128)  # (width - 1) x (keys, queries and values)
recurrent_state = 32 * 128 * 128  # a 128 x 128 matrix per value head
state_page = 2 * (conv_state + recurrent_state)
print(f"attention: {attention_per_token:,} bytes a token; a Gated DeltaNet state: {state_page:,} bytes")
for alignment in (16, 128):
    block_size = alignment * -(-state_page // (alignment * attention_per_token))
    page = block_size * attention_per_token
    padded = 100 * (page - state_page) / state_page
    print(f"alignment {alignment:>3}: {block_size}-token blocks, {page:,}-byte pages, padding {padded:.2f} %")

# %% [markdown]
# Blocks of 544 tokens, 34 times vLLM's default of 16, with the state page padded by 1.49 %; 640
# tokens with pages of 128. A bigger block wastes more in each request's last block (lesson 00) and
# gives prefix caching a coarser grain: the price of one pool for two kinds of memory. (Prefix
# caching adds alignments of its own for Mamba layers, which this leaves out.)

# %% [markdown]
# ## 5. Prefix caching with windows
#
# Lesson 08's prefix cache finds a prompt's longest cached prefix, block by block from the start. In
# a sliding group that asks too much: after a hit of `n` blocks, the first token to compute sits at
# position `n * block_size` and reads only the `W - 1` tokens before it, so the hit needs only its
# last `ceil((W - 1) / block_size)` blocks cached (vLLM: `_contiguous_blocks_for_hit`). The blocks
# before them may be gone; their entries are null. A run of fewer cached blocks from block 0 is a hit
# too, since the window then reaches back to the first token.
#
# Each group finds its own longest hit, and the request's hit is the longest prefix **every** group
# hits. A full-attention hit of 5 blocks is also a hit of 4, but a sliding hit of 8 blocks says
# nothing about 4 blocks, which needs other blocks. So the coordinator starts from the longest
# possible hit, asks each group in turn for its longest hit no longer than that, and when any group
# shortens it, asks again: a **fixed point** (vLLM: `HybridKVCacheCoordinator.find_longest_cache_hit`).
#
# Below, with prefix caching: request `a` prefills a 33-token prompt and decodes 12 tokens, so its
# window moves and its first sliding blocks go back to the free list, still cached. Then a second
# request with the same prompt looks it up.

# %%
gemma2_shape = kv_cache_groups([8, None], block_size=4)
memory = KVCacheManager(64, kv_cache_groups=gemma2_shape, enable_caching=True)
prompt = [100 + t for t in range(33)]
a, b = SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")
memory.allocate_slots(a, 33, prompt)
for generated in range(1, 13):
    memory.allocate_slots(a, 1, prompt + list(range(200, 200 + generated)))
print("a's sliding table:", memory.get_block_ids("a")[0])
hit = memory.get_computed_blocks(b, prompt)
print(f"hit: {hit.num_tokens} tokens; sliding {list(hit.block_ids[0])}, full {list(hit.block_ids[1])}")

# %% [markdown]
# A hit of 32 tokens, 8 blocks: at most `(33 - 1) // 4` blocks, since the last token must be computed
# to give the next one. The full group hits all 8 blocks that `a` still holds. The sliding group's
# hit is blocks 7 and 8, the prompt's logical blocks 6 and 7: `a` freed them when its window moved
# on, but they stay cached on the free list, and the new request would take them back.
#
# **Predict, then run.** `a` finishes, and the full group's logical block 4 (positions 16 to 19) is
# evicted. How long is the hit now, and which sliding blocks does it need?

# %%
memory.free("a")
memory.block_pool.evict(hit.block_ids[1][4])  # the full group's block of positions 16..19
again = memory.get_computed_blocks(b, prompt)
print(f"hit: {again.num_tokens} tokens; sliding {list(again.block_ids[0])}, full {list(again.block_ids[1])}")

# %% [markdown]
# 16 tokens. The full group now hits 4 blocks, and the sliding group, asked again at 4 blocks, needs
# the window of position 16: logical blocks 2 and 3 (blocks 3 and 4 of the pool), still cached. Had
# they been evicted too, the sliding group would have shortened the hit again, to the next run of two
# cached blocks to their left: logical blocks 0 and 1, a hit of 8 tokens.

# %% [markdown]
# ## 6. Serving a tiny Gemma 3
#
# The engine of lessons 09 to 11 serves a hybrid model the same way: `Engine` reads each layer's
# window from the model (Hugging Face's `layer_types` and `sliding_window`; Mistral, Qwen2, Gemma 2
# and Gemma 3 are supported), builds the KV-cache groups, and gives them to its `KVCacheManager`,
# the same class as for the tiny GPT, whose coordinator is now the hybrid one (vLLM's
# `HybridKVCacheCoordinator`, where a one-group model gets the `UnitaryKVCacheCoordinator`, and
# vLLM a model without prefix caching its `KVCacheCoordinatorNoPrefixCache`). The model's attention reads the table of its layer's group and sees the window (lesson 12's
# kernel takes it as `SLIDING_WINDOW`).
#
# The model is a tiny Gemma 3 built from `transformers.Gemma3TextConfig` with random weights, nothing
# downloaded: 6 layers (`layer_types` makes every sixth one full, so five slide over 8 tokens), 2 K/V
# heads of 16.

# %%
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=128)
SIZES |= dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SIZES |= dict(sliding_window=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_gemma3(**overrides) -> transformers.Gemma3ForCausalLM:
    """A seeded random-weight Gemma 3 of SIZES: no download."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SIZES, **overrides)).eval()
    model.generation_config.eos_token_id = None
    return model.to(device)


def hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy generation of one prompt, with its own cache."""
    ids = torch.tensor([prompt], device=device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


gemma = tiny_gemma3()  # the first Gemma 3 built imports transformers' Gemma 3 code
print("layer types:", gemma.config.layer_types)

# %% [markdown]
# Six requests of 10 to 24 prompt tokens each generate 32 tokens, under a token budget of 32, in
# blocks of 4; then Hugging Face's `generate` runs each one alone, with its own cache.

# %%
rng = random.Random(0)
requests = [EngineRequest(i, [rng.randrange(256) for _ in range(rng.randint(10, 24))], 32) for i in range(6)]
engine = Engine(gemma, num_blocks=256, block_size=4, max_num_batched_tokens=32)
served = engine.run(requests)
print("groups:", [(g.spec.sliding_window, g.layers) for g in engine.kv_cache_groups])
same = all(served.tokens[r.request_id] == hf_generate(gemma, r.prompt, 32) for r in requests)
print("the same tokens as model.generate:", same)

# %% [markdown]
# Six groups of one layer each, the sliding ones with a window of 8, and the engine's tokens are
# Hugging Face's, token for token.
#
# To see what the groups save, the same requests go to the same model with every layer made full
# attention (`layer_types`), one group of six layers: it computes other tokens, but holds the same
# number of tokens at every step. A block costs one layer's page in the hybrid engine
# (`bytes_per_block`, 1,024 bytes in float32) and six in the other, so the plot compares the bytes
# each holds at every step.

# %%
full_gemma = tiny_gemma3(layer_types=["full_attention"] * 6)
all_full = Engine(full_gemma, num_blocks=256, block_size=4, max_num_batched_tokens=32)
held_full = all_full.run(requests)
hybrid_bytes = [blocks * engine.bytes_per_block for blocks in served.used_blocks]
full_bytes = [blocks * all_full.bytes_per_block for blocks in held_full.used_blocks]
print(f"bytes per block: {engine.bytes_per_block:,} per group, {all_full.bytes_per_block:,} all full")
saving = max(full_bytes) / max(hybrid_bytes)
print(f"peak: {max(hybrid_bytes):,} bytes against {max(full_bytes):,}, {saving:.1f} times less")
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot([b / 1024 for b in full_bytes], "o-", color=PALETTE[5], label="every layer full attention")
ax.plot([b / 1024 for b in hybrid_bytes], "s-", color=PALETTE[0], label="KV-cache groups (5 sliding, 1 full)")
ax.set_xlabel("engine step")
ax.set_ylabel("KV cache held (KiB)")
ax.set_ylim(bottom=0)
ax.legend(frameon=False)
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# With every layer full, the cache grows with every token until requests finish. With groups it
# grows only in the full layer: the five sliding layers hold at most 3 blocks a request once decoding
# (`ceil((8 - 1 + 1) / 4) + 1`), 12 token slots, while the longest request grows to 56 tokens. The
# peak is 2.7 times lower here; with a window of 1,024 and requests of 32k tokens, section 1's four
# times. The first steps show the price of prefilling in chunks: a chunk's tokens are all in flight,
# and the sliding groups hold every block of it until the step is done.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. vLLM has one `KVCacheManager` for every model, over a coordinator (unitary
# for one KV-cache group, hybrid for several, one that never hits without prefix caching) of one pool
# with one single-type manager per group:
#
# * `vllm/v1/kv_cache_interface.py`: `FullAttentionSpec` and `SlidingWindowSpec` describe a layer;
#   `SlidingWindowSpec.max_admission_blocks_per_request` is section 1's bound,
#   `cdiv(num_tokens, self.block_size) + 1`, where `num_tokens` counts the window's
#   `sliding_window - 1` tokens and those in flight;
#   `MambaSpec.page_size_bytes` sums the state shapes; `KVCacheGroupSpec` holds a group's
#   `layer_names` and `kv_cache_spec`.
# * `vllm/v1/core/single_type_kv_cache_manager.py`: `SlidingWindowManager.get_num_skipped_tokens` is
#   `max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)`;
#   `remove_skipped_blocks` frees `num_skipped_tokens // self.block_size` blocks through
#   `_remove_blocks_in_range`, which walks backward, stops at the first `_null_block` and writes
#   `_null_block` in the freed entries; `find_longest_cache_hit` scans from the right for
#   `_contiguous_blocks_for_hit` blocks, `cdiv(window_size - 1, block_size)`.
# * `vllm/v1/core/kv_cache_coordinator.py`: `HybridKVCacheCoordinator.find_longest_cache_hit`, "an
#   iterative fixed-point algorithm": full attention, sorted first, is looked up once and only trimmed
#   afterwards (`is_simple_hybrid`: one full and one other spec need a single pass).
# * `vllm/v1/core/block_pool.py`: `BlockPool.null_block` is the first block popped from
#   `free_block_queue`, in every pool whatever the model, never freed; `get_usage` subtracts 1 for
#   it.
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.allocate_slots` calls `remove_skipped_blocks`
#   before `get_num_blocks_to_allocate`, "even if we cannot schedule this request".
# * `vllm/v1/core/kv_cache_planning.py`: `_get_kv_cache_groups_uniform_page_size` makes section 3's
#   groups (`group_size`, the 1.5 rule, `layers[i::num_groups]`, padding layers);
#   `unify_kv_cache_spec_page_size` scales block sizes to one page; `get_kv_cache_config_from_groups`
#   divides the memory by `_get_kv_cache_bytes_per_block` (the largest group's) into `num_blocks` and
#   lists in `kv_cache_tensors` one `KVCacheTensor` per group, each of the whole pool's `size`,
#   `bytes_per_block * num_blocks`: the groups alias one buffer from byte 0, since a block belongs to
#   one group at a time. The runner allocates that buffer once (`allocate_kv_cache` in
#   `vllm/v1/worker/utils.py`, lesson 09).
# * `vllm/config/vllm.py`: `VllmConfig` turns the hybrid manager off when `kv_transfer_config` names
#   a connector that does not support it, logging "Turning off hybrid kv cache manager", as
#   `SchedulerConfig.disable_hybrid_kv_cache_manager` (`vllm/config/scheduler.py`) does by hand. Then
#   `get_kv_cache_groups` (`vllm/v1/core/kv_cache_planning.py`) first calls
#   `unify_hybrid_kv_cache_specs`, which logs "Hybrid KV cache manager is disabled for this hybrid
#   model" and makes every sliding-window layer a `FullAttentionSpec`
#   (`vllm/v1/kv_cache_interface.py`) that records its `sliding_window` for the attention only: one
#   group, every token held.
# * `vllm/platforms/interface.py`: `Platform.update_block_size_for_backend` calls
#   `_align_hybrid_block_size`, which sets `attn_block_size` from `mamba_page_size` and
#   `kernel_block_alignment_size` and pads `mamba_page_size_padded`; the model side,
#   `HybridAttentionMambaModelConfig.verify_and_update_config` in
#   `vllm/model_executor/models/config.py`, leaves that alignment to it.
#
# What the course leaves out or does differently: vLLM frees a window's blocks only up to the tokens
# already processed, so that a step still in flight keeps what it reads (`num_in_flight_tokens`), and
# keeps `extra_retained_tokens` more for speculative decoding; the course's coordinator asks every group at each
# round where vLLM looks a spec up once for all its groups; the course has no Mamba layers, no EAGLE
# drop, no hash blocks finer than a block, and none of vLLM's other layouts (packed groups of several
# page sizes, chunked local attention).

# %% [markdown]
# ## Recap
#
# * A sliding-window layer of window `W` never reads a token again once `max(0, n - W + 1)` of
#   `n` computed tokens are behind the next one; only blocks wholly before the window are freed,
#   `skipped // block_size` of them.
# * A freed block's entry becomes the null block, block 0 of every pool, never allocated nor freed: the
#   table keeps its length, positions keep their slots, and the attention starts at the window's
#   first block. A sliding group holds at most `ceil((W - 1 + tokens in flight) / block_size) + 1`
#   blocks per request.
# * Layers with one spec form a KV-cache group with a table of its own; vLLM makes groups of one
#   size so that a block is the same bytes in every group. Gemma 3 27B: 7 groups padded to 10 layers
#   (8 padding layers); under a 2,048-token budget one request at 32k tokens holds 3.9 GiB instead
#   of 15.5 GiB, at 128k 11.4 GiB instead of 62 GiB.
# * Page sizes are unified across groups: an attention and Gated DeltaNet hybrid, Qwen3-Next-80B-A3B,
#   gets blocks of 544 tokens (at an alignment of 16) so that an attention page holds a
#   1,097,728-byte state.
# * A prefix-cache hit is the longest prefix every group hits, found as a fixed point; a sliding
#   group needs only `ceil((W - 1) / block_size)` cached blocks at the end of the hit, and blocks
#   freed from a window stay cached.
# * The engine serves a tiny Gemma 3 with Hugging Face's tokens, at 2.7 times less KV cache at its
#   peak than with every layer full.
#
# **Next, lesson 14:** how vLLM sizes the pool when it starts, for models like these and for one that
# attends fully everywhere, to the last block. The exercise, `exercises/13_hybrid_models.ipynb`, has you write the
# skipped tokens, the blocks a window frees (the null block in their place, in vLLM's order) and the
# prefix-cache hit every group agrees on.

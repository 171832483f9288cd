# %% [markdown]
# # Lesson 10 · Real models and the token budget
#
# Lesson 09's engine served a tiny GPT with random weights, and every step prefilled whole prompts.
# A production engine differs on both counts. The models it serves are real architectures, most of
# them of the Llama family, with rotary positions and fewer K/V heads than query heads, and it
# bounds every step by a budget of tokens, so that a long prompt is prefilled in chunks beside the
# decodes instead of stalling them. This lesson runs a Hugging Face model on the course's cache and
# engine, with exactly Hugging Face's tokens, then gives the engine vLLM's token budget, and last
# halves the cache's bytes by storing K and V in fp8.
#
# **By the end of this lesson you can**
#
# 1. explain which two features of a Llama-family model touch the KV cache (grouped-query attention
#    and rotary position embeddings) and why neither changes its design;
# 2. size a real model's cache from its config (its K/V heads, head size and layers) and give the
#    engine its memory in bytes, as vLLM is given it; say what an fp8 cache saves in bytes and what
#    it costs in greedy tokens;
# 3. run a Hugging Face model on the paged cache and the engine and get exactly the greedy tokens of
#    Hugging Face's own `generate`;
# 4. trace a step under a token budget, `max_num_batched_tokens`: each running request's
#    `num_scheduled_tokens` in list order, then the chunks of newly admitted prompts, each chunk
#    attending over the cache at an offset and only a prompt's last chunk sampling;
# 5. read what a budget does to the largest step and to the time to first token of a stream with
#    long prompts.
#
# Most of the cells' time is the real model's; without a network, the model is a stand-in of the
# same architecture with random weights.

# %%
import random
import statistics

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT, encode
from paged_kv.pictures.plots import PALETTE, plot_block_tables
from paged_kv.serving.engine import Engine, EngineRequest

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny models' operations are too small to share between CPU threads
model = TinyGPT(GPTConfig(), seed=0).to(device).eval()  # lesson 09's tiny GPT, for section 2
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. A real model on the same cache
#
# The tiny GPT is GPT-2 in miniature. The models vLLM serves are mostly of the Llama family, and
# they differ from it in four ways: RMSNorm instead of LayerNorm, a gated MLP, **rotary position
# embeddings** instead of a learned position table, and **grouped-query attention** (lesson 06):
# fewer K/V heads than query heads. Only the last two touch the cache, and neither changes its
# design:
#
# * the cache stores the K/V heads only: `num_kv_heads`, not `num_heads`, sizes its blocks;
# * rotary embeddings rotate each query and key by an angle that grows with its position, before
#   attention. A key is stored already rotated, at its position, so decode only has to rotate the
#   new token's query and key, at the position the cache gives it (`append` returns it; in the
#   engine, the step's `positions`).
#
# `paged_kv` runs Hugging Face `transformers` models of the Llama family (Llama, Qwen2, Mistral)
# through the same calls as the tiny GPT: `prefill` and `decode_step` for `generate`, and
# `forward_step`, lesson 09's one forward over a flattened batch, for the engine. Hugging Face's own modules
# do all of the model (embeddings, norms, projections, rotary embeddings at the positions given,
# MLP, head) except the attention: transformers looks each layer's attention function up by name,
# and `paged_kv` registers one that hands the layer's queries, keys and values to the paged cache
# (`paged_kv/model/hf.py`). vLLM's *Transformers backend* plugs in at the same place; its own model
# files (`vllm/model_executor/models/llama.py`) re-write each layer around the attention instead.
#
# `load_model` fetches `HuggingFaceTB/SmolLM2-135M` and its tokenizer when the Hugging Face Hub
# answers. Without a network, as when the course's tests run, it says so in one line and builds a
# model of the same architecture with random weights and the tiny GPT's byte tokens: the text is then
# noise, but everything this section checks holds the same. (`python -m paged_kv check-env` says
# whether the Hub answers.)

# %%
# NBVAL_IGNORE_OUTPUT
from paged_kv.kv.sizing import KVCacheSpec, format_bytes
from paged_kv.model.causal_lm import as_causal_lm
from paged_kv.model.hub import load_model

loaded = load_model("HuggingFaceTB/SmolLM2-135M")
print(loaded.note)
llama = loaded.model.to(device)
sizes = as_causal_lm(llama).config  # what the cache needs to know, read from the model's config
spec = KVCacheSpec(sizes.num_layers, sizes.num_kv_heads, sizes.head_dim, llama.dtype)
print(f"{type(llama).__name__}: {sum(p.numel() for p in llama.parameters()) / 1e6:.0f}M parameters")
print(
    f"{sizes.num_layers} layers, {sizes.num_heads} query heads over {sizes.num_kv_heads} K/V heads "
    f"of {sizes.head_dim}: {format_bytes(spec.bytes_per_token)} of K/V per token in {llama.dtype}"
)

# %% [markdown]
# *Predict:* SmolLM2-135M has 30 layers of 3 K/V heads of size 64. How much cache does one token
# take in 16-bit, and how much would it take with a K/V head for each of its 9 query heads?
#
# (2 · 30 · 3 · 64 · 2 bytes = 22.5 KiB; three times that, 67.5 KiB, without grouped-query
# attention. The cell above prints it in float32, the dtype the CPU runs in: twice the 16-bit figure.)
#
# Now generate from two prompts with the paged cache, and again with Hugging Face's own
# `generate` and its own cache, one prompt at a time, greedily:

# %%
# NBVAL_IGNORE_OUTPUT
texts = ["The KV cache of a transformer", "Paged attention splits memory into"]
real_prompts = [loaded.encode(t) for t in texts]
real_cache = PagedKVCache(sizes, num_blocks=8, block_size=16, device=device, dtype=llama.dtype, record=True)
ours = generate(llama, real_prompts, max_new_tokens=12, cache=real_cache).tokens


def hf_generate(ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's greedy generation of one prompt, with its own KV cache."""
    batch = torch.tensor([ids], device=device)
    out = llama.generate(
        batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(ids) :].tolist()


theirs = [hf_generate(ids, 12) for ids in real_prompts]
for text, tokens in zip(texts, ours, strict=True):
    print(repr(text + loaded.decode(tokens)))
assert ours == theirs
print("identical to Hugging Face's generate:", ours == theirs)

# %% [markdown]
# Every layer of the model wrote into one `PagedKVCache`, under one block table per prompt, with
# 3 K/V heads per block; the prefill ran `paged_prefill_attention` and each decode step
# `paged_attention`, with 9 query heads over them.
#
# The bookkeeping looks exactly as it did for the tiny GPT: the trace's fullest moment, just before
# `generate` freed the prompts, has one block table per prompt. Each block the tables name holds the
# K/V of its 16 tokens in all 30 layers at once (30 pools indexed by the same block id), so the
# picture is the same whatever the model's depth; only the bytes behind each box grow.

# %%
# NBVAL_IGNORE_OUTPUT
frames = real_cache.trace
first_free = next(i for i, f in enumerate(frames) if f.event == "free")
plot_block_tables(
    frames[first_free - 1].snapshot,
    title=f"two prompts: one block table each, for all {sizes.num_layers} layers",
)
plt.show()

# %% [markdown]
# The engine serves the model as it served the tiny GPT. This time give it memory the way vLLM is
# given memory: not a number of blocks but a number of bytes (vLLM's `kv_cache_memory_bytes`; or
# `gpu_memory_utilization`, a share of the device's memory from which the weights are subtracted).
# The engine divides the budget by the bytes of one block over all 30 layers, and gives out every
# block but block 0, the null block (lesson 07):

# %%
# NBVAL_IGNORE_OUTPUT
server = Engine(llama, kv_cache_memory_bytes=8 * 2**20, block_size=16)
print(
    f"8 MiB / {format_bytes(server.bytes_per_block)} per block = {server.num_blocks} blocks "
    f"= {server.budget_tokens} token slots"
)
stream = [EngineRequest(i, loaded.encode(t), 8, arrival_step=i) for i, t in enumerate(texts * 2)]
served = server.run(stream)
expected = {tuple(ids): hf_generate(ids, 8) for ids in real_prompts}  # each prompt twice in the stream
assert all(served.tokens[r.request_id] == expected[tuple(r.prompt)] for r in stream)
print(f"{len(stream)} requests in {served.steps} steps, peak {served.peak_running} running: tokens identical")

# %% [markdown]
# ## 2. A token budget: chunked prefill
#
# So far a step prefills every prompt it admits, whole. A step's work is its tokens, one per
# decode and all of each prompt's, and every sequence in the step waits for all of them: when a
# 200-token prompt arrives, the dozen sequences decoding beside it get their next token only after
# those 200 tokens have gone through the model. A server cares about both latencies, the **time to
# first token** of a new request and the time between two tokens of a running one, and a long
# prompt in an unbounded step hurts the second.
#
# vLLM's scheduler bounds a step instead, by a **token budget**, `max_num_batched_tokens`. Each
# request keeps a count of its *computed* tokens, those whose K/V the cache holds
# (`num_computed_tokens`), and each step hands out at most the budget's tokens so that the counts
# catch up with the requests' tokens: first one token to every running decode, then what is left
# to **chunks** of prompts, the partly prefilled prompt first, then newly admitted ones, each
# taking as many of its remaining tokens as the budget allows. A chunk is positions `c .. c + n - 1`
# of its prompt, computed after `c` others: its queries attend over the cached positions before it
# and its own, the same paged attention as after a prefix cache hit (lesson 08), in the same one
# forward as the step's decodes (lesson 09). Only the chunk that reaches the end of the prompt
# samples a token; an earlier chunk's last logits predict a prompt token we already know.
#
# The step is lesson 09's, with the budget as one more limit: the scheduler walks the running
# requests in list order, giving each `min(num_tokens - num_computed_tokens, budget left)` tokens,
# then admits waiting requests while the budget lasts, each with `min(prompt tokens, budget left)`.
# Admission stops when the budget is spent, so at most one prompt is ever partly prefilled, the
# newest running request, which is why the decodes come first: they are older, not favoured. (vLLM
# can also cap every chunk at `long_prefill_token_threshold` tokens while more than one request runs
# or waits; then a long prompt leaves budget to the requests behind it, and several prompts can be
# partly prefilled at once.) Each chunk's
# blocks are taken by `allocate_slots` when the chunk is scheduled, after admission checked that the
# whole prompt fits. `Engine(..., max_num_batched_tokens=8)` on a 19-token prompt, with a 5-token
# prompt arriving a step later, shows the schedule step by step: `EngineResult.scheduled_tokens`
# keeps each step's `num_scheduled_tokens`, the running requests first, in list order, then the new
# ones.
#
# **Predict, then run.** At which step does `b`, arriving at step 1, get its first token?

# %%
budgeted = [
    EngineRequest("a", encode("a 19-token prompt.."), max_tokens=3),
    EngineRequest("b", encode("short"), max_tokens=3, arrival_step=1),
]
chunked = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=8).run(budgeted)
for step, scheduled in enumerate(chunked.scheduled_tokens):
    print(f"step {step}: " + ", ".join(f"{request} {n}" for request, n in scheduled))
print("first token at step:", chunked.first_token_step)
print("time to first token (steps):", chunked.time_to_first_token)
whole = Engine(model, num_blocks=16, block_size=4).run(budgeted)
print("same tokens as without a budget:", chunked.tokens == whole.tokens)

# %% [markdown]
# At step 2. `a`'s 19 tokens take three steps, 8, 8 and 3. `b` arrives at step 1, when `a`'s
# second chunk has spent the budget, and waits; at step 2 `a`'s last chunk samples its first token
# and leaves 5 tokens of the budget, which admit `b` with a chunk of 5, its whole prompt, so `b`
# samples in the same step. From then on both decode, one token each. Time to first token: 3 steps
# for `a`, 2 for `b`. Without a budget `a` would have been one step of 19 tokens, and `b` admitted
# the step it arrived.
#
# Now a stream where it matters: 48 requests, one arriving per step, with short prompts of 4 to 16
# tokens, except every eighth, which brings a long one of 160 to 200. The same 128 blocks of 16,
# enough never to preempt, and three budgets: none, 32 and 64 tokens a step. The table gives the
# steps, the largest step in tokens, and the time to first token in steps (from arrival to the step
# that samples it, both counted), median and 99th percentile (nearest rank).

# %%
rng = random.Random(1)
long_stream = []
for i in range(48):
    length = rng.randint(160, 200) if i % 8 == 0 else rng.randint(4, 16)
    prompt = [rng.randrange(256) for _ in range(length)]
    long_stream.append(EngineRequest(f"r{i}", prompt, rng.randint(8, 24), arrival_step=i))


def nearest_rank(values, share):
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * share // 100) - 1)]


budgets = {}
for budget in (None, 32, 64):
    budgets[budget] = Engine(model, num_blocks=128, block_size=16, max_num_batched_tokens=budget).run(
        long_stream
    )
print("budget  steps  largest step  mean running  TTFT median  TTFT p99  same tokens")
for budget, r in budgets.items():
    ttft = list(r.time_to_first_token.values())
    print(
        f"{budget or 'none':>6}{r.steps:>7}{max(r.tokens_per_step):>14}{r.mean_running:>14.1f}"
        f"{statistics.median(ttft):>13.0f}{nearest_rank(ttft, 99):>10}  {r.tokens == budgets[None].tokens}"
    )

# %% [markdown]
# A budget of 64 bounds every step to 64 tokens, against 210 without one, in the same 68 steps:
# a long prompt now spreads over three or four steps, beside the decodes, where before it made one
# step three times the size of the others. The median request still gets its first token in the
# step it arrives; the long prompts wait a few steps more (the 99th percentile goes from 1 to 4).
# A budget of 32 is too tight for this stream: about 10 sequences decode at once and take a third
# of it, so a long prompt takes many steps to prefill, the short prompts queue behind it (first
# come, first served), and the median time to first token climbs to 11 steps. Steps are not seconds,
# though: the cost of a step grows with its tokens, and a step of 210 tokens costs several of 64.
# The budget trades a little time to first token for a bound on the time between tokens. vLLM's
# `EngineArgs` picks a default by device, from 2,048 tokens (an API server on a smaller GPU) to
# 16,384 (on the largest), for models thousands of times larger than this one. The tokens per
# step, step by step, for no budget and a budget of 64:

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.plot(budgets[None].tokens_per_step, color=PALETTE[1], label="no budget")
ax.plot(budgets[64].tokens_per_step, color=PALETTE[0], label="max_num_batched_tokens = 64")
ax.axhline(64, color=PALETTE[0], linestyle=":", linewidth=1)
ax.set_xlabel("step")
ax.set_ylabel("tokens in the step")
ax.set_title("48 requests, every 8th with a 160- to 200-token prompt: the tokens each step runs")
ax.legend(frameon=False)
ax.spines[["top", "right"]].set_visible(False)
plt.show()

# %% [markdown]
# Without a budget the steps are a few tokens, the decodes, with a spike of about 200 at every long
# prompt; with one, the spike is cut at 64 and its rest runs in the next steps, so the line is
# flatter and never crosses the dotted bound. `bench/bench_chunked.py` measures the same on a
# larger stream and lesson 11 uses the budget's other effect: a request preempted by recompute
# resumes by prefilling, in chunks, the tokens it had generated.

# %% [markdown]
# ## 3. Half the bytes: an fp8 cache
#
# Section 1 sized the cache by its dtype as well as its heads: two bytes a number in 16-bit. vLLM
# can store K and V in **one** byte instead (`--kv-cache-dtype fp8`): a block then takes half the
# bytes, and the same memory holds twice the blocks, twice the tokens in flight. An 8-bit float keeps
# a sign, a few bits of exponent and very few of mantissa, in one of two layouts: `fp8_e4m3` (vLLM's
# `"fp8"`: 4 bits of exponent, 3 of mantissa, finite up to 448) and `fp8_e5m2` (5 and 2, up to
# 57,344: more range, less precision). Two neighbouring e4m3 numbers are 7 to 12.5 % apart, so a
# stored value is off by up to about 6 %.
#
# So that the values sit in the format's range, each layer has two **scales**, one number for all
# of its K and one for its V: the cache stores `K / k_scale`, clamped to the format's finite range,
# and attention reads `stored * k_scale` back in the model's dtype (V likewise). vLLM loads the
# scales from the checkpoint when a quantized model brings them, and uses 1.0 when it does not;
# `paged_kv` does the same, and with `calculate_kv_scales=True` it measures each layer's scales from
# the first K and V the layer writes, so that the largest fills the format. Every attention backend
# of lessons 05, 06 and 12 reads an fp8 pool: `GATHER` dequantizes the blocks it gathers, the
# Triton and C kernels (`TRITON_ATTN`, `CPU_ATTN`) load the bytes and fold `k_scale` into their score
# scale. The saving, for
# SmolLM2-135M, and three numbers stored in e4m3 and read back:

# %%
from paged_kv.kv.fp8 import dequantize, kv_cache_dtype_str_to_dtype, quantize

fp8 = kv_cache_dtype_str_to_dtype("fp8", llama.dtype)  # vLLM's name for torch.float8_e4m3fn
for dtype in (torch.float32, torch.bfloat16, fp8):
    smol = KVCacheSpec(sizes.num_layers, sizes.num_kv_heads, sizes.head_dim, dtype)
    print(
        f"{str(dtype).removeprefix('torch.'):>13}: {format_bytes(smol.bytes_per_block(16)):>9} a block "
        f"of 16 tokens, {smol.num_blocks(8 * 2**20, 16) * 16:>3} tokens in 8 MiB"
    )
x = torch.tensor([0.1, 3.14159, 1000.0])
print("stored in e4m3 and read back:", dequantize(quantize(x, 1.0, fp8), 1.0, torch.float32).tolist())

# %% [markdown]
# 180 KiB a block instead of 360, so the 8 MiB of section 1 hold 720 tokens instead of 352 (one
# block more than twice as many: the remainder is smaller). 0.1 became 0.1015625, pi 3.25, and 1,000,
# past the range, 448: with a scale of 1.0 a key larger than 448 would be clipped, which is what the
# scales are for.
#
# **Predict, then run.** The tiny GPT generates 24 tokens for each of 32 prompts, greedily, with the
# 32-bit cache and with fp8 caches. Each token is the largest of 256 logits that the cache's
# rounding moves a little. How many of the 32 requests get exactly the same 24 tokens with e4m3?
# And how many of their first tokens, computed from the prompts alone?

# %%
# NBVAL_IGNORE_OUTPUT
rng = random.Random(0)
prompts32 = [[rng.randrange(256) for _ in range(rng.randint(4, 40))] for _ in range(32)]
full = generate(model, prompts32, max_new_tokens=24)  # the 32-bit cache
top_two = full.logits.topk(2, dim=-1).values
print(f"median gap between the two largest logits: {(top_two[..., 0] - top_two[..., 1]).median():.2f}")
for kv_cache_dtype in ("fp8", "fp8_e5m2"):
    low = generate(model, prompts32, max_new_tokens=24, kv_cache_dtype=kv_cache_dtype)
    pairs = list(zip(low.tokens, full.tokens, strict=True))
    print(
        f"{kv_cache_dtype:>8}: {sum(a == b for a, b in pairs)} of 32 requests identical, "
        f"{sum(a[0] == b[0] for a, b in pairs)} of 32 first tokens, "
        f"{sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True))} of {32 * 24} tokens; "
        f"first logits moved by up to {(low.logits[0] - full.logits[0]).abs().max():.2f}"
    )

# %% [markdown]
# With e4m3, 21 of the 32 requests, and every first token: the prompts' logits moved by at most
# 0.05, and no largest logit lost its place. But a request's 24 tokens are 24 chances for a near
# tie, and its first flip changes its context, so most of its later tokens differ too: 632 of 768
# tokens agree (82 %), 570 with e5m2 (74 %, 16 requests identical). This is a sharp test: the tiny
# GPT's weights are random and its logits nearly flat (a median gap of 0.24 between the two
# largest), which a trained model's seldom are. `bench/bench_fp8.py` measures the same on the tiny
# Llama of the tests (73 % of the tokens with e4m3), and attention over an e4m3 cache within 4 % of
# the exact output (8 % in e5m2, 0.35 % in bfloat16). What fp8 costs a trained model is measured on
# its evaluations; scales calibrated on real data and shipped in the checkpoint are how quantized
# checkpoints keep it small. (On another CPU or a GPU, a near tie or two may fall the other way.)

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Real models and the token budget:
#
# * `vllm/model_executor/models/llama.py`: `LlamaAttention` builds its `Attention` layer with
#   `num_kv_heads`, and `LlamaForCausalLM` is vLLM's own Llama; the Transformers backend,
#   `vllm/model_executor/models/transformers/base.py`, runs a Hugging Face model whose attention
#   vLLM replaces, the place `paged_kv/model/hf.py` plugs in.
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` spends `token_budget` (its
#   `max_num_scheduled_tokens`, which defaults to `max_num_batched_tokens`) in one pass over
#   `self.running`, then over the waiting queue: our `Scheduler.schedule` (decodes come first only
#   because that pass is in list order and the one partly prefilled request is the newest). A
#   running request asks for `num_tokens_with_spec` plus its `num_output_placeholders` (with
#   asynchronous scheduling, the tokens of a step whose output has not come back) minus
#   `num_computed_tokens`, and is skipped once those placeholders reach its `max_tokens`; a waiting
#   one asks for `num_tokens` minus its prefix-cache hit. Each ask is cut to
#   `long_prefill_token_threshold` when that is positive and more than one request runs or waits (a
#   lone request has nobody to starve), then to the budget left; a running one
#   also to the positions left before `max_model_len`. Without chunked prefill
#   (`enable_chunked_prefill` off), a waiting prompt larger than the budget left ends admission for
#   the step;
# * `vllm/config/scheduler.py`: `SchedulerConfig.max_num_batched_tokens`, at least `max_num_seqs`,
#   and without chunked prefill at least `max_model_len` (`verify_max_model_len` refuses less: a
#   prompt must then fit one step); `long_prefill_token_threshold`, 0 (no cap) by default, and
#   `long_prefill_token_threshold_adaptive`, which floors it at a fair share of the budget. The
#   course leaves both out. The default budget comes
#   from `EngineArgs._set_default_max_num_seqs_and_batched_tokens_args` in `vllm/engine/arg_utils.py`:
#   by device and usage (`get_batch_defaults`), raised to `max_model_len` when chunked prefill is
#   off, and at most `max_num_seqs` times `max_model_len`;
# * `vllm/v1/request.py`: `Request.num_computed_tokens` and `num_tokens`, the counts our
#   scheduler keeps per request, and `is_prefill_chunk`, our request still prefilling;
# * `vllm/v1/core/sched/output.py`: `SchedulerOutput.num_scheduled_tokens`, a dict of tokens per
#   request, and `total_num_scheduled_tokens`, the same names as ours;
# * `Scheduler._update_after_schedule` advances `num_computed_tokens` as soon as a step is
#   scheduled, and `Scheduler.update_from_output` appends the sampled tokens, as ours do;
# * `vllm/v1/worker/gpu/input_batch.py`, Model Runner V2's: `get_num_sampled_and_rejected` sets
#   `num_sampled` to 0 for a request whose `seq_lens` entry is still below its `prefill_len`
#   (`is_chunked_prefilling`), so a partial chunk samples nothing (the V1 runner,
#   `vllm/v1/worker/gpu_model_runner.py`, uses its `discard_request_mask`): our
#   `ModelRunner.execute_model`, which samples only for chunks that end a prompt;
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.allocate_slots` takes the blocks of the
#   tokens scheduled each step; with `full_sequence_must_fit` (the scheduler's
#   `SchedulerConfig.scheduler_reserve_full_isl` in `vllm/config/scheduler.py`, on by default)
#   admission first checks that the whole prompt fits.
# * `vllm/config/cache.py`: `CacheConfig.cache_dtype` (`--kv-cache-dtype`), whose `CacheDType`
#   names include `"fp8"`, `"fp8_e4m3"` and `"fp8_e5m2"`; `vllm/utils/torch_utils.py`:
#   `kv_cache_dtype_str_to_dtype` maps them, through `STR_DTYPE_TO_TORCH_DTYPE`, to bytes
#   (`torch.uint8`) that the kernels view as fp8, where our function of that name gives torch's fp8
#   dtypes themselves. `vllm/model_executor/layers/quantization/kv_cache.py`:
#   `BaseKVCacheMethod.process_weights_after_loading` gives each attention layer its per-tensor
#   `_k_scale` and `_v_scale` from the checkpoint, or 1.0 when it brings none;
#   `vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`: `reshape_and_cache_kernel_flash`
#   stores each new key divided by `k_scale` (its `FP8_KV_CACHE` branch), and a key that is fp8
#   already as it is, as our `KVStorage.write_slots` does; `vllm/v1/attention/ops/triton_unified_attention.py`:
#   `kernel_unified_attention` reads each tile of K and V through `_cast_kv_tile`, the stored bytes
#   in float32 times the scale, cast to the query's dtype, as our `GATHER` backend reads an fp8 pool;
#   when the queries are fp8 too it folds the scales instead, `score_scale` and `value_scale`, as
#   our Triton launcher and C kernel do.
#
# What the course leaves out or does differently: `long_prefill_token_threshold`, speculative
# decoding (the `_spec` in `num_tokens_with_spec`), asynchronous scheduling, and of fp8 the queries
# quantized too (vLLM's `query_quant`), scales per token and head, and the other formats of
# `CacheDType`. The course's tokens never depend on the budget or on the batch (the table's "same
# tokens"); vLLM does not promise that, since a chunk or a batch of another shape may round its sums
# differently, unless `VLLM_BATCH_INVARIANT` (`vllm/envs.py`, off by default) selects
# batch-invariant kernels.

# %% [markdown]
# ## Recap
#
# * A Hugging Face Llama (SmolLM2-135M's architecture: 30 layers, 9 query heads over 3 K/V heads,
#   rotary positions) runs on the same cache and engine through the same calls as the tiny GPT and
#   gives exactly Hugging Face's greedy tokens; its cache is sized by the K/V heads, 22.5 KiB per
#   token in 16-bit, and the engine can take its memory in bytes.
# * A token budget, `max_num_batched_tokens`, bounds a step: the running requests in list order
#   (decodes first because the one partly prefilled prompt is the newest), then chunks of new
#   prompts, each attending over the cache at an offset, the same tokens. On 48 requests with a long prompt every
#   eighth, a budget of 64 cut the largest step from 210 tokens to 64 in the same 68 steps, for a
#   99th-percentile time to first token of 4 steps instead of 1.
# * An fp8 cache (`kv_cache_dtype="fp8"`, e4m3) stores each K and V number in one byte, `value /
#   scale` with a scale per layer for K and one for V (1.0 unless the checkpoint brings them), and
#   reads `stored * scale`: half the bytes of 16-bit (SmolLM2: 180 KiB a block of 16, 720 tokens in
#   8 MiB instead of 352), a quarter of float32. The tiny GPT's first tokens all agreed with the
#   32-bit cache's, 21 of 32 requests throughout and 82 % of the tokens (74 % in e5m2): its random
#   weights leave near ties that a small rounding flips.
#
# **Next, lesson 11:** running out of blocks: what the engine does when the sequences it admitted
# outgrow the pool (preemption by recompute, which resumes by prefilling in chunks under this
# lesson's budget, or by swap), and a watermark that makes it rare. The exercise for this lesson,
# `exercises/10_real_models_and_the_token_budget.ipynb`, has you size a real model's cache from its
# config, schedule a step under a token budget, and find the step that samples each request's first
# token.

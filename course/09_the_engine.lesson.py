# %% [markdown]
# # Lesson 09 · The engine
#
# Lessons 00 to 08 built the parts one at a time: blocks and block tables, an allocator with a free
# list, the translation from a token's position to a slot, on-demand blocks during decode, attention
# that reads through block tables, a scheduler that lets requests come and go, and blocks shared
# between sequences. None of them ran a model. This lesson puts them behind a real transformer, a
# tiny GPT, and serves a stream of requests with it, the way an inference engine such as vLLM does:
# first checking that the paged cache changes nothing in what the model computes, then measuring
# what it changes in how many requests the same memory serves at once.
#
# **By the end of this lesson you can**
#
# 1. explain the two phases of generation, prefill and decode, and the five calls through which a
#    model's attention layers use its KV cache;
# 2. show that greedy generation with the paged cache gives exactly the tokens of the contiguous
#    cache, for a batch of prompts of different lengths, even in a fragmented pool;
# 3. trace the engine's loop: admission with one block of headroom per running sequence, a new block
#    only at a block boundary during decode, memory released the step a request finishes;
# 4. serve a ShareGPT-shaped workload in the same memory with paged blocks and with contiguous
#    slots, and compare running sequences, steps and memory utilization;
# 5. weigh what paging costs (a slower attention kernel, some bookkeeping) against what it saves,
#    with the numbers of the course's benchmarks and of the vLLM paper.
#
# The cells run in 6 to 8 s on a quiet 2-core CPU (10 s with two busy processes beside it); a GPU
# is used when there is one. Lesson 10 runs
# a Hugging Face model on the same engine and gives its steps a token budget.

# %%
import random
import statistics

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode
from paged_kv.pictures.plots import plot_block_tables
from paged_kv.serving.engine import Engine, EngineRequest, plot_metrics
from paged_kv.simulation.workload import sample_requests

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
# The tiny model's operations are too small to share between CPU threads: one thread is as fast,
# and many times faster when other programs keep the cores busy.
torch.set_num_threads(1)
config = GPTConfig()
model = TinyGPT(config, seed=0).to(device).eval()
print("paged_kv", paged_kv.__version__)
print(config)
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")

# %% [markdown]
# ## 1. A tiny GPT and where its KV cache enters
#
# `TinyGPT` is a decoder-only transformer, the shape of GPT-2 in miniature: token and position
# embeddings, 2 blocks of causal self-attention and an MLP, and a head that turns the last hidden
# state into one score (a *logit*) per token of the vocabulary. Its tokens are bytes (`encode` gives
# the UTF-8 bytes of a text, `decode` turns them back), so the vocabulary has 256 entries. Its
# weights come from a seeded random generator, not from training: it writes noise. But it is
# deterministic noise, and that is all this lesson needs, because the question is not whether the
# text is good but whether two caches produce *the same* text.
#
# Generation runs in two phases.
#
# * **Prefill**: the whole prompt goes through the model at once, with ordinary causal attention over
#   its own queries, keys and values. Each attention layer stores the prompt's K and V in the cache.
#   The logits of the last position give the first new token.
# * **Decode**: then, one token per sequence per step, for the whole batch at once. The new token's
#   query must attend to every earlier token of its sequence, and their keys and values come from
#   the cache instead of being recomputed: that is what the KV cache is for. Each layer stores the
#   new token's K and V, and attends over everything the sequence holds.
#
# The attention layers see the cache only through five calls, `paged_kv.model.kv_cache.KVCache`:
#
# | call | when | what a cache does |
# |---|---|---|
# | `add_sequence(seq_id, num_tokens)` | before a prefill | make room for the prompt |
# | `write_prompt(layer, seq_id, k, v)` | prefill, in each layer | store the prompt's K and V |
# | `append(seq_ids)` | each decode step, once | grow each sequence by one token; return the new tokens' positions |
# | `attend(layer, seq_ids, q, k, v)` | each decode step, in each layer | store the new K and V, attend over the whole sequence |
# | `free(seq_id)` | when a sequence finishes | give its memory back |
#
# Two caches implement them. `ContiguousKVCache` is the baseline: per layer and per sequence, one K
# and one V tensor that grow by concatenation, and PyTorch's `scaled_dot_product_attention` (SDPA)
# over them. `PagedKVCache` keeps, as vLLM does, **one block manager** for all the layers (the
# bookkeeping of lessons 02, 04 and 08: block tables, ref counts, the free list, no tensors) and,
# per layer, a pool of K/V blocks that the same block ids index: `add_sequence` allocates the
# prompt's blocks once (lesson 02), `write_prompt` writes a layer's K and V into their slots (lesson
# 03), `append` grows every sequence by one token, taking a block at a boundary (lesson 04), `attend`
# writes the new K and V and calls `paged_attention` on the block tables (lesson 05), and `free`
# gives the blocks back. Every layer stores the same tokens at the same slots, so one block table per
# sequence serves every layer.
#
# How large is this model's cache? Each token stores one key and one value vector of `num_heads *
# head_dim` numbers in every layer.

# %%
bytes_per_token = 2 * config.num_layers * config.num_heads * config.head_dim * 4  # K and V, float32
numbers = f"2 x {config.num_layers} layers x {config.d_model} numbers"
print(f"KV cache per token: {numbers} x 4 bytes = {bytes_per_token:,} bytes")
print(f"a sequence of max_len {config.max_len} tokens: {bytes_per_token * config.max_len // 1024} KiB")

# %% [markdown]
# A kibibyte a token, where the 7B model of lesson 00 needs half a mebibyte: the arithmetic is the
# same, only the numbers shrink. Here is one prompt going through the paged cache by hand, in blocks
# of 4 tokens. `prefill` stores the prompt in every layer; each `decode_step` feeds back the token
# just chosen (greedy: the largest logit) and grows the sequence by one.
#
# **Predict, then run.** The prompt `"Paging!"` is 7 bytes, so after the prefill it holds 7 tokens
# in 2 blocks of 4. In which decode step does it take its third block?

# %%
cache = PagedKVCache(config, num_blocks=8, block_size=4, device=device)
prompt = torch.tensor(encode("Paging!"), device=device)
cache.add_sequence("s", len(prompt))
blocks = cache.manager  # the one block manager of every layer
steps = []  # the logits of each new token
with torch.no_grad():
    steps.append(model.prefill(prompt, "s", cache)[-1])
    print(
        f"prefill:       {blocks.sequence_length('s')} tokens, block table {blocks.get_block_table('s').block_ids}"
    )
    for step in range(1, 7):
        token = steps[-1].argmax()[None]
        steps.append(model.decode_step(token, ["s"], cache)[0])
        table = blocks.get_block_table("s").block_ids
        print(f"decode step {step}: {blocks.sequence_length('s')} tokens, block table {table}")

# %% [markdown]
# After decode step 1 the sequence holds 8 tokens, filling its two blocks exactly; decode step 2
# stores the 9th token and is the one that takes block 2. That is lesson 04's boundary rule: a
# sequence holding `n` tokens needs a new block before its next token exactly when `n` is a multiple
# of the block size. The next block follows at decode step 6, with the 13th token.
#
# The cache must not change what the model computes. Without any cache, the model can run the
# prompt and the tokens it generated as one sequence (`model(tokens)`, every position attending
# causally to the ones before it), and the logits at each position must be the ones the cached
# steps produced. Floating-point sums in a different order differ in the last bits, so the
# comparison allows a tolerance of `1e-4`.

# %%
generated = torch.stack([s.argmax() for s in steps])
with torch.no_grad():
    full = model(torch.cat([prompt, generated[:-1]])[None])[0]  # (positions, vocab), no cache
cached = torch.stack(steps)  # the logits of the last prompt position, then of each decode step
print(
    "same logits as the full forward pass:",
    torch.allclose(full[len(prompt) - 1 :], cached, atol=1e-4, rtol=1e-4),
)
cache.free("s")
print("free blocks after free:", cache.num_free_blocks, "of", cache.num_blocks)

# %% [markdown]
# ## 2. The same text, whichever the cache
#
# `generate(model, prompts, max_new_tokens, cache=...)` runs greedy generation for a batch: the
# prompts are prefilled together in one forward, their tokens packed one after another
# (`prefill_batch`; each prompt attends only to itself, and on the paged cache one
# `paged_prefill_attention` per layer reads all of them through their block tables), then every
# decode step feeds the whole batch's last tokens at once through one `decode_step`. The prompts may have any lengths; the caches deal with that, the
# contiguous one with a tensor per sequence, the paged one with a block table per sequence. With
# `cache="paged"` it builds a `PagedKVCache` with just enough blocks of 16; `GenerationResult` holds
# the new tokens of each prompt and the logits they came from.

# %%
texts = ["Hi", "The KV cache", "Paged attention stores K and V in blocks"]
prompts = [encode(t) for t in texts]
contiguous = generate(model, prompts, max_new_tokens=20, cache="contiguous")
paged = generate(model, prompts, max_new_tokens=20, cache="paged", block_size=16)
for text, prompt, new in zip(texts, prompts, paged.tokens, strict=True):
    print(f"{len(prompt):>2}-token prompt {text!r} -> {decode(new)!r}")
print()
print("same tokens:", contiguous.tokens == paged.tokens)
print("logits shape (step, prompt, vocab):", tuple(paged.logits.shape))
print(
    "same logits (atol = rtol = 1e-4):", torch.allclose(contiguous.logits, paged.logits, atol=1e-4, rtol=1e-4)
)

# %% [markdown]
# The continuations are noise, as promised (`repr` shows control bytes such as `\x15` escaped, and
# the `�` are bytes that are not valid UTF-8 on their own), but identical noise: the 60 tokens agree
# one for one. The logits agree within `1e-4`, not
# bit for bit: SDPA and `paged_attention` add up the same products in a different order.
#
# That pool was fresh: its blocks were handed out in order, so each sequence's blocks happened to
# be neighbours. A server's pool is never like that. Requests come and go, the free list gets
# shuffled, and every free block still holds the keys and values of whoever used it last. The next
# cell builds such a pool: 24 blocks of 8, each first filled by an old sequence with random K and
# V, then freed in a random order. `record=True` keeps a trace of the bookkeeping, so that we can
# look at the block tables afterwards.
#
# **Predict, then run.** The new sequences get blocks scattered over the pool, full of stale keys
# and values. Does the text change?

# %%
pool = PagedKVCache(config, num_blocks=24, block_size=8, device=device, record=True)
generator = torch.Generator().manual_seed(0)
for block in range(24):  # an old sequence in every block, with random K and V in every layer
    pool.add_sequence(("old", block), 8)
    for layer in range(config.num_layers):
        k, v = torch.randn(2, 8, config.num_heads, config.head_dim, generator=generator).to(device)
        pool.write_prompt(layer, ("old", block), k, v)
order = list(range(24))
random.Random(0).shuffle(order)
for block in order:
    pool.free(("old", block))
print("free list, first 12:", list(pool.manager.snapshot().free_block_ids[:12]))
fragmented = generate(model, prompts, max_new_tokens=20, cache=pool)
print("same tokens:", fragmented.tokens == contiguous.tokens)
print(
    "same logits (atol = rtol = 1e-4):",
    torch.allclose(contiguous.logits, fragmented.logits, atol=1e-4, rtol=1e-4),
)
print("free blocks after generate:", pool.num_free_blocks)

# %% [markdown]
# The text does not change. `generate` frees its sequences at the end, so the picture below comes
# from the trace: the bookkeeping just before the first of them was freed, when the three block
# tables were at their longest. Each sequence's logical blocks (bottom) point up into the pool (top)
# wherever the shuffled free list sent them; the hatched part of a block is its unused tail.

# %%
frames = pool.trace
first_free = next(i for i, f in enumerate(frames) if f.event == "free" and str(f.seq_id).startswith("prompt"))
fullest = frames[first_free - 1].snapshot
for seq_id, table in fullest.tables.items():
    print(f"{seq_id}: {table.num_tokens} tokens in blocks {table.block_ids}")
plot_block_tables(fullest, title="three prompts in a fragmented pool, at their longest")
plt.show()

# %% [markdown]
# A sequence holds its prompt plus 19 generated tokens (the 20th new token is chosen but never fed
# back), 21, 31 and 59 tokens: 3, 4 and 8 blocks of 8, 15 of the pool's 24. The prompts took their
# blocks from the head of the free list, in the shuffled order printed above, and the decode steps
# took the next ones as each sequence crossed a block boundary, so the tables jump all over the pool.
# The stale data in those blocks never reaches the attention: every token's K and V are written
# before they are read, and the slots past each sequence's length are masked (lesson 05).

# %% [markdown]
# ## 3. The engine: continuous batching on the paged cache
#
# `generate` serves one batch that starts together. A server has requests arriving all the time.
# `paged_kv.serving.engine.Engine` runs the tiny GPT behind the package's one scheduler,
# `paged_kv.serving.scheduler.Scheduler`: the scheduler lesson 07's simulator runs with a stand-in
# for the model, so both count steps and tokens alike. It is split the way serving engines are: each
# step, `output = scheduler.schedule()` decides what runs and returns it as a value (a
# `SchedulerOutput`: the admissions to prefill, the sequences to decode, the preemptions), a model
# runner computes it (`ModelRunner.execute(output)`: the step's prefills in one packed
# `prefill_batch`, then one batched `decode_step`)
# and returns the sampled tokens, and `scheduler.update(output, result)` appends them and finishes
# the requests that are done. vLLM v1 has the same three pieces: `Scheduler.schedule()`
# (`vllm/v1/core/sched/scheduler.py`) returning a `SchedulerOutput` (`vllm/v1/core/sched/output.py`),
# `GPUModelRunner.execute_model` (`vllm/v1/worker/gpu_model_runner.py`) and
# `Scheduler.update_from_output`. An
# `EngineRequest(request_id, prompt, max_new_tokens, arrival_step)` asks for `max_new_tokens` tokens
# (there is no end-of-sequence token, so it gets exactly that many). `Engine(model, num_blocks=...,
# block_size=..., mode=...)` serves requests in a budget of `num_blocks * block_size` token slots,
# in one of two modes: `"paged"` (a `PagedKVCache`) or `"contiguous"` (a `ContiguousKVCache` with one
# slot of `max_model_len` tokens reserved per sequence, out of the same budget). Each step of
# `Engine.run(requests)`:
#
# 1. **arrive**: requests whose `arrival_step` has come join the back of the waiting queue;
# 2. **admit**: first come first served, the request at the front is admitted while it fits, and
#    its prompt is prefilled (its first token comes from the prefill logits). In contiguous mode it
#    fits when one more slot of `max_model_len` does. In paged mode it fits when the blocks of its
#    prompt, plus **one block of headroom per running sequence, the new one included**, are free;
# 3. **decode**: the sequences that were running before this step's admissions decode one token
#    each, in one batched `decode_step`; in paged mode, a sequence takes a new block only when it
#    sits at a block boundary;
# 4. **finish**: a sequence that has all its tokens leaves, and its memory goes back at once, for the
#    next step's admissions.
#
# Why the headroom? One decode step adds one token per sequence, so it needs at most one new block
# per running sequence. Admitting a request only when that many blocks stay free means the next
# decode step can always run. Later steps may still run out, since every sequence keeps growing; the
# engine then *preempts* the newest sequence (frees its blocks and puts it back at the front of the
# queue, to be recomputed later). Lesson 11 is about that case.
#
# Three requests in a pool of 6 blocks of 4 slots show the loop at work: `a` and `b` arrive at step
# 0, `c` at step 1.
#
# | request | prompt | prompt blocks | new tokens | arrives |
# |---|---:|---:|---:|---:|
# | a | `"Once upon"`, 9 tokens | 3 | 6 | 0 |
# | b | `"KV"`, 2 tokens | 1 | 3 | 0 |
# | c | `"Hello"`, 5 tokens | 2 | 2 | 1 |
#
# At step 0, `a` needs its 3 blocks plus 1 of headroom, 4 of the 6 free; then `b` needs 1 block
# plus 2 of headroom (for `a` and itself), 3 of the 3 left free. Both are admitted.
#
# **Predict, then run.** `b` finishes at step 2 and gives its block back. At which step is `c`
# admitted?

# %%
tiny = [
    EngineRequest("a", encode("Once upon"), max_new_tokens=6),
    EngineRequest("b", encode("KV"), max_new_tokens=3),
    EngineRequest("c", encode("Hello"), max_new_tokens=2, arrival_step=1),
]
trace = Engine(model, num_blocks=6, block_size=4).run(tiny)
print("step  running  waiting  used blocks  tokens held")
for step in range(trace.steps):
    print(
        f"{step:>4}{trace.running[step]:>9}{trace.waiting[step]:>9}"
        f"{trace.used_blocks[step]:>13}{trace.held_tokens[step]:>13}"
    )
print("admitted at step:", trace.admitted_step)
print("finished at step:", trace.finished_step)

# %% [markdown]
# Step 6, not 3. When `b` leaves, `a` still fits in its 3 blocks, so 3 blocks are free; `c` needs
# 2 for its prompt plus 2 of headroom (`a` and `c`), 4 in all, and waits. At step 4 `a` takes its
# fourth block for its 13th token, leaving 2 free. Only when `a` finishes at step 5 and frees its 4
# blocks is `c` admitted, at step 6. The headroom rule is cautious on purpose: it trades a little
# waiting for a guarantee about the next step. (The table is measured after each step's decode, so
# a sequence that finishes at a step still counts as running in it.)
#
# Each request got exactly the tokens it would get alone. That is the engine's promise, and the
# course's tests check it for both modes: batching and paging change when a token is computed,
# never which token.

# %% [markdown]
# ### A ShareGPT-shaped stream, in the same memory
#
# Now a real workload. Lesson 07 drew request lengths shaped like ShareGPT conversations, up to 1,024
# prompt and 1,024 output tokens. The tiny model has `max_len` 256, so the lengths are divided by 8:
# the shape of the distribution stays, and even the longest possible request, 128 + 128 tokens,
# fits. The prompts are random bytes. 96 requests arrive as a Poisson stream of one per step on
# average.
#
# The budget is 2,048 token slots, 2 MiB of this model's KV cache: 8 contiguous slots of
# `max_model_len` 256, or 128 blocks of 16.


# %%
def scaled_sharegpt(
    num_requests: int, arrival_rate: float, seed: int = 0, scale: int = 8
) -> list[EngineRequest]:
    """ShareGPT-shaped requests with lengths divided by ``scale`` and random prompt bytes."""
    rng = random.Random(seed)
    requests = []
    for r in sample_requests("sharegpt", num_requests, seed, arrival_rate):
        prompt = [rng.randrange(256) for _ in range(max(1, round(r.prompt_tokens / scale)))]
        requests.append(
            EngineRequest(r.request_id, prompt, max(1, round(r.output_tokens / scale)), r.arrival_step)
        )
    return requests


requests = scaled_sharegpt(96, arrival_rate=1.0)
first, last = requests[0].arrival_step, requests[-1].arrival_step
print(f"{len(requests)} requests arriving from step {first} to step {last}")
mean_prompt = statistics.mean(len(r.prompt) for r in requests)
mean_output = statistics.mean(r.max_new_tokens for r in requests)
print(f"mean prompt {mean_prompt:.1f} tokens, mean output {mean_output:.1f}")
print("longest request:", max(len(r.prompt) + r.max_new_tokens for r in requests), "tokens")

results = {}
for mode in ("paged", "contiguous"):
    engine = Engine(model, num_blocks=128, block_size=16, mode=mode)
    results[mode] = engine.run(requests)
paged_run, contiguous_run = results["paged"], results["contiguous"]
print()
print("mode          steps  peak running  mean running  most waiting  mean util  preemptions")
for mode, r in results.items():
    print(
        f"{mode:<12}{r.steps:>7}{r.peak_running:>14}{r.mean_running:>14.1f}{max(r.waiting):>14}"
        f"{r.mean_utilization:>11.0%}{r.preemptions:>13}"
    )
print()
print("same tokens in both modes:", paged_run.tokens == contiguous_run.tokens)
print(f"mean running, paged / contiguous: {paged_run.mean_running / contiguous_run.mean_running:.1f}x")

# %% [markdown]
# Same requests, same memory, same tokens. The contiguous engine never runs more than 8 sequences,
# the 2,048 slots divided by 256, however short the requests are; the paged engine runs up to 33.
# On average it runs 17.3 sequences against 7.2, 2.4 times as many, and finishes the stream in 226
# steps instead of 544. Its blocks are 89 % full on average, against 24 % for the contiguous slots,
# and the headroom rule kept it from ever preempting.
#
# The engine's metrics, step by step. `plot_metrics` draws the running and the waiting sequences,
# and the utilization on a second axis (tokens held / slots reserved). First the paged engine:

# %%
ax = plot_metrics(paged_run)
ax.set_ylim(0, 80)
ax.set_xlim(0, contiguous_run.steps)
plt.show()

# %% [markdown]
# For the first 50 steps or so every request is admitted the step it arrives. Then the stream has
# brought more tokens than 128 blocks hold, and a short queue forms, 14 requests at most, while the
# running sequences hover around 30. Utilisation stays between 0.8 and 1 throughout: the only
# reserved slots that hold nothing are the unused tails of the sequences' last blocks. Now the
# contiguous engine, on the same axes:

# %%
ax = plot_metrics(contiguous_run)
ax.set_ylim(0, 80)
ax.set_xlim(0, contiguous_run.steps)
plt.show()

# %% [markdown]
# Eight running sequences, a flat line, while the queue climbs to 68 requests, most of the stream.
# Utilisation stays between 0.1 and 0.4: each sequence reserves 256 slots, and the average request
# ends at 62 tokens (21.5 + 40.7).

# %% [markdown]
# ## 4. What paging costs, and what it saves
#
# Nothing above was timed: step counts and sequence counts are the same on every machine. Speed is
# measured by the scripts in `bench/`, each against a baseline timed in the same run, and their
# results are in `bench/RESULTS.md` (run `.venv/bin/python bench/run_all.py` to measure your own).
#
# **The saving is concurrency.** `bench/bench_engine.py` serves 160 ShareGPT-shaped requests (the
# lengths divided by 8, as here), all arriving at once, in 3,072 token slots. The paged engine runs
# 26.7 sequences on average against 10.5 for the contiguous one, **2.5 times** as many (and 68
# against 12 at the peak), with identical tokens. The stream above gave 2.4 times.
#
# **The cost is in the attention and the bookkeeping.** `bench/bench_attention.py` times one decode
# step of attention (32 sequences, 8 heads of dimension 64, contexts of 1,024 tokens in scattered
# blocks of 16) against SDPA on the same tokens held contiguously: `paged_attention` takes **1.7 to
# 2.2 times** as long on a quiet 2-core CPU, and 1.9 to 9 times with two busy processes beside it
# (the benchmark's two threads then wait their turn). Gathering the blocks into a contiguous copy first, the simple way of
# lesson 05, would cost about 15 times the whole of SDPA for the copy alone, which is why
# `paged_attention` reads the blocks where they lie. On GPUs, the vLLM paper measures its
# PagedAttention kernel at **20 to 26 %** more latency than FasterTransformer's contiguous kernel.
# Around the attention, every step builds block tables and scatters the new keys and values into
# their slots: a little Python and indexing work per step.
#
# **Which wins depends on what limits a step.** On a GPU, a decode step of a real model reads all
# the weights from memory whatever the batch, so a step of 25 sequences costs little more than a
# step of 10: more sequences per step means more tokens per second. That is how the vLLM paper gets
# 2 to 4 times the throughput of earlier systems at the same latency, a much bigger gain than the
# attention kernel's overhead. The tiny model on a CPU is a poor stand-in for that: its weights are
# tiny, each step's cost grows with the batch, and the benchmark measures about the same tokens
# per second as the contiguous engine (1.07 to 1.2 times quiet, 1.24 to 1.29 busy). What it does show, on any machine, is the work done
# per step, output tokens divided by steps:

# %%
output_tokens = sum(r.max_new_tokens for r in requests)
for mode, r in results.items():
    per_step = output_tokens / r.steps
    print(f"{mode:<11}: {output_tokens:,} output tokens in {r.steps} steps = {per_step:.1f} tokens per step")

# %% [markdown]
# These are the mean running sequences again, since every running sequence produces one token per
# step (its prefill step included). The paged engine does 2.4 times the work per step; on hardware
# where a step costs about the same for 7 or for 17 sequences, that is 2.4 times the throughput.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. The engine's loop is vLLM v1's engine core, its scheduler and its
# model runner:
#
# * `vllm/v1/engine/core.py`: `EngineCore.step` is one step of the loop: `scheduler.schedule()`, then
#   the model executor's `execute_model` on the `SchedulerOutput` and its `sample_tokens`, then
#   `scheduler.update_from_output` with what was sampled: our `Engine`'s schedule, execute, update.
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` decides the step from `self.running` and
#   `self.waiting`, and admits a waiting request only when `KVCacheManager.allocate_slots`
#   (`vllm/v1/core/kv_cache_manager.py`) finds blocks for it; `Scheduler.update_from_output` appends
#   the sampled tokens and frees a finished request's blocks at once (`Scheduler._free_request`),
#   continuous batching's release.
# * `vllm/v1/core/sched/output.py`: `SchedulerOutput`, the step as a value, with `scheduled_new_reqs`
#   (requests prefilled for the first time, with their block ids) and `scheduled_cached_reqs` (the
#   requests already running).
# * `vllm/v1/worker/gpu_model_runner.py`: `GPUModelRunner.execute_model` builds the step's inputs
#   from the `SchedulerOutput` and runs the model once; its `kv_caches` hold one tensor per layer,
#   all indexed by the block ids of one table per request, as this lesson's `PagedKVCache`.
#
# What the course leaves out or does differently: vLLM's scheduler takes a request's blocks for the
# tokens it schedules each step, where this engine admits a prompt with its blocks and takes a
# decode block when a sequence crosses a boundary; the admission headroom of one block per running
# sequence is the course's (vLLM preempts when a step does not fit, lesson 11); sampling beyond
# greedy, stop conditions and detokenisation are out of scope.

# %% [markdown]
# ## Recap
#
# * Generation has two phases: **prefill** runs the whole prompt and stores its K and V in every
#   layer; **decode** feeds one token per sequence per step, stores its K and V, and attends over the
#   cache. The model sees the cache through five calls (`add_sequence`, `write_prompt`, `append`,
#   `attend`, `free`), so the contiguous and the paged back-ends swap freely. This tiny GPT needs
#   1,024 bytes of cache per token.
# * The paged cache takes a new block exactly at a block boundary (the 9th and 13th tokens in blocks
#   of 4) and gives the logits of a full forward pass within `1e-4`.
# * Greedy generation for prompts of 2, 12 and 40 tokens gives the same 60 tokens with either cache,
#   also in a shuffled pool of stale blocks, with the 15 blocks in use scattered over 24.
# * The engine admits a request when its prompt's blocks plus one block per running sequence (the new
#   one included) are free, takes blocks on demand, and frees a finished request at once; in the
#   three-request example `c` waits from step 1 to step 6.
# * On 96 ShareGPT-shaped requests in 2,048 slots: 17.3 sequences running on average against 7.2
#   (2.4 times), 226 steps against 544, utilization 89 % against 24 %, the same tokens. The
#   benchmark's burst of 160 requests gives 2.5 times.
# * The costs: `paged_attention` at 1.7 to 2.2 times SDPA on a quiet CPU, the vLLM kernel 20 to 26 % slower
#   than contiguous attention on GPUs, and the bookkeeping of each step; repaid many times over where
#   a step costs the same for more sequences.
#
# **Next, lesson 10:** a real model, a Hugging Face Llama with grouped-query attention and rotary
# positions, on the same cache and engine, with exactly Hugging Face's tokens; and a token budget
# that bounds each step by prefilling long prompts in chunks. The exercise for this lesson,
# `exercises/09_the_engine.ipynb`, has you write the admission rule, the slots of a decode step and
# your own paged cache, and plug that cache into the engine.

# %% [markdown]
# # Lesson 09 · The engine
#
# Lessons 00 to 08 built the parts one at a time: block tables, an allocator, the translation from
# position to slot, on-demand blocks, paged attention, a scheduler, shared blocks. None ran a model. This lesson puts them behind a tiny GPT and serves a stream of requests with it, the way
# vLLM does: first checking that the paged cache changes nothing in what the model computes, then
# following one step of the engine from the scheduler's decision to the model's forward, then
# measuring how many requests the same memory serves at once.
#
# **By the end of this lesson you can**
#
# 1. explain prefill and decode, and the calls through which a model's attention uses its KV cache;
# 2. show that greedy generation with the paged cache gives exactly the contiguous cache's tokens,
#    even in a fragmented pool;
# 3. trace one engine step in vLLM v1's order: `schedule()` gives each request its
#    `num_scheduled_tokens` and takes their blocks with `allocate_slots` (all or nothing), the
#    `SchedulerOutput` carries both to the model runner, which prepares `positions`,
#    `query_start_loc`, `seq_lens` and the `slot_mapping` once and runs **one** forward, and
#    `update_from_output` takes the sampled tokens back;
# 4. serve a ShareGPT-shaped workload in the same memory with paged blocks and with contiguous
#    slots, and compare running sequences, steps and utilization;
# 5. weigh what paging costs against what it saves.
#
# A GPU is used when there is one; nothing needs it.

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
from paged_kv.pictures.plots import plot_block_tables, plot_metrics, plot_step_batch
from paged_kv.serving.engine import Engine, EngineRequest
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
# state into one score (a *logit*) per token of the vocabulary. Its tokens are bytes (`encode` and
# `decode`). Its weights are seeded random numbers, so it writes deterministic noise: the question
# is not whether the text is good but whether two caches produce *the same* text.
#
# Generation runs in two phases. **Prefill**: the whole prompt goes through the model at once; each
# attention layer stores the prompt's K and V in the cache, and the last position's logits give the
# first new token. **Decode**: then one token per sequence per step, for the whole batch at once; the
# new token's query attends to every earlier token of its sequence, whose K and V come from the cache.
#
# In `generate`, the course's batch generation, the attention layers see the cache only through five
# calls, `paged_kv.model.kv_cache.KVCache` (the engine of section 3 prepares each step's inputs
# itself, vLLM's way):
#
# | call | when | what a cache does |
# |---|---|---|
# | `add_sequence(seq_id, num_tokens)` | before a prefill | make room for the prompt |
# | `write_prompt(layer, seq_id, k, v)` | prefill, in each layer | store the prompt's K and V |
# | `append(seq_ids)` | each decode step, once | grow each sequence by one token; return the new tokens' positions |
# | `attend(layer, seq_ids, q, k, v)` | each decode step, in each layer | store the new K and V, attend over the whole sequence |
# | `free(seq_id)` | when a sequence finishes | give its memory back |
#
# `ContiguousKVCache`, the baseline, keeps per layer and per sequence one K and one V tensor that grow
# by concatenation, and runs PyTorch's `scaled_dot_product_attention` (SDPA) over them.
# `PagedKVCache` keeps, as vLLM does, **one block manager** for all the layers (block tables, ref
# counts, the free list, no tensors) and per layer a pool of K/V blocks that
# the same block ids index, so one block table per sequence serves every layer; `attend` calls
# lesson 05's `paged_attention`.
#
# How large is this model's cache? Each token stores a key and a value of `num_heads * head_dim`
# numbers in every layer.

# %%
bytes_per_token = 2 * config.num_layers * config.num_heads * config.head_dim * 4  # K and V, float32
numbers = f"2 x {config.num_layers} layers x {config.d_model} numbers"
print(f"KV cache per token: {numbers} x 4 bytes = {bytes_per_token:,} bytes")
print(f"a sequence of max_len {config.max_len} tokens: {bytes_per_token * config.max_len // 1024} KiB")

# %% [markdown]
# A kibibyte a token, where the 7B model of lesson 00 needs half a mebibyte. Here is one prompt
# going through the paged cache by hand, in blocks of 4 tokens. `prefill` stores the prompt in every layer; each `decode_step` feeds back the token
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
# Decode step 2 stores the 9th token and takes block 2: lesson 04's boundary rule, a sequence
# holding `n` tokens needs a new block before its next token exactly when `n` is a multiple of the
# block size. The next block follows at decode step 6, with the 13th token.
#
# The cache must not change what the model computes. Without any cache, the model can run the
# prompt and the tokens it generated as one sequence (`model(tokens)`), and the logits at each
# position must be those of the cached steps, within `1e-4` (sums in another order differ in the
# last bits).

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
# `generate(model, prompts, max_new_tokens, cache=...)` runs greedy generation for a batch of
# prompts of any lengths: they are prefilled together in one forward, their tokens packed one after
# another (`prefill_batch`, each prompt attending only to itself), then every decode step feeds the
# batch's last tokens at once through one `decode_step`. With `cache="paged"` it builds a
# `PagedKVCache` with just enough blocks of 16; `GenerationResult` holds the new tokens of each
# prompt and the logits they came from.

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
# Noise (the `�` are bytes that are not valid UTF-8 alone), but identical noise: the 60 tokens agree
# one for one, the logits within `1e-4`.
#
# That pool was fresh: each sequence's blocks happened to be neighbours. A server's free list is
# shuffled, and every free block still holds the K and V of whoever used it last. The next cell
# builds such a pool, 24 blocks of 8, each first filled by an old
# sequence with random K and V, then freed in a random order; `record=True` keeps a trace of the
# bookkeeping, for a picture afterwards.
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
# The text does not change. The picture, from the trace just before `generate` freed the first
# sequence, shows each sequence's logical blocks (bottom) pointing into the pool (top) wherever the
# shuffled free list sent them; a block's hatched part is its unused tail.

# %%
frames = pool.trace
first_free = next(i for i, f in enumerate(frames) if f.event == "free" and str(f.seq_id).startswith("prompt"))
fullest = frames[first_free - 1].snapshot
for seq_id, table in fullest.tables.items():
    print(f"{seq_id}: {table.num_tokens} tokens in blocks {table.block_ids}")
plot_block_tables(fullest, title="three prompts in a fragmented pool, at their longest")
plt.show()

# %% [markdown]
# A sequence holds its prompt plus 19 generated tokens (the 20th is sampled, never fed back), 21, 31
# and 59 tokens: 3, 4 and 8 blocks of 8, taken from the head of the shuffled free list. The stale
# data in those blocks never reaches the attention: every token's K and V are written before they
# are read, and the slots past each sequence's length are masked (lesson 05).

# %% [markdown]
# ## 3. One step of the engine, vLLM's way
#
# A server has requests arriving all the time. `paged_kv.serving.engine.Engine` runs the tiny GPT behind the package's one `Scheduler`, the one
# lesson 07's simulator runs with a stand-in for the model. Each step is three calls, as in vLLM
# v1's engine core: `output = scheduler.schedule()` decides what runs and takes its memory, `result
# = runner.execute_model(output)` computes it, `scheduler.update_from_output(output, result)` takes
# the sampled tokens back. The scheduler holds no tensor; the runner never allocates or frees.
#
# **The scheduler decides tokens and blocks, before anything runs.** A request holds `num_tokens`
# tokens (its prompt, then what it generated), `num_computed_tokens` of them with their K/V in the
# cache. A step walks the running requests **in list order** (the order they were admitted) and
# gives each `num_scheduled_tokens = num_tokens - num_computed_tokens`: 1 for a request that decodes
# (its last sampled token), the rest of its prompt for one being prefilled. For each it calls
# `allocate_slots(request, num_new_tokens)` at once, which takes the blocks those tokens need (a
# decode token takes one only at a block boundary), **all or nothing**: the new block ids, or `None`
# when too few blocks are free. On `None` the scheduler *preempts* the newest running request
# (`running.pop()`: its blocks freed, back to the front of the queue, lesson 11) and asks again; if
# the newest is the request itself, it is the one preempted. Then, if nobody was preempted, it admits
# waiting requests, oldest first, each when the blocks of its **whole prompt** are free, keeping
# nothing back for the running requests' growth (lesson 11). Last, every scheduled request's
# `num_computed_tokens` advances by its scheduled tokens.
#
# **The `SchedulerOutput` carries the decision**, a frozen value with vLLM's names:
# `num_scheduled_tokens` (request id to tokens, in the order the runner flattens them),
# `total_num_scheduled_tokens`, `scheduled_new_reqs` (each new request's token ids and `block_ids`),
# `scheduled_cached_reqs` (the `new_block_ids` each running request gained), the preempted and the
# finished request ids. Block ids come as vLLM sends them, one tuple per *KV-cache group*: a model
# whose layers all attend fully has one group, so `((1, 2, 3),)` is one table's blocks 1, 2 and 3
# (lesson 13 meets models with several).
#
# **The model runner prepares the step once and runs one forward.** It keeps a persistent block
# table on the cache's device, one row per request (`BlockTables`): a new request's row gets its
# `block_ids`, a running one's its `new_block_ids`, a finished or preempted one's row is dropped.
# From the rows it builds, with a few tensor operations and no loop over tokens, what every layer
# needs for the flattened batch, the step's tokens one request after another:
#
# * `positions`: request `b`'s tokens sit at positions `num_computed_tokens` onwards;
# * `query_start_loc`: where each request's tokens start in the batch, and where the batch ends;
# * `seq_lens`: the tokens each request attends over once this step's are in;
# * `slot_mapping`: every token's slot, `block_table[b, p // block_size] * block_size + p %
#   block_size`, lesson 03's translation for the whole batch at once.
#
# Then **one** forward: every layer writes its new K/V at the `slot_mapping` and runs one paged
# attention over the flattened batch, causal inside each request's tokens, prefill chunks and
# decodes alike. Each request whose tokens reached its end samples a token; `update_from_output`
# appends it, and a request that has all its tokens finishes and frees its blocks at once.
#
# Here are those pieces built by hand, for `a`, the 9-token prompt `"Once upon"` asking for 6
# tokens, and `b`, `"KV"` (2 tokens), for 3, on a pool of 7 blocks of 4: block 0 is the null block
# (lesson 07), so 6 are given out. `KVCacheManager` is the scheduler's memory, as vLLM names it: the
# requests' block tables over one `BlockPool`, no tensor; `KVStorage` holds every layer's K/V pool, which the same block ids
# index. `EngineCoreRequest` is a request as the engine core receives it.

# %%
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.kv.storage import KVStorage
from paged_kv.serving.model_runner import ModelRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler

memory = KVCacheManager(num_blocks=7, block_size=4)  # block 0, the null block, and 6 to give out
scheduler = Scheduler(memory)
storage = KVStorage(config.num_layers, 7, 4, config.num_kv_heads, config.head_dim, torch.float32, device)
runner = ModelRunner(model, storage, max_num_reqs=3, max_blocks_per_req=4)


def request(request_id: str, text: str, max_tokens: int) -> EngineCoreRequest:
    prompt = encode(text)
    return EngineCoreRequest(request_id, len(prompt), max_tokens, tuple(prompt))


def step():
    """One engine step: schedule (tokens and blocks), execute (one forward), update (tokens back)."""
    output = scheduler.schedule()
    result = runner.execute_model(output)
    scheduler.update_from_output(output, result)
    return output, result


scheduler.add_request(request("a", "Once upon", 6))
scheduler.add_request(request("b", "KV", 3))
output, result = step()
print(f"step 0: num_scheduled_tokens {output.num_scheduled_tokens}")
for new in output.scheduled_new_reqs:
    print(f"  new request {new.req_id}: block_ids {new.block_ids}")
print(f"  sampled {result.sampled_token_ids}; free blocks: {memory.num_free_blocks} of 6")

# %% [markdown]
# Step 0 admitted both requests and prefilled both prompts in one forward of 11 tokens: `a`'s 9
# tokens need 3 blocks, `b`'s 2 one block, the first four after the null block. Each prefill sampled
# its request's first token.
#
# **Predict, then run.** Now `c`, the 5-token prompt `"Hello"` (5 new tokens), arrives. `a` and `b`
# hold 4 of the 6 blocks and both decode in the next step; `c`'s prompt needs 2 blocks. Is `c`
# admitted, and how many tokens does the step's one forward run?

# %%
scheduler.add_request(request("c", "Hello", 5))
output, result = step()
print(f"step 1: num_scheduled_tokens {output.num_scheduled_tokens}")
print(f"  total_num_scheduled_tokens {output.total_num_scheduled_tokens}")
cached = output.scheduled_cached_reqs
for req_id, new_ids, done in zip(
    cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
):
    print(f"  running {req_id}: {done} tokens computed before the step, new_block_ids {new_ids}")
for new in output.scheduled_new_reqs:
    print(f"  new request {new.req_id}: block_ids {new.block_ids}")
print(f"  sampled {result.sampled_token_ids}; free blocks: {memory.num_free_blocks} of 6")

# %% [markdown]
# Admitted, into a pool it fills: no block is left free. `a`'s 10th token (position 9) and `b`'s 3rd
# fit in blocks they hold (`new_block_ids` empty), and `c` took 2. The forward ran 7 tokens, two
# decodes and a whole prompt, and sampled a token for each request.
#
# What did the runner hand the layers? It keeps the step's metadata, which `prepare_attention` built
# once from its block table, as `runner.last_metadata`; `plot_step_batch` draws the batch's tokens
# with their positions, their slots, and each request's block-table row.

# %%
req_ids = list(output.num_scheduled_tokens)
metadata = runner.last_metadata
for name in ("positions", "query_start_loc", "seq_lens", "slot_mapping"):
    print(f"{name:<16} {getattr(metadata, name).tolist()}")
print(f"{'block_table':<16} {metadata.block_table.tolist()}")
plot_step_batch(
    req_ids,
    metadata.query_start_loc,
    metadata.positions,
    metadata.slot_mapping,
    metadata.block_table,
    block_size=4,
    title="step 1: two decodes and a prompt, one forward",
)
plt.show()

# %% [markdown]
# Token 0 of the batch is `a`'s position 9: column `9 // 4 = 2` of `a`'s row holds block 3, offset
# 1, so slot `3 * 4 + 1 = 13`. `c`'s five tokens are batch rows 2 to 6 (`query_start_loc` 2 and 7)
# and go to slots 20 to 24, in its blocks 5 and 6. Every layer writes its K and V at these 7 slots;
# then `c`'s position 3 attends over `c`'s positions 0 to 3 only, and `a`'s one query over all 10 of
# `a`'s tokens (`seq_lens`): one attention call, any number of queries per request.
#
# The pool is full. `Engine.run` runs the same loop, scheduler and runner to the end;
# `EngineResult.scheduled_tokens` keeps each step's `num_scheduled_tokens`.
#
# **Predict, then run.** `b` finishes at step 2 and frees its block. `a` reaches 13 tokens at
# step 4 and `c` 9 tokens at step 5: both need a new block then. What happens at step 5?

# %%
tiny = [
    EngineRequest("a", encode("Once upon"), max_tokens=6),
    EngineRequest("b", encode("KV"), max_tokens=3),
    EngineRequest("c", encode("Hello"), max_tokens=5, arrival_step=1),
]
trace = Engine(model, num_blocks=7, block_size=4).run(tiny)  # the same pool: the null block and 6
print("step  used blocks  running  waiting  num_scheduled_tokens")
for s in range(trace.steps):
    scheduled = ", ".join(f"{r} {n}" for r, n in trace.scheduled_tokens[s])
    print(f"{s:>4}{trace.used_blocks[s]:>13}{trace.running[s]:>9}{trace.waiting[s]:>9}  {scheduled}")
print("preemptions:", trace.preemptions, "| tokens recomputed:", trace.recomputed_tokens)
alone = {r.request_id: generate(model, [r.prompt], r.max_tokens, cache="contiguous").tokens[0] for r in tiny}
print("every request got the tokens it gets alone:", trace.tokens == alone)

# %% [markdown]
# At step 4 `a`'s 13th token took the block `b` gave back. At step 5 `c`'s 9th token found none
# free: `allocate_slots` returned `None`, and the newest running request, `c` itself, was preempted,
# its 2 blocks freed and its 8 computed tokens thrown away; the step ran `a` alone, which finished.
# At step 6 `c` was admitted again and prefilled 9 tokens, its prompt and the 4 tokens it had
# generated (a resumed request prefills up to its `num_tokens`), and sampled its last one. (The
# table is measured after each step's scheduling: a request that finishes at a step counts as
# running in it.)
#
# Had admission kept a free block per running request, `c` would have waited until step 6; vLLM
# keeps none, and pays a recompute now and then for a full pool. Each request still gets the tokens
# it gets alone: in the course's engine, batching, paging and preemption change when a token is
# computed, never which (vLLM does not promise that: In vLLM, below).

# %% [markdown]
# ## 4. A ShareGPT-shaped stream, in the same memory
#
# Now a real workload. Lesson 07 drew request lengths shaped like ShareGPT conversations, up to 1,024
# prompt and 1,024 output tokens; divided by 8 they fit the tiny model's `max_len` of 256. The
# prompts are random bytes; 96 requests arrive as a Poisson stream of one per step on average.
#
# `Engine(model, num_blocks=..., block_size=..., mode=...)` serves them in `num_blocks * block_size`
# token slots, in one of two modes: `"paged"`, the blocks of section 3, or `"contiguous"`, one slot
# of `max_model_len` tokens reserved per request at admission, as the systems before paging did. The
# budget is 2,048 token slots, 2 MiB of this model's cache: 8 slots of 256, or 128 blocks of 16, of
# which the paged engine gives out 127 (its block 0 is the null block).


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
mean_output = statistics.mean(r.max_tokens for r in requests)
print(f"mean prompt {mean_prompt:.1f} tokens, mean output {mean_output:.1f}")
print("longest request:", max(len(r.prompt) + r.max_tokens for r in requests), "tokens")

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
# the 2,048 slots divided by 256, however short the requests are; the paged engine runs up to 38.
# On average it runs 18.7 sequences against 7.2, 2.6 times as many, and finishes the stream in 209
# steps instead of 544. Its blocks are 89 % full on average, against 24 % for the contiguous slots.
# It preempted 4 times: admitting into a full pool has that price.
#
# Step by step, `plot_metrics` draws the running and the waiting sequences, and the utilization
# (tokens held / slots reserved) on a second axis. First the paged engine:

# %%
ax = plot_metrics(paged_run)
ax.set_ylim(0, 80)
ax.set_xlim(0, contiguous_run.steps)
plt.show()

# %% [markdown]
# Until step 93 every request is admitted the step it arrives. Then the running sequences' growth
# fills all 127 blocks: for a dozen steps up to 9 requests wait, and the four preemptions throw away
# 149 tokens of K/V, computed again on resuming. Utilization climbs from 0.8 to nearly 1: only the
# unused tails of the sequences' last blocks hold nothing. Now the contiguous engine, on the same axes:

# %%
ax = plot_metrics(contiguous_run)
ax.set_ylim(0, 80)
ax.set_xlim(0, contiguous_run.steps)
plt.show()

# %% [markdown]
# Eight running sequences, a flat line, while the queue climbs to 68 requests. Utilization stays
# between 0.1 and 0.4: each sequence reserves 256 slots, and the average request ends at 62 tokens.

# %% [markdown]
# ## 5. What paging costs, and what it saves
#
# Nothing above was timed: step counts and sequence counts are the same on every machine. Speed is
# measured by the scripts in `bench/`, each against a baseline timed in the same run
# (`bench/RESULTS.md`; `.venv/bin/python bench/run_all.py` measures your own).
#
# **The saving is concurrency.** `bench/bench_engine.py` serves 160 ShareGPT-shaped requests (the
# lengths divided by 8), all arriving at once, in 3,072 token slots: the paged engine runs 31.6
# sequences on average against 10.5, **3.0 times** as many (107 against 12 at the peak), with
# identical tokens, at the price of 74 preemptions. The stream above gave 2.6 times.
#
# **The cost is in the attention and the bookkeeping.** `bench/bench_attention.py` times one decode
# step of attention (32 sequences, 8 heads of 64, contexts of 1,024 tokens in scattered blocks of
# 16) against SDPA on the same tokens held contiguously: `paged_attention`, in its C backend
# `CPU_ATTN`, took **0.9 to 1.2 times** as long in four runs on a quiet 2-core CPU. On GPUs
# the vLLM paper measures its PagedAttention kernel at **20 to 26 %** more latency than
# FasterTransformer's contiguous kernel. Around the attention, every step schedules in Python and
# builds its inputs once, whatever the layers.
#
# **Which wins depends on what limits a step.** On a GPU, a decode step of a real model reads all
# the weights whatever the batch, so a step of 25 sequences costs little more than a step of 10:
# that is how the vLLM paper gets 2 to 4 times the throughput of earlier systems at the same
# latency. The tiny model on a CPU is a poor stand-in, each step's cost growing with its tokens.
# Every running sequence yields one token a step, so 2.6 times the mean running sequences is 2.6
# times the work per step, and the throughput too wherever a step of 19 costs about what one of 7
# does.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. The engine's step is vLLM v1's engine core, its scheduler and its
# model runner:
#
# * `vllm/v1/engine/core.py`: `EngineCore.step` is one step of the loop: `scheduler.schedule()`, then
#   the model executor's `execute_model` on the `SchedulerOutput` and its `sample_tokens`, then
#   `scheduler.update_from_output` with what was sampled: our `Engine`'s schedule, execute, update.
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` walks `self.running` in list order,
#   gives each request `num_new_tokens` (its `num_tokens_with_spec` less its `num_computed_tokens`,
#   capped by the `token_budget` and the other limits of lesson 10) and calls `allocate_slots` for
#   them at once; on `None` it pops the newest request off `self.running` (`_preempt_request`) and
#   tries again. Only when nobody was preempted does it admit from `self.waiting`, with `full_sequence_must_fit` set from
#   `scheduler_reserve_full_isl` (on by default). `_update_after_schedule` advances
#   `num_computed_tokens`; `update_from_output` appends the sampled tokens and frees a finished
#   request at once (`_free_request`).
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.allocate_slots` returns `None` when the
#   `required_blocks` exceed the pool's free blocks (all or nothing), and applies its
#   `watermark_blocks` to waiting requests only, when `has_scheduled_reqs` (lesson 11).
# * `vllm/v1/core/sched/output.py`: `SchedulerOutput`, the step as a value: `num_scheduled_tokens`
#   (a dict per request), `total_num_scheduled_tokens`, `scheduled_new_reqs` (`NewRequestData`, with
#   its `block_ids`), `scheduled_cached_reqs` (`CachedRequestData`, with the `new_block_ids` of each
#   running request), `preempted_req_ids` and `finished_req_ids`.
# * `vllm/config/vllm.py`: `use_v2_model_runner` makes **Model Runner V2** the default.
#   `vllm/v1/worker/gpu/model_runner.py`: its `GPUModelRunner.execute_model` applies the output
#   (`finish_requests`, `add_requests`, `update_requests`), prepares the step's inputs once
#   (`prepare_inputs`) and runs one forward over the flattened batch: our `ModelRunner`.
# * `vllm/v1/worker/gpu/block_table.py`: `BlockTables`, the persistent block table on the GPU, one
#   row per request; `append_block_ids` adds a request's new blocks and `compute_slot_mappings` gives
#   every token's slot: our `BlockTables` and our `prepare_attention`. Beside it,
#   `vllm/v1/worker/gpu/input_batch.py`: `InputBatch` holds the flattened batch's `input_ids`,
#   `positions`, `query_start_loc`, `seq_lens` and `logits_indices`: our `AttentionMetadata`. And
#   `vllm/v1/worker/gpu/states.py`: `RequestState` keeps each request's tokens and
#   `num_computed_tokens` in arrays indexed by the request's row, so a step gathers the whole batch's
#   in one operation: our `RequestState`.
# * `vllm/v1/worker/gpu_model_runner.py` and `vllm/v1/worker/block_table.py` (`BlockTable`): the V1
#   model runner, now the fallback.
# * `vllm/v1/worker/utils.py`: `allocate_kv_cache` allocates one backing buffer for all the layers
#   and views it per layer with `create_kv_cache_views`, every view indexed by the same block ids.
#   The course's `KVStorage` does the same with one tensor for K and one for V.
#
# What the course leaves out or does differently: sampling beyond greedy, stop strings and
# detokenisation; asynchronous scheduling and CUDA graphs; a swap path for preemption (vLLM v1
# recomputes; lesson 11 has both). The course's engine gives a request the same tokens whatever runs
# beside it; vLLM does not promise that, since its kernels may sum in another order for another batch
# shape, unless `VLLM_BATCH_INVARIANT` (`vllm/envs.py`, off by default) selects batch-invariant ones.

# %% [markdown]
# ## Recap
#
# * **Prefill** runs the whole prompt and stores its K and V in every layer; **decode** feeds one
#   token per sequence per step and attends over the cache. This tiny GPT needs 1,024 bytes of cache
#   per token. In `generate` the model sees the cache through five calls, so the contiguous and the
#   paged caches swap freely: the same 60 tokens for prompts of 2, 12 and 40 tokens, also in a
#   shuffled pool of stale blocks, the logits within `1e-4`.
# * One engine step, vLLM's way: `schedule()` gives each running request, in list order, its
#   `num_scheduled_tokens` and takes their blocks with `allocate_slots`, all or nothing, preempting
#   the newest when they do not fit, then admits waiting requests whose whole prompt fits. The
#   `SchedulerOutput` carries tokens and new block ids; the runner prepares `positions`,
#   `query_start_loc`, `seq_lens` and the `slot_mapping` once and runs **one** forward;
#   `update_from_output` appends the sampled tokens. In the three-request example `c` is preempted
#   at step 5 and resumed at step 6 by prefilling 9 tokens, with the tokens it gets alone.
# * On 96 ShareGPT-shaped requests in 2,048 slots: 18.7 sequences running on average against 7.2
#   (2.6 times), 209 steps against 544, utilization 89 % against 24 %, 4 preemptions, the same
#   tokens; the benchmark's burst gives 3.0 times. The price: `paged_attention` at 0.9 to 1.2 times
#   SDPA on a CPU (20 to 26 % on GPUs in the vLLM paper) and each step's bookkeeping.
#
# **Next, lesson 10:** a Hugging Face Llama on the same cache and engine, with exactly Hugging
# Face's tokens, and a token budget that prefills long prompts in chunks. The exercise,
# `exercises/09_the_engine.ipynb`, has you write vLLM's admission rule, the slots of a decode step
# and your own paged cache, and run `generate` on it.

# %% [markdown]
# # Lesson 15 · Settings and metrics
#
# Fourteen lessons built vLLM's memory management from the inside: blocks, tables, the allocator,
# the scheduler's token budget, preemption, prefix caching, hybrid groups, the sizing at start-up.
# Someone who runs vLLM meets it from the outside: a dozen settings on the command line, and a log
# line every ten seconds with a handful of percentages. This lesson joins the two views. Each setting
# is mapped to the part you built and what it moves, the metrics vLLM reports are computed by their
# vLLM names on the course's engine, and two settings are measured where they trade one thing
# against another.
#
# **By the end of this lesson you can**
#
# 1. say, for each of vLLM's KV-cache and scheduler settings, which part of the engine it moves and
#    which lesson built that part;
# 2. read vLLM's periodic log line and its `vllm:` metrics, compute each from the engine, and explain
#    why "KV cache usage" falls to 0 % after a burst while the prefix cache still holds its blocks;
# 3. measure what `max_num_seqs` and `max_num_batched_tokens` trade: requests at once, preemptions
#    and time to first token, in steps and in seconds.
#
# Nothing here needs a GPU.

# %%
import logging
import random
import statistics

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import Engine, EngineRequest, GPTConfig, TinyGPT
from paged_kv.pictures.plots import PALETTE
from paged_kv.serving.metrics import enable_engine_log
from paged_kv.simulation.workload import sample_requests

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny model's operations are too small to share between threads
model = TinyGPT(GPTConfig(max_len=512), seed=0).to(device).eval()  # lesson 09's tiny GPT, longer
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. The settings, and what each moves
#
# Every setting below is an argument of vLLM's `LLM(...)` and a flag of `vllm serve` (with dashes:
# `--max-num-seqs`). The middle column is vLLM 0.33.0's default; "by GPU" means `EngineArgs` picks it
# from the device's memory and the entry point (the `LLM` class or the API server).
#
# | setting | default | what it moves | built in |
# |---|---|---|---|
# | `gpu_memory_utilization` | 0.92 | the share of the GPU the engine may take; the pool is what is left after the weights, the profiled activations and the CUDA graphs | lesson 14 |
# | `kv_cache_memory_bytes` | unset | the pool's bytes, given: no share, no profiling | `Engine(kv_cache_memory_bytes=...)` |
# | `num_gpu_blocks_override` | unset | the pool's blocks, given (for tests) | `Engine(num_blocks=...)` |
# | `max_model_len` | the model's context | the longest request; the start-up check that one fits; the requests of the "maximum concurrency" line | lesson 14 |
# | `block_size` | the attention backend's | the tokens of a block: waste in the last block, the grain of prefix caching, the kernel's tile | lessons 01, 04, 14 |
# | `kv_cache_dtype` | `"auto"` (the model's) | the bytes of a token's K/V: `"fp8"` halves every block against 16-bit | lesson 10 |
# | `enable_prefix_caching` | on | whether a freed block keeps its hash and can be found again | lesson 08 |
# | `max_num_seqs` | by GPU: 256 or 1,024 | the most requests running at once | lesson 09; section 3 |
# | `max_num_batched_tokens` | by GPU: 2,048 to 16,384 | the step's token budget, so chunked prefill; and the size of the profiling run | lessons 10, 14; section 3 |
# | `tensor_parallel_size` | 1 | the GPUs a layer's heads are split over: a block and the weights cost each `1/tp` | lesson 14 |
#
# vLLM v1 preempts by recompute only (lesson 11), so no setting picks the way. The course's `Engine`
# takes the same names where it has the concept: `Engine(model, max_num_seqs=..., max_num_batched_tokens=...,
# block_size=..., enable_prefix_caching=..., gpu_memory_utilization=...)`.

# %% [markdown]
# ## 2. The metrics, by vLLM's names
#
# A running vLLM server tells you how its cache is doing in two places. Every ten seconds
# (`VLLM_LOG_STATS_INTERVAL`) it logs one line:
#
# ```
# Engine 000: Avg prompt throughput: 8447.0 tokens/s, Avg generation throughput: 4815.9 tokens/s,
# Running: 13 reqs, Waiting: 9 reqs, Preemptions: 7, GPU KV cache usage: 97.9%, Prefix cache hit rate: 70.0%
# ```
#
# and its `/metrics` endpoint serves the same figures to Prometheus, under names that start with
# `vllm:`. Each is a number the course has computed under another name:
#
# * **KV cache usage** (`vllm:kv_cache_usage_perc`, a fraction from 0 to 1 despite the name): the
#   blocks in use over the pool. A free block is free even when it still holds a cached prefix: it
#   sits on the free list (lesson 08), ready to be evicted.
# * **Running** and **Waiting** (`vllm:num_requests_running`, `vllm:num_requests_waiting`): the
#   scheduler's two queues after the step.
# * **Preemptions** (`vllm:num_preemptions`): requests sent back to the waiting queue because a
#   running one found no free block (lesson 11). The log shows the count since the last line, and
#   only when it is not 0.
# * **Prefix cache hit rate** (`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`, both in
#   tokens): the share of the prompt tokens looked up that the cache served. A request readmitted
#   after a preemption is looked up again, and vLLM counts that lookup apart, so the rate is that
#   of first lookups; the log line shows it over the last 1,000 requests.
# * Prompt and generation throughput: the prompt tokens computed and the tokens sampled since the
#   last line, over the seconds since it. The prompt tokens the cache served are not computed, so
#   they are not in the line's throughput; `vllm:prompt_tokens` counts every prompt token once,
#   hits included, and `vllm:prompt_tokens_cached` the hits alone (`vllm:generation_tokens` the
#   sampled ones).
#
# `Engine(..., log_stats_interval=20)` logs the line every 20 steps, to the logger
# `paged_kv.engine`, which `enable_engine_log()` sends to the cell's output. The pool is named as
# vLLM names it, after the device: "GPU" on CUDA, "CPU" here. The warning before the first line is
# vLLM V0's, word for word, which it logged at the first preemption and every 50th after; many users
# still paste it. vLLM v1 logs no warning and only counts preemptions, in the line.
#
# The workload: two bursts of 24 requests with the same 64-token system prompt, four arriving per
# step, the second 100 steps after the first, on a pool of 48 blocks of 16 tokens, with prefix
# caching.
#
# **Predict, then run.** Between the bursts nothing runs. What will the line say the usage is then,
# and what will the first requests of the second burst find in the cache?

# %%
rng = random.Random(0)
system_prompt = [rng.randrange(256) for _ in range(64)]


def burst(name, num_requests, at):
    """Requests under the shared system prompt, four arriving per step from step ``at``."""
    return [
        EngineRequest(
            f"{name}{i}",
            system_prompt + [rng.randrange(256) for _ in range(rng.randint(8, 40))],
            max_tokens=rng.randint(16, 48),
            arrival_step=at + i // 4,
        )
        for i in range(num_requests)
    ]


bursts = burst("a", 24, at=0) + burst("b", 24, at=100)
handler = enable_engine_log()
engine = Engine(model, num_blocks=48, block_size=16, enable_prefix_caching=True, log_stats_interval=20)
run = engine.run(bursts)
logging.getLogger("paged_kv.engine").removeHandler(handler)

# %% [markdown]
# Each burst wants more than the pool: 24 requests of about 90 tokens at their longest, 6 blocks
# each, against 48 blocks. The first burst preempted 8 requests, the second 11. Between the bursts
# the line says 0.0 %, yet the prefix cache never emptied:

# %%
second = min(step for step, stats in enumerate(run.scheduler_stats) if step >= 100 and stats.num_running_reqs)
print(f"usage at step 99: {run.kv_cache_usage[99]:.1%}")
print(
    f"the lookups of step {second}, when b0 to b3 were admitted:",
    run.scheduler_stats[second].prefix_cache_stats,
)

# %% [markdown]
# The four requests admitted at step 100 found their 64-token system prompt, 4 blocks each, in a pool
# whose usage was 0 %. The usage counts the blocks requests hold; the cache lives in the blocks they
# do not. A vLLM user who sees "GPU KV cache usage: 0.0%" on an idle server has not lost the cache,
# and one who sees 100 % has not run out of room for it: as soon as a block is needed, the oldest
# cached one is evicted (lesson 08). The step by step view:

# %%
fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True)
steps = range(run.steps)
top.plot(steps, [100 * u for u in run.kv_cache_usage], color=PALETTE[0], label="vllm:kv_cache_usage_perc")
top.set_ylabel("KV cache usage, %")
top.legend(frameon=False, loc="center", fontsize=8)
running = [s.num_running_reqs for s in run.scheduler_stats]
waiting = [s.num_waiting_reqs for s in run.scheduler_stats]
bottom.plot(steps, running, color=PALETTE[1], label="vllm:num_requests_running")
bottom.plot(steps, waiting, color=PALETTE[2], label="vllm:num_requests_waiting")
for step, stats in enumerate(run.scheduler_stats):
    if stats.num_preempted_reqs:
        bottom.axvline(step, color="0.6", linewidth=0.6, zorder=0)
bottom.set_ylabel("requests")
bottom.set_xlabel("step (grey lines: steps that preempted)")
bottom.legend(frameon=False, loc="upper right", fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# A burst fills the pool in a few steps; the scheduler admits while blocks last, preempts when a
# running request's next token finds none (the grey lines), and the queue drains as requests finish.
# The usage falls back to 0 % when the last request leaves, while the system prompt's blocks stay
# cached on the free list for the second burst.
#
# What the `/metrics` endpoint would serve at the end of the run, counters and gauges (the
# histograms of latencies are left out here; they are in seconds, different at every run):

# %%
metrics = run.metrics()
for line in metrics.prometheus_text().splitlines():
    if line.startswith("vllm:") and "_seconds" not in line:
        print(line)
stats = run.prefix_cache_stats
print(f"hit rate of first lookups: {stats.hit_rate:.1%}; readmissions apart: {stats.preempted_requests} "
      f"lookups, {stats.preempted_hits:,} of {stats.preempted_queries:,} tokens")  # fmt: skip

# %% [markdown]
# Counters end in `_total`, as Prometheus names them. The 4,245 prompt tokens are each prompt
# counted once, and 3,008 of them came from the cache (`vllm:prompt_tokens_cached`), so the log
# line's prompt throughput counted the other 1,237; the 19 readmissions looked up 1,738 tokens more, of which the cache had 1,280, and
# they stay out of the rate a dashboard shows. `vllm:external_prefix_cache_queries` and `_hits`
# count the lookups a KV connector answers past the device's pool (a host-memory tier, with
# `kv_offloading_size`); vLLM declares them always, and without a connector they stay at 0.
# `run.metrics().summary()` prints the latencies in the layout of `vllm bench serve`.

# %% [markdown]
# ## 3. Two settings that trade
#
# `max_num_seqs` caps the requests running at once; `max_num_batched_tokens` caps the tokens a step
# computes, so a long prompt is prefilled in chunks beside the decodes (lesson 10). Both decide how
# much a step does, so neither has a right value: each trades waiting against something.
#
# The workload is lesson 09's ShareGPT-shaped stream with lengths divided by 4: 48 requests arriving
# at about 2 a step, prompts of 45 tokens on average and answers of 75, on a pool of 96 blocks of 16
# (95 past the null block: 1,520 tokens). Four engines serve it: at most 8 requests at once without a
# budget, and at most 64 with a budget of 32 tokens, 128 tokens, or none. For each, the most requests
# that ran at once, the preemptions, and the time to first token in steps (from arrival to the step
# that samples it, median and worst).
#
# **Predict, then run.** With at most 8 requests at once, will anyone be preempted? What will the
# cap cost?


# %%
def scaled_sharegpt(num_requests, arrival_rate, scale, seed=0):
    """ShareGPT-shaped requests with lengths divided by ``scale`` and random prompt bytes (lesson 09)."""
    rng = random.Random(seed)
    requests = []
    for r in sample_requests("sharegpt", num_requests, seed, arrival_rate):
        prompt = [rng.randrange(256) for _ in range(max(1, round(r.prompt_tokens / scale)))]
        requests.append(
            EngineRequest(r.request_id, prompt, max(1, round(r.output_tokens / scale)), r.arrival_step)
        )
    return requests


stream = scaled_sharegpt(48, arrival_rate=2.0, scale=4)
sweep = {}
for max_num_seqs, budget in ((8, None), (64, 32), (64, 128), (64, None)):
    sweep[max_num_seqs, budget] = Engine(
        model, num_blocks=96, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
    ).run(stream)
print("max_num_seqs  budget  steps  most running  preemptions  TTFT steps: median  worst  same tokens")
for (max_num_seqs, budget), r in sweep.items():
    ttft = list(r.time_to_first_token.values())
    print(
        f"{max_num_seqs:>12}{budget or 'none':>8}{r.steps:>7}{r.peak_running:>14}{r.preemptions:>13}"
        f"{statistics.median(ttft):>21.1f}{max(ttft):>7}  {r.tokens == sweep[8, None].tokens}"
    )

# %% [markdown]
# With at most 8 requests at once nothing is preempted: 8 requests of this stream always fit in
# 95 blocks. But the others wait in the queue, and the median request gets its first token 135
# steps after it arrived (a budget changes that by a few steps only). With 64 allowed, the pool is the only limit: 28
# run at once, the median first token comes 1 or 2 steps after arrival, and the price is paid in
# preemptions, 40 to 43 of them, each a request whose K/V is thrown away and recomputed. A budget of
# 32 tokens throttles admission instead (a step holds a few decodes and one prompt chunk): fewer than
# half the preemptions, at the cost of a median first token 37 steps late. Every engine produced the
# same tokens: here the settings move when tokens come, never which, because the course's engine
# computes a request's logits the same way whatever shares its batch (lesson 09). vLLM promises that
# only with `VLLM_BATCH_INVARIANT=1` (off by default): its kernels may add in another order for
# another batch, so a greedy token can differ once two candidates are nearly tied.
#
# Steps are not seconds: a step of 300 prompt tokens costs more than a step of 20 decodes. The same
# runs on the wall clock, with vLLM's latency metrics: the median time to first token, and the 99th
# percentile of the inter-token latency (`vllm:inter_token_latency_seconds`, the wait between two
# tokens of one request), in milliseconds. They change with the machine and with every run: the
# cell prints this run's, and the text gives the ranges of five quiet runs on this course's 2-core
# machine.

# %%
# NBVAL_IGNORE_OUTPUT
print("max_num_seqs  budget  TTFT median, ms  ITL p99, ms  run, s")
for (max_num_seqs, budget), r in sweep.items():
    itl = sorted(r.inter_token_latency_seconds)
    p99 = itl[min(len(itl) - 1, int(0.99 * len(itl)))]
    print(
        f"{max_num_seqs:>12}{budget or 'none':>8}{1e3 * statistics.median(r.time_to_first_token_seconds.values()):>17.1f}"
        f"{1e3 * p99:>13.2f}{r.elapsed_seconds:>8.2f}"
    )

# %% [markdown]
# Quiet, over five runs: the cap of 8 cost 160 to 290 ms of median time to first token, against 3
# to 5 ms with 64 and no budget, and 55 to 110 ms with 64 and a budget of 32. The budget's benefit
# shows in the inter-token latency: without one, a step that prefills long prompts makes every
# decoding request wait for it, and the 99th percentile was 4.5 to 8 ms; a budget of 128 brought it
# to 4 to 7 ms, one of 32 to 2 to 4 ms. That tail is a few thousand waits of a few milliseconds:
# with other work on the cores, the waits for the CPU swamp it, and the order above can flip. That is the trade vLLM's defaults make: the API server, where a user
# watches tokens arrive, gets a smaller `max_num_batched_tokens` than the `LLM` class, which runs
# offline batches for throughput.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0.
#
# * `vllm/config/cache.py`: `CacheConfig` holds `gpu_memory_utilization` (0.92), `cache_dtype`,
#   `enable_prefix_caching` (on), `kv_cache_memory_bytes`, `num_gpu_blocks_override`, `block_size`
#   with `DEFAULT_BLOCK_SIZE` and `user_specified_block_size`.
# * `vllm/config/scheduler.py`: `SchedulerConfig.max_num_seqs` and `max_num_batched_tokens`, with
#   `DEFAULT_MAX_NUM_BATCHED_TOKENS` and `DEFAULT_MAX_NUM_SEQS`; `vllm/engine/arg_utils.py`:
#   `EngineArgs.get_batch_defaults` picks them by device memory and `UsageContext` (8,192 and 16,384
#   tokens on an H100 for the API server and the offline class; 2,048 and 8,192 on smaller GPUs).
# * `vllm/v1/metrics/loggers.py`: `LoggingStatLogger.log` writes section 2's line (at DEBUG when the
#   engine is idle); `PrometheusStatLogger` declares `vllm:kv_cache_usage_perc`,
#   `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:num_preemptions`,
#   `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`, `vllm:time_to_first_token_seconds` and
#   `vllm:inter_token_latency_seconds`.
# * `vllm/v1/metrics/stats.py`: `SchedulerStats` (a step's `num_running_reqs`, `num_waiting_reqs`,
#   `kv_cache_usage`, `prefix_cache_stats`), `PrefixCacheStats` with its `preempted_requests`,
#   `preempted_queries` and `preempted_hits`, and `CachingMetrics`, the log line's hit rate over
#   `max_recent_requests` requests.
# * `vllm/v1/core/block_pool.py`: `BlockPool.get_usage`, one minus the free blocks over the pool
#   without the null block: cached free blocks count as free. `vllm/v1/core/kv_cache_manager.py`:
#   `KVCacheManager.usage`, `make_prefix_cache_stats`.
# * `vllm/v1/metrics/loggers.py` again: `LoggingStatLogger` adds `prompt_token_stats.computed` to
#   the line's prompt tokens; `PrometheusStatLogger` counts `vllm:prompt_tokens` (every prompt
#   token) and `vllm:prompt_tokens_cached` (the hits). `vllm/v1/metrics/stats.py`:
#   `PromptTokenStats`, with `computed`, `cached_tokens` and `total`.
#
# What the course leaves out or does differently: the engine's steps run one after another, where
# vLLM overlaps the scheduling of a step with the forward of the one before (async scheduling); the
# log interval counts steps or seconds of the engine's own clock; histograms and the Prometheus text
# are built at the end of a run rather than served live (the serving lesson's engine does that).

# %% [markdown]
# ## Recap
#
# * Each of vLLM's cache settings moves one part you built: the pool's size (`gpu_memory_utilization`,
#   `kv_cache_memory_bytes`, `num_gpu_blocks_override`, lesson 14), a block's bytes (`block_size`,
#   `kv_cache_dtype`, `tensor_parallel_size`), and the scheduler's step (`max_num_seqs`,
#   `max_num_batched_tokens`).
# * "GPU KV cache usage" is the blocks requests hold over the pool. Cached blocks on the free list
#   count as free, so an idle server shows 0 % with its cache intact; the hit rate counts first
#   lookups in tokens, readmissions apart.
# * At most 8 requests at once: no preemption, a median first token 135 steps late. At most 64: 40
#   preemptions, the first token 1 step after arrival. A budget of 32 more than halves them and
#   bounds the inter-token latency, at the cost of time to first token.
#
# **Next, lesson 16:** the same engine online, behind an OpenAI-compatible server. The exercise for
# this lesson, `exercises/15_settings_and_metrics.ipynb`, has you write vLLM's log line and its
# windowed hit rate.

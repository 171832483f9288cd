# %% [markdown]
# # Lesson 06 · A concurrent workload
#
# Lesson 00 measured the waste of one frozen set of requests. A real server never stands still:
# requests arrive at any time, grow by one token per step, and leave when they are done, while the
# next ones wait for memory. What matters is how many requests the cache can serve *at once, over
# time*, because that decides how fast the server works through its queue. This lesson runs a small
# serving simulator, the same requests and the same memory budget for four memory policies, and
# watches where the memory goes step by step.
#
# **By the end of this lesson you can**
#
# 1. trace a request through a serving step (arrive, wait, admit and prefill, decode, finish and
#    release) and explain why continuous batching releases a finished request's memory at once;
# 2. compute what paged blocks and three contiguous reservations (maximum length, next power of two,
#    exact final length) set aside for a request, and explain why the exact one is out of reach;
# 3. sample workloads shaped like ShareGPT and Alpaca and compute how many sequences fit in a fixed
#    budget under each policy;
# 4. run a concurrent workload through the four policies, read memory utilization, running
#    sequences and tokens per step, and explain why the peak number of running sequences misleads;
# 5. compare the fraction of reserved memory that holds tokens with lesson 00 and the vLLM paper.
#
# Nothing here needs a GPU, and every simulation takes a fraction of a second.

# %%
import statistics

import matplotlib.pyplot as plt

import paged_kv
from paged_kv import blocks_for_tokens
from paged_kv.simulation.workload import (
    ALPACA,
    SHAREGPT,
    ContiguousPolicy,
    PagedPolicy,
    Request,
    compare_policies,
    format_table,
    sample_requests,
    sequences_that_fit,
    simulate,
)

# One colour per policy, from the Okabe-Ito palette: paged in blue as in lesson 00.
COLOURS = {
    "paged/16": "#0072B2",
    "contiguous/max": "#D55E00",
    "contiguous/pow2": "#E69F00",
    "contiguous/oracle": "#009E73",
}
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. The life of a request
#
# A serving engine works in **steps**. Each step is one forward pass of the model over every
# sequence it is running. Around that loop, a request goes through five stages:
#
# 1. **arrive**: it joins the back of the waiting queue;
# 2. **wait**: the scheduler looks at the queue first come first served, and admits the request at
#    the front only when the KV cache has room for it;
# 3. **admit and prefill**: one forward pass over the whole prompt computes the prompt's keys and
#    values, stores them in the cache, and samples the first output token;
# 4. **decode**: every later step feeds the last token in and samples one more; the key and value
#    of the token fed in take one more slot;
# 5. **finish and release**: after its last token, the request leaves and its memory goes back to
#    the free pool.
#
# The simulator of this lesson, `paged_kv.simulation.workload.simulate`, runs the package's
# scheduler, the one lesson 09's engine runs, with a stand-in for the model that only counts tokens.
# It counts steps as the engine (and vLLM) does: the prefill step samples the first output token,
# and each later step one more, so a request with `o` output tokens runs for `o` steps.
#
# Older servers used **static batching**: they formed a batch, ran it until its *longest* member
# was done, and only then took new requests, so a short request's memory sat idle until the long
# one finished. **Continuous batching** (iteration-level scheduling, introduced by the Orca system)
# rebuilds the batch every step: a finished request releases its memory at once, and a waiting
# request can start in the very next step.
#
# The scheduler admits the request at the front of the queue when the blocks of its prompt, plus one
# block of **headroom** for every running sequence, itself included, are free: the headroom is the
# most the next decode step can take, one block per sequence (lesson 08 comes back to this rule).
# Here are three requests in a tiny paged cache of 6 blocks of 4 slots (24 slots in all):
#
# | request | arrives at step | prompt | output | final length |
# |---|---:|---:|---:|---:|
# | short-0 | 0 | 4 | 2 | 6 |
# | long-1 | 0 | 4 | 6 | 10 |
# | late-2 | 1 | 6 | 3 | 9 |
#
# **Predict, then run.** `late-2` arrives at step 1. At which step can it start, given that each of
# the other two takes a second block at step 1, when it stores its fifth token?

# %%
tiny = [Request("short-0", 0, 4, 2), Request("long-1", 0, 4, 6), Request("late-2", 1, 6, 3)]
trace = simulate(tiny, PagedPolicy(block_size=4), budget_tokens=24)
print("step  running  waiting  finished  held  reserved")
for step in range(trace.steps):
    print(
        f"{step:>4}{trace.running[step]:>9}{trace.waiting[step]:>9}{trace.finished[step]:>10}"
        f"{trace.held_tokens[step]:>6}{trace.reserved_tokens[step]:>10}"
    )

# %% [markdown]
# Read it row by row. At step 0 both first requests prefill their 4-token prompts into one block
# each, and each prefill samples a first token: 8 tokens held in 8 slots. At step 1 each feeds that
# token in, its fifth, and takes a second block, so 16 of the 24 slots are in use; `late-2` arrives
# and needs its prompt's 2 blocks plus 3 of headroom (for `short-0`, `long-1` and itself), but only
# 4 are free: it waits. That step samples `short-0`'s second and last token, so it finishes at the
# end of step 1 (`finished` is 1) and its 2 blocks go back at once. At step 2 `late-2` is admitted
# (2 blocks plus 2 of headroom, 4 free) while `long-1` keeps decoding. `held` counts tokens (the
# token a step samples is stored by the next one), `reserved` counts the slots of the blocks in use.
#
# With static batching, `late-2` would wait for the whole first batch, `long-1` included. The same
# simulator, run on the first batch alone and then on `late-2` alone, shows what that costs:

# %%
first_batch = simulate(tiny[:2], PagedPolicy(block_size=4), budget_tokens=24).steps
second_batch = simulate([Request("late-2", 0, 6, 3)], PagedPolicy(block_size=4), budget_tokens=24).steps
print("continuous batching: all done after", trace.steps, "steps")
print("static batching:     all done after", first_batch + second_batch, "steps")

# %% [markdown]
# Six steps against nine, with the same memory. On a real server the gap grows with the spread of
# lengths: one 1,000-token answer would hold a whole static batch hostage.

# %% [markdown]
# The same run, animated. `simulate(..., record=True)` keeps the paged allocator's picture after
# every allocation, token and release. Watch `late-2` wait while the pool is full, then take the
# blocks `short-0` gives back.

# %%
from paged_kv.pictures.widgets import AllocationPlayer

recorded = simulate(tiny, PagedPolicy(block_size=4), budget_tokens=24, record=True)
AllocationPlayer(recorded.trace)

# %% [markdown]
# ## 2. Four memory policies
#
# Before it admits a request, the scheduler must know where that request's keys and values will
# go. The simulator compares four answers:
#
# * **`contiguous/max`**: one contiguous slot as long as the longest sequence the model serves,
#   `max_model_len`, for every request. It needs no knowledge of the request; it is what lesson 00
#   called the simple way.
# * **`contiguous/pow2`**: one contiguous slot of the next power of two at or above the final length.
# * **`contiguous/oracle`**: one contiguous slot of exactly the final length, prompt plus output.
# * **`paged/16`**: blocks of 16 slots on demand. At admission the request takes the blocks its
#   prompt fills (and the scheduler checks that one block of headroom per running sequence is free
#   as well, section 1); then a new block each time its last one is full.
#
# **The oracle is out of reach.** The engine knows the prompt, but the model decides when to stop:
# it emits an end-of-sequence token whenever the answer is complete, and the user's `max_tokens` is
# only an upper bound. No engine knows the final length at admission. The oracle is the best any
# contiguous reservation could do, a bound to compare with, not a design.
#
# **Powers of two are a common compromise.** Memory allocators often keep a few *size classes*
# instead of arbitrary sizes. A **buddy allocator**, the one Linux uses for physical pages, splits a
# free region of $2^k$ slots into two "buddies" of $2^{k-1}$, and merges two free buddies back
# into one. Rounding every request up to a power of two keeps allocation and freeing fast and
# freed space easy to reuse, at the price of internal fragmentation of up to half the slot. In this
# simulator `pow2` rounds the *final* length, which it knows just as the oracle does: it measures
# what rounding to size classes costs. A real engine would start with the prompt's size class and
# move the sequence to a slot twice as large each time it fills up, copying its keys and values, to
# end in the same size class.
#
# **Predict, then run.** The ShareGPT-shaped workload below allows prompts and outputs of up to
# 1,024 tokens each, so `max_model_len` is 2,048. A request has a 100-token prompt and will generate
# 200 tokens. How many slots does each policy set aside for it?

# %%
request = Request("r", arrival_step=0, prompt_tokens=100, output_tokens=200)
print("max_model_len:", SHAREGPT.max_model_len, " final length:", request.total_tokens)
for kind in ("max", "pow2", "oracle"):
    policy = ContiguousPolicy(kind, SHAREGPT.max_model_len)
    print(f"{policy.name:<18} reserves {policy.reservation(request):>5} slots at admission")
paged = PagedPolicy(block_size=16)
at_admission = blocks_for_tokens(request.prompt_tokens, 16) * 16
print(
    f"{paged.name:<18} reserves {at_admission:>5} slots at admission, {paged.peak_tokens(request)} at the end"
)

# %% [markdown]
# The contiguous slots are fixed at admission: 2,048, 512 (the power of two above 300) and 300. The
# paged request starts with the 7 blocks its 100-token prompt needs, 112 slots, and grows one block
# every 16 tokens up to 19 blocks, 304 slots (it stores at most 299 tokens: its last one is sampled,
# never fed back). The picture follows the request through its life (the
# right panel zooms in): the black line is what it holds, the coloured lines what each policy reserves.

# %%
life = range(request.output_tokens)  # step 0 is the prefill, then one token per step
held = [request.prompt_tokens + step for step in life]
lines = {
    f"contiguous/{kind}": [ContiguousPolicy(kind, SHAREGPT.max_model_len).reservation(request)] * len(held)
    for kind in ("max", "pow2", "oracle")
}
lines["paged/16"] = [blocks_for_tokens(h, 16) * 16 for h in held]
fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
for ax, top in zip(axes, (2200, 560), strict=True):
    for name, reserved in lines.items():
        ax.plot(life, reserved, color=COLOURS[name], drawstyle="steps-post", label=name)
    ax.plot(life, held, color="black", lw=1, label="tokens held")
    ax.set_ylim(0, top)
    ax.set_xlabel("step of the request's life")
    ax.spines[["top", "right"]].set_visible(False)
axes[0].set_ylabel("token slots")
axes[0].set_title("what one request (100 + 200 tokens) reserves", loc="left", fontsize=11)
axes[1].set_title("the same, below 560 slots", loc="left", fontsize=11)
axes[0].legend(frameon=False, fontsize=8, loc="center right")
fig.tight_layout()
plt.show()

# %% [markdown]
# The gap between a coloured line and the black one is reserved memory that holds nothing. Even the
# oracle's gap is large early in the request's life, because it sets aside room for 200 tokens that
# do not exist yet. The paged staircase never rises more than one block above the black line.

# %% [markdown]
# ## 3. Two workloads
#
# How much each policy wastes depends on the lengths of the requests. The vLLM paper's experiments
# use two data sets:
#
# * **ShareGPT**, conversations that users shared from ChatGPT: long prompts and long answers,
#   161 and 338 tokens on average;
# * **Alpaca**, a set of short instructions and their answers: 19 and 58 tokens on average.
#
# `sample_requests(workload, num_requests, seed)` draws synthetic lengths with those means from a
# log-normal distribution, a common model of text lengths: most requests short, a few very long.
# Lengths are clipped at 1,024 tokens per prompt and per output for ShareGPT, and at 256 for Alpaca.
# The same seed always gives the same requests.

# %%
sharegpt_requests = sample_requests(SHAREGPT, num_requests=200, seed=0)
alpaca_requests = sample_requests(ALPACA, num_requests=200, seed=0)
print(f"{'':<10}{'mean prompt':>12}{'mean output':>12}{'longest':>9}{'max_model_len':>15}")
for dist, requests in ((SHAREGPT, sharegpt_requests), (ALPACA, alpaca_requests)):
    prompts = [r.prompt_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    longest = max(r.total_tokens for r in requests)
    print(
        f"{dist.name:<10}{statistics.mean(prompts):>12.1f}{statistics.mean(outputs):>12.1f}"
        f"{longest:>9}{dist.max_model_len:>15}"
    )

# %% [markdown]
# Means of 200 draws from a long-tailed distribution land a few percent from their targets
# (ShareGPT's output mean is 354 here, not 338); the package's tests check that 5,000 draws land
# within 5 %. Note the last two columns: the longest of these 200 ShareGPT requests is 1,550
# tokens, and a `max`-length slot has room for 2,048.
#
# The histograms have logarithmic bins, so that both workloads fit on one axis.

# %%
bins = [2**k for k in range(11)]  # 1, 2, 4, ..., 1024 tokens
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
for ax, part in zip(axes, ("prompt", "output"), strict=True):
    for dist, requests, colour in (
        (SHAREGPT, sharegpt_requests, "#0072B2"),
        (ALPACA, alpaca_requests, "#E69F00"),
    ):
        lengths = [getattr(r, f"{part}_tokens") for r in requests]
        ax.hist(lengths, bins=bins, histtype="step", lw=1.8, color=colour, label=dist.name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{part} tokens")
    ax.spines[["top", "right"]].set_visible(False)
axes[0].set_ylabel("requests (of 200)")
axes[0].legend(frameon=False)
fig.tight_layout()
plt.show()

# %% [markdown]
# Both are skewed: most requests are a fraction of the maximum, and a few outputs reach it. That
# is the worst case for reserving the maximum: almost every slot ends up mostly empty.

# %% [markdown]
# ## 4. How many sequences fit in a fixed budget
#
# Give each workload a fixed KV budget: 32,768 token slots for ShareGPT (16 GiB for the 7B model of
# lesson 00, at 0.5 MiB a token) and 4,096 for Alpaca: room for 16 and 8 sequences of the maximum
# length. `sequences_that_fit(requests, policy, budget)` answers a simple question: taking the
# requests in order, how many fit at once if each is at its final length? Under the paged policy a
# sequence takes its final length rounded up to whole blocks.

# %%
BUDGETS = {"sharegpt": 32768, "alpaca": 4096}


def policies(dist):
    """The lesson's four policies for a workload, paged first (the order of COLOURS)."""
    contiguous = [ContiguousPolicy(kind, dist.max_model_len) for kind in ("max", "pow2", "oracle")]
    return [PagedPolicy(block_size=16), *contiguous]


fits = {name: [] for name in COLOURS}
for dist, requests in ((SHAREGPT, sharegpt_requests), (ALPACA, alpaca_requests)):
    for policy in policies(dist):
        fits[policy.name].append(sequences_that_fit(requests, policy, BUDGETS[dist.name]))
print(f"{'policy':<20}{'sharegpt':>10}{'alpaca':>10}")
for name, (on_sharegpt, on_alpaca) in fits.items():
    print(f"{name:<20}{on_sharegpt:>10}{on_alpaca:>10}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.2))
width = 0.2
for i, (name, row) in enumerate(fits.items()):
    xs = [w + (i - 1.5) * width for w in range(2)]
    bars = ax.bar(xs, row, width, color=COLOURS[name], label=name)
    ax.bar_label(bars, fontsize=8)
ax.set_xticks(range(2), ["sharegpt (32,768 slots)", "alpaca (4,096 slots)"])
ax.set_ylabel("sequences that fit at once")
ax.legend(frameon=False, fontsize=8)
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# Reserving the maximum fits 16 and 8 sequences, by construction. Powers of two fit 3 to 5 times
# as many, the oracle and the paged policy 4 to 7 times as many. The paged policy fits slightly
# fewer than the oracle here (67 against 68, 52 against 59): counted at their final lengths, paged
# sequences lose the unused tail of their last block, which the oracle does not. Alpaca's short
# sequences feel that tail more.
#
# This count is a snapshot of everyone at their final length. Over time the paged policy does
# better than the oracle, because a sequence holds only the tokens it has generated *so far*. The
# next section shows it.

# %% [markdown]
# ## 5. Serving a stream of requests
#
# Now the requests arrive over time. `sample_requests(..., arrival_rate=λ)` spaces them as a
# Poisson process, the usual model of independent users: on average λ requests per step, at random
# moments. The lengths stay the same for the same seed. `compare_policies` samples the requests
# once and serves them with each of the four policies in the same budget; `format_table` prints one
# row per policy:
#
# | column | meaning |
# |---|---|
# | mean running | sequences in the forward pass, averaged over the steps |
# | peak running | the most sequences in one step |
# | mean util % | tokens held / slots reserved, averaged over the steps that reserve something |
# | steps | steps until the last request finished |
# | tokens/step | output tokens / steps: the server's throughput |
# | preemptions | sequences thrown out of the cache to make room (section 6) |
#
# For ShareGPT, one request every five steps (λ = 0.2) keeps every contiguous policy busy.
# Each run takes a fraction of a second; for larger ones, `simulate(..., progress=True)` shows a
# progress bar.

# %%
sharegpt = compare_policies("sharegpt", num_requests=200, budget_tokens=32768, seed=0, arrival_rate=0.2)
arrivals = [r.arrival_step for r in sample_requests(SHAREGPT, 200, seed=0, arrival_rate=0.2)]
print(f"200 requests arriving from step {arrivals[0]} to step {arrivals[-1]}")
print()
print(format_table(sharegpt))
print()
print(f"{'policy':<18}{'most waiting':>14}{'running, summed over the steps':>32}")
for result in sharegpt:
    print(f"{result.policy:<18}{max(result.waiting):>14}{sum(result.running):>32}")

# %% [markdown]
# The same 200 requests, arriving at the same moments, in the same memory. The paged cache
# finishes them in 2,083 steps, reserving the maximum takes 4,895. It produces 34.0 tokens per step
# against 14.5: 2.3 times the throughput. It never makes a request wait: every request is admitted
# the step it arrives, while the contiguous policies build queues of up to 128, 94 and 45 requests.
# It even beats the oracle, which reserves each sequence's full length from its first step.
#
# The first picture plots, step by step, the fraction of reserved slots that hold a token.

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
for result in sharegpt:
    ax.plot(range(result.steps), result.utilization, color=COLOURS[result.policy], lw=1, label=result.policy)
ax.set_ylim(0, 1.2)
ax.set_xlabel("step")
ax.set_ylabel("held / reserved")
ax.set_title("memory utilization over time (sharegpt, λ = 0.2)", loc="left", fontsize=11)
ax.legend(frameon=False, fontsize=8, loc="upper right", ncol=2)
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# While requests keep arriving, each policy stays in its own band: paged just under 1, the oracle
# a little above 0.5 (a sequence starts with its prompt and fills its slot one token at a time, so
# over its life it is a little more than half full), powers of two around 0.4, the maximum around
# 0.2. Towards the end, the last sequences run alone and fill their slots, so the
# contiguous lines climb: the oracle's nearly reaches 1, since its last sequence ends one token
# short of full (its last token is sampled, never stored). (The first 9 steps reserve nothing: the
# first request arrives at step 9.)
#
# The second picture plots the sequences running (top) and waiting (bottom) at each step. The
# running counts are noisy, so each line shows the average over a window of 50 steps.


# %%
def smooth(values: list[int], window: int = 50) -> list[float]:
    """The mean of each run of `window` consecutive values (fewer at the start)."""
    total, out = 0, []
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0)
        out.append(total / min(i + 1, window))
    return out


fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
for result in sharegpt:
    top.plot(range(result.steps), smooth(result.running), color=COLOURS[result.policy], label=result.policy)
    bottom.plot(range(result.steps), result.waiting, color=COLOURS[result.policy])
top.set_ylabel("running")
bottom.set_ylabel("waiting")
bottom.set_xlabel("step")
top.set_title("sequences running and waiting (sharegpt, λ = 0.2)", loc="left", fontsize=11)
top.legend(frameon=False, fontsize=8)
for ax in (top, bottom):
    ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# `contiguous/max` is stuck at 16 running sequences (32,768 / 2,048) while its queue climbs; the
# paged cache runs every request that has arrived and not finished. Summed over the steps, the
# running counts are the same for every policy (70,797, the last column above, the output tokens
# of the 200 requests), because each request runs one step per output token whatever the policy. So a policy that runs more at once
# must finish sooner. Mean running (that sum divided by the steps) and tokens per step measure the
# work done per step over the whole run, which makes them the fair comparison.
#
# **Predict, then run.** Alpaca's requests are about 6 times shorter than its `max_model_len` on
# average (81 of 512 tokens), ShareGPT's about 4 times (516 of 2,048). On which workload does the
# paged policy gain more over `contiguous/max`? Here Alpaca requests arrive at λ = 0.8 per step in
# 4,096 slots.

# %%
alpaca = compare_policies("alpaca", num_requests=200, budget_tokens=4096, seed=0, arrival_rate=0.8)
print(format_table(alpaca))
for workload, results in (("sharegpt", sharegpt), ("alpaca", alpaca)):
    paged_tps, max_tps = results[0].throughput, results[1].throughput
    print(f"{workload}: paged / contiguous/max tokens per step = {paged_tps / max_tps:.1f}")

# %% [markdown]
# On Alpaca the gain is larger, 3.3 times the throughput against 2.3: the shorter the requests
# compared with the maximum length, the more a maximum-length slot wastes. The paged utilization
# is lower on Alpaca (91 % against 98 %), because the half-empty last block of a short sequence is
# a larger share of it.

# %% [markdown]
# ## 6. A burst: preemption, and why the peak misleads
#
# The paged scheduler admits a request as soon as its prompt fits with one block of headroom per
# running sequence. That is a bet: the headroom covers the next step, not the hundreds after it, so
# it hands out memory the running sequences will need later, counting on some of them to finish
# first. When all 200 ShareGPT requests arrive together at step 0, the bet fails.

# %%
burst = compare_policies("sharegpt", num_requests=200, budget_tokens=32768, seed=0)
print(format_table(burst))

# %% [markdown]
# The paged policy admits 182 requests at step 0: their prompts fit, with the headroom. As they
# decode, the free blocks run out, and the sequences that need a new block cannot all get one. The
# scheduler then **preempts** the most recently admitted sequence: it frees that sequence's blocks
# and puts it back at the front of the queue, to be **recomputed** later. Here that happens 43
# times. A preempted sequence starts over: its prefill runs again and its tokens are generated
# again (lesson 09's engine regenerates exactly the same text). Lesson 08 covers preemption, a second
# way to do it (swapping to host memory), and a *watermark* of free blocks that makes it rare.
#
# So the peak of 182 running sequences says little: it is the count at step 0, before the cache
# filled up, and the 43 preemptions that followed threw some of that work away. The mean of 46.5
# running and the 45.1 tokens per step measure what the server sustained. (Tokens per step is the
# lower of the two because some steps produce a token that a preemption later throws away: every
# step of a running sequence samples a token, its prefill included.) Even with the thrashing, the
# paged cache finishes the burst first, in 1,569 steps against 2,163 for the oracle.

# %%
paged_burst = burst[0]
last_wait = max(step for step, waiting in enumerate(paged_burst.waiting) if waiting)
print(f"paged/16 has requests waiting until step {last_wait}, and finishes at step {paged_burst.steps - 1}")
fig, ax = plt.subplots(figsize=(8, 3.5))
for result in burst:
    ax.plot(range(result.steps), result.running, color=COLOURS[result.policy], lw=1, label=result.policy)
ax.set_xlabel("step")
ax.set_ylabel("running")
ax.set_title("sequences running, all 200 arriving at step 0 (sharegpt)", loc="left", fontsize=11)
ax.legend(frameon=False, fontsize=8)
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# The blue line starts at the peak of 182 and falls fast, as sequences are preempted back into the
# queue and others finish. It stays above the contiguous policies while requests wait; once its
# queue is empty (after the step printed above) it only finishes what is left, and drops below the
# oracle, which still has a queue.

# %% [markdown]
# ## 7. Back to lesson 00: how much of the reservation holds tokens
#
# Lesson 00 quoted the vLLM paper's measurement: in earlier serving systems, which reserve
# contiguous memory, only 20.4 % to 38.2 % of the KV cache held actual token states, while with vLLM
# the waste was near zero. Those are the paper's figures, measured on real systems. The simulator
# gives its own, as the mean utilization of each policy on the two streams of section 5:

# %%
print(f"{'policy':<20}{'sharegpt':>10}{'alpaca':>10}")
for on_sharegpt, on_alpaca in zip(sharegpt, alpaca, strict=True):
    print(f"{on_sharegpt.policy:<20}{on_sharegpt.mean_utilization:>10.1%}{on_alpaca.mean_utilization:>10.1%}")

# %% [markdown]
# Reserving the maximum uses 25 % and 17 %: in the lower part of the paper's range, or below it.
# Powers of two reach about 39 % and the oracle 60 to 64 %, above the paper's range, and paging 98 %
# and 91 %: little waste, as the paper found, though Alpaca's short sequences feel the empty tail of
# their last block more. The simulator is kind to the contiguous policies: it only counts their
# slots, and never finds the free memory cut into holes too small for the next request (the external
# fragmentation of lesson 00), which real contiguous systems suffer.
#
# Lesson 00 promised that a paged sequence wastes less than one block. The simulator checks it at
# every step of the ShareGPT stream: the reserved slots that hold no token, per running sequence.

# %%
paged_run = sharegpt[0]
waste = [
    (reserved - held) / running
    for held, reserved, running in zip(
        paged_run.held_tokens, paged_run.reserved_tokens, paged_run.running, strict=True
    )
    if running
]
print(f"wasted slots per running sequence: at most {max(waste):.1f}, on average {statistics.mean(waste):.1f}")
print("block size:", 16)

# %% [markdown]
# Never more than 15 slots, the unused tail of one block, and 7.5 on average: half a block, the
# expected tail when lengths fall anywhere within a block. Whatever the length of a sequence, paging
# wastes about half a block of it; reserving the maximum wastes everything the sequence does not
# reach.

# %% [markdown]
# ## Recap
#
# * A request arrives, waits, is admitted and prefilled, decodes one token per step, and finishes.
#   With continuous batching its memory goes back the step it finishes: on the three-request
#   example, 6 steps against 9 with static batching. Its prefill samples its first token, so a
#   request with `o` output tokens runs `o` steps, in this simulator as in lesson 09's engine: both
#   run the package's one scheduler.
# * Contiguous policies reserve a whole slot at admission: `max_model_len` (2,048 for the ShareGPT
#   shape), the next power of two of the final length (a buddy-style size class), or the exact final
#   length (an oracle no engine has, since the model decides when to stop). Paging takes one block
#   of 16 at a time.
# * In 32,768 slots, 16 ShareGPT-shaped sequences fit at the maximum length, 49 at powers of two,
#   68 with the oracle and 67 with blocks.
# * Serving 200 ShareGPT requests arriving at λ = 0.2 per step: the paged cache runs 34.0 sequences
#   on average and produces 34.0 tokens per step, against 29.4 (oracle), 21.2 (powers of two) and
#   14.5 (maximum). Alpaca gains more: 3.3 times the throughput of the maximum.
# * Peak running misleads: in a burst of 200 the paged policy peaks at 182 but preempts 43 times;
#   compare mean running and tokens per step.
# * Utilization: paging 98 % (ShareGPT) and 91 % (Alpaca), with less than one block wasted per
#   sequence; contiguous reservation from 17 % (maximum, Alpaca) to 64 % (oracle, ShareGPT). The
#   vLLM paper reports 20.4 % to 38.2 % for earlier, contiguous systems and near-zero waste with
#   paging.
#
# **Next, lesson 07:** sharing, where several sequences point at the same blocks: forking a
# sequence with reference counts and copy-on-write, and prefix caching by block hash. The exercise
# for this lesson, `exercises/06_concurrent_workload.ipynb`, has you write the reservations and a
# small continuous-batching scheduler yourself.

# %% [markdown]
# # Lesson 07 · A concurrent workload
#
# Lesson 00 measured the waste of one frozen set of requests. A real server never stands still:
# requests arrive, grow by one token per step and leave, while the next ones wait for memory. What
# matters is how many requests the cache serves *at once, over time*, since that decides how fast
# the server works through its queue. This lesson runs a small serving simulator, the same requests
# and memory for four memory policies, and watches where the memory goes.
#
# **By the end of this lesson you can**
#
# 1. trace a request through a serving step (arrive, wait, admit and prefill, decode, finish and
#    release) and explain why continuous batching releases a finished request's memory at once;
# 2. compute what paged blocks and three contiguous reservations (maximum length, the prompt plus a
#    power of two for the output, exact final length) set aside for a request, and explain why the
#    exact one is out of reach;
# 3. sample workloads shaped like ShareGPT and Alpaca and compute how many sequences fit in a fixed
#    budget under each policy;
# 4. run a concurrent workload through the four policies, read memory utilization, running
#    sequences and tokens per step, and explain why the peak number of running sequences misleads;
# 5. measure where the memory goes, token states, reservation, internal and external
#    fragmentation, as the vLLM paper's Figure 2 does, and explain each difference from the paper's
#    bars.
#
# Nothing here needs a GPU: the simulator only counts tokens.

# %%
import statistics

import matplotlib.pyplot as plt

import paged_kv
from paged_kv import blocks_for_tokens
from paged_kv.pictures.plots import PALETTE
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

# One colour per policy, from the course's palette: paged in blue as in lesson 00.
COLOURS = {
    "vLLM (blocks of 16)": PALETTE[0],
    "Orca (Max)": PALETTE[5],
    "Orca (Pow2)": PALETTE[1],
    "Orca (Oracle)": PALETTE[2],
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
# The simulator, `paged_kv.simulation.workload.simulate`, runs the package's scheduler with a
# stand-in for the model that only counts tokens (lesson 09 puts a model there). It counts steps as
# vLLM does: the prefill step samples the first output token and each later step one more, so a
# request with `o` output tokens runs for `o` steps. Its pool, like vLLM's and unlike lesson 02's,
# keeps block 0 aside as the **null block**, never handed out (lesson 13 shows what it stands for):
# a pool of `N` blocks gives out `N - 1`. The simulator adds it to the budget and draws it grey.
#
# Older servers used **static batching**: a batch ran until its *longest* member was done, and only
# then took new requests, so a short request's memory sat idle. **Continuous batching**
# (iteration-level scheduling, introduced by the Orca system) rebuilds the batch every step: a
# finished request releases its memory at once, and a waiting request can start in the next step.
#
# Each step the scheduler first gives every running sequence a slot for its next token, taking a
# block when its blocks are full (lesson 04), then admits requests from the front of the queue while
# the blocks of each one's whole prompt are free. As in vLLM, nothing is kept back for growth: the
# pool can fill to its last block, and a decode that then finds no free block preempts the newest
# running sequence (section 6). Three requests in a paged cache of 6 blocks of 4 slots (24 in all):
#
# | request | arrives at step | prompt | output | final length |
# |---|---:|---:|---:|---:|
# | short-0 | 0 | 4 | 2 | 6 |
# | long-1 | 0 | 4 | 6 | 10 |
# | late-2 | 1 | 9 | 3 | 12 |
#
# **Predict, then run.** `late-2` arrives at step 1. At which step can it start, given that each of
# the other two takes a second block at step 1, when it stores its fifth token?

# %%
tiny = [Request("short-0", 0, 4, 2), Request("long-1", 0, 4, 6), Request("late-2", 1, 9, 3)]
trace = simulate(tiny, PagedPolicy(block_size=4), budget_tokens=24)
print("step  running  waiting  finished  held  reserved")
for step in range(trace.steps):
    print(
        f"{step:>4}{trace.running[step]:>9}{trace.waiting[step]:>9}{trace.finished[step]:>10}"
        f"{trace.held_tokens[step]:>6}{trace.reserved_tokens[step]:>10}"
    )

# %% [markdown]
# At step 0 both first requests prefill their 4-token prompts into one block each and sample a
# first token. At step 1 each feeds that token in, its fifth, and takes a second block: 16 of the 24
# slots are in use, and `late-2` needs its prompt's 3 blocks with only 2 free, so it waits (an
# 8-token prompt would have started). `short-0` samples its last token at step 1 and its 2 blocks go
# back at once; at step 2 `late-2` is admitted. (`held` counts tokens stored, `reserved` the slots of
# the blocks in use; a token sampled at a step is stored by the next one.)
#
# With static batching, `late-2` would wait for the whole first batch, `long-1` included. The same
# simulator, run on the first batch alone and then on `late-2` alone, shows what that costs:

# %%
first_batch = simulate(tiny[:2], PagedPolicy(block_size=4), budget_tokens=24).steps
second_batch = simulate([Request("late-2", 0, 9, 3)], PagedPolicy(block_size=4), budget_tokens=24).steps
print("continuous batching: all done after", trace.steps, "steps")
print("static batching:     all done after", first_batch + second_batch, "steps")

# %% [markdown]
# Six steps against nine, with the same memory. On a real server the gap grows with the spread of
# lengths: one 1,000-token answer would hold a whole static batch hostage.

# %% [markdown]
# The same run, animated. `simulate(..., record=True)` keeps the paged allocator's picture after
# every allocation, token and release: 7 blocks, the null block and the 6 of the budget. Watch
# `late-2` wait while too few blocks are free, then start in the blocks `short-0` gives back and the
# two no one took.

# %%
from paged_kv.pictures.widgets import AllocationPlayer

recorded = simulate(tiny, PagedPolicy(block_size=4), budget_tokens=24, record=True)
AllocationPlayer(recorded.trace)

# %% [markdown]
# ## 2. Four memory policies
#
# Before it admits a request, the scheduler must know where its keys and values will go. The
# simulator compares four answers, named as in the vLLM paper (Kwon et al., *Efficient
# Memory Management for Large Language Model Serving with PagedAttention*, SOSP 2023). Its
# baseline is Orca, the serving system that introduced continuous batching; Orca's code is not
# public, so the paper's authors rebuilt it with three ways of reserving a contiguous range:
#
# * **Orca (Max)**: a range of `max_model_len`, the longest sequence the model serves, for every
#   request: lesson 00's simple way.
# * **Orca (Pow2)**: the prompt's length plus the next power of two at or above the output's
#   length: 32 slots for a 25-token answer.
# * **Orca (Oracle)**: exactly the final length, prompt plus output.
# * **vLLM (blocks of 16)**: the blocks its prompt fills, taken at admission (section 1), then a new
#   block each time its last one is full.
#
# **The oracle is out of reach.** The model decides when to stop, by emitting an end-of-sequence
# token, and the user's `max_tokens` is only an upper bound: no engine knows the final length at
# admission. The oracle is a bound to compare with, not a design.
#
# **Powers of two are a common compromise.** Memory allocators often keep a few *size classes*: a
# **buddy allocator** (Linux's, for physical pages) splits a free region of $2^k$ slots into two
# "buddies" of $2^{k-1}$ and merges two free buddies back into one: fast, and freed space is easy
# to reuse, at the price of up to half the rounded size. Orca (Pow2) rounds only what the engine
# does not know, the output: an engine whose guess of the output length is never short and at most
# twice too long, so it measures what a good but imperfect prediction costs.
#
# **Predict, then run.** The ShareGPT-shaped workload below allows prompts and outputs of up to
# 1,024 tokens each, so `max_model_len` is 2,048. A request has a 100-token prompt and will generate
# 200 tokens. How many slots does each policy set aside for it?

# %%
request = Request("r", arrival_step=0, prompt_tokens=100, output_tokens=200)
print("max_model_len:", SHAREGPT.max_model_len, " final length:", request.total_tokens)
for kind in ("max", "pow2", "oracle"):
    policy = ContiguousPolicy(kind, SHAREGPT.max_model_len)
    print(f"{policy.name:<21} reserves {policy.reservation(request):>5} slots at admission")
paged = PagedPolicy(block_size=16)
at_admission = blocks_for_tokens(request.prompt_tokens, 16) * 16
print(
    f"{paged.name:<21} reserves {at_admission:>5} slots at admission, {paged.peak_tokens(request)} at the end"
)

# %% [markdown]
# The contiguous slots are fixed at admission: 2,048; 356, the prompt plus 256 (the power of two
# above the 200-token output); and 300. The paged request starts with the 7 blocks of its prompt,
# 112 slots, and grows a block every 16 tokens up to 19 blocks, 304 slots (it stores at most 299
# tokens: its last one is sampled, never fed back). In the picture (the right panel zooms in) the
# black line is what the request holds, the coloured lines what each policy reserves.

# %%
life = range(request.output_tokens)  # step 0 is the prefill, then one token per step
held = [request.prompt_tokens + step for step in life]
lines = {}
for kind in ("max", "pow2", "oracle"):
    policy = ContiguousPolicy(kind, SHAREGPT.max_model_len)
    lines[policy.name] = [policy.reservation(request)] * len(held)
lines[paged.name] = [blocks_for_tokens(h, 16) * 16 for h in held]
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
# The gap between a coloured line and the black one is reserved memory that holds nothing. Below
# the request's final length (300) it is **reservation**, slots kept for tokens still to come;
# above it, **internal fragmentation**, slots never used. The oracle has no internal fragmentation
# but a large reservation early in the request's life; Max and Pow2 have both. The paged staircase
# never rises more than one block above the black line, and only 4 slots (304 - 300) end up as
# internal fragmentation.
#
# ### Where the ranges go: first fit, with holes
#
# A contiguous range must be one unbroken run of slots. The simulator lays the ranges out in one
# address space of `budget_tokens` slots (`paged_kv.simulation.contiguous.ContiguousAllocator`): a
# new range starts at the lowest address of the first **hole** (run of free slots) large enough
# (**first fit**), and a freed range merges with the holes on either side. As ranges of different
# sizes come and go, the free slots split into holes: **external fragmentation**, lesson 00's third
# waste.
#
# **Predict, then run.** Ten slots hold three ranges of 3, 3 and 4 slots. The first and the last
# finish, so 7 of the 10 slots are free. Can a request that needs 5 slots start?

# %%
from paged_kv.simulation.contiguous import ContiguousAllocator

space = ContiguousAllocator(10)
for name, size in [("a", 3), ("b", 3), ("c", 4)]:
    print(f"{name} gets {size} slots from address {space.allocate(name, size).start}")
space.free("a")
space.free("c")
print("holes (start, size):", [tuple(hole) for hole in space.holes])
print("free slots:", space.free_slots, " largest hole:", space.largest_hole, " 5 fit:", space.fits(5))
space.free("b")
print("after b finishes:", [tuple(hole) for hole in space.holes], " 5 fit:", space.fits(5))

# %% [markdown]
# No: the 7 free slots are holes of 3 and 4 on either side of `b`, so the request waits until `b`
# finishes and all merge into one hole of 10. A paged cache never meets this: any free block fits
# any request. The simulator counts each step at which the request at the front of the queue waits
# although the free slots in all would hold it (`blocked_by_holes`, section 7).

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
# log-normal distribution, a common model of text lengths: most requests a fraction of the maximum,
# a few reaching it, the worst case for reserving the maximum. Lengths are clipped at 1,024 tokens
# per prompt and per output for ShareGPT, 256 for Alpaca; the same seed gives the same requests.
# (Means of 200 long-tailed draws land a few percent from their targets: ShareGPT's output mean is
# 354 here.)

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
# ## 4. How many sequences fit in a fixed budget
#
# Give each workload a fixed KV budget: 32,768 token slots for ShareGPT (16 GiB for the 7B model of
# lesson 00, at 0.5 MiB a token) and 4,096 for Alpaca: room for 16 and 8 sequences of the maximum
# length. `sequences_that_fit(requests, policy, budget)` answers: taking the requests in order, how
# many fit at once if each is at its final length (rounded up to whole blocks when paged)?

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
print(f"{'policy':<21}{'sharegpt':>10}{'alpaca':>10}")
for name, (on_sharegpt, on_alpaca) in fits.items():
    print(f"{name:<21}{on_sharegpt:>10}{on_alpaca:>10}")

# %% [markdown]
# Reserving the maximum fits 16 and 8 sequences, by construction; powers of two fit 60 and 45; the
# oracle and the paged policy 4 to 7 times as many as the maximum. Paged fits slightly fewer than the
# oracle (67 against 68, 52 against 59): at their final lengths, paged sequences lose the unused tail
# of their last block. But over time a paged sequence holds only the tokens it has so far, which the
# next section shows.

# %% [markdown]
# ## 5. Serving a stream of requests
#
# Now the requests arrive over time. `sample_requests(..., arrival_rate=λ)` spaces them as a
# Poisson process, the usual model of independent users: on average λ requests per step, at random
# moments, with the same lengths for the same seed. `compare_policies` serves the same requests with
# each policy in the same budget; `format_table` prints one row per policy:
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
# For ShareGPT, one request every five steps (λ = 0.2) keeps every contiguous policy busy. (For a
# larger run, `simulate(..., progress=True)` shows a progress bar.)

# %%
sharegpt = compare_policies("sharegpt", num_requests=200, budget_tokens=32768, seed=0, arrival_rate=0.2)
arrivals = [r.arrival_step for r in sample_requests(SHAREGPT, 200, seed=0, arrival_rate=0.2)]
print(f"200 requests arriving from step {arrivals[0]} to step {arrivals[-1]}")
print()
print(format_table(sharegpt))
print()
print(f"{'policy':<21}{'most waiting':>14}{'running, summed over the steps':>32}")
for result in sharegpt:
    print(f"{result.policy:<21}{max(result.waiting):>14}{sum(result.running):>32}")

# %% [markdown]
# The same 200 requests, at the same moments, in the same memory: the paged cache finishes them in
# 2,083 steps, reserving the maximum in 4,895; 34.0 tokens per step against 14.5, 2.3 times the
# throughput. It never makes a request wait, while the contiguous policies build queues of up to
# 128, 80 and 67 requests. It even beats the oracle, which reserves each sequence's full length from
# its first step.
#
# The picture plots the sequences running (top, averaged over windows of 50 steps, since the counts
# are noisy) and waiting (bottom) at each step.


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
# Orca (Max) is stuck at 16 running sequences (32,768 / 2,048) while its queue climbs; the paged
# cache runs every request that has arrived and not finished. Summed over the steps, the running
# counts are the same for every policy (70,797, the last column above, the 200 requests' output
# tokens), since each request runs one step per output token. So a policy that runs more at once
# finishes sooner, and mean running (that sum over the steps) and tokens per step, the work done
# per step over the whole run, are the fair comparison.
#
# **Predict, then run.** Alpaca's requests are about 6 times shorter than its `max_model_len` on
# average (81 of 512 tokens), ShareGPT's about 4 times (516 of 2,048). On which workload does the
# paged policy gain more over Orca (Max)? Here Alpaca requests arrive at λ = 0.8 per step in
# 4,096 slots.

# %%
alpaca = compare_policies("alpaca", num_requests=200, budget_tokens=4096, seed=0, arrival_rate=0.8)
print(format_table(alpaca))
for workload, results in (("sharegpt", sharegpt), ("alpaca", alpaca)):
    paged_tps, max_tps = results[0].throughput, results[1].throughput
    print(f"{workload}: vLLM / Orca (Max) tokens per step = {paged_tps / max_tps:.1f}")

# %% [markdown]
# On Alpaca the gain is larger, 3.3 times the throughput against 2.3: the shorter the requests
# against the maximum length, the more a maximum-length slot wastes. The paged utilization is lower
# (91 % against 98 %): a short sequence's half-empty last block is a larger share of it.

# %% [markdown]
# ## 6. A burst: preemption, and why the peak misleads
#
# The paged scheduler admits a request as soon as the blocks of its prompt are free, keeping
# nothing back for the running sequences' growth: a bet that some of them finish first. When all
# 200 ShareGPT requests arrive together at step 0, the bet fails.

# %%
burst = compare_policies("sharegpt", num_requests=200, budget_tokens=32768, seed=0)
print(format_table(burst))

# %% [markdown]
# The paged policy admits 195 requests at step 0: their prompts take 2,036 of the 2,048 blocks. As
# they decode, the free blocks run out, and a sequence that needs a new block finds none. The
# scheduler then **preempts** the most recently admitted sequence: it frees its blocks and puts it
# back at the front of the queue, to be prefilled again, with the tokens it had generated, when it
# fits. Here that happens 157 times; lesson 11 is about this moment, another way through it
# (swapping to host memory) and a *watermark* that makes it rarer.
#
# So the peak of 195 running sequences says little: it is the count at step 0, before the cache
# filled up. The mean of 48.5 running and 48.5 tokens per step measure what the server sustained,
# and even with its preemptions the paged cache finishes the burst first, in 1,460 steps against
# 2,416 for the oracle. The steps flatter it: the simulator counts a step, not its work, while a
# real engine computes each victim's prompt and tokens again.

# %% [markdown]
# ## 7. Where the memory goes: the paper's Figure 2, measured
#
# Lesson 00 quoted the vLLM paper: in Orca, only 20.4 % to 38.2 % of the KV cache memory held
# token states, in vLLM 96.3 %: the paper's Figure 2, one stacked bar per system split into four
# parts. The simulator measures the same four at every step, in **slot-steps** (one slot of the
# memory during one step). A running sequence that holds `h`
# tokens in `r` reserved slots, and will end at `f` tokens (prompt plus output), counts
#
# | part | slots | what they are |
# |---|---|---|
# | token states | `h` | slots that hold a computed token's keys and values |
# | reservation | `min(r, f) - h` | slots kept for tokens it will still generate |
# | internal fragmentation | `max(r - f, 0)` | slots reserved beyond its final length, never used |
#
# and the free slots are **external fragmentation and others**. `SimulationResult.memory_shares`
# sums the four over the steps at which a request still waits after the step's admissions, when
# memory limits the server (with nobody waiting, free slots are idle, not wasted); then every free
# slot is one the request at the front could not use. The four sum to 100 %
# (`paged_kv.simulation.shares` has the definitions).
#
# The paper measured OPT-13B on one 40 GB A100: 12 GB of KV cache, 15,728 slots at 800 KiB a token.
# The simulator takes that memory and section 3's 200 ShareGPT-shaped requests, arriving together
# (`python -m paged_kv simulate --json --budget-tokens 15728` prints the figures as JSON).
#
# **Predict, then run.** Orca (Oracle) reserves exactly what each request will need. Which of the
# four parts is zero for it, and which is not, although its reservations are exact?

# %%
from paged_kv.pictures.plots import plot_memory_shares
from paged_kv.simulation.shares import SHARES, beside_the_paper

PAPER_SLOTS = 15728  # 12 GiB of KV cache at 800 KiB a token
paged_first = compare_policies("sharegpt", num_requests=200, budget_tokens=PAPER_SLOTS, seed=0)
figure2 = paged_first[1:] + paged_first[:1]  # the paper's order: Max, Pow2, Oracle, vLLM
columns = ["tokens", "reservation", "internal", "external"]
header = "".join(f"{c:>12}" for c in columns) + f"{'steps measured':>17}{'blocked by holes':>18}"
print(f"{'%':<21}{header}{'preemptions':>13}")
for result in figure2:
    percent = result.memory_shares.percent()
    measured = f"{result.memory_shares.steps} of {result.steps}"
    shares = "".join(f"{percent[name]:>12.1f}" for name in SHARES)
    print(f"{result.policy:<21}{shares}{measured:>17}{result.blocked_by_holes:>18}{result.preemptions:>13}")

# %%
bars = beside_the_paper([result.memory_shares for result in figure2])  # the paper's bar, then ours
fig, ax = plt.subplots(figsize=(9, 4))
plot_memory_shares(bars, group=2, ax=ax, title="the KV cache memory: the paper's Figure 2, and measured")
fig.tight_layout()
plt.show()

# %% [markdown]
# Internal fragmentation is zero for the oracle, here and in the paper, since it reserves nothing
# beyond the final length; its external fragmentation is not, because ranges of every size leave
# holes. Bar by bar:
#
# * **Orca (Max): the paper's bar within a point** (21.0, 13.8, 56.3 and 8.9 % against 20.4, 13.3,
#   57.3 and 8.9 %). Seven ranges of 2,048 fit in 15,728 slots and the other 1,392, 8.9 %, can
#   never hold an eighth: all of Max's "external fragmentation and others", in the paper too.
# * **Tokens against reservation: the same split in every Orca bar**, about 1.5 to 1, measured and
#   in the paper: it depends on the requests' lengths, not on the policy.
# * **Orca (Pow2) and (Oracle): far fewer holes, so more tokens** (44.8 % token states against the
#   paper's 26.8 %, and 50.2 % against 38.2 %; external fragmentation 13.9 % against 41.6 %, and
#   16.0 % against 36.6 %). The paper assumes a buddy allocator, where a freed block merges only
#   with its own buddy; first fit merges any neighbouring holes, so it keeps fewer, larger ones. Pow2's internal fragmentation only looks close (11.4 against 13.6 %): 20
#   of the 200 synthetic outputs are cut at the 1,024-token limit, itself a power of two, and waste
#   nothing past their final length.
# * **vLLM: 97.4 % against the paper's 96.3 %.** The reservation is the rest of each sequence's last
#   block, 1.6 %; the free slots while a request waits, 1.0 %, are those the next prompt finds too
#   few, since nothing is kept back for the running sequences. The price is in compute, not memory:
#   302 preemptions (the last column).
#
# The holes cost the oracle even so: at 3,478 of the measured steps the request at the front waited
# although the free slots in all would have held it (`blocked_by_holes`). The next cell serves the
# same requests with compaction, every range moved down to close the holes whenever that admits a
# request (a real server would pay by copying the K/V it moves).

# %%
compacted = simulate(
    sample_requests(SHAREGPT, 200, seed=0), ContiguousPolicy("oracle", 2048, compact=True), PAPER_SLOTS
)
for result in (figure2[2], compacted):
    external = result.memory_shares.percent()["external_fragmentation"]
    print(
        f"{result.policy:<25} {result.steps:>5} steps, {result.blocked_by_holes:>5} blocked by holes, "
        f"external fragmentation {external:.1f} %"
    )

# %% [markdown]
# Without holes the oracle finishes in 4,082 steps instead of 4,631, and its free memory while
# requests wait falls from 16.0 % to 2.7 %. Paging gets the same effect for free: any block fits any
# request, so there is nothing to compact.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Continuous batching lives in the v1 scheduler, which builds each step
# from a queue of waiting requests and a list of running ones:
#
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` first schedules `self.running`, a list
#   in admission order, then, if nobody was preempted in the step, admits from `self.waiting` while
#   fewer than `max_num_active_reqs` (the `max_num_active_seqs` setting, `max_num_seqs` by default)
#   run and the cache can take the blocks of the whole prompt (`scheduler_reserve_full_isl`, on by
#   default); the first request that does not fit stops the admissions. A running request that
#   cannot get its blocks preempts `self.running[-1]`, the newest (section 6).
# * `vllm/v1/core/sched/request_queue.py`: `FCFSRequestQueue`, a `deque`, the default of
#   `create_request_queue`.
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.allocate_slots` takes the blocks for a
#   request's new tokens or returns None when too few are free; `KVCacheManager.free` gives them
#   back.
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.update_from_output` frees a request's blocks the
#   step it stops (`Scheduler._free_request`): continuous batching's release.
#
# What the course leaves out or does differently: vLLM bounds each step by a token budget (lesson
# 10), where this simulator prefills a whole prompt on admission; and vLLM has no contiguous
# policy: the Orca baselines exist only in the paper's evaluation.

# %% [markdown]
# ## Recap
#
# * A request arrives, waits, is admitted and prefilled, decodes one token per step (`o` steps for
#   `o` output tokens) and finishes; with continuous batching its memory goes back that step: 6
#   steps against 9 with static batching on the three-request example.
# * The paper's Orca baselines reserve one contiguous range at admission: `max_model_len` (Max),
#   the prompt plus the next power of two of the output (Pow2), or the exact final length (Oracle,
#   which no engine knows), placed first fit, so the free slots split into holes. vLLM takes one
#   block of 16 at a time.
# * In 32,768 slots, 16 ShareGPT-shaped sequences fit at the maximum length, 60 at powers of two,
#   68 with the oracle and 67 with blocks.
# * 200 ShareGPT requests at λ = 0.2 per step: the paged cache produces 34.0 tokens per step (34.0
#   running on average), against 27.6 (oracle), 24.8 (powers of two) and 14.5 (maximum). Alpaca
#   gains more: 3.3 times the throughput of the maximum.
# * Peak running misleads: in a burst of 200 the paged policy peaks at 195 but preempts 157 times.
# * The paper's Figure 2, measured in its 15,728 slots while requests wait: token states 21.0 %
#   (Max), 44.8 % (Pow2), 50.2 % (Oracle) and 97.4 % (vLLM), against the paper's 20.4, 26.8, 38.2
#   and 96.3 %. Max matches; Pow2 and Oracle keep fewer holes here (first fit, not a buddy
#   allocator), so more of their memory holds tokens.
#
# **Next, lesson 08:** sharing, where several sequences point at the same blocks: forking a
# sequence with reference counts and copy-on-write, and prefix caching by block hash. The exercise
# for this lesson, `exercises/07_concurrent_workload.ipynb`, has you write the reservations and a
# small continuous-batching scheduler yourself.

# %% [markdown]
# # Lesson 11 · Running out of blocks
#
# Paging lets an engine admit a request with only the blocks of its prompt and hand out the rest one
# block at a time, as the sequence grows. That is where its concurrency comes from (lesson 07: 34.0
# sequences running on average against 14.5 with maximum-length slots, in the same memory), and it
# is also a promise the engine cannot always keep: the sequences it admitted keep growing, and the
# blocks they will need may not be there. Lesson 07's burst showed the result, 43 preemptions,
# without looking into them. This lesson is about that moment: what an engine can do about it, what
# each answer costs, and how to make it rare.
#
# **By the end of this lesson you can**
#
# 1. explain why a paged engine runs out of blocks in the middle of a decode step, and why vLLM
#    then preempts whole sequences, the most recently admitted first;
# 2. compare the two ways to preempt, recompute and swap, by what each costs (tokens computed again
#    by prefill, blocks copied to host memory and back), and show that neither changes the
#    generated text;
# 3. explain the admission watermark and measure how it trades running sequences for preemptions;
# 4. read the preemptions, steps and running sequences of a workload against the memory budget,
#    from the smallest budget that can serve it to one where nothing is ever preempted.
#
# The cells run in about 12 s on a quiet 2-core CPU (18 s with two busy processes beside it); a GPU
# is used when there is one.

# %%
import random

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.grading.reference.lesson04 import decode_step
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT, encode
from paged_kv.pictures.plots import PALETTE, plot_block_tables
from paged_kv.serving.engine import Engine, EngineRequest, min_num_blocks, plot_metrics, sweep_budgets
from paged_kv.serving.memory import admits
from paged_kv.serving.preemption import choose_victims

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny model of section 2 has operations too small to share between threads
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Why blocks run out, even with paging
#
# A contiguous cache decides everything at admission: a request gets its slot of `max_model_len`
# tokens or waits, and once admitted it can never run short. A paged cache decides at admission
# only about the prompt. The admission rule of the course's engine (`paged_kv.serving.memory.admits`)
# admits a request when its prompt's blocks plus **one block of headroom per running sequence, the
# new one included**, are free. That guarantees the *next* decode step (each sequence takes at most
# one new block per step) and nothing after it. Admission is a bet that, by the time the running
# sequences need more blocks, others will have finished and freed theirs. An operating system makes
# the same bet when it promises processes more virtual memory than it has physical pages.
#
# Here is the bet failing on the bookkeeping alone: three requests, `a`, `b` and `c`, each with a
# 3-token prompt, in a pool of 8 blocks of 4 tokens. Each is admitted under that rule, and then
# every decode step adds one token to each of them with lesson 04's all-or-nothing `decode_step`.
#
# **Predict, then run.** After admission, 5 of the 8 blocks are free. Each sequence takes a new
# block when it holds a multiple of 4 tokens. In which decode step does the pool run out?

# %%
pool = PagedKVCacheAllocator(num_blocks=8, block_size=4, num_heads=1, head_dim=1)  # bookkeeping only
for running, seq_id in enumerate("abc"):
    fits = admits(pool.num_free_blocks, 1, running)
    print(f"admit {seq_id}: 1 prompt block + {running + 1} of headroom, {pool.num_free_blocks} free: {fits}")
    pool.allocate_for_sequence(seq_id, 3)
for step in range(1, 10):
    needed = sum(pool.needs_new_block(s) for s in "abc")
    try:
        decode_step(pool, "abc")
    except OutOfBlocksError as error:
        print(f"decode step {step}: {error}")
        break
    print(
        f"decode step {step}: {needed} new block(s), each sequence now holds {pool.sequence_length('a')} "
        f"tokens, {pool.num_free_blocks} blocks free"
    )

# %% [markdown]
# Step 6. Step 2 took three blocks at once, when the 5th tokens started a second block in every
# sequence, and left 2 free. Steps 3 to 5 filled those second blocks, and step 6 needs a third
# block for each sequence: 3 blocks, 2 free. The step fails as a whole and changes nothing (lesson
# 04), so the engine is still free to choose what to do. Here is the pool at that moment:

# %%
plot_block_tables(pool.snapshot(), title="decode step 6 needs 3 new blocks; 2 are free")
plt.show()

# %% [markdown]
# What can an engine do?
#
# * **Refuse**: fail a request that needs a block. Its user gets an error for a request the server
#   had accepted, and all the work done on it is lost.
# * **Wait**: pause the sequences that need a block until one frees up. Here all three need one, and
#   none can finish without growing first, so none will ever free a block: a deadlock.
# * **Preempt**: take the blocks of some sequence back, so that the others can go on, and resume
#   that sequence later.
#
# vLLM preempts, with two rules (section 4.5 of the PagedAttention paper). **All or nothing per
# sequence**: every decode step attends over all of a sequence's tokens, so a sequence with some of
# its blocks taken away could not run anyway; it loses all of them. **The most recently admitted
# first**: requests are served first come, first served, so the newest one gives way and the
# oldest ones finish first. The victims are taken one at a time, newest first, until the step fits.
# Each victim helps twice: its blocks become free, and it no longer needs a block in this step.
# `paged_kv.serving.preemption.choose_victims` is that rule on plain numbers: the running sequences, oldest
# first, as `(seq_id, blocks held, needs a block)`, and the free blocks.

# %%
candidates = [(s, len(pool.get_block_mapping(s)), pool.needs_new_block(s)) for s in pool.seq_ids]
print("running, oldest first:", candidates)
victims = choose_victims(candidates, pool.num_free_blocks)
print("victims:", victims)
for seq_id in victims:
    pool.free_sequence(seq_id)
decode_step(pool, [s for s in "abc" if s not in victims])
print(
    "after the step:",
    {s: pool.sequence_length(s) for s in pool.seq_ids},
    f"{pool.num_free_blocks} blocks free",
)

# %% [markdown]
# Preempting `c` frees its 2 blocks and drops its need: 2 blocks needed, 4 free, and the step runs.
# The oldest sequence is never a victim: with nothing left running, no sequence would ever finish.
# That is safe because the engine refuses, up front, any request that could not run alone at its
# full length in the whole pool. `paged_kv.serving.engine.min_num_blocks(requests, block_size)` is that
# smallest pool, and section 4 starts from it.

# %% [markdown]
# ## 2. Recompute or swap
#
# A preempted sequence must come back later with its K/V. There are two ways to get it back.
#
# **Recompute.** Free the victim's blocks, drop its K/V and put the request back at the *front* of
# the waiting queue: it was admitted before every request still waiting. When it fits again, its
# K/V is computed again from its tokens. Greedy decoding is deterministic, so the text does not
# change. The cost is computation: every token whose K/V was dropped is processed again. vLLM
# does it in one **prefill**, the pass that runs many tokens through the model at once and writes
# the K/V of all of them (the way a new prompt enters the cache), over the prompt and the tokens
# generated so far; a GPU runs that far faster than the decode steps, one token each, that first
# produced them. vLLM v1 keeps a count of each request's *computed* tokens, those whose K/V the
# cache holds; preemption sets it back to 0, and when the request is admitted again the scheduler
# gives it the tokens it lacks, prompt and generated ones, in chunks of at most a token budget per
# step (`max_num_batched_tokens`, lesson 10), and the last chunk samples the next token.
# The course's engine recomputes that way too: a victim keeps its generated tokens, and when it is
# admitted again it prefills its prompt and those tokens, whole, or in chunks under a budget,
# `Engine(..., max_num_batched_tokens=64)`, which this lesson gives it. The PagedAttention paper
# (§4.5) does the same, for the same reason: the tokens generated so far are concatenated with the
# prompt as a new prompt, whose K/V one prefill computes. The operating-system analogue is
# dropping a clean page of a program's code: it is never written to disk, because it can always be
# read from the file again.
#
# **Swap.** Copy the victim's K/V to host memory, free its blocks, and when enough blocks are free
# again, give it fresh ones (whichever are free: the block table changes, the content does not) and
# copy the K/V back. Nothing is computed again; the sequence continues exactly where it stopped. The
# cost is the copies: on a GPU, every swapped block crosses the PCIe bus twice. This is the
# operating system's swap: dirty pages written to disk and read back on the next fault.
#
# To see both on real K/V, lesson 09's tiny GPT serves again: `TinyGPT` (2 layers of 4 heads of
# dimension 16, byte tokens, seeded random weights: deterministic noise, all a test of "the same
# text after a preemption" needs) on a `PagedKVCache`, one block manager for every layer and one
# pool of K/V blocks per layer, 1,024 bytes a token. `PagedKVCache.swap_out(seq_id)` and
# `swap_in(seq_id, saved)` swap a sequence, every layer at once (`paged_kv.kv.swap`; the exercise
# builds them for one allocator), between `model.prefill` and `model.decode_step` calls.
#
# The whole round trip by hand: a prompt is prefilled and decodes 4 tokens in blocks of 4, is
# swapped out, another sequence takes two blocks, and the prompt comes back and decodes 5 more.

# %%
config = GPTConfig()  # 2 layers, 4 heads of 16, a vocabulary of 256 bytes
model = TinyGPT(config, seed=0).to(device).eval()
print(f"TinyGPT: {sum(p.numel() for p in model.parameters()):,} parameters")
cache = PagedKVCache(config, num_blocks=6, block_size=4, device=device)
blocks = cache.manager  # the one block manager every layer's K/V follows
prompt = encode("Swap me")
tokens = []  # the greedy tokens, fed back one step at a time
with torch.no_grad():
    cache.add_sequence("s", len(prompt))
    tokens.append(int(model.prefill(torch.tensor(prompt, device=device), "s", cache)[-1].argmax()))
    for _ in range(4):
        tokens.append(
            int(model.decode_step(torch.tensor(tokens[-1:], device=device), ["s"], cache)[0].argmax())
        )
    print(
        f"before: 's' holds {blocks.sequence_length('s')} tokens in blocks {blocks.get_block_table('s').block_ids}"
    )
    k_before, v_before = cache.read_kv(0, "s")  # layer 0
    saved = cache.swap_out("s")
    on_host = all(t.device.type == "cpu" for t in saved.k + saved.v)
    print(f"swapped out: {saved.num_tokens} tokens, {saved.nbytes:,} bytes in host memory: {on_host}")
    print(f"free blocks while 's' is out: {cache.num_free_blocks} of 6")
    cache.add_sequence("other", 8)
    cache.swap_in("s", saved)
    print(
        f"after:  's' holds {blocks.sequence_length('s')} tokens in blocks {blocks.get_block_table('s').block_ids}"
    )
    k_after, v_after = cache.read_kv(0, "s")
    print("same K and V:", torch.equal(k_before, k_after) and torch.equal(v_before, v_after))
    for _ in range(5):
        tokens.append(
            int(model.decode_step(torch.tensor(tokens[-1:], device=device), ["s"], cache)[0].argmax())
        )
never_swapped = generate(model, [prompt], len(tokens), cache="contiguous").tokens[0]
print(f"{len(tokens)} tokens, the same as generating without a swap:", tokens == never_swapped)

# %% [markdown]
# The prompt of 7 bytes and 4 decoded tokens make 11 tokens in 3 blocks, blocks 0 to 2. Swapped out,
# they take 11 × 1,024 = 11,264 bytes of host memory, and all 6 blocks are free. `other` takes
# blocks 3 and 4, so `s` comes back in blocks 5, 0 and 1: other blocks, the same keys and values,
# and the next 5 tokens are the ones it would have generated had it never left.
#
# Now both ways on a workload that runs out, served by lesson 09's `Engine`, which preempts with
# `choose_victims` itself (`preemption="recompute"` or `"swap"`), under lesson 10's token budget,
# `max_num_batched_tokens=64`: here it matters only for the recomputed requests, which prefill the
# tokens they had generated in chunks of at most 64.
#
# Twelve requests arrive at once, each a prompt of 4 to 12 random bytes asking for 17 to 37 tokens,
# in blocks of 4. `min_num_blocks` gives the smallest pool that can serve them; the engine gets
# twice that.

# %%
BLOCK_SIZE = 4
rng = random.Random(0)
requests = [
    EngineRequest(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(4, 12))], rng.randint(16, 40))
    for i in range(12)
]
smallest = min_num_blocks(requests, BLOCK_SIZE)
at_longest = sum(blocks_for_tokens(len(r.prompt) + r.max_new_tokens - 1, BLOCK_SIZE) for r in requests)
print(
    f"{len(requests)} requests; prompts of {min(len(r.prompt) for r in requests)} to "
    f"{max(len(r.prompt) for r in requests)} tokens, outputs of {min(r.max_new_tokens for r in requests)} to "
    f"{max(r.max_new_tokens for r in requests)}"
)
print(f"smallest pool that serves them: {smallest} blocks; all of them at their longest: {at_longest} blocks")
NUM_BLOCKS = 2 * smallest

# %% [markdown]
# Eleven blocks is what the longest request needs on its own: 6 prompt tokens and 37 new ones, of
# which the last is never fed back, so 42 tokens held, 11 blocks of 4. Holding all twelve at their
# longest would take 99 blocks. With 22, the engine must bet.
#
# **Predict, then run.** Recompute throws work away and redoes it; swap keeps it. Which of the two
# finishes the burst in fewer steps, and does either change a single generated token?

# %%
BUDGET = 64  # max_num_batched_tokens: tokens a step may run
alone = {
    r.request_id: generate(model, [r.prompt], r.max_new_tokens, cache="contiguous").tokens[0]
    for r in requests
}
settings = {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE}
runs = {
    way: Engine(model, **settings, preemption=way, max_num_batched_tokens=BUDGET).run(requests)
    for way in ("recompute", "swap")
}
print(f"{NUM_BLOCKS} blocks of {BLOCK_SIZE}")
print("preemption        steps  preemptions  recomputed  prefilled  blocks out / in  mean running  same text")
for way, r in runs.items():
    print(
        f"{way:<16}{r.steps:>7}{r.preemptions:>13}{r.recomputed_tokens:>12}{r.prefill_tokens_computed:>11}"
        f"{r.blocks_swapped_out:>11} / {r.blocks_swapped_in:<4}{r.mean_running:>13.1f}  {r.tokens == alone}"
    )
bytes_per_block = 2 * config.num_layers * config.d_model * 4 * BLOCK_SIZE  # K and V, float32
print(
    f"swap copied {runs['swap'].blocks_swapped_out * bytes_per_block:,} bytes each way "
    f"({bytes_per_block:,} bytes per block)"
)

# %% [markdown]
# Both finish in 88 steps, and the text is the same every way, token for token the text each
# request gets alone. Recompute preempted 8 times and threw away the K/V of 131 tokens, all of
# which were computed again by prefill: 233 tokens prefilled in all, the 94 of the prompts, the
# 131, and the 8 last tokens the victims had sampled and not yet fed back. Swap preempted 9 times,
# prefilled only the prompts, and moved 39 blocks out and the same 39 back in, 159,744 bytes each
# way. Both ran 3.4 sequences at once on average.
#
# On a real model the bytes are what matter. A 7B model's block of 16 tokens holds 8 MiB of K/V
# (lesson 00: half a mebibyte per token), and a PCIe 4.0 link moves roughly 25 GB/s, so a
# 1,000-token sequence takes about 20 ms to swap out and as long to come back. The PagedAttention
# paper compares the two ways on a GPU: swapping suffers with small blocks, because many small
# copies cannot use the bus's bandwidth; recomputation costs the same whatever the block size; for
# blocks of 16 to 64 tokens the two perform about the same. vLLM's current engine (V1) preempts by
# recomputation, which needs no host memory at all.
#
# A recomputed request often finds part of its K/V still there. Its freed blocks keep their hashes
# (lesson 08's prefix cache: a freed block stays cached on the free list until it is reused), so
# with `enable_prefix_caching=True` the resumed prefill looks its tokens up like any prompt and
# computes only what the cache lacks, as vLLM's resumed requests do:

# %%
cached = Engine(model, **settings, max_num_batched_tokens=BUDGET, enable_prefix_caching=True).run(requests)
print(
    f"recompute with prefix caching: {cached.preemptions} preemptions, "
    f"{cached.prefill_tokens_computed} tokens prefilled instead of {runs['recompute'].prefill_tokens_computed}, "
    f"{cached.prefix_cache_hits} served by the cache; same text: {cached.tokens == alone}"
)

# %% [markdown]
# The cache served 60 tokens of the recomputed prefills, 173 prefilled instead of 233. Only full
# blocks are cached, the blocks of a prompt and, as in vLLM, the blocks that decoding fills (lesson
# 07), so a resumed request finds every full block it held that was not evicted meanwhile; the
# tokens of its last, partly filled block, and those of blocks handed to other requests, are
# computed again.
#
# Step by step, `plot_metrics` draws the sequences running, waiting and (for swap) swapped out, and
# the utilization, tokens held per slot reserved, on a second axis: the recompute run above, the
# swap run below. The titles count the preemptions.

# %%
fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
for ax, r in zip(axes, runs.values(), strict=True):
    plot_metrics(r, ax=ax)
    ax.set_ylim(0, 12.5)
    ax.get_legend().set_loc("center right")  # the utilization runs along the top
axes[0].set_xlabel("")
fig.tight_layout()
plt.show()

# %% [markdown]
# Both start alike: the burst is admitted as far as the headroom allows, and the first preemptions
# come as the sequences outgrow the pool. Then they part. A recomputed request returns to the
# *waiting* queue and is admitted again like any other, when its prompt and headroom fit. A swapped
# sequence waits in its own queue, the *swapped* line, which comes before the waiting one: it comes
# back first, as soon as its blocks and the headroom fit, and no new request is admitted while any
# sequence is still swapped out, so that the oldest work finishes first. Utilisation stays high in
# both: paging wastes little of what it holds, however often it preempts.

# %% [markdown]
# ## 3. The admission watermark
#
# Preemptions happen because admission looks only one step ahead. The **watermark** looks a little
# further: admission keeps a fraction `watermark` of *all* the pool's blocks free, on top of the
# prompt and the headroom, rounded up to whole blocks, `ceil(watermark * num_blocks)`. The reserve
# absorbs the growth of the running sequences for a while, at the price of admitting fewer of them.
# vLLM's earlier (V0) block manager kept a watermark of 1 % of the blocks, "to avoid frequent cache
# eviction" as its comment says. vLLM v1 has one again: `SchedulerConfig.watermark`, a fraction of
# the blocks (0 by default), which its `KVCacheManager` turns into `watermark_blocks`; when it
# allocates the slots of a waiting or a preempted request, and some request is already scheduled,
# it requires that many blocks to stay free besides, and it never holds them back from a running
# request. Both round down (`int(watermark * num_blocks)`), so a pool of fewer than 100 blocks keeps
# nothing at 1 %; the course's engine rounds up, so that any watermark above zero keeps at least
# one block. `Engine(..., watermark=0.1)` keeps `ceil(0.1 × 22) = 3` of our 22 blocks free.
#
# **Predict, then run.** With 22 blocks and no watermark, recompute preempted 8 times. How many
# preemptions are left with a 20 % watermark (5 blocks kept free), and what does that cost?

# %%
watermarks = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
engines = {w: Engine(model, **settings, watermark=w, max_num_batched_tokens=BUDGET) for w in watermarks}
marked = {w: engine.run(requests) for w, engine in engines.items()}
print(f"recompute, {NUM_BLOCKS} blocks of {BLOCK_SIZE}")
print("watermark  kept free  preemptions  mean running  steps")
for w, r in marked.items():
    print(f"{w:>9.0%}{engines[w].watermark_blocks:>11}{r.preemptions:>13}{r.mean_running:>14.2f}{r.steps:>7}")

# %% [markdown]
# A 20 % watermark cuts the preemptions from 8 to 3, and the price is concurrency: 2.84 sequences
# running on average instead of 3.35, since 5 of the 22 blocks are off limits to admission. The
# steps grow, 104 against 88: a recomputed request prefills what it lost in a step or two, so the
# preemptions the watermark avoids cost few steps, and the sequences it keeps waiting cost more.
# From 30 % on, the preemptions dwindle (2, 2, 1) while the concurrency keeps falling (2.63, 2.61,
# 2.34). On a GPU a decode step reads all the model's weights whatever the batch, so a step costs
# about the same for 3 sequences as for 2, and fewer running sequences means fewer tokens per
# second. A watermark is worth what the preemptions it avoids cost (here, the computation of the
# tokens recomputed); a small one catches the worst of them.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
percent = [100 * w for w in watermarks]
left.plot(percent, [r.preemptions for r in marked.values()], "o-", color=PALETTE[5])
left.set_ylabel("preemptions")
left.set_ylim(bottom=0)
right.plot(percent, [r.mean_running for r in marked.values()], "o-", color=PALETTE[0])
right.set_ylabel("mean running sequences")
right.set_ylim(bottom=0)
for ax in (left, right):
    ax.set_xlabel("watermark (% of the blocks kept free)")
    ax.spines[["top", "right"]].set_visible(False)
fig.suptitle(
    f"recompute, {NUM_BLOCKS} blocks of {BLOCK_SIZE}: the watermark trades concurrency for preemptions",
    fontsize=10,
)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Preemptions against the memory budget
#
# The watermark moves the bet; memory changes the odds. `sweep_budgets(model, requests,
# num_blocks_list, block_size, preemption, max_num_batched_tokens=64)` serves the same requests once
# per budget and returns a row per budget: steps, preemptions, recomputed tokens, blocks swapped out, running sequences. The
# sweep runs from `min_num_blocks`, 11, to 99, where every request fits at its longest and nothing
# can be preempted, both ways.

# %%
budgets = [smallest, 14, 18, NUM_BLOCKS, 33, 44, 66, at_longest]
sweeps = {
    way: sweep_budgets(model, requests, budgets, BLOCK_SIZE, preemption=way, max_num_batched_tokens=BUDGET)
    for way in ("recompute", "swap")
}
print("blocks    recompute: preemptions  steps  mean running    swap: preemptions  steps  mean running")
for a, b in zip(sweeps["recompute"], sweeps["swap"], strict=True):
    print(
        f"{a['num_blocks']:>6}{a['preemptions']:>24}{a['steps']:>7}{a['mean_running']:>14.2f}"
        f"{b['preemptions']:>19}{b['steps']:>7}{b['mean_running']:>14.2f}"
    )

# %%
fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
for way, colour in (("recompute", PALETTE[5]), ("swap", PALETTE[3])):
    rows = sweeps[way]
    for ax, key in zip(axes, ("preemptions", "steps", "mean_running"), strict=True):
        ax.plot(
            [row["num_blocks"] for row in rows], [row[key] for row in rows], "o-", color=colour, label=way
        )
for ax, label in zip(
    axes, ("preemptions", "steps to serve the burst", "mean running sequences"), strict=True
):
    ax.axvline(smallest, color="#555555", linestyle="--", linewidth=1)
    ax.axvline(at_longest, color="#555555", linestyle=":", linewidth=1)
    ax.set_xlabel("num_blocks (blocks of 4)")
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
    ax.spines[["top", "right"]].set_visible(False)
axes[0].text(smallest + 2, 1, f"min_num_blocks = {smallest}", fontsize=8, color="#555555")
axes[0].text(at_longest - 2, 1, "all at their longest", fontsize=8, color="#555555", ha="right")
axes[0].legend(frameon=False)
fig.tight_layout()
plt.show()

# %% [markdown]
# At the smallest budget the engine mostly thrashes: recompute preempts 10 times and needs 185
# steps, swap 13 times and 182 steps, with fewer than 2 sequences running on average. Each added
# block helps, fast at first: at 22 blocks (twice the minimum) the steps are down to 88 both ways,
# and at 44 to 54. The preemptions fall less smoothly (swap preempts 9 times at 22 blocks, once
# more than at 18): one preemption more or less depends on which sequences happen to cross a block
# boundary together. At 99 blocks nothing is preempted either way, both take 37 steps (the longest
# output) and run 7.97 sequences on average. Recompute by prefill takes as many steps as swap at
# every budget but the smallest, so in steps the two are even; what separates them is the rest of
# the bill, the tokens recompute computes again against the blocks swap copies twice over the bus.
#
# The two vertical lines, dashed and dotted, bound the range where preemption matters. Below
# `min_num_blocks` some request cannot run at all; above "all at their longest" the bet cannot fail.
# A real server sits in between, much nearer the left line than the right: holding every sequence
# at its longest is exactly the waste that paging set out to avoid.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Preemption lives in v1's scheduler, the watermark in its KV cache
# manager:
#
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` calls `KVCacheManager.allocate_slots`
#   for each running request and, while it returns `None`, preempts `self.running[-1]`, the newest
#   (under the default first-come-first-served policy), until the request fits or is itself the
#   victim: our `choose_victims`, applied one victim at a time;
# * `Scheduler._preempt_request` frees the victim's blocks, sets its `num_computed_tokens` to 0 and
#   puts it at the front of the waiting queue (`prepend_request`): our recompute;
# * in the waiting loop of `Scheduler.schedule`, a request with `num_computed_tokens == 0` looks
#   its tokens up in the prefix cache and schedules `request.num_tokens` minus the hits, "to
#   consider the resumed requests, which have output tokens": the resumed prefill of section 2;
# * `vllm/v1/core/block_pool.py`: `BlockPool.free_blocks` puts a freed block that holds a hash at
#   the tail of the free queue, still cached: why a resumed request hits its own blocks;
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager` takes `watermark` and keeps
#   `watermark_blocks = int(watermark * kv_cache_config.num_blocks)`, which `allocate_slots` adds to
#   the blocks a `WAITING` or `PREEMPTED` request needs when `has_scheduled_reqs`;
#   `vllm/config/scheduler.py`: `SchedulerConfig.watermark`, in `[0, 1)`, 0 by default;
# * `vllm/v1/request.py`: `Request.num_preemptions` counts a request's preemptions, and
#   `RequestStatus.PREEMPTED` marks one waiting to resume.
#
# What the course leaves out or does differently: vLLM v1 has no swap (a preempted request's K/V
# is recomputed, or reloaded by a KV connector), and it allocates blocks step by step, so it
# preempts when a step's tokens do not fit rather than when the decode step's new blocks do not.

# %% [markdown]
# ## Recap
#
# * A paged engine admits a request with only its prompt's blocks and one block of headroom per
#   running sequence: enough for the next decode step, a bet on the ones after it. Three 3-token
#   sequences in 8 blocks of 4 run out at decode step 6, needing 3 blocks with 2 free.
# * Refusing loses work and waiting can deadlock, so vLLM **preempts**: whole sequences, all their
#   blocks, the most recently admitted first, until the step fits; a victim frees its blocks and
#   drops its own need. The oldest is never preempted, and `min_num_blocks` makes sure it always
#   fits.
# * **Recompute** drops the victim's K/V and requeues it at the front, its computed count back to
#   0, to prefill its prompt and generated tokens when it resumes (the paper's way and vLLM's, in
#   chunks under a token budget); **swap** copies it to host memory and back into other blocks. Neither changes the text.
#   On 12 requests in 22 blocks of 4, with a budget of 64 tokens a step: recompute preempted 8 times
#   and prefilled 131 lost tokens again, swap preempted 9 times and moved 39 blocks (159,744 bytes)
#   each way, both in 88 steps. With prefix caching the
#   cache served 60 of the recomputed tokens: freed blocks keep their hashes.
# * A **watermark** keeps `ceil(watermark * num_blocks)` blocks free at admission (vLLM v1 has one
#   too, for waiting and preempted requests): 20 % cut the preemptions from 8 to 3 for 2.84
#   sequences running on average instead of 3.35, and 104 steps instead of 88.
# * Against the budget: from 10 preemptions (recompute) and 13 (swap) at the smallest pool, 11
#   blocks, to none at 99, where every request fits at its longest; recompute and swap take the
#   same steps at every pool but the smallest.
#
# **Next, lesson 12:** writing the kernel. Every decode step above ends in `paged_attention`, which
# does lesson 03's address translation with PyTorch operations; a serving engine hands it to one
# kernel, whose programs load the block ids from the table and read the keys and values they point
# to. Lesson 12 writes it in Triton. The exercise for this lesson,
# `exercises/11_running_out_of_blocks.ipynb`, has you write the watermark rule, the choice of
# victims and their requeueing, and the swap of a sequence out to host memory and back.

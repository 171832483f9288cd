# %% [markdown]
# # Lesson 11 · Running out of blocks
#
# Paging lets an engine admit a request with only the blocks of its prompt and hand out the rest one
# block at a time, as the sequence grows. That is where its concurrency comes from (lesson 07), and
# it is also a promise the engine cannot always keep: the sequences it admitted keep growing, and
# the blocks they will need may not be there. Lesson 07's burst showed preemptions without looking
# into them. This lesson is about that moment: what vLLM does about it, what each answer costs, and
# how to make it rare.
#
# **By the end of this lesson you can**
#
# 1. explain why vLLM admits a request into a pool that its next decode step may find full, and how
#    its scheduler then preempts whole sequences, the newest running one first, one at a time;
# 2. compare the two ways to preempt, recompute (vLLM v1's) and swap (the PagedAttention paper's and
#    vLLM V0's), by what each costs, and show that neither changes the generated text;
# 3. explain the admission watermark, why it is kept only while other requests run, and measure how
#    it trades running sequences for preemptions;
# 4. read the preemptions, steps and running sequences of a workload against the memory budget,
#    from the smallest budget that can serve it to one where nothing is ever preempted;
# 5. say whose blocks vLLM's priority policy takes, and what it changes (who waits, not the text).
#
# A GPU is used when there is one; nothing needs it.

# %%
import random
from collections import deque

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT, encode
from paged_kv.pictures.plots import PALETTE, plot_block_tables, plot_metrics
from paged_kv.serving.engine import Engine, EngineRequest, min_num_blocks, sweep_budgets
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.scheduler import EngineCoreRequest, Scheduler, run_steps

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny model of section 2 has operations too small to share between threads
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Why blocks run out, even with paging
#
# A contiguous cache decides everything at admission: a request gets its slot of `max_model_len`
# tokens or waits, and once admitted it can never run short. A paged cache decides at admission
# only about the prompt. vLLM's scheduler admits the request at the front of the waiting queue
# when the blocks of its **whole prompt** are free; after that, a decode takes one more block each
# time a sequence's next token starts one. Nothing is set aside for that growth. Keeping one free
# block per running sequence (a decode step takes at most one each) would guard only the next
# step, and those blocks would sit idle at every step. So vLLM admits into a pool that the next
# decode may find full, and deals with the shortfall when it happens: a bet that, by the time the
# running sequences need more blocks, others will have finished and freed theirs. An operating
# system makes the same bet when it promises more virtual memory than it has physical pages.
#
# When the bet fails, a sequence's next token finds no free block. vLLM's scheduler goes through
# the running requests **in order, oldest first**, and asks for each one's new slots
# (`allocate_slots`, which takes a block at a boundary or returns `None`). On `None` it **preempts
# the newest running request** (`self.running.pop()`), whose blocks come back, and asks again; if
# the newest is the request itself, it preempts itself and the loop ends. Here is that loop, for a
# `PagedKVCacheAllocator` that does the bookkeeping only:


# %%
def schedule_running(pool, running, waiting):
    """One decode step of vLLM's running loop; returns the preempted sequences, newest first."""
    preempted, index = [], 0
    while index < len(running):
        seq_id = running[index]
        while pool.needs_new_block(seq_id) and pool.num_free_blocks == 0:  # allocate_slots: None
            victim = running.pop()  # the newest running sequence
            pool.free_sequence(victim)  # all of its blocks go back to the pool
            waiting.appendleft(victim)  # it waits at the front of the queue
            preempted.append(victim)
            if victim == seq_id:  # it was the newest: the step goes on without it
                return preempted
        pool.append_tokens(seq_id, 1)  # takes a block when the token starts one
        index += 1
    return preempted


# %% [markdown]
# Four requests, `a` to `d`, each with a 3-token prompt, arrive at a pool of 8 blocks of 4 tokens.
# Each prompt takes one block, so all four are admitted, and each decode step adds one token to
# every running sequence.
#
# **Predict, then run.** After admission, 4 of the 8 blocks are free. Each sequence takes a new
# block for its 5th token and its 9th. In which decode step does the pool run out, and which
# sequences does the loop preempt?

# %%
pool = PagedKVCacheAllocator(num_blocks=8, block_size=4, num_heads=1, head_dim=1)  # bookkeeping only
running, waiting = [], deque()
for seq_id in "abcd":  # admitted while the prompt's blocks are free
    if blocks_for_tokens(3, pool.block_size) <= pool.num_free_blocks:
        pool.allocate_for_sequence(seq_id, 3)
        running.append(seq_id)
print(f"admitted {running}; {pool.num_free_blocks} blocks free")
for step in range(1, 10):
    preempted = schedule_running(pool, running, waiting)
    held = {s: pool.sequence_length(s) for s in running}
    print(f"decode step {step}: tokens held {held}, {pool.num_free_blocks} free, preempted {preempted}")
    if preempted:
        break
print("waiting, front first:", list(waiting))

# %% [markdown]
# Step 6. Step 2 took four blocks at once, when the 5th tokens started a second block in every
# sequence, and left none free. Steps 3 to 5 filled those second blocks, and in step 6 every
# sequence needs a third. `a` finds no block: the loop preempts `d`, the newest, whose 2 blocks come
# back; `a` takes one, `b` the other. `c` finds none, and the newest running sequence is now `c`
# itself: it preempts itself. `a` and `b` go on; `c` and `d` wait at the front of the queue, `c`
# first, in the order they came. Here is the pool after the step:

# %%
plot_block_tables(pool.snapshot(), title="decode step 6: d, then c preempted; a and b hold 9 tokens")
plt.show()

# %% [markdown]
# Why preempt? When a sequence needs a block and none is free, an engine can:
#
# * **refuse**: fail the request, an error for a request the server had accepted, its work lost;
# * **wait**: pause the sequences that need a block until one frees up. Here all four need one,
#   and none can finish without growing first: a deadlock;
# * **preempt**: take some sequence's blocks back, so that the others can go on, and resume that
#   sequence later.
#
# vLLM preempts, with two rules (section 4.5 of the PagedAttention paper). **All or nothing per
# sequence**: a decode attends over all of a sequence's tokens, so a sequence missing some blocks
# could not run anyway; it loses all of them. **The most recently admitted first**: requests are
# served first come, first served, so the newest gives way. Over a whole step the loop amounts to
# one rule: preempt from the newest down until the others' new blocks fit. Each victim helps
# twice: its blocks become free, and it needs no block in this step. The exercise has you write
# that rule on plain numbers.
#
# The package's scheduler runs the same loop (`paged_kv.serving.scheduler.Scheduler`, over
# `KVCacheManager`, the engine's memory of lesson 09). With a runner that runs no model,
# `CountingRunner`, it serves the same four requests in a pool of 8 blocks; step 0 is their
# prefill, step `k` decode step `k`:

# %%
memory = KVCacheManager(num_blocks=8, block_size=4)
arrivals = [(0, EngineCoreRequest(seq_id, num_prompt_tokens=3, max_tokens=12)) for seq_id in "abcd"]
for output, _ in run_steps(Scheduler(memory), CountingRunner(), arrivals, max_steps=9):
    if output.preemptions:
        victims = [(p.request_id, p.way, p.num_tokens) for p in output.preemptions]
        print(f"step {output.step}: preempted {victims}; scheduled {dict(output.num_scheduled_tokens)}")

# %% [markdown]
# The same victims in the same order, but `d` goes four steps earlier: the engine's pool sets
# block 0 aside as the null block (lesson 07), so its 8 blocks give out 7, and 3 are free after the
# prefill, not 4. At step 2 the 5th tokens need four blocks: `a`, `b` and `c` take the three, and
# `d`, the newest, finds none and preempts itself, by recompute, with the 4 tokens it had computed.
# At step 6 `a` takes the block `d` gave back; `b` finds none and preempts `c`, with 8 tokens
# computed, and takes one of its 2 blocks. The oldest request is never a victim: `a` is served
# first, so every other request is preempted before it, and it needs at most the blocks it can hold
# alone. That is safe because the engine refuses, up front, any request that could not run alone at
# its longest in the whole pool. `paged_kv.serving.engine.min_num_blocks(requests, block_size)` is
# that smallest pool, and section 4 starts from it.

# %% [markdown]
# ## 2. Recompute or swap
#
# A preempted sequence must come back later with its K/V. There are two ways to get it back.
#
# **Recompute.** Free the victim's blocks, drop its K/V and put the request back at the *front* of
# the waiting queue: it was admitted before every request still waiting. When it fits again, its
# K/V is computed again from its tokens; greedy decoding is deterministic, so the text does not
# change. The cost is computation. vLLM does it in one **prefill** (the pass that runs many tokens
# through the model at once, as a new prompt enters the cache) over the prompt and the tokens
# generated so far, far faster on a GPU than the decode steps that first produced them. vLLM v1
# counts each request's *computed* tokens, those whose K/V the cache holds; preemption sets the
# count back to 0, and once the request is admitted again (its whole sequence must fit, like a
# prompt) it gets the tokens it lacks in chunks of at most the token budget
# (`max_num_batched_tokens`, lesson 10); the last chunk samples the next token. The course's
# engine does the same, as does the PagedAttention paper (§4.5). The operating-system analogue is
# dropping a clean page of code: it can always be read from the file again.
#
# **Swap.** Copy the victim's K/V to host memory, free its blocks, and when enough blocks are free
# again, give it fresh ones (the block table changes, the content does not) and copy the K/V back.
# Nothing is computed again. The cost is the copies: on a GPU, every swapped block crosses the
# PCIe bus twice, as dirty pages go to disk and back in an operating system. It is the paper's
# second way, and vLLM V0 had it; vLLM v1 has no swap, and the course keeps it to compare.
#
# To see swap on real K/V, lesson 09's tiny GPT serves again: `TinyGPT` (2 layers of 4 heads of
# dimension 16, byte tokens, seeded random weights) on a `PagedKVCache`, one block manager for
# every layer, 1,024 bytes a token. `PagedKVCache.swap_out(seq_id)` and `swap_in(seq_id, saved)`
# swap a sequence, every layer at once (`paged_kv.kv.swap`; the exercise builds them for one
# allocator). By hand: a prompt is prefilled and decodes 4 tokens in blocks of 4, is swapped out,
# another sequence takes two blocks, and the prompt comes back and decodes 5 more.

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
# Now both ways on a workload that runs out, served by lesson 09's `Engine`, whose scheduler runs
# section 1's loop (`preemption="recompute"` or `"swap"`), under lesson 10's token budget,
# `max_num_batched_tokens=64`: here it matters only for the recomputed requests, which prefill the
# tokens they had generated in chunks of at most 64. A swapped-out request waits in a queue of its
# own, which comes back before any new request is admitted.
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
at_longest = sum(blocks_for_tokens(len(r.prompt) + r.max_tokens - 1, BLOCK_SIZE) for r in requests)
at_longest += 1  # and the null block
print(
    f"{len(requests)} requests; prompts of {min(len(r.prompt) for r in requests)} to "
    f"{max(len(r.prompt) for r in requests)} tokens, outputs of {min(r.max_tokens for r in requests)} to "
    f"{max(r.max_tokens for r in requests)}"
)
print(
    f"smallest pool that serves them: {smallest} blocks; a pool for all at their longest: {at_longest} blocks"
)
NUM_BLOCKS = 2 * smallest

# %% [markdown]
# The longest request needs 11 blocks on its own: 6 prompt tokens and 37 new ones, of which the
# last is never fed back, so 42 tokens held, 11 blocks of 4; the pool needs one more, its null
# block. Holding all twelve at their longest would take 99 blocks, a pool of 100. With 24, 23 to
# give out, the engine must bet.
#
# **Predict, then run.** Recompute throws work away and redoes it; swap keeps it. Which of the two
# finishes the burst in fewer steps, and does either change a single generated token?

# %%
BUDGET = 64  # max_num_batched_tokens: tokens a step may run
alone = {
    r.request_id: generate(model, [r.prompt], r.max_tokens, cache="contiguous").tokens[0] for r in requests
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
# Both finish in 83 steps, and the text is the same every way, token for token the text each
# request gets alone. Recompute preempted 14 times and threw away the K/V of 204 tokens, all of
# which were computed again by prefill: 312 tokens prefilled in all, the 94 of the prompts, the
# 204, and the 14 last tokens the victims had sampled and not yet fed back. Swap preempted 14
# times too, prefilled only the prompts, and moved 56 blocks out and the same 56 back in, 229,376
# bytes each way. Both ran 3.6 sequences at once on average. The two take the same steps because
# a resumed request comes back in one step either way: its prefill fits the budget of 64 tokens,
# as a swap-in takes one step to copy the K/V back and decode.
#
# On a real model the bytes are what matter: a 7B model holds half a mebibyte of K/V per token
# (lesson 00), and a PCIe 4.0 link moves roughly 25 GB/s, so a 1,000-token sequence takes about
# 20 ms to swap out and as long to come back. The PagedAttention paper finds swapping slow with
# small blocks (many small copies) and the two even for blocks of 16 to 64 tokens; vLLM v1
# preempts by recomputation only, which needs no host memory.
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
# The cache served 68 tokens of the recomputed prefills, 244 prefilled instead of 312. Only full
# blocks are cached, the blocks of a prompt and, as in vLLM, the blocks that decoding fills, so a
# resumed request finds every full block it held that was not evicted meanwhile; the tokens of
# its last, partly filled block, and those of blocks handed to other requests, are computed again.
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
# Both start alike: the burst is admitted as far as the prompts fit, and preemptions come as the
# sequences outgrow the pool. A recomputed request returns to the *waiting* queue and is admitted
# again when its whole sequence fits. A swapped sequence waits in its own queue, the *swapped*
# line, which comes first: no new request is admitted while any is swapped out (vLLM V0's order).
# Utilisation stays high in both: paging wastes little of what it holds, however often it preempts.

# %% [markdown]
# ## 3. The admission watermark
#
# Preemptions happen because admission looks only at the prompt. The **watermark** looks a little
# further: while other requests run, admission keeps a fraction `watermark` of *all* the pool's
# blocks free besides the prompt's, rounded up, `ceil(watermark * num_blocks)`. The running
# sequences may grow into that reserve, so it absorbs their growth for a while, at the price of
# admitting fewer of them. A request that would run alone has nobody's growth to protect, so
# **alone it needs no watermark**, as in vLLM. That matters for the victims of recompute: a
# resumed request's "prompt" holds its generated tokens too and may need most of the pool; alone,
# it always comes back.
#
# vLLM v1's is `SchedulerConfig.watermark` (0 by default), which its `KVCacheManager` turns into
# `watermark_blocks`, added to the blocks a waiting or preempted request needs only when some
# request is running. vLLM rounds down (`int(watermark * num_blocks)`), so a pool of fewer than 100
# blocks keeps nothing at 1 %; the course rounds up, so that any watermark above zero keeps a
# block. `Engine(..., watermark=0.1)` keeps `ceil(0.1 × 24) = 3` of our 24 blocks free (the null
# block counts in `num_blocks`).
#
# **Predict, then run.** With 24 blocks and no watermark, recompute preempted 14 times. How many
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
# A 20 % watermark cuts the preemptions from 14 to 7, and the price is concurrency: 3.28
# sequences running on average instead of 3.55, since 5 of the 23 blocks given out are off limits
# to admission while others run. The steps grow, 90 against 83: a recomputed request prefills what
# it lost in one step, so the preemptions the watermark avoids cost few steps, and the sequences
# it keeps waiting cost more. From 30 % on, the preemptions dwindle (4, 2, 2) while the
# concurrency keeps falling (3.07, then 2.63 at 40 % as at 50 %). On a GPU a decode step reads all
# the weights whatever the batch, so fewer running sequences means fewer tokens per second. A
# watermark is worth what the preemptions it avoids cost: here 20 % halves them.

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
# per budget and returns a row per budget: steps, preemptions, recomputed tokens, blocks swapped
# out, running sequences. The sweep runs from `min_num_blocks`, 12, to 100, where every request fits
# at its longest and nothing can be preempted, both ways.

# %%
budgets = [smallest, 16, NUM_BLOCKS, 44, 66, at_longest]
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
for way, colour, style in (("recompute", PALETTE[5], "o-"), ("swap", PALETTE[3], "x--")):
    rows = sweeps[way]
    for ax, key in zip(axes, ("preemptions", "steps", "mean_running"), strict=True):
        ax.plot(
            [row["num_blocks"] for row in rows], [row[key] for row in rows], style, color=colour, label=way
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
# At the smallest budget the engine mostly thrashes: 20 preemptions and 177 steps, with 1.67
# sequences running on average. Each added block helps, fast at first: at 24 blocks (twice the
# minimum) the steps are down to 83, at 44 to 54. The preemptions fall more slowly (19 at 16
# blocks, 14 at 24, 8 at 44). At 100 blocks nothing is preempted, the run takes 37 steps
# (the longest output) and runs 7.97 sequences on average. Swap gives the very same row at every
# budget: a victim comes back in one step either way, in the same order, so in steps the two are
# even (the swap line lies on the recompute one). What separates them is the rest of the bill, the
# tokens recompute computes again against the blocks swap copies twice over the bus.
#
# The dashed and dotted lines bound where preemption matters: below `min_num_blocks` some request
# cannot run, above "all at their longest" the bet cannot fail. A real server sits much nearer the
# left line: holding every sequence at its longest is the waste paging avoids.

# %% [markdown]
# ## 5. Whose blocks are taken: priority
#
# Newest first is vLLM's default, `--scheduling-policy fcfs`. Under `--scheduling-policy priority`
# each request has a `priority`, lower first: the waiting queue is ordered by `(priority,
# arrival_time)`, and the victim is the running request with the largest `(priority,
# arrival_time)`, wherever it stands, even one scheduled earlier in the step (its tokens and blocks
# go back). Admission still never preempts. Below, every third request of the burst is urgent
# (priority 0, the rest 1).

# %%
tier = {r.request_id: 0 if i % 3 == 2 else 1 for i, r in enumerate(requests)}  # 0: urgent


def by_class(policy):
    """Each class's preemptions and mean finishing step, on the scheduler with a counting runner."""
    scheduler = Scheduler(
        KVCacheManager(NUM_BLOCKS, BLOCK_SIZE), policy=policy, max_num_batched_tokens=BUDGET
    )
    rank = tier if policy == "priority" else dict.fromkeys(tier, 0)
    arrivals = [
        (0, EngineCoreRequest(r.request_id, len(r.prompt), r.max_tokens, priority=rank[r.request_id]))
        for r in requests
    ]
    preempted, finish = [0, 0], [[], []]
    for step, (output, result) in enumerate(run_steps(scheduler, CountingRunner(), arrivals)):
        for p in output.preemptions:
            preempted[tier[p.request_id]] += 1
        for request_id, _ in result.finished:
            finish[tier[request_id]].append(step)
    return preempted, [sum(f) / len(f) for f in finish]


for policy in ("fcfs", "priority"):
    (urgent, rest), (done_urgent, done_rest) = by_class(policy)
    print(f"{policy:<9} preempted: urgent {urgent:>2}, others {rest:>2}; ", end="")
    print(f"mean finishing step: urgent {done_urgent:.0f}, others {done_rest:.0f}")
ranked = [EngineRequest(r.request_id, r.prompt, r.max_tokens, priority=tier[r.request_id]) for r in requests]
by_rank = Engine(model, **settings, max_num_batched_tokens=BUDGET, scheduling_policy="priority").run(ranked)
print(f"the engine under priority: {by_rank.preemptions} preemptions; same text: {by_rank.tokens == alone}")

# %% [markdown]
# First come first served preempts whoever is newest: 6 of its 14 victims are urgent, who finish
# no sooner than the rest (step 50 on average, against 48). Under priority the urgent ones are
# admitted first and preempted once, when only urgent requests run, and finish at step 20; the
# others take 15 preemptions and finish at 59. The policy decides who waits, never the text.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Admission and preemption live in v1's scheduler, the watermark in
# its KV cache manager:
#
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` goes through `self.running` in order,
#   calling `KVCacheManager.allocate_slots` for each request's new tokens; while it returns `None`
#   it pops the newest, `self.running.pop()` (under the default first-come-first-served policy),
#   until the request fits or is itself the victim (`preempted_req == request`): section 1's loop.
#   Under `SchedulingPolicy.PRIORITY` the victim is `max(self.running, key=lambda r: (r.priority,
#   r.arrival_time))` and the waiting queue a `PriorityRequestQueue`
#   (`vllm/v1/core/sched/request_queue.py`), section 5's. Waiting requests are scheduled only `if not preempted_reqs`;
# * `Scheduler._preempt_request` frees the victim's blocks, sets its `num_computed_tokens` to 0 and
#   puts it at the front of the waiting queue (`prepend_request`). Resumed, it schedules
#   `request.num_tokens` minus its prefix-cache hits, "to consider the resumed requests, which have
#   output tokens": section 2's prefill;
# * `vllm/v1/core/kv_cache_manager.py`: `allocate_slots` with `full_sequence_must_fit` admits a
#   waiting request only when the blocks of its whole sequence are free; `KVCacheManager` keeps
#   `watermark_blocks`, `int(watermark * num_blocks)` of the pool, added to the blocks a `WAITING`
#   or `PREEMPTED` request needs when `has_scheduled_reqs` (the scheduler passes whether anything
#   runs);
# * `vllm/config/scheduler.py`: `SchedulerConfig.watermark`, in `[0, 1)`, 0 by default, and
#   `scheduler_reserve_full_isl`, on by default: the whole sequence must fit at admission;
# * `vllm/v1/core/block_pool.py`: `BlockPool.free_blocks` puts a freed block that holds a hash at
#   the tail of the free queue, still cached: why a resumed request hits its own blocks;
# * `vllm/v1/request.py`: `Request.num_preemptions` counts a request's preemptions, and
#   `RequestStatus.PREEMPTED` marks one waiting to resume.
#
# What the course leaves out or does differently: vLLM v1 has no swap (a preempted request's K/V
# is recomputed, or reloaded by a KV connector); the course's swap, its swapped queue that comes
# back before any admission, follows the paper and vLLM V0. V0 swapped into a CPU pool of
# `swap_space` GiB per GPU (4 by default), which v1 never used. The `CacheConfig` of vLLM 0.33.0
# (`vllm/config/cache.py`) has no such field: host memory holds K/V through KV offloading instead,
# `kv_offloading_size` (`--kv-offloading-size`, in GiB) with its `kv_offloading_backend`, a
# connector that copies blocks to the CPU and loads them back on a later hit, a resumed request's
# too. The course's engine gives a request the same tokens however often it is preempted and
# whatever runs beside it; vLLM does not promise that, since a recomputed prefill and the decodes
# it replaces run other batch shapes, whose reductions may round differently, unless
# `VLLM_BATCH_INVARIANT` (`vllm/envs.py`, off by default) selects batch-invariant kernels. The
# course's watermark rounds up where vLLM's rounds down.

# %% [markdown]
# ## Recap
#
# * vLLM admits a request when its whole prompt's blocks are free and keeps nothing back for the
#   running sequences' growth. Four 3-token sequences in 8 blocks of 4 run out at decode step 6.
# * Refusing loses work and waiting can deadlock, so vLLM **preempts** whole sequences: going
#   through the running requests oldest first, one that finds no block preempts the newest
#   (`self.running.pop()`), itself when it is the newest: in step 6, `d`, then `c`. The engine's
#   8 blocks give out 7 (block 0 is the null block), so it preempts `d` at step 2 and `c` at step
#   6. The oldest is never preempted; `min_num_blocks` makes sure it always fits.
# * **Recompute** (vLLM v1's way) drops the victim's K/V and requeues it at the front, to prefill
#   its prompt and generated tokens when it resumes; **swap** (the paper's and V0's) copies it to
#   host memory and back into other blocks. Neither changes the text. On 12 requests in 24 blocks
#   of 4 (23 to give out), both preempted 14 times in 83 steps: recompute prefilled 204 lost tokens
#   again, swap moved 56 blocks (229,376 bytes) each way. Prefix caching served 68 of the
#   recomputed tokens.
# * A **watermark** keeps `ceil(watermark * num_blocks)` blocks free at admission while others
#   run, none for a request alone: 20 % cut the preemptions from 14 to 7, for 3.28 sequences
#   running on average instead of 3.55 and 90 steps instead of 83.
# * Against the budget: from 20 preemptions and 177 steps at 12 blocks to none and 37 steps at 100;
#   swap takes the same steps as recompute at every budget.
# * Under `--scheduling-policy priority` the victim is the running request with the largest
#   `(priority, arrival_time)`: urgent requests lost their blocks once instead of 6 times and
#   finished at step 20 instead of 50, the others at 59; the same text.
#
# **Next, lesson 12:** writing the kernel. Every decode step above ends in attention over the
# paged cache, which a serving engine hands to one kernel, whose programs load the block ids from
# the table and read the keys and values they point to: on this CPU the package's `CPU_ATTN`, in
# C; `GATHER` does lesson 03's address translation with PyTorch operations instead. Lesson 12
# writes such a kernel in Triton. The exercise for this lesson,
# `exercises/11_running_out_of_blocks.ipynb`, has you write the watermark rule, the choice of
# victims and their requeueing, the swap of a sequence out to host memory and back, and the
# victims under priority.

# %% [markdown]
# # Lesson 04 · On-demand decode allocation
#
# A request's prompt arrives all at once, but its answer is generated one token per step, and
# nobody knows in advance how long the answer will be. A paged cache therefore gives a request the
# blocks for its prompt, then one more block each time its last block fills up during decoding, and
# takes all of them back the moment the request finishes. This lesson pins down exactly when that
# new block is needed (a check that is easy to write gets it wrong by one token) and runs a small
# server loop in which requests come and go.
#
# **By the end of this lesson you can**
#
# 1. compute how many blocks a prompt takes, and at which decode steps a sequence takes another;
# 2. state the boundary rule, a new block before token `n + 1` exactly when the `n` tokens fill the
#    blocks held, and show why the check `(n + 1) % block_size == 0` is off by one;
# 3. grow a sequence with `append_tokens`, and with the low-level `append_block_to_sequence`;
# 4. run a continuous-batching loop that frees a finished request at once and admits a waiting one,
#    and read the staircase of blocks in use.

# %%
from collections import deque

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.pictures.plots import PALETTE, plot_held_and_reserved

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Prefill: blocks for the prompt
#
# Serving a request starts with the **prefill**: the model reads the whole prompt in one pass and
# produces the keys and values of every prompt token. Before that pass, the cache must hold a slot
# for each of them, so the request takes `ceil(prompt / block_size)` blocks. With blocks of 4, a
# 10-token prompt takes 3 blocks, 12 slots, and the last block has 2 slots left.

# %%
BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 4, 2, 4
cache = PagedKVCacheAllocator(
    num_blocks=16, block_size=BLOCK_SIZE, num_heads=NUM_HEADS, head_dim=HEAD_DIM, device=device
)
prompt_k = torch.randn(10, NUM_HEADS, HEAD_DIM, device=device)
prompt_v = torch.randn(10, NUM_HEADS, HEAD_DIM, device=device)

table = cache.allocate_for_sequence("a", 10)
cache.write_kv("a", prompt_k, prompt_v)
print("a:", table)
print("blocks:", blocks_for_tokens(10, BLOCK_SIZE), "| slots:", table.capacity(BLOCK_SIZE))
print("free slots in the last block:", table.capacity(BLOCK_SIZE) - table.num_tokens)

# %% [markdown]
# ## 2. Decode: one token at a time
#
# After the prefill comes the **decode**: each step, the model produces one new token per sequence,
# and the new token's K and V go into the cache at position `n`, where `n` is the number of tokens
# the sequence held before. So each step first makes room for one more token, with
# `cache.append_tokens("a", 1)`, then writes K/V at `start_position=n`. `append_tokens` takes a new
# block only when the next token has no slot, and returns the ids of the blocks it took (usually
# none). `cache.needs_new_block("a")` asks the question on its own.
#
# **Predict, then run.** `a` holds 10 tokens in 3 blocks of 4. Over the next 8 decode steps, at which
# steps does it take a new block?

# %%
ks, vs = [prompt_k], [prompt_v]
print("step  tokens before  needs_new_block  new blocks  block table")
for step in range(1, 9):
    n = cache.sequence_length("a")
    needs = cache.needs_new_block("a")
    new_blocks = cache.append_tokens("a", 1)  # room for the new token, at position n
    k_new = torch.randn(1, NUM_HEADS, HEAD_DIM, device=device)  # what the model would produce
    v_new = torch.randn(1, NUM_HEADS, HEAD_DIM, device=device)
    cache.write_kv("a", k_new, v_new, start_position=n)
    ks.append(k_new)
    vs.append(v_new)
    print(f"{step:>4} {n:>14} {needs!s:>16} {new_blocks!s:>11}  {cache.get_block_mapping('a')}")

k_back, v_back = cache.read_kv("a")
same_k, same_v = torch.equal(k_back, torch.cat(ks)), torch.equal(v_back, torch.cat(vs))
print("tokens:", cache.sequence_length("a"), "| K and V read back:", same_k, same_v)

# %% [markdown]
# Steps 3 and 7. At step 3 the sequence held 12 tokens, its 3 blocks were full, and the 13th token
# needed block 3; at step 7 the 17th token needed block 4. The other six steps took nothing. K/V of
# all 18 tokens, written as they came, read back unchanged.
#
# Over a longer run this is a staircase: tokens grow by one per step, and the reserved slots jump by
# a whole block each time the tokens reach them. The gap between the two, hatched, is the only waste,
# the empty tail of the last block; it never reaches a whole block.

# %%
growing = PagedKVCacheAllocator(num_blocks=16, block_size=BLOCK_SIZE, num_heads=1, head_dim=1, device=device)
growing.allocate_for_sequence("b", 3)
held, reserved = [], []
for _ in range(22):
    held.append(growing.usage().allocated_tokens)
    reserved.append(growing.usage().reserved_tokens)
    growing.append_tokens("b", 1)
print("tokens held:   ", held)
print("slots reserved:", reserved)

fig, ax = plt.subplots(figsize=(7, 3))
plot_held_and_reserved(
    held, reserved, ax=ax, xlabel="decode step", reserved_label="slots reserved (blocks × 4)"
)
ax.legend(frameon=False, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# The animation records a smaller run token by token: `a` with a 6-token prompt and `b` with a
# 3-token prompt decode side by side in 12 blocks of 4, then `a` finishes. Step through it and watch
# the captions: a frame says a block was appended exactly when a sequence's blocks were full, and
# every other token fits in the last block. (Press **Play** or step with the frame number's arrows;
# it also plays in this notebook exported to HTML.)

# %%
from paged_kv.pictures.widgets import AllocationPlayer, AllocatorPlayground

recorded = PagedKVCacheAllocator(num_blocks=12, block_size=BLOCK_SIZE, num_heads=1, head_dim=1, record=True)
recorded.allocate_for_sequence("a", 6)
recorded.allocate_for_sequence("b", 3)
for _ in range(6):
    recorded.append_tokens("a", 1)
    recorded.append_tokens("b", 1)
recorded.free_sequence("a")
AllocationPlayer(recorded.trace)

# %% [markdown]
# ## 3. The boundary rule, and a check that is off by one
#
# A sequence that holds `n` tokens in `b` blocks has `b × block_size` slots. The next token goes to
# position `n`, so it fits exactly when `n < b × block_size`, and a new block is needed exactly when
#
# $$n = b \times \mathrm{block\_size},$$
#
# when the blocks are full. A sequence that holds no spare block has `b = ceil(n / block_size)`, and
# the rule becomes `n % block_size == 0`. That includes `n = 0`: a sequence with no tokens holds no
# block, and its first token needs one.
#
# A tempting way to write the check, which you may meet in tutorials, runs before each new token:
#
# ```python
# if (current_length + 1) % block_size == 0:
#     allocate_block()
# generate_next_token()
# ```
#
# **Predict, then run.** With blocks of 4, for which lengths `n` from 0 to 9 does each rule take a
# block?


# %%
def boundary_rule(n: int, block_size: int) -> bool:
    """A new block before token n + 1 exactly when the n tokens fill their blocks."""
    return n % block_size == 0


def tutorial_rule(n: int, block_size: int) -> bool:
    """The tempting check: off by one."""
    return (n + 1) % block_size == 0


print(" n  blocks  free slots  boundary rule  tutorial rule")
for n in range(10):
    blocks = blocks_for_tokens(n, 4)
    free = blocks * 4 - n
    print(f"{n:>2} {blocks:>7} {free:>11} {boundary_rule(n, 4)!s:>14} {tutorial_rule(n, 4)!s:>14}")

# %% [markdown]
# The boundary rule fires at `n` = 0, 4 and 8, where the free slots are 0. The tutorial rule fires at
# 3 and 7, where one slot is still free, and never where the blocks are full. It reads as "the block
# is about to fill", but the check runs *before* the new token: it should ask whether the `n` tokens
# already fill the blocks, not whether `n + 1` will.
#
# What goes wrong depends on where the sequence starts. Here is the bookkeeping alone, with plain
# integers: the tutorial's rule after a prompt of 5 tokens and after a prompt of 4, then the boundary
# rule after the prompt of 4.


# %%
def grow_with(rule, prompt: int, steps: int, block_size: int = 4) -> None:
    """Decode `steps` tokens, taking a block whenever `rule` says so, and report each step."""
    n, blocks = prompt, blocks_for_tokens(prompt, block_size)
    for _ in range(steps):
        free = blocks * block_size - n
        state = f"{free} free slot{'' if free == 1 else 's'}"
        if rule(n, block_size):
            blocks += 1
            state += ", takes a block"
        else:
            state += ", takes nothing"
        if n >= blocks * block_size:
            print(f"  n={n}: {state}; token {n + 1} has no slot!")
            return
        print(f"  n={n}: {state}; token {n + 1} fits ({blocks} blocks)")
        n += 1


print("tutorial rule, prompt of 5 tokens:")
grow_with(tutorial_rule, prompt=5, steps=4)
print("tutorial rule, prompt of 4 tokens:")
grow_with(tutorial_rule, prompt=4, steps=4)
print("boundary rule, prompt of 4 tokens:")
grow_with(boundary_rule, prompt=4, steps=4)

# %% [markdown]
# With 5 prompt tokens, the tutorial's rule works but takes each block one step early, so an empty
# block sits reserved and unused for a step. With 4 prompt tokens (or 0, or any multiple of the
# block size) it fails outright: the blocks are full and it takes nothing, so token 5 has no slot.
# Its position, 4, lies past the last block of the table, and the translation of lesson 03 has no
# physical block to give it.
#
# The package follows the boundary rule. Growing a sequence from 0 tokens one at a time, it needs a
# block at the same lengths as the boundary-rule column of the table, 0, 4 and 8; a sequence of 3
# tokens takes nothing for its 4th. And with vLLM's default of 16 slots a block: a sequence of 48
# tokens in 3 blocks of 16 takes a 4th block for its 49th token.

# %%
checker = PagedKVCacheAllocator(num_blocks=8, block_size=4, num_heads=1, head_dim=1, device=device)
checker.allocate_for_sequence("empty", 0)
needs_at = []
for n in range(10):
    if checker.needs_new_block("empty"):
        needs_at.append(n)
    checker.append_tokens("empty", 1)
print("package needs a new block at n =", needs_at)

checker.allocate_for_sequence("three", 3)
for _ in range(2):
    n, needs = checker.sequence_length("three"), checker.needs_new_block("three")
    print(f"{n} tokens: needs_new_block {needs} | append_tokens -> {checker.append_tokens('three')}")

blog = PagedKVCacheAllocator(num_blocks=8, block_size=16, num_heads=1, head_dim=1, device=device)
blog.allocate_for_sequence("req-a", 48)
print("48 tokens:", blog.get_block_mapping("req-a"), "| append_tokens ->", blog.append_tokens("req-a", 1))
print("49 tokens:", blog.get_block_mapping("req-a"))

# %% [markdown]
# ## 4. The low-level step: `append_block_to_sequence`
#
# `append_tokens` does two things at once: it takes the blocks that are missing and counts the new
# tokens. A serving engine splits them, and takes the blocks first, in its scheduler, before the
# step runs: the scheduler goes through the running sequences and gives each a slot for its next
# token, taking a block for one whose blocks are full (vLLM's `KVCacheManager.allocate_slots`); when
# no block is free, it makes room by preempting a sequence (lesson 11). Only then does the model
# run, writing each new token's K and V into the slot it was given: the model never allocates.
# Last, the sampled tokens are counted.
#
# `cache.append_block_to_sequence(seq_id)` is that first half: it adds one free block to the table
# and no tokens. Afterwards the sequence holds a spare block, so `needs_new_block` turns false, and
# the next `append_tokens` uses the spare block instead of taking another.

# %%
cache.allocate_for_sequence("c", 8)  # two full blocks
print("c:", cache.get_block_table("c"), "| needs_new_block:", cache.needs_new_block("c"))
reserved_block = cache.append_block_to_sequence("c")
print("append_block_to_sequence ->", reserved_block)
print("c:", cache.get_block_table("c"), "| needs_new_block:", cache.needs_new_block("c"))
print("8 % 4 == 0:", 8 % 4 == 0)
print("append_tokens('c', 1) ->", cache.append_tokens("c", 1))
print("c:", cache.get_block_table("c"))

# %% [markdown]
# With a spare block, `n % block_size == 0` is no longer the right test: `c` holds 8 tokens, a
# multiple of 4, yet needs nothing. The general rule compares the tokens with the capacity,
# `n == blocks × block_size`, which is what `needs_new_block` does.

# %% [markdown]
# ## 5. Continuous batching: free at once, admit at once
#
# A server decodes many sequences together, one token each per step. With **static batching** a
# batch runs until its longest request is done, and requests that finish early sit idle while new
# ones wait. **Continuous batching** (iteration-level scheduling, introduced by the Orca system;
# vLLM's scheduler works this way too) re-forms the batch at every step: the moment a request
# finishes, its blocks go back to the free list, and a waiting request joins the batch with them.
# Paging is what makes that cheap: the freed blocks are the same size as every other, so any request
# can use them, wherever they are in the pool.
#
# Five requests wait, each with its prompt length and the number of tokens it will generate (a real
# server learns the second only when the model emits an end token). The pool has 10 blocks of 4, and
# the batch has room for 3 sequences. The pool is tight: A, C and D at their full lengths would need
# 11 blocks, but in this run the requests finish in time and the pool never runs dry (lesson 11
# handles the case where it does). Every step:
#
# 1. each running sequence decodes one token (`append_tokens`, which takes a block when the boundary
#    rule says so);
# 2. every sequence that has generated all its tokens is freed at once (`free_sequence`);
# 3. waiting requests join, in arrival order, while the batch has room and the pool has the blocks
#    for the next one's prompt (`allocate_for_sequence`).
#
# The K/V writes are left out; they do not change which blocks are taken.
#
# This admission rule is the simplest there is, and vLLM's: a request joins when its prompt's blocks
# are free, and nothing is kept back for the running sequences' growth. The package's one scheduler,
# `paged_kv.serving.scheduler.Scheduler`, which lesson 07's simulator and lesson 09's engine run,
# admits by it too, but orders the step as vLLM does: the running sequences get their slots first,
# then waiting requests join in the blocks left (each prefill samples a first token), then the model
# runs, and the finished are freed at the end. So a newcomer never takes a block that a running
# sequence needs in that step. This loop admits after the decode instead, so a newcomer can take a
# block the next decode needs (lessons 07 and 11 show what the pool running dry costs).
#
# **Predict, then run.** B (3 prompt tokens, 4 to generate) finishes first. When it does, which
# request takes its place, and does it get B's blocks?

# %%
requests = {"A": (6, 9), "B": (3, 4), "C": (9, 6), "D": (5, 7), "E": (2, 5)}  # prompt, tokens to generate
MAX_RUNNING = 3
pool = PagedKVCacheAllocator(num_blocks=10, block_size=BLOCK_SIZE, num_heads=1, head_dim=1, device=device)
waiting = deque(requests)
left_to_generate = {}
history = []  # per step: blocks held by each request, tokens held, slots reserved


def admit(events: list[str]) -> None:
    """Admit waiting requests in arrival order while the batch has room and the prompt's blocks are free."""
    while waiting and len(pool.seq_ids) < MAX_RUNNING:
        request = waiting[0]
        prompt, to_generate = requests[request]
        if blocks_for_tokens(prompt, BLOCK_SIZE) > pool.num_free_blocks:
            break
        waiting.popleft()
        table = pool.allocate_for_sequence(request, prompt)
        left_to_generate[request] = to_generate
        events.append(f"{request} joins with {table.block_ids}")


def record(step: int, events: list[str]) -> None:
    usage = pool.usage()
    history.append(
        (
            {seq: len(pool.get_block_mapping(seq)) for seq in pool.seq_ids},
            usage.allocated_tokens,
            usage.reserved_tokens,
        )
    )
    running = ", ".join(f"{seq}:{pool.sequence_length(seq)}" for seq in pool.seq_ids)
    line = f"{step:>4}  {running:<16} {usage.used_blocks:>4}/{usage.free_blocks:<4}  {'; '.join(events)}"
    print(line.rstrip())


print("step  running:tokens   used/free  events")
events = []
admit(events)
record(0, events)
step = 0
while pool.seq_ids:
    step += 1
    events = []
    for seq in pool.seq_ids:
        new_blocks = pool.append_tokens(seq, 1)
        left_to_generate[seq] -= 1
        if new_blocks:
            events.append(f"{seq} takes {new_blocks}")
    for seq in [s for s in pool.seq_ids if left_to_generate[s] == 0]:
        events.append(f"{seq} done, frees {pool.free_sequence(seq)}")
    admit(events)
    record(step, events)

# %% [markdown]
# B finishes at step 4 and frees blocks 2 and 6. D, next in line, joins in the same step and takes
# block 9, the one block that was already free, and block 2: the free list is a first-in, first-out
# queue, so block 9, at its front, goes first, and B's blocks, which joined at the back in the order B
# freed them, come next. At step 6, C frees four blocks and E joins with block 6, another of B's. The
# pool, nine blocks of ten in use at the peak, ends empty: every block came back.
#
# No request waited for a whole batch to finish. With static batches of three, D and E could start
# only once A, B and C were all done, after A's 9 steps:

# %%
static_batches = [["A", "B", "C"], ["D", "E"]]
static_steps = sum(max(requests[request][1] for request in batch) for batch in static_batches)
print("steps to serve all five: continuous", step, "| static batches of three", static_steps)

# %% [markdown]
# The picture shows the continuous run. Top: the blocks in use after each step, coloured by request; each
# request's share grows one block at a time and vanishes the step it finishes. Bottom: the tokens
# held against the slots reserved, the staircase of section 2 summed over the batch; the hatched gap
# stays below one block per running request.

# %%
names = list(requests)
colours = dict(zip(names, PALETTE, strict=False))  # the course's sequence colours, one per request
steps = range(len(history))
fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
base = [0] * len(history)
for name in names:
    heights = [blocks.get(name, 0) for blocks, _, _ in history]
    top.bar(steps, heights, bottom=base, width=0.85, color=colours[name], label=name)
    base = [b + h for b, h in zip(base, heights, strict=True)]
top.axhline(pool.num_blocks, color="#444444", ls="--", lw=1)
top.text(len(history) - 0.5, pool.num_blocks + 0.2, "pool: 10 blocks", ha="right", fontsize=9)
top.set_ylabel("blocks in use")
top.set_ylim(0, pool.num_blocks + 1.5)
top.legend(frameon=False, ncol=5, loc="upper left", fontsize=9)
tokens = [held for _, held, _ in history]
slots = [reserved for _, _, reserved in history]
plot_held_and_reserved(tokens, slots, ax=bottom, where="mid")
bottom.legend(frameon=False, loc="upper right", fontsize=9)
for ax in (top, bottom):
    ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Explore: decode in the playground
#
# A live allocator of 16 blocks of 4 slots. Add a few sequences with different prompt lengths, then
# press **decode step** again and again: every sequence grows by one token, and a sequence takes a
# block only on the step after its blocks fill up. Finish one to free its blocks at once, add a new
# one into them, and decode until the pool runs out: the step is refused as a whole, with the number
# of blocks it needed, and nothing changes (lesson 11 shows what a real engine does then).

# %%
AllocatorPlayground(num_blocks=16, block_size=4)

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. On-demand allocation is one call of the scheduler per request and step,
# `KVCacheManager.allocate_slots`, for however many new tokens the step computes:
#
# * `vllm/v1/core/kv_cache_manager.py`: `allocate_slots` takes a request and `num_new_tokens` (1 for a
#   decode step), works out `num_tokens_need_slot`, the tokens computed plus the new ones, and returns
#   `None` when the blocks they need, plus `watermark_blocks` (0 by default) for a request still
#   waiting, are more than the pool has free; otherwise it takes them and returns the new blocks.
# * `vllm/v1/core/single_type_kv_cache_manager.py`: `get_num_blocks_to_allocate` is the boundary rule:
#   `num_required_blocks = cdiv(num_tokens, self.block_size)`, less the `num_req_blocks` the request
#   holds, which is 0 until its blocks are full.
# * `vllm/v1/core/single_type_kv_cache_manager.py`: `allocate_new_blocks` takes that many blocks from
#   the pool (lesson 02) and appends them to the request's list in `req_to_blocks`;
#   `FullAttentionManager` is the `SingleTypeKVCacheManager` of ordinary attention layers.
# * `vllm/v1/core/kv_cache_coordinator.py`: `KVCacheCoordinator` asks every KV cache group's manager
#   (`get_num_blocks_to_allocate`, `allocate_new_blocks`), so that a step's allocation is checked for
#   all groups before any block is taken.
# * `vllm/v1/core/sched/scheduler.py`: `Scheduler.schedule` asks the manager for each running
#   request's slots, in list order, before the model runs; when there are too few, it preempts the
#   newest running request (`_preempt_request`, lesson 11). Then it admits waiting requests into the
#   blocks left. `Scheduler.update_from_output` appends the sampled tokens and frees a finished
#   request's blocks at once (`_free_request`), for the next step to admit into: continuous batching.
#
# What the course leaves out or does differently: the course appends one token per decode step
# (`append_tokens`, `append_block_to_sequence`); vLLM's one call covers any number of new tokens: a
# prompt chunk, a decode token, the `num_lookahead_tokens` of speculative decoding. Its scheduler
# decides how many by a token budget per step (lesson 10).

# %% [markdown]
# ## Recap
#
# * Prefill takes `ceil(prompt / block_size)` blocks: 3 blocks of 4 for a 10-token prompt.
# * Decode adds one token per step. A sequence holding `n` tokens in `b` blocks needs a new block
#   before token `n + 1` exactly when `n == b × block_size`; with no spare block, when
#   `n % block_size == 0`, including `n = 0`. From 10 tokens, that is at 12 and at 16.
# * The check `(n + 1) % block_size == 0` is off by one: it takes a block while one slot is still
#   free (n = 3, 7 with blocks of 4) and never when the blocks are full (n = 0, 4, 8), where a token
#   then has no slot. 48 tokens in blocks of 16 take a 4th block for the 49th.
# * `append_tokens` takes missing blocks and counts tokens; `append_block_to_sequence` only takes a
#   block: what a scheduler does for each running sequence before the model runs (vLLM's
#   `allocate_slots`). The model never allocates.
# * Continuous batching frees a finished request at once and admits a waiting one in the same step:
#   in our run D and E reused B's blocks, all five were served in 11 steps (16 with static batches
#   of three), and the pool of 10 peaked at 9 blocks in use.
#
# **Next, lesson 05:** attention that reads K and V through the block tables, and gives the same
# result as attention over contiguous tensors. The exercise for this lesson,
# `exercises/04_decode_allocation.ipynb`, has you write the boundary rule, `append_block_to_sequence`
# (one block from the free list onto a table), a whole decode step for a batch, and the free-and-admit
# step of the scheduler.

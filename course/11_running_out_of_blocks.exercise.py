# %% [markdown]
# # Exercise 11 · Running out of blocks
#
# In this exercise you write the decisions of lesson 11 that keep a paged engine going when its
# blocks run out: the admission rule with a watermark, the choice of which sequences to preempt
# (and where they wait afterwards), the swap of a sequence's K/V to host memory and back, and the
# victims of vLLM's priority policy. Each
# task says what to build and how it is checked; the cell after it runs the check and prints a
# tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The package makes the same decisions inside its scheduler
# (`paged_kv.serving.scheduler`, over `paged_kv.core.kv_cache_manager.KVCacheManager`) and swaps with
# `paged_kv.kv.swap`; try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/11_running_out_of_blocks.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
import math
from collections import deque

import torch

import paged_kv
from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.checks import check

device = paged_kv.default_device()

# %% [markdown]
# ## Task 1 · Admission with a watermark
#
# vLLM's scheduler, and the course's engine, admit the request at the front of the queue when the
# blocks of its whole prompt are free. Nothing is kept back for the running sequences' growth: when
# a running sequence's next token later finds no free block, the newest running sequence is
# preempted. The watermark adds a reserve: a fraction `watermark` of *all* the pool's `num_blocks`
# blocks, rounded **up** to whole blocks, `ceil(watermark * num_blocks)`, that admission leaves free
# for the growth of the sequences already running, and so **only while another sequence runs**.
# Alone, a request needs no reserve; that is also why a request resumed by recompute, whose prompt
# now holds its output too, always comes back.
#
# Write `admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark)`:
# whether a request whose prompt takes `prompt_blocks` blocks is admitted next to `num_running`
# running sequences (not counting itself), when `num_free_blocks` of the pool's `num_blocks` blocks
# are free. Return a `bool`.
#
# **Checked:** a watermark of 0 (3 free blocks admit a 3-block prompt next to 2 running sequences,
# 2 do not); a 10 % watermark of 40 blocks (4 kept free); 1 % of 50 blocks, half a block, which
# keeps 1 block free, not 0; 10 % of 100 blocks with only 13 or 14 free (the watermark is of all
# the blocks, not of the free ones); half of 16 blocks beside one running sequence and beside none
# (then nothing is kept); a 10-block prompt alone in 10 free blocks of 16 under a 50 % watermark;
# that the result is a `bool`; and agreement with the engine's own memory
# (`paged_kv.core.kv_cache_manager.KVCacheManager`) on a grid of cases one block either side of the rule.


# %%
def admit_with_watermark(
    num_free_blocks: int, prompt_blocks: int, num_running: int, num_blocks: int, watermark: float
) -> bool:
    """Whether the prompt's blocks are free, and the watermark's blocks besides while another sequence runs."""
    ### BEGIN SOLUTION: besides the prompt's blocks, keep ceil(watermark * num_blocks) blocks free (math.ceil rounds up), but only when num_running > 0
    keep_free = math.ceil(watermark * num_blocks) if num_running else 0
    return prompt_blocks + keep_free <= num_free_blocks
    ### END SOLUTION


# %%
check("11.admit_with_watermark", admit_with_watermark)

# %% [markdown]
# ## Task 2 · Who is preempted, and where they wait
#
# Each step, the scheduler gives every running sequence its next token, oldest first, and takes a
# block for each one whose blocks are full. When a sequence finds no free block, it preempts the
# **newest** running sequence (vLLM: `self.running.pop()`) and tries again. Over the whole step
# that is one rule: preempt from the newest down until the others' new blocks fit. Each victim helps
# twice: its blocks become free, and it no longer decodes in this step, so its own need goes too.
# The oldest sequence is never preempted: with nothing running, nothing would ever finish (the
# engine refuses a request that cannot run alone in the whole pool, so the oldest alone fits).
#
# Write `choose_victims(running, num_free_blocks)`. `running` lists the running sequences in
# admission order, oldest first, each as a tuple `(seq_id, blocks, needs_block)`: the blocks it
# holds (all of which preempting it frees) and whether its next token needs a new block (`True` or
# `False`). Return the list of the victims' ids, newest first (`[]` when the step fits already).
# Leave `running` as it is. When even the oldest sequence alone does not fit, raise
# `OutOfBlocksError(needed, free)`.
#
# Then write `requeue(waiting, victims)`: put the victims, given newest first as `choose_victims`
# returns them, back at the **front** of `waiting`, a `deque` of ids, in place. They were admitted
# before every request still waiting, so they come first, and among them the oldest victim first.
#
# **Checked:** steps that fit (nobody preempted); one victim whose blocks cover the others; two
# victims; a victim that needs no block but frees two; a victim that holds no block; the list
# `running` after the call; two cases where the oldest alone does not fit (`OutOfBlocksError`);
# agreement with the package's answer on 300 random cases; and `requeue` with two
# victims before two waiting requests, into an empty queue, with no victims, and with three victims.


# %%
def choose_victims(running: list[tuple], num_free_blocks: int) -> list:
    """The ids of the sequences to preempt, newest first, so that the others' next tokens fit."""
    ### BEGIN SOLUTION: count the blocks needed; while more are needed than are free, take the newest sequence not yet taken (never the oldest: raise OutOfBlocksError), add its blocks to the free ones and take its need away
    needed = sum(needs for _, _, needs in running)
    free = num_free_blocks
    victims = []
    while needed > free:
        if len(victims) == len(running) - 1:
            raise OutOfBlocksError(needed, free, "the oldest running sequence alone")
        seq_id, blocks, needs = running[-1 - len(victims)]
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims
    ### END SOLUTION


def requeue(waiting: deque, victims: list) -> None:
    """Put the victims (newest first) at the front of waiting, the oldest victim first."""
    ### BEGIN SOLUTION: appendleft each victim in the order given: the newest goes in first and ends up behind the older ones
    for seq_id in victims:
        waiting.appendleft(seq_id)
    ### END SOLUTION


# %%
check("11.choose_victims", choose_victims, requeue)

# %% [markdown]
# ## Task 3 · Swapping out and back in
#
# Preemption by swap keeps a victim's work: its K and V go to host memory, its blocks go back to the
# pool, and when blocks are free again it gets fresh ones, whichever they are, and its K and V are
# copied into them. Write, for one `PagedKVCacheAllocator`:
#
# * `swap_out(allocator, seq_id)`: return the sequence's K and V as a tuple `(k, v)` of **CPU**
#   tensors of shape `(num_tokens, num_heads, head_dim)` (`read_kv` gathers them from the blocks;
#   `.cpu()` copies them to the host when the pool is on a GPU), then free the sequence. An unknown
#   `seq_id` raises `KeyError` and frees nothing.
# * `swap_in(allocator, seq_id, saved)`: give `seq_id` blocks for every saved token and write the
#   saved K and V back, on the allocator's device. All or nothing: when too few blocks are free,
#   raise `OutOfBlocksError` and change nothing; a `seq_id` that is allocated already is a
#   `ValueError`, and changes nothing either. `allocate_for_sequence` raises both for you, before
#   anything is written.
#
# **Checked**, on pools of blocks of 4 on `paged_kv.default_device()` full of stale random K/V:
# sequences of 6, 8 and 1 tokens swapped out next to another sequence (the saved tensors' shapes,
# device, values, and the blocks freed), another sequence writing over every free block while they
# are out (the saved K/V must not change), then swapped back in, into other physical blocks (the
# length, the K/V read back, the free blocks); a swap-in with too few free blocks; a swap-in of a
# sequence that is allocated; a swap-out of an unknown sequence.


# %%
def swap_out(allocator: PagedKVCacheAllocator, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K and V copied to host memory, as (k, v); then its blocks are freed."""
    ### BEGIN SOLUTION: read_kv, copy both tensors to the CPU (.cpu()), then free_sequence
    k, v = allocator.read_kv(seq_id)
    saved = (k.cpu(), v.cpu())
    allocator.free_sequence(seq_id)
    return saved
    ### END SOLUTION


def swap_in(allocator: PagedKVCacheAllocator, seq_id, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Fresh blocks for the saved tokens, and the saved K and V written back; all or nothing."""
    ### BEGIN SOLUTION: allocate_for_sequence(seq_id, k.shape[0]) (it raises before anything changes), then write_kv with k and v moved to allocator.device
    k, v = saved
    allocator.allocate_for_sequence(seq_id, k.shape[0])
    allocator.write_kv(seq_id, k.to(allocator.device), v.to(allocator.device))
    ### END SOLUTION


# %%
check("11.swap_round_trip", swap_out, swap_in)

# %% [markdown]
# ## Task 4 · Whose blocks under priority
#
# Under `--scheduling-policy priority` (lesson 11, section 5) a victim is no longer the newest: it
# is the running sequence with the **largest** `(priority, arrival)`, wherever it stands in the
# running list (a lower priority is served first), then the next largest, until the others' next
# tokens fit; each victim's blocks become free and its own need goes, as in Task 2. Under priority
# the running list is in admission order, which is not arrival order: an urgent request that
# arrived late is admitted early.
#
# Write `priority_victims(running, num_free_blocks)`. Each entry of `running` is a tuple
# `(seq_id, blocks, needs_block, priority, arrival)`: Task 2's three, an int `priority` and a
# distinct `arrival` time. Return the victims' ids in the order they are preempted (`[]` when the
# step fits). When only one sequence is left and it still does not fit, raise
# `OutOfBlocksError(needed, free)`.
#
# **Checked:** a step that fits; a victim in the middle of the list; equal priorities told apart by
# arrival, in an order that is not the list's; a victim admitted first but arrived last; two
# victims; a case where the last one left does not fit (`OutOfBlocksError`); agreement with the
# package's answer on 300 random cases (the priority scheduler preempts exactly these: the
# package's tests check it step by step).


# %%
def priority_victims(running: list[tuple], num_free_blocks: int) -> list:
    """The ids of the sequences to preempt, the largest (priority, arrival) first, until the others fit."""
    ### BEGIN SOLUTION: sort the entries by (priority, arrival), largest first; take them in that order while more blocks are needed than are free, as in choose_victims (never the last one left: raise OutOfBlocksError)
    order = sorted(running, key=lambda entry: (entry[3], entry[4]), reverse=True)
    needed = sum(entry[2] for entry in running)
    free = num_free_blocks
    victims = []
    while needed > free:
        if len(victims) == len(running) - 1:
            raise OutOfBlocksError(needed, free, "the last running sequence alone")
        seq_id, blocks, needs, _, _ = order[len(victims)]
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims
    ### END SOLUTION


# %%
check("11.priority_victims", priority_victims)

# %% [markdown]
# ## Putting it together
#
# A bookkeeping engine built from your three functions, in the order of the course's scheduler.
# Eight sequences arrive at once, each with a prompt and a final length. Every step, your
# `choose_victims` makes room for the running sequences' next tokens, the victims are swapped out
# and requeued, and every running sequence gains one token; then, only if nobody was preempted,
# swapped-out sequences come back while their K/V and next token fit, and, only if none is left
# out, waiting requests are admitted under your watermark rule (both decode from the next step).
# The K and V of token `p` of sequence `s` are the number `100 * s + p` (and its negative),
# so when a sequence finishes, its K/V must read back as exactly those numbers, however many times
# it went to host memory and came back in other blocks. Try other watermarks, or fewer blocks.


# %%
def kv_of(seq: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of tokens first .. first + count - 1 of sequence seq: 100 * seq + position, and minus that."""
    k = torch.arange(100 * seq + first, 100 * seq + first + count, dtype=torch.float32, device=device)
    return k.view(-1, 1, 1), -k.view(-1, 1, 1)


def serve(requests: list[tuple[int, int, int]], num_blocks: int, watermark: float) -> None:
    """Run (seq, prompt_tokens, final_tokens) requests to the end; print what happened."""
    allocator = PagedKVCacheAllocator(num_blocks, 4, 1, 1, device=device)
    final = {seq: total for seq, _, total in requests}
    waiting, swapped, running, saved = deque(requests), deque(), [], {}
    steps = preemptions = intact = 0
    while waiting or swapped or running:
        candidates = [(s, len(allocator.get_block_mapping(s)), allocator.needs_new_block(s)) for s in running]
        victims = choose_victims(candidates, allocator.num_free_blocks)
        for seq in victims:
            saved[seq] = swap_out(allocator, seq)
            running.remove(seq)
        requeue(swapped, victims)
        preemptions += len(victims)
        for seq in running:
            length = allocator.sequence_length(seq)
            allocator.append_tokens(seq, 1)
            allocator.write_kv(seq, *kv_of(seq, length, 1), start_position=length)
        while (
            not victims
            and swapped
            and admit_with_watermark(  # its K/V and next token, no watermark
                allocator.num_free_blocks,
                blocks_for_tokens(len(saved[swapped[0]][0]) + 1, 4),
                len(running),
                num_blocks,
                0,
            )
        ):
            seq = swapped.popleft()
            swap_in(allocator, seq, saved.pop(seq))
            running.append(seq)
        while not victims and not swapped and waiting:
            seq, prompt, _ = waiting[0]
            if not admit_with_watermark(
                allocator.num_free_blocks, blocks_for_tokens(prompt, 4), len(running), num_blocks, watermark
            ):
                break
            waiting.popleft()
            allocator.allocate_for_sequence(seq, prompt)
            allocator.write_kv(seq, *kv_of(seq, 0, prompt))
            running.append(seq)
        for seq in [s for s in running if allocator.sequence_length(s) == final[s]]:
            k, v = allocator.read_kv(seq)
            intact += torch.equal(k, kv_of(seq, 0, final[seq])[0]) and torch.equal(
                v, kv_of(seq, 0, final[seq])[1]
            )
            allocator.free_sequence(seq)
            running.remove(seq)
        steps += 1
    print(
        f"{num_blocks} blocks, watermark {watermark}: {steps} steps, {preemptions} preemptions, "
        f"{intact} of {len(requests)} sequences with intact K/V, {allocator.num_free_blocks} blocks free at the end"
    )


burst = [(seq, 3 + seq % 4, 24 + 2 * seq) for seq in range(8)]
serve(burst, num_blocks=12, watermark=0.0)
serve(burst, num_blocks=12, watermark=0.25)

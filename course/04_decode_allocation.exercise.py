# %% [markdown]
# # Exercise 04 · On-demand decode allocation
#
# In this exercise you write the decode-time side of a paged cache's scheduler: the block boundary
# rule, one decode step for a whole batch that takes the blocks it needs or none at all, and the step
# that frees finished requests at once and admits waiting ones. At the end, the three run the
# continuous-batching loop of lesson 04. Each task says what to build and how it is checked; the
# cell after it runs the check and prints a tick, or tells you which call gave which wrong answer.
#
# Tasks 2 and 3 work on the package's `PagedKVCacheAllocator`, through the calls the lesson showed:
# `sequence_length`, `get_block_mapping`, `append_block_to_sequence`, `append_tokens`,
# `free_sequence`, `allocate_for_sequence`, `num_free_blocks`, `block_size` and `seq_ids`. The cache
# has its own `needs_new_block`; Task 1 has you write the rule yourself, so use yours.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the repository:
# `.venv/bin/python -m paged_kv.grade exercises/04_decode_allocation.ipynb` prints each task's points and what
# went wrong where a task lost them.

# %%
from collections import deque
from collections.abc import Hashable

import paged_kv
from paged_kv import OutOfBlocksError, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.checks import check

device = paged_kv.default_device()

# %% [markdown]
# ## Task 1 · The boundary rule
#
# Write `needs_new_block(num_tokens, num_blocks_held, block_size)`: whether a sequence that holds
# `num_tokens` tokens in `num_blocks_held` blocks needs a new block before its next token. That is
# exactly when its blocks are full, `num_tokens == num_blocks_held * block_size`, which covers an
# empty sequence (0 tokens, 0 blocks: its first token needs a block) and a block reserved ahead (4
# tokens in 2 blocks of 4: the next token fits). Do not use `(num_tokens + 1) % block_size == 0`:
# lesson 04 shows it is off by one.
#
# **Checked:** 1, 4 and 3 tokens in one block of 4, an empty sequence, 5 and 8 tokens in 2 blocks,
# 47 and 48 tokens in 3 blocks of 16, blocks of 1, a spare block reserved ahead (4 tokens in 2 blocks,
# 0 tokens in 1), and that the result is a `bool`.


# %%
def needs_new_block(num_tokens: int, num_blocks_held: int, block_size: int) -> bool:
    """Whether the next token needs a new block: the blocks held are full."""
    ### BEGIN SOLUTION: compare num_tokens with the capacity of the blocks held
    return num_tokens == num_blocks_held * block_size
    ### END SOLUTION


# %%
check("04.needs_new_block", needs_new_block)

# %% [markdown]
# ## Task 2 · One decode step for a batch, all or nothing
#
# Write `decode_step(cache, seq_ids)`: the running sequences `seq_ids` (distinct ids the cache holds)
# each gain one token. It works in two passes, the way a scheduler does:
#
# 1. **Look.** For every sequence, decide with your `needs_new_block` whether its next token needs a
#    block (`cache.sequence_length(seq_id)` tokens in `len(cache.get_block_mapping(seq_id))` blocks
#    of `cache.block_size`). If the batch needs more blocks than `cache.num_free_blocks`, raise
#    `OutOfBlocksError(needed, free)` with the two counts, and change nothing. An unknown id makes
#    the cache raise `UnknownSequenceError` (a `KeyError`) during this pass, so it too changes
#    nothing.
# 2. **Change.** In the order of `seq_ids`: when the sequence needs a block, take one with
#    `cache.append_block_to_sequence(seq_id)`; then record its token with
#    `cache.append_tokens(seq_id, 1)`, which finds a free slot and takes no block.
#
# Return a dict `{seq_id: the id of the block taken, or None}` with every sequence of the batch.
#
# **Checked:** a sequence with a free slot (`None`), one with a full block, an empty one, one with a
# spare block reserved ahead, a batch of the three, blocks of 1; the block tables and free list
# afterwards; eight steps of two sequences; an empty batch (`{}`); a batch of three that needs 3
# blocks when 1 is free (`OutOfBlocksError` with `needed == 3`, `free == 1`, the cache unchanged);
# and an unknown id (a `KeyError`, the cache unchanged).


# %%
def decode_step(cache: PagedKVCacheAllocator, seq_ids: list[Hashable]) -> dict[Hashable, int | None]:
    """Add one token to every sequence of the batch, taking the blocks they need, or none at all."""
    ### BEGIN SOLUTION: pass 1: who needs a block, OutOfBlocksError if too few are free; pass 2: append_block_to_sequence where needed, then append_tokens(seq_id, 1)
    needs = {
        seq_id: needs_new_block(
            cache.sequence_length(seq_id), len(cache.get_block_mapping(seq_id)), cache.block_size
        )
        for seq_id in seq_ids
    }
    needed = sum(needs.values())
    if needed > cache.num_free_blocks:
        raise OutOfBlocksError(needed, cache.num_free_blocks)
    taken = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)
    return taken
    ### END SOLUTION


# %%
check("04.decode_step", decode_step)

# %% [markdown]
# ## Task 3 · Free at once, admit at once
#
# Write `finish_and_admit(cache, finished, waiting, max_running)`, the end of every step in a
# continuous-batching server:
#
# 1. free every sequence of the list `finished` at once, with `cache.free_sequence(seq_id)`;
# 2. then admit waiting requests in arrival order. `waiting` is a `deque` of `(seq_id, prompt_tokens)`
#    pairs, oldest first. While the cache holds fewer than `max_running` sequences
#    (`len(cache.seq_ids)`) and the first request's prompt fits in the free blocks
#    (`blocks_for_tokens(prompt_tokens, cache.block_size) <= cache.num_free_blocks`), pop it from the
#    left and give it its blocks with `cache.allocate_for_sequence(seq_id, prompt_tokens)`. Stop at
#    the first request that does not fit: none skips ahead of an older one.
#
# Return the ids admitted, in order.
#
# **Checked:** in a pool of 6 blocks of 4 where `a` holds blocks `[0, 1]`, `b` holds `[2, 3, 4]` and
# block 5 is free: finishing `a` with nobody waiting; finishing `a` with two requests waiting (both
# join); a request joining with nothing finished; a request too big for the free blocks, with a small
# one behind it (neither joins); a 13-token prompt (4 blocks, not 3); finishing both; and a limit of
# 3 running sequences. Each time the result, the block tables and free list, and what is left in
# `waiting`.


# %%
def finish_and_admit(
    cache: PagedKVCacheAllocator,
    finished: list[Hashable],
    waiting: deque[tuple[Hashable, int]],
    max_running: int,
) -> list[Hashable]:
    """Free the finished sequences, then admit waiting requests in order while they fit."""
    ### BEGIN SOLUTION: free_sequence each finished id; then while waiting and the head fits (count and blocks), popleft and allocate_for_sequence
    for seq_id in finished:
        cache.free_sequence(seq_id)
    admitted = []
    while waiting and len(cache.seq_ids) < max_running:
        seq_id, prompt_tokens = waiting[0]
        if blocks_for_tokens(prompt_tokens, cache.block_size) > cache.num_free_blocks:
            break
        waiting.popleft()
        cache.allocate_for_sequence(seq_id, prompt_tokens)
        admitted.append(seq_id)
    return admitted
    ### END SOLUTION


# %%
check("04.finish_and_admit", finish_and_admit)

# %% [markdown]
# ## Putting it together
#
# With the three tasks done, this is the continuous-batching loop of lesson 04 built from your
# functions: five requests, a pool of 10 blocks of 4, at most 3 running. Compare its log with the
# lesson's. Then try `max_running=4`: at step 4, two sequences need a block and none is free, and
# your `decode_step` refuses the step without changing anything. What an engine does then is the
# subject of lesson 08.

# %%
requests = {"A": (6, 9), "B": (3, 4), "C": (9, 6), "D": (5, 7), "E": (2, 5)}  # prompt, tokens to generate
cache = PagedKVCacheAllocator(num_blocks=10, block_size=4, num_heads=1, head_dim=1, device=device)
waiting = deque((seq_id, prompt) for seq_id, (prompt, _) in requests.items())
left_to_generate = {seq_id: to_generate for seq_id, (_, to_generate) in requests.items()}

print("step 0: joined", finish_and_admit(cache, [], waiting, max_running=3))
step = 0
while cache.seq_ids:
    step += 1
    taken = decode_step(cache, list(cache.seq_ids))
    for seq_id in taken:
        left_to_generate[seq_id] -= 1
    done = [seq_id for seq_id in cache.seq_ids if left_to_generate[seq_id] == 0]
    joined = finish_and_admit(cache, done, waiting, max_running=3)
    new_blocks = {seq_id: block for seq_id, block in taken.items() if block is not None}
    usage = cache.usage()
    print(
        f"step {step}: new blocks {new_blocks}, done {done}, joined {joined}, "
        f"used/free {usage.used_blocks}/{usage.free_blocks}"
    )

# %% [markdown]
# # Exercise 04 · On-demand decode allocation
#
# In this exercise you write the decode-time side of a paged cache's scheduler: the block boundary
# rule, the allocator's `append_block_to_sequence` that takes a block on demand, one decode step for
# a whole batch that takes the blocks it needs or none at all, and the step that frees finished
# requests at once and admits waiting ones. At the end, they run the continuous-batching loop of
# lesson 04. Each task says what to build and how it is checked; the cell after it runs the check
# and prints a tick, or tells you which call gave which wrong answer.
#
# Tasks 3 and 4 work on the package's `PagedKVCacheAllocator`, through the calls the lesson showed:
# `sequence_length`, `get_block_mapping`, `append_block_to_sequence`, `append_tokens`,
# `free_sequence`, `allocate_for_sequence`, `num_free_blocks`, `block_size` and `seq_ids`. The cache
# has its own `needs_new_block` and `append_block_to_sequence`; Tasks 1 and 2 have you write them
# yourself, so use your rule.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/04_decode_allocation.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from collections import deque
from collections.abc import Hashable

import paged_kv
from paged_kv import Block, BlockTable, OutOfBlocksError, PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.checks import check
from paged_kv.checks.lesson04 import watched_step

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
# ## Task 2 · A block on demand
#
# When a sequence's blocks are full, the allocator hands it one more: `append_block_to_sequence`.
# Here it is a method of `BlockManager`, the allocator as the seed lesson writes it, with its state
# in plain sight: `blocks`, a `Block` handle per physical block with its `ref_count`; `free_blocks`,
# the free list, a `deque` of ids; and `sequence_block_tables`, a dict from sequence id to
# `BlockTable`. `__init__` and `allocate_for_sequence` are written.
#
# Write `append_block_to_sequence(seq_id)`: look the sequence's table up (an unknown id raises
# `KeyError`); check the free list, and when it is empty raise `OutOfBlocksError(needed=1, free=0)`;
# then take the block at the **head** of the free list, set its ref count to 1, append it to the
# table and return its id. It adds room, not tokens: the table's `num_tokens` stays as it was. A
# call that raises changes nothing.
#
# **Checked:** in a pool of 4 blocks of 4, `a` holds `[0]` and `b` holds `[1]`; appending to `a`
# gives block 2 and to `b` block 3, each off the free list, with ref count 1, at the end of its
# table; a third append finds the free list empty (`OutOfBlocksError` with `needed == 1` and
# `free == 0`, nothing changed); and an unknown id in a fresh pool is a `KeyError` that takes no
# block.


# %%
class BlockManager:
    """The seed lesson's allocator: Block handles with ref counts, a FIFO free list and block tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.sequence_block_tables: dict[Hashable, BlockTable] = {}

    def allocate_for_sequence(self, seq_id: Hashable, num_prompt_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its prompt and return their ids, all or nothing."""
        if seq_id in self.sequence_block_tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        if needed > len(self.free_blocks):
            raise OutOfBlocksError(needed=needed, free=len(self.free_blocks))
        block_ids = [self.free_blocks.popleft() for _ in range(needed)]
        for block_id in block_ids:
            self.blocks[block_id].ref_count = 1
        self.sequence_block_tables[seq_id] = BlockTable(block_ids, num_prompt_tokens)
        return list(block_ids)

    def append_block_to_sequence(self, seq_id: Hashable) -> int:
        """Take the block at the head of the free list for the sequence and return its id.

        Raises:
            KeyError: seq_id is not allocated.
            OutOfBlocksError: no block is free (needed=1, free=0).
        """
        ### BEGIN SOLUTION: look the table up (KeyError), raise OutOfBlocksError(needed=1, free=0) on an empty free list, then popleft(), ref count 1, table.append_block
        table = self.sequence_block_tables[seq_id]
        if not self.free_blocks:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self.free_blocks.popleft()
        self.blocks[block_id].ref_count = 1
        table.append_block(block_id)
        return block_id
        ### END SOLUTION


# %%
check("04.append_block", BlockManager)

# %% [markdown]
# ## Task 3 · One decode step for a batch, all or nothing
#
# Write `decode_step(cache, seq_ids)`: the running sequences `seq_ids` (distinct ids the cache holds)
# each gain one token. It works in two passes, so that a step the pool cannot serve changes nothing
# (vLLM's scheduler instead asks for each request's slot in turn and preempts when one finds no
# block, lesson 11):
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
# ## Task 4 · Free at once, admit at once
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
# With the four tasks done, this is the continuous-batching loop of lesson 04 built from your
# functions: five requests, a pool of 10 blocks of 4, at most 3 running. Compare its log with the
# lesson's. Then try `max_running=4`: at step 4, two sequences need a block and none is free, and
# your `decode_step` refuses the step without changing anything. What an engine does then is the
# subject of lesson 11.
#
# `watched_step` runs your `decode_step` and looks at what it did. A rule that is off by one would
# not stop the loop: the cache's `append_tokens` takes a missing block itself, and the log would show
# no new block while the usage climbs. So when a sequence takes a block it did not need, or none
# where its blocks were full, the run stops at that step, naming the sequence, its token, and what
# your `needs_new_block` returned.

# %%
requests = {"A": (6, 9), "B": (3, 4), "C": (9, 6), "D": (5, 7), "E": (2, 5)}  # prompt, tokens to generate
cache = PagedKVCacheAllocator(num_blocks=10, block_size=4, num_heads=1, head_dim=1, device=device)
waiting = deque((seq_id, prompt) for seq_id, (prompt, _) in requests.items())
left_to_generate = {seq_id: to_generate for seq_id, (_, to_generate) in requests.items()}

print("step 0: joined", finish_and_admit(cache, [], waiting, max_running=3))
step = 0
while cache.seq_ids:
    step += 1
    taken = watched_step(step, decode_step, cache, list(cache.seq_ids), needs_new_block)
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

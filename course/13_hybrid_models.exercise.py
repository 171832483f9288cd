# %% [markdown]
# # Exercise 13 · Hybrid models
#
# In this exercise you write the three rules of lesson 13 that let a hybrid model's sliding-window
# layers keep only their window: which tokens a window skips, which blocks it then frees (the null
# block in their place), and how long a prefix-cache hit every KV-cache group agrees on is. Each task
# says what to build and how it is checked; the cell after it runs the check and prints a tick, or
# tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The package has the same rules in `paged_kv.core.kv_cache_groups`
# (`SlidingWindowSpec`), `paged_kv.core.single_type_kv_cache_manager` (`SlidingWindowManager`) and
# `paged_kv.core.kv_cache_coordinator` (`KVCacheCoordinator`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/13_hybrid_models.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · The tokens a window skips
#
# A sliding-window layer of window `W` lets the token at position `p` attend to the `W` positions
# `p - W + 1 .. p`, itself included. When `num_computed_tokens` tokens are in the cache, the next
# token to compute sits at position `num_computed_tokens`; it, and every later token, reads nothing
# before position `num_computed_tokens - W + 1`. Those leading tokens are **skipped**: their K/V will
# never be read again.
#
# Write `num_skipped_tokens(num_computed_tokens, sliding_window)`: how many leading tokens are
# skipped. Return an `int`; it is never negative.
#
# **Checked:** a window of 4 with 7 computed tokens (the next token reads positions 4 to 7, so 4
# tokens are skipped), then 8, 3, 4, 0 and 2 computed tokens; a window of one token; Gemma 3's
# window of 1,024 at 1,023, 1,024 and 32,768 computed tokens; that the result is an `int`; and
# agreement with the package's `SlidingWindowSpec(...).num_skipped_tokens` on 496 cases.


# %%
def num_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """The leading tokens that neither the next token, at position num_computed_tokens, nor any later one reads."""
    ### BEGIN SOLUTION: the next token reads num_computed_tokens - sliding_window + 1 .. num_computed_tokens; count what comes before, never below 0
    return max(0, num_computed_tokens - sliding_window + 1)
    ### END SOLUTION


# %%
check("13.num_skipped_tokens", num_skipped_tokens)

# %% [markdown]
# ## Task 2 · The blocks a window frees
#
# A sliding-window group's block table gives back every block that lies **wholly** before the window:
# the first `num_skipped_tokens(...) // block_size` entries (a block that still holds one position of
# the window stays). Each such block goes back to the pool, and the **null block** takes its entry, so
# the table keeps its length and every position keeps its slot. The walk is vLLM's: from the last
# skipped entry down to the first, stopping at the first entry that is null already (an earlier call
# gave back that block and all those before it). The skipped entries may be more than the table
# holds; then every entry is skipped.
#
# Write
# `remove_skipped_blocks(block_ids, num_computed_tokens, sliding_window, block_size, null_block=0)`:
# return a tuple `(new_block_ids, freed)`, the new table as a new list (leave `block_ids` as it
# was) and the freed block ids as a list, in the order you freed them.
#
# **Checked:** nothing computed; a window of 4 in blocks of 4 at 6 computed tokens (the next token
# reads 3 to 6, so block 0 still holds position 3) and at 7; three blocks freed at once, listed last
# first; a table whose first entries are null already; a table with no new block to free; more
# skipped blocks than entries; a pool whose null block is 99; the calls of vLLM's own test, one after
# another on the table each returns (11 blocks of 2, window 4, at 0, 4, 5, 6, 7 and 11 computed
# tokens); that `block_ids` is unchanged; and agreement with the package's
# `SlidingWindowManager.remove_skipped_blocks` on 400 random tables.


# %%
def remove_skipped_blocks(
    block_ids: list[int], num_computed_tokens: int, sliding_window: int, block_size: int, null_block: int = 0
) -> tuple[list[int], list[int]]:
    """The table with its blocks wholly before the window replaced by null_block, and those blocks, last first."""
    ### BEGIN SOLUTION: copy the table; count = min(num_skipped_tokens(...) // block_size, len(table)); walk i from count - 1 down to 0, stop at a null entry, else list table[i] as freed and put null_block there
    table = list(block_ids)
    count = min(num_skipped_tokens(num_computed_tokens, sliding_window) // block_size, len(table))
    freed = []
    for i in range(count - 1, -1, -1):
        if table[i] == null_block:
            break
        freed.append(table[i])
        table[i] = null_block
    return table, freed
    ### END SOLUTION


# %%
check("13.remove_skipped_blocks", remove_skipped_blocks)

# %% [markdown]
# ## Task 3 · The hit every group agrees on
#
# With prefix caching, a new prompt reuses the blocks of its longest cached prefix. A hybrid model's
# groups cached their own blocks, and each group needs different ones:
#
# * a **full-attention** group needs every block of the prefix, from block 0;
# * a **sliding-window** group needs only the blocks that the window of the first token to compute
#   reads: a hit of `n` blocks must end with `need = ceil((W - 1) / block_size)` cached blocks,
#   blocks `n - need .. n - 1` (the blocks before those may be gone). A run of fewer cached blocks
#   that starts at block 0 is a hit too, since then the window reaches back to the first token.
#
# The request's hit is the longest prefix that every group hits. Start from the most the prompt
# allows, `(num_tokens - 1) // block_size` blocks (its last token is always computed, to give the
# next token), and ask each group in turn for its longest hit of at most that length, which becomes
# the new length. A shorter length moves a sliding window's blocks, so when any group shortened it,
# ask every group again; stop when no group shortens it (a **fixed point**).
#
# Write `hybrid_hit(cached, windows, block_size, num_tokens)`. `cached[g][i]` says whether group
# `g` still has the prompt's full block `i` cached (each list has `num_tokens // block_size`
# entries); `windows[g]` is group `g`'s window, `None` for full attention (windows are at least 2).
# Return the hit's length in blocks, an `int`.
#
# **Checked:** ten examples that each isolate one rule (a full-attention group alone; a prompt of
# whole blocks; a sliding hit after evicted blocks; a short run from block 0; a window of 6 and of 5
# in blocks of 4; a full group and a sliding group that must be asked again; three groups where the
# last shortens the length; nothing cached; a window longer than the prompt), that the result is an
# `int`, and agreement with the package's `KVCacheCoordinator.get_computed_blocks` on 300 random
# prompts.


# %%
def hybrid_hit(cached: list[list[bool]], windows: list, block_size: int, num_tokens: int) -> int:
    """The longest prefix-cache hit, in blocks, that every group hits."""
    ### BEGIN SOLUTION: length = (num_tokens - 1) // block_size; repeat: ask each group for its hit of at most length (full: leading run of cached blocks; sliding: scan from the right for a run of need = ceil((W - 1) / block_size), else the run from block 0) until a pass changes nothing
    length = (num_tokens - 1) // block_size
    while True:
        before = length
        for flags, window in zip(cached, windows, strict=True):
            if window is None:
                hit = 0
                while hit < length and flags[hit]:
                    hit += 1
            else:
                need, run, hit = -(-(window - 1) // block_size), 0, None
                for i in range(length - 1, -1, -1):
                    run = run + 1 if flags[i] else 0
                    if run >= need:
                        hit = i + run
                        break
                if hit is None:
                    hit = run  # the run that starts at block 0, shorter than need
            length = hit
        if length == before:
            return length
    ### END SOLUTION


# %%
check("13.hybrid_hit", hybrid_hit)

# %% [markdown]
# ## Putting it together
#
# A request of Gemma 2's shape, one sliding group (window 8) beside one full group, in blocks of 4:
# a 6-token prompt takes 2 blocks in each group, then the request decodes. Before each token, your
# `remove_skipped_blocks` gives back the sliding group's blocks that left the window (to the tail of
# the free list); at each block boundary both groups take a block from its head. The printout shows
# the tables at each boundary: the null entries grow in front of the sliding table, which never
# holds more than three blocks. Then your `hybrid_hit` says how many blocks of the 28 tokens a
# second request would find if the sliding group's blocks were all still cached and the full group
# had lost its block 4. Try other windows and block sizes.

# %%
WINDOW, BLOCK_SIZE = 8, 4
free_blocks = list(range(1, 64))  # block 0 is the null block
sliding = [free_blocks.pop(0), free_blocks.pop(0)]  # the 6-token prompt: 2 blocks in each group
full = [free_blocks.pop(0), free_blocks.pop(0)]
most = 2
for position in range(6, 28):  # decode: the token at `position` is about to be computed
    sliding, freed = remove_skipped_blocks(sliding, position, WINDOW, BLOCK_SIZE)
    free_blocks += freed  # back to the tail of the free list
    if position % BLOCK_SIZE == 0:  # the token starts a new block in both groups
        sliding.append(free_blocks.pop(0))
        full.append(free_blocks.pop(0))
        print(f"token {position + 1:2d}: sliding {sliding}, full {full}")
    most = max(most, sum(block != 0 for block in sliding))
print("the most blocks the sliding group held at once:", most)
full_cached = [block != 4 for block in range(7)]  # the full group lost the prompt's block 4
print("the hit:", hybrid_hit([[True] * 7, full_cached], [WINDOW, None], BLOCK_SIZE, 28), "blocks")

# %% [markdown]
# # Exercise 00 · Why paging?
#
# In this exercise you write the arithmetic of lesson 00 yourself: how many blocks a request needs,
# what a paged cache reserves and wastes, and what one contiguous slot per request reserves and
# wastes. Each task says what to build and how it is checked; the cell after it runs the check and
# prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished package has its own versions of these functions
# (`paged_kv.blocks_for_tokens`, `paged_kv.fragmentation_report`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/00_why_paging.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · Blocks for a number of tokens
#
# Write `blocks_for_tokens(num_tokens, block_size)`: how many blocks of `block_size` token slots
# hold `num_tokens` tokens. Zero tokens need zero blocks; 16 tokens fit in one block of 16, the 17th
# needs a second. Use integer arithmetic only (no `math.ceil` of a float).
#
# **Checked:** the results for 0, 1, 16, 17, 33 and 41 tokens in blocks of 16, for blocks of 1, and
# that the result is an `int`.


# %%
def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size), in integers."""
    ### BEGIN SOLUTION: return the ceiling of num_tokens / block_size using only // (hint: -(-a // b))
    return -(-num_tokens // block_size)
    ### END SOLUTION


# %%
check("00.blocks_for_tokens", blocks_for_tokens)

# %% [markdown]
# ## Task 2 · What a paged cache reserves and wastes
#
# Write `paged_usage(request_tokens, block_size)` for a list of request lengths, each a request's
# final length (it is done growing, so no slot is reservation for tokens to come). Return a dict with
#
# * `used_blocks`: the blocks all requests hold together;
# * `reserved_tokens`: the slots in those blocks;
# * `internal_fragmentation_tokens`: reserved slots that hold no token, all beyond the final lengths;
# * `block_utilization`: tokens held divided by slots reserved (0.0 when nothing is reserved).
#
# **Checked:** the six requests of the lesson, `[9, 17, 33, 5, 41, 12]` in blocks of 16 (11 blocks,
# 176 slots, 59 wasted), a single request, and an empty list.


# %%
def paged_usage(request_tokens: list[int], block_size: int) -> dict:
    """Blocks, slots and waste when every request holds whole blocks."""
    ### BEGIN SOLUTION: count blocks per request with blocks_for_tokens, then derive the slots and the waste
    used_blocks = sum(blocks_for_tokens(tokens, block_size) for tokens in request_tokens)
    reserved = used_blocks * block_size
    held = sum(request_tokens)
    return {
        "used_blocks": used_blocks,
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "block_utilization": held / reserved if reserved else 0.0,
    }
    ### END SOLUTION


# %%
check("00.paged_usage", paged_usage)

# %% [markdown]
# ## Task 3 · What contiguous slots reserve and waste
#
# Write `contiguous_usage(request_tokens, slot_tokens=None)`: every request reserves one slot of
# `slot_tokens` tokens, by default as long as the longest request. Return a dict with
# `reserved_tokens`, `internal_fragmentation_tokens` and `utilization` (0.0 when nothing is
# reserved).
#
# **Checked:** the lesson's six requests (246 slots, 129 wasted), the three requests of 300, 5,000
# and 70 tokens in 8,000-token slots from the lesson's section 2, and an empty list.


# %%
def contiguous_usage(request_tokens: list[int], slot_tokens: int | None = None) -> dict:
    """Slots and waste when every request reserves one contiguous slot."""
    ### BEGIN SOLUTION: default the slot to max(request_tokens) (0 for no requests); reserve one per request
    slot = max(request_tokens, default=0) if slot_tokens is None else slot_tokens
    reserved = slot * len(request_tokens)
    held = sum(request_tokens)
    return {
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "utilization": held / reserved if reserved else 0.0,
    }
    ### END SOLUTION


# %%
check("00.contiguous_usage", contiguous_usage)

# %% [markdown]
# ## Putting it together
#
# With the three tasks done, this compares the two layouts on the lesson's requests. Try other
# requests and block sizes: when does paging waste *more* than the contiguous baseline?

# %%
requests = [9, 17, 33, 5, 41, 12]
paged = paged_usage(requests, block_size=16)
contiguous = contiguous_usage(requests)
print(f"paged:      {paged['reserved_tokens']} slots, {paged['internal_fragmentation_tokens']} wasted")
print(
    f"contiguous: {contiguous['reserved_tokens']} slots, {contiguous['internal_fragmentation_tokens']} wasted"
)

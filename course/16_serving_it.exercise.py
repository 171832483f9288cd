# %% [markdown]
# # Exercise 16 · Serving it
#
# In this exercise you write three pieces of the online engine of lesson 16, the ones a server runs
# around the scheduler and the cache: the front end's stop strings (where a completion ends, and how
# much of a running one a stream may already send), the child requests of a request that asks for `n`
# completions, and the abort that finishes requests when their clients hang up, giving a running
# request's blocks back at once. Each task says what to build and how it is checked; the cell after it
# runs the check and prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The package does the same in `paged_kv.serving.output_processor`
# (`OutputProcessor`), `paged_kv.serving.llm_engine` (`LLMEngine.add_request`) and
# `paged_kv.serving.scheduler` (`Scheduler.finish_requests`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/16_serving_it.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from collections import Counter

from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · Stop strings, and what a stream may send
#
# A request may carry stop strings, `SamplingParams(stop=["\n", "User:"])`. After every step the
# front end decodes the completion's tokens to text and looks for them. It tries them **in the order
# they are listed**, and the first one found anywhere in the text ends the completion: the text is cut
# just before it (the stop string itself is left out, vLLM's default), and the string becomes the
# completion's `stop_reason`, beside the `finish_reason` `"stop"`. Since the text is checked after
# every token, two stop strings are in it at once only when one step's characters completed both;
# then the one listed first wins, even if the other starts earlier.
#
# Write `cut_at_stop(text, stop)`: `stop` is a list of non-empty strings; return
# `(the text before the first stop string of the list found in it, that stop string)`, or
# `(text, None)` when none is in the text.
#
# A stream must never send what it may take back. While a completion runs, its text may end with the
# start of a stop string, `"Hello wor"` with the stop string `"world"`; if the next token completes
# it, that tail is cut. So a running stream holds back the last `max(len(s) for s in stop) - 1`
# characters of its text (0 without stop strings): a stop string whose `len(s)` characters were all
# there would have been found already. It holds back a trailing `"\ufffd"` too: a token may carry the
# first byte of `"é"` and the next token its second, and the text decoded in between ends with the
# replacement character `"\ufffd"`, which the next token turns into the real character (a 3-byte
# character such as `"€"` can leave two of them). A `"\ufffd"` inside the text is followed by other
# characters: it is final.
#
# Write `sendable(text, stop, finished)`: the part of `text` a stream may send now, a prefix of it. A
# finished completion (its text cut already, and no byte to come) sends everything, a trailing
# `"\ufffd"` included. A running one first drops its trailing `"\ufffd"` characters, then holds back
# the last `max(len(s) for s in stop) - 1` characters of what is left; a text shorter than that sends
# nothing yet. Beware of `text[:-hold]` when `hold` is 0.
#
# vLLM's `OutputProcessor.process_outputs` in `vllm/v1/engine/output_processor.py` updates each
# request's detokenizer with the step's new tokens. In `vllm/v1/engine/detokenizer.py`,
# `check_stop_strings` looks for the stop strings in the new text, in the order listed, and
# `get_next_output_text` holds back `stop_buffer_length` characters (`max(len(s) for s in stop) - 1`)
# unless the request finished. vLLM's incremental decoding emits no new text that ends in `"\ufffd"`
# until the character is complete; the package's `OutputProcessor` decodes the whole text each step
# and drops the trailing `"\ufffd"` instead, which is what you write here.
#
# **Checked:** `cut_at_stop` on a text without stop strings and one without any of its stop strings,
# a stop string in the middle, at the end and at the start, its first occurrence, two stop strings in
# the text in both orders, one stop string inside another, a stop string longer than the text, then
# against the package's `OutputProcessor` on 300 random texts; `sendable` without stop strings and with
# a one-character one (nothing held back), running and finished, the longest stop string wherever it is
# listed, one and two trailing `"\ufffd"`, one inside the text, a `"\ufffd"` and a hold together, a
# finished text ending in `"\ufffd"`, a text shorter than the hold and an empty one, then against the
# package on the same 300 texts; and both together on 150 random token streams, some splitting `"é"`
# and `"€"` across tokens, whose every output (its text, `finish_reason` and `stop_reason`) must be the
# package's `OutputProcessor`'s.


# %%
def cut_at_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text before the first stop string of the list found in it, and that string; else (text, None)."""

    ### BEGIN SOLUTION: for each s of stop, in order: at = text.find(s); the first one found gives (text[:at], s); none found: (text, None)
    for s in stop:
        at = text.find(s)
        if at != -1:
            return text[:at], s
    return text, None
    ### END SOLUTION


def sendable(text: str, stop: list[str], finished: bool) -> str:
    """The prefix of a completion's text that a stream may send now."""

    ### BEGIN SOLUTION: finished: the whole text; else text = text.rstrip('\ufffd'), hold = max(len(s) for s in stop) - 1 (0 without stop strings), and text[:max(len(text) - hold, 0)]
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = max((len(s) for s in stop), default=1) - 1
    return text[: max(len(text) - hold, 0)]
    ### END SOLUTION


# %%
check("16.stop_strings", cut_at_stop, sendable)

# %% [markdown]
# ## Task 2 · The children of a request with `n` completions
#
# A request with `n = 3` asks for three completions of one prompt. The front end turns it into three
# requests for the engine core, its **children**: child `i` (from 0) is the request
# `f"{i}_{request_id}"`, and its seed is `seed + i`, so that each child draws its own random numbers
# while the whole request stays reproducible. A request without a seed (`None`) gives its children no
# seed either. A request with `n = 1` is not split: the core serves it under its own id, with its own
# seed. The children have the same prompt, so with prefix caching they share its full blocks (lesson
# 16, section 2).
#
# Write `child_requests(request_id, n, seed)`: the requests the core gets, a list of
# `(child_id, child_seed)` tuples in the order of `i`. `request_id` may be a string or an int; a
# child's id is a string either way.
#
# vLLM's `ParentRequest` in `vllm/v1/engine/parallel_sampling.py` does it: `get_child_info` names child
# `index` and gets its sampling parameters from `_get_child_sampling_params`, a copy with `n = 1` and
# the seed `seed + index`. `AsyncLLM.add_request` in `vllm/v1/engine/async_llm.py` makes a
# `ParentRequest` only when `n > 1`.
#
# **Checked:** one completion, without a seed and with one; three children with seeds 42, 43, 44; two
# children without seeds; a seed of 0; an int request id; 16 children; and agreement with the
# package's engine on 200 random requests.


# %%
def child_requests(request_id, n: int, seed: int | None) -> list[tuple]:
    """The engine core's requests for a request of n completions: (child_id, child_seed) each."""

    ### BEGIN SOLUTION: n == 1: [(request_id, seed)]; else [(f'{i}_{request_id}', None if seed is None else seed + i) for i in range(n)]
    if n == 1:
        return [(request_id, seed)]
    return [(f"{i}_{request_id}", None if seed is None else seed + i) for i in range(n)]
    ### END SOLUTION


# %%
check("16.child_requests", child_requests)

# %% [markdown]
# ## Task 3 · An abort gives the blocks back at once
#
# A client that hangs up aborts its request. The scheduler finishes it wherever it is, between two
# steps:
#
# * a **running** request gives back every block of its table at once, before the next step, so a
#   request waiting for room may be admitted in that step; its table goes, and it leaves `running`;
# * a **waiting** request holds no blocks (blocks are allocated at admission): it just leaves the
#   queue;
# * an id that is neither running nor waiting (a request that finished already, or that the
#   scheduler never saw) is skipped, and so is an id given a second time.
#
# Giving blocks back follows the pool's rules of lessons 02 and 08:
#
# * a block several tables hold (a cached prefix, lesson 08) goes back to the free list only when the
#   last table holding it goes: count each block's holders over all the tables;
# * a freed block goes to the **tail** of the free list: the head is the next block allocated, so the
#   block freed longest ago is reused (and its cached prefix evicted) first;
# * a request gives its blocks back **the last first**, `reversed(table)`, so that a cached prefix is
#   evicted from its end, its first blocks, which more prompts share, kept longest.
#
# Write `abort(running, waiting, free_blocks, block_tables, request_ids)`: `running` is the list of the
# running requests' ids, `waiting` the queue of the waiting ones, `free_blocks` the free list of block
# ids, head first, and `block_tables` a dict from each running request's id to its list of block ids
# (tables may share blocks). Finish the requests of `request_ids` in that order, changing the lists and
# the dict in place, and return the ids finished, in the order given, each once. Every freed block goes
# to the tail here: the package and vLLM send a freed block that holds no cached prefix (a partly filled
# last block) to the head instead, a detail left out.
#
# vLLM's `Scheduler.finish_requests` in `vllm/v1/core/sched/scheduler.py` takes the requests out of
# their queues and frees each one with `_free_request`. `SingleTypeKVCacheManager.free` in
# `vllm/v1/core/single_type_kv_cache_manager.py` gives a request's blocks back in reverse order, and
# `BlockPool.free_blocks` in `vllm/v1/core/block_pool.py` lowers each block's ref count and appends
# those that reach 0 to the free block queue. vLLM takes the ids as a set, in no particular order; the
# package and this task finish them in the order given.
#
# **Checked:** a running request (its blocks at the tail, the last first), a waiting one, an unknown id,
# a request sharing two blocks with another, both holders of those blocks at once, two running requests
# in the order given, a waiting one then a running one, ids given twice, a block held by three tables,
# nothing to abort, all of these together: what `abort` returns, `running`, `waiting`, `free_blocks` and
# `block_tables` after each; and agreement with the package's KV-cache manager on 300 random
# schedulers, some of whose requests share a cached prefix.


# %%
def abort(
    running: list, waiting: list, free_blocks: list[int], block_tables: dict, request_ids: list
) -> list:
    """Finish request_ids in place; return those finished, in the order given."""

    ### BEGIN SOLUTION: holders = Counter of the block ids of every table; for each new id: running -> for b in reversed(block_tables.pop(id)): holders[b] -= 1, free_blocks.append(b) at 0; running.remove(id); waiting -> waiting.remove(id); else skip; collect the ids finished
    holders = Counter(block_id for table in block_tables.values() for block_id in table)
    finished = []
    for request_id in request_ids:
        if request_id in finished:
            continue
        if request_id in running:
            for block_id in reversed(block_tables.pop(request_id)):
                holders[block_id] -= 1
                if holders[block_id] == 0:
                    free_blocks.append(block_id)
            running.remove(request_id)
        elif request_id in waiting:
            waiting.remove(request_id)
        else:
            continue
        finished.append(request_id)
    return finished
    ### END SOLUTION


# %%
check("16.abort", abort)

# %% [markdown]
# ## Putting it together
#
# First a completion streamed token by token with the stop strings `"\n"` and `"User:"` (a hold of 4
# characters): each line shows the text decoded so far and what your `sendable` lets the client read.
# The third token brings half of `"é"` and the fourth its other half; the stop string `"User:"`
# arrives in two tokens, and the stream never shows its start. Then the children of a request with
# `n = 3`, and an abort in a scheduler where `A` and `B` share a cached prefix of two blocks: `B` and
# the waiting `C` go, and an id that finished long ago is skipped; then `A` goes. Try other stop
# strings, tokens or tables.

# %%
tokens = [b"Hello", b", caf", b"\xc3", b"\xa9", b" is open. ", b"Us", b"er: thanks"]
stop = ["\n", "User:"]
for step in range(1, len(tokens) + 1):
    text = b"".join(tokens[:step]).decode("utf-8", errors="replace")
    cut, stop_reason = cut_at_stop(text, stop)
    shown = sendable(cut, stop, finished=stop_reason is not None)
    print(f"step {step}: decoded {text!r:36} the client has {shown!r}")
    if stop_reason is not None:
        print(f"finished: stop_reason {stop_reason!r}")
        break

print(child_requests("cmpl-42", 3, seed=7))
print(child_requests("cmpl-43", 1, seed=None))

running, waiting, free_blocks = ["A", "B"], ["C"], [9]
block_tables = {"A": [0, 1, 2], "B": [0, 1, 3, 4]}
print("aborted", abort(running, waiting, free_blocks, block_tables, ["B", "C", "gone"]))
print(f"  running {running}, waiting {waiting}, tables {block_tables}, free list {free_blocks}")
print("aborted", abort(running, waiting, free_blocks, block_tables, ["A"]))
print(f"  running {running}, waiting {waiting}, tables {block_tables}, free list {free_blocks}")

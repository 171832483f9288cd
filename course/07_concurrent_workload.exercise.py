# %% [markdown]
# # Exercise 07 · A concurrent workload
#
# In this exercise you write the pieces of lesson 07's simulator that decide where memory goes: the
# power-of-two size classes, the slot each contiguous policy reserves for a request, and a small
# continuous-batching scheduler that admits requests first come first served and releases a
# finished request's memory at once. Each task says what to build and how it is checked; the cell
# after it runs the check and prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished versions live in `paged_kv.simulation.workload`
# (`next_power_of_two`, `ContiguousPolicy.reservation`, `simulate`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/07_concurrent_workload.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from collections import deque
from dataclasses import dataclass

from paged_kv.checks import check
from paged_kv.simulation.workload import Request, sample_requests

# %% [markdown]
# ## Task 1 · The next power of two
#
# Write `next_power_of_two(n)`: the smallest power of two that is at least `n`, for an integer
# `n >= 1`. A power of two is its own answer (16 gives 16, not 32), and 1 is a power of two too
# ($2^0$). Raise a `ValueError` when `n < 1`. Integers only: Python's `int.bit_length()` helps
# (`(5).bit_length()` is 3, since 5 is `0b101`).
#
# **Checked:** 3, 5, 17 and 300 (4, 8, 32, 512); the exact powers 16, 2 and 1,024 (themselves);
# 1 (1); 1,025 (2,048); that the result is an `int`; that 0 raises `ValueError`; and that it agrees
# with `paged_kv.simulation.workload.next_power_of_two` for every `n` from 1 to 4,096.


# %%
def next_power_of_two(n: int) -> int:
    """The smallest power of two that is at least n (n >= 1)."""
    ### BEGIN SOLUTION: raise ValueError when n < 1; then look at (n - 1).bit_length(), the bits n - 1 needs
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return 1 << (n - 1).bit_length()
    ### END SOLUTION


# %%
check("07.next_power_of_two", next_power_of_two)

# %% [markdown]
# ## Task 2 · What a contiguous slot reserves
#
# A contiguous policy reserves one slot for a request when it admits it, and the slot cannot grow
# afterwards. Write `reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len)`, the slots
# reserved for a request whose final length is `prompt_tokens + output_tokens`:
#
# * `"max"`: `max_model_len`, whatever the request;
# * `"pow2"`: the vLLM paper's Orca (Pow2), which over-reserves only the room for the output, by less
#   than twice: the prompt's `prompt_tokens` slots plus the next power of two of `output_tokens`
#   (32 slots for a 25-token output), but never more than `max_model_len` in all;
# * `"oracle"`: exactly the final length.
#
# Raise a `ValueError` whose message contains `kind` for any other kind, and one whose message
# contains `max_model_len` when the final length is longer than `max_model_len`.
#
# **Checked:** a request of 100 + 200 tokens with `max_model_len` 2,048 (2,048, 356 = 100 + 256 and
# 300 slots); under `"pow2"`, 300 + 1 tokens (301: the prompt is not rounded), 200 + 64 (264: 64 is
# already a power of two), 150 + 200 with `max_model_len` 400 (400, not 406) and 250 + 250 with 500
# (500); a request of exactly `max_model_len`; the two errors; and agreement with
# `paged_kv.simulation.workload.ContiguousPolicy(kind, max_model_len).reservation(request)` for 200 sampled
# ShareGPT-shaped and 200 Alpaca-shaped requests.


# %%
def reserved_tokens(kind: str, prompt_tokens: int, output_tokens: int, max_model_len: int) -> int:
    """The slots a contiguous policy of this kind reserves for the request at admission."""
    ### BEGIN SOLUTION: compute the final length (prompt + output), check it, then pick max_model_len, the prompt plus the output's power of two (capped), or the final length
    total = prompt_tokens + output_tokens
    if kind not in ("max", "pow2", "oracle"):
        raise ValueError(f"kind must be 'max', 'pow2' or 'oracle', got {kind!r}")
    if total > max_model_len:
        raise ValueError(f"the request holds {total} tokens, more than max_model_len ({max_model_len})")
    if kind == "max":
        return max_model_len
    if kind == "pow2":
        return min(prompt_tokens + next_power_of_two(output_tokens), max_model_len)
    return total
    ### END SOLUTION


# %%
check("07.reserved_tokens", reserved_tokens)

# %% [markdown]
# ## Task 3 · A continuous-batching scheduler
#
# `ContinuousBatcher` serves requests with one contiguous reservation each, in a budget of
# `budget_tokens` slots. Its `reserve` argument is a function that returns the slots to reserve for
# a request, for example `lambda r: reserved_tokens("oracle", r.prompt_tokens, r.output_tokens, 512)`.
# Its state, which `__init__` sets up for you:
#
# * `free_tokens`: the slots no running sequence has reserved;
# * `waiting`: a `deque` of `Request`s, the oldest at the front (`waiting[0]`);
# * `running`: a list of `Running` sequences, in the order they were admitted; each has its
#   `request`, the slots `reserved` for it, and the output tokens `generated` so far.
#
# Write `step(arrivals=())`, one step of the engine, in this order:
#
# 1. the `arrivals` (a list of `Request`s) join the back of `waiting`, in order;
# 2. every running sequence decodes one token: its `generated` grows by 1;
# 3. waiting requests are admitted first come first served: while the request at the *front* of
#    the queue fits (`reserve(request) <= free_tokens`), take it off the queue, subtract its
#    reservation from `free_tokens` and append `Running(request, reserved)` to `running`. Its
#    `generated` starts at 1: it prefills this step, and the prefill samples its first output
#    token, as in vLLM and in lesson 09's engine. Stop at the first request that does not fit,
#    even if a later one would;
# 4. every running sequence whose `generated` equals its request's `output_tokens` finishes: it
#    leaves `running` and its reservation goes back to `free_tokens` at once, even if other
#    sequences keep running.
#
# Return the ids of the requests that finished in this step, in admission order. A request with
# `o` output tokens thus runs for `o` steps (one prefill, `o - 1` decodes), and memory released in
# part 4 is free for the next step's admissions, as in `paged_kv.simulation.workload.simulate`,
# which runs the package's scheduler.
#
# **Checked**, with `reserve` giving each request its final length:
#
# * a budget of 10 and requests `a` (2 + 1 tokens), `b` (2 + 4) and `c` (3 + 1) arriving together:
#   `a` and `b` are admitted (3 + 6 slots) and `c` waits; `a` finishes at step 0, in its prefill,
#   and its 3 slots come back at once although `b` still runs; `c` is admitted at step 1 and
#   finishes then, `b` at step 3;
# * a budget of 10 and requests `x` (8 slots), `y` (5) and `z` (2): only `x` is admitted, and `z`
#   must not jump ahead of `y`; a request arriving at the next step waits behind both;
# * the requests `sample_requests("alpaca", 30, seed=0, arrival_rate=1.0)`, each handed to `step`
#   at its `arrival_step`, in a budget of 1,024: the number of sequences in each step's forward pass
#   (those still running after it plus those that finished in it) equals the `running` series of
#   `simulate(requests, policy, 1024)`, for `ContiguousPolicy("oracle", compact=True)` and for
#   `ContiguousPolicy("max", 512)`. Your batcher counts free slots and never looks for a hole, so
#   it is compared with the simulator's compacted memory, which moves the reservations together
#   whenever that lets a request in (with `max`, every reservation is the same size, and first fit
#   never meets a hole too small).


# %%
@dataclass
class Running:
    """A sequence being served: its request, the slots reserved for it, the output tokens it holds."""

    request: Request
    reserved: int
    generated: int = 1  # its prefill samples the first output token


class ContinuousBatcher:
    """Continuous batching with one contiguous reservation per sequence, first come first served."""

    def __init__(self, budget_tokens: int, reserve) -> None:
        self.free_tokens = budget_tokens
        self.reserve = reserve  # request -> slots reserved for it at admission
        self.waiting: deque[Request] = deque()  # the oldest at the front
        self.running: list[Running] = []  # in admission order

    def step(self, arrivals=()) -> list:
        """One step of the engine; returns the ids of the requests that finished in it."""
        ### BEGIN SOLUTION: queue the arrivals; decode; admit from the front while it fits; release the finished at once
        self.waiting.extend(arrivals)
        for seq in self.running:
            seq.generated += 1
        while self.waiting and self.reserve(self.waiting[0]) <= self.free_tokens:
            request = self.waiting.popleft()
            reserved = self.reserve(request)
            self.free_tokens -= reserved
            self.running.append(Running(request, reserved))
        finished = [seq for seq in self.running if seq.generated == seq.request.output_tokens]
        for seq in finished:
            self.free_tokens += seq.reserved
        self.running = [seq for seq in self.running if seq.generated < seq.request.output_tokens]
        return [seq.request.request_id for seq in finished]
        ### END SOLUTION


# %%
check("07.continuous_batcher", ContinuousBatcher)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, this serves the 200 ShareGPT-shaped requests of lesson 07 (arriving at
# 0.2 per step, in 32,768 slots) with your scheduler and each contiguous reservation. Compare the
# steps and the mean running sequences with the lesson's table: Orca (Max) matches it, while your
# Pow2 and Oracle finish sooner than the lesson's, because your batcher counts free slots and never
# meets a hole (it matches `ContiguousPolicy(kind, 2048, compact=True)`). Then try a larger budget,
# or `arrival_rate=None`: how much does each policy gain?

# %%
requests = sample_requests("sharegpt", 200, seed=0, arrival_rate=0.2)
for kind in ("max", "pow2", "oracle"):
    batcher = ContinuousBatcher(
        32768, lambda r, kind=kind: reserved_tokens(kind, r.prompt_tokens, r.output_tokens, 2048)
    )
    pending, step, done, running_sum = deque(requests), 0, 0, 0
    while done < len(requests):
        arrivals = []
        while pending and pending[0].arrival_step <= step:
            arrivals.append(pending.popleft())
        finished = batcher.step(arrivals)
        running_sum += len(batcher.running) + len(finished)  # the finished ones ran in this step too
        done += len(finished)
        step += 1
    print(f"{kind:<7} {step:>5} steps, {running_sum / step:.1f} sequences running on average")

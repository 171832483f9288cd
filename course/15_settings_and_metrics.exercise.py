# %% [markdown]
# # Exercise 15 · Settings and metrics
#
# In this exercise you write two pieces of lesson 15 that vLLM runs around its KV cache: the line it
# logs every few seconds about the engine's throughput and its cache, and the prefix cache's hit
# rate that line shows, over the most recent requests. Each task says what to build and how it is checked; the cell
# after it runs the check and prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The package has the same pieces in `paged_kv.serving.metrics`
# (`format_log_line`, `CachingMetrics`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/15_settings_and_metrics.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from collections import deque

from paged_kv.checks import check
from paged_kv.core.prefix_cache import PrefixCacheStats

# %% [markdown]
# ## Task 1 · vLLM's log line
#
# A running vLLM server logs one line every 10 seconds about the window since the last line:
#
# `Engine 000: Avg prompt throughput: 125.0 tokens/s, Avg generation throughput: 30.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, Preemptions: 2, GPU KV cache usage: 42.5%, Prefix cache hit rate: 50.0%`
#
# Write `log_line(prompt_tokens, generation_tokens, seconds, num_running_reqs, num_waiting_reqs,
# kv_cache_usage, num_preemptions=0, prefix_cache_hit_rate=None)`: the line, a `str`, for a window of
# `seconds` seconds in which the engine computed `prompt_tokens` prompt tokens (those the prefix cache
# served are not counted) and generated `generation_tokens` tokens. `num_running_reqs`,
# `num_waiting_reqs` and `kv_cache_usage` (the share of the pool's blocks in use, a fraction from 0 to
# 1) are those of the window's last step; `num_preemptions` counts the window's preemptions;
# `prefix_cache_hit_rate` is a fraction, or `None` while nothing was looked up. The parts, joined by
# `", "` after `"Engine 000: "`:
#
# * `Avg prompt throughput: … tokens/s` and `Avg generation throughput: … tokens/s`: tokens over
#   seconds, with one decimal; a window of 0 seconds (or less) has 0.0;
# * `Running: N reqs` and `Waiting: N reqs`, "reqs" whatever the count;
# * `Preemptions: N`, only when the window preempted (N > 0);
# * `GPU KV cache usage: 42.5%`: the fraction times 100, with one decimal;
# * `Prefix cache hit rate: 50.0%`, the same way, only when the rate is not `None`.
#
# vLLM builds the line in `LoggingStatLogger.log` (`vllm/v1/metrics/loggers.py`) from a format string
# and its arguments, `%.1f` for every rate and `%d` for every count, after `_get_throughput` divided
# each token count by the window's seconds.
#
# **Checked:** a window of 10 s without preemptions nor lookups; one with preemptions; hit rates of 0.5
# and 0.0 (which is shown); `num_preemptions=0` (not shown); a window of 0 s; rounding to one decimal;
# one running request; a full pool with every part; and agreement with the package's `format_log_line`
# on 200 random windows.


# %%
def log_line(
    prompt_tokens: int,
    generation_tokens: int,
    seconds: float,
    num_running_reqs: int,
    num_waiting_reqs: int,
    kv_cache_usage: float,
    num_preemptions: int = 0,
    prefix_cache_hit_rate: float | None = None,
) -> str:
    """vLLM's periodic log line for one window of the engine."""

    ### BEGIN SOLUTION: throughput = tokens / seconds, 0.0 when seconds <= 0; parts with f'{x:.1f}'; 'Preemptions: N' only when N > 0; usage and hit rate times 100 with a '%'; the hit rate only when it is not None; 'Engine 000: ' + ', '.join(parts)
    def throughput(tokens):
        return tokens / seconds if seconds > 0 else 0.0

    parts = [
        f"Avg prompt throughput: {throughput(prompt_tokens):.1f} tokens/s",
        f"Avg generation throughput: {throughput(generation_tokens):.1f} tokens/s",
        f"Running: {num_running_reqs} reqs",
        f"Waiting: {num_waiting_reqs} reqs",
    ]
    if num_preemptions > 0:
        parts.append(f"Preemptions: {num_preemptions}")
    parts.append(f"GPU KV cache usage: {kv_cache_usage * 100:.1f}%")
    if prefix_cache_hit_rate is not None:
        parts.append(f"Prefix cache hit rate: {prefix_cache_hit_rate * 100:.1f}%")
    return "Engine 000: " + ", ".join(parts)
    ### END SOLUTION


# %%
check("15.log_line", log_line)

# %% [markdown]
# ## Task 2 · The hit rate of the recent requests
#
# The hit rate in the line is not the whole run's: it is that of the most recent 1,000 requests. Each
# step, the scheduler counts its lookups in the prefix cache in a `PrefixCacheStats`, in tokens:
# `requests` (the requests it looked up for the first time), `queries` (the tokens those looked up) and
# `hits` (the tokens of those found in the cache). A request resumed after a preemption looks its
# tokens up again; those lookups are counted apart, in `preempted_requests`, `preempted_queries` and
# `preempted_hits`, and they are not part of the hit rate (the request finds its own blocks again).
#
# `CachingMetrics(max_recent_requests=1000)` keeps the window: `query_queue` holds one
# `(requests, queries, hits)` entry per step, oldest first, and three sums over it. Write its
#
# * `observe(stats)`: a step without a first lookup (`stats.requests == 0`) changes nothing. Otherwise
#   append the step's `(requests, queries, hits)` to `query_queue` and add them to the sums; then, while
#   the queue holds more than one step and `aggregated_requests` is above `max_recent_requests`, drop the
#   oldest step (`popleft`) and subtract its counts. Steps go whole, and the newest always stays, even
#   when it alone has more requests than the window;
# * `empty`: whether no request is in the window;
# * `hit_rate`: the window's hits over its queries, 0.0 when it has no query.
#
# vLLM's `CachingMetrics` in `vllm/v1/metrics/stats.py` keeps the window this way, and
# `PrefixCacheStats.record` there counts a resumed request's lookup apart. Its `LoggingStatLogger`
# feeds it each step's stats and shows the rate unless the window is empty.
#
# **Checked:** a new `CachingMetrics()` (empty, rate 0.0); one lookup; a step without lookups and one
# with a resumed request's only (neither counts); a step with both kinds; hits over queries in tokens;
# windows of 2, 3 and 4 requests that drop one step, a whole step, and two steps at once; a step with
# more requests than its window, then an empty step; the default window of 1,000 requests; `empty` and
# `hit_rate` after every step of those; and agreement with the package's `CachingMetrics` on 200 random
# runs of steps.


# %%
class CachingMetrics:
    """The prefix cache's hit rate over the most recent max_recent_requests first lookups."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0  # the sums over query_queue
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue = deque()  # (requests, queries, hits) of each step kept, oldest first

    def observe(self, stats: PrefixCacheStats) -> None:
        """Take one step's lookups into the window, dropping the oldest steps beyond it."""
        ### BEGIN SOLUTION: return when stats.requests == 0; append (requests, queries, hits) and add them to the sums; while len(query_queue) > 1 and aggregated_requests > max_recent_requests: popleft and subtract
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self.query_queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits
        ### END SOLUTION

    @property
    def empty(self) -> bool:
        """Whether no request is in the window."""
        ### BEGIN SOLUTION: no request in the window: aggregated_requests == 0
        return self.aggregated_requests == 0
        ### END SOLUTION

    @property
    def hit_rate(self) -> float:
        """The window's hits over its queries, in tokens; 0.0 without a query."""
        ### BEGIN SOLUTION: aggregated_query_hit / aggregated_query_total, 0.0 when the total is 0
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
        ### END SOLUTION


# %%
check("15.CachingMetrics", CachingMetrics)

# %% [markdown]
# ## Putting it together
#
# A minute of a chat server, in windows of 10 s: every request starts with the same 1,024-token system prompt, so
# after the first request each one finds it in the prefix cache. Your `CachingMetrics` (a window of 8
# requests, to see it move) takes each window's lookups, and your `log_line` writes vLLM's line. In
# the third window the pool is full: two requests are preempted and later resumed, and their lookups
# do not count. Try a larger window, or a window without any lookup.

# %%
metrics = CachingMetrics(max_recent_requests=8)
resumed = PrefixCacheStats(preempted_requests=2, preempted_queries=2900, preempted_hits=2048)
windows = [  # (prompt tokens computed, generated, running, waiting, usage, preemptions, the window's lookups)
    (2048, 40, 4, 0, 0.31, 0, [PrefixCacheStats(requests=4, queries=5120, hits=3072)]),
    (1536, 620, 10, 0, 0.78, 0, [PrefixCacheStats(requests=6, queries=7680, hits=6144)]),
    (0, 980, 8, 2, 1.0, 2, [resumed]),  # two requests preempted, then resumed: their lookups do not count
    (384, 870, 9, 0, 0.86, 0, [PrefixCacheStats(requests=1, queries=1408, hits=1024)]),
    (0, 310, 3, 0, 0.24, 0, []),
    (0, 0, 0, 0, 0.0, 0, []),
]
for prompt, generated, running, waiting, usage, preemptions, lookups in windows:
    for stats in lookups:
        metrics.observe(stats)
    hit_rate = None if metrics.empty else metrics.hit_rate
    print(log_line(prompt, generated, 10.0, running, waiting, usage, preemptions, hit_rate))

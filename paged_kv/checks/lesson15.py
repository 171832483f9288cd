"""Checks of exercise 15: vLLM's periodic log line, and the prefix cache's hit rate over the most recent
requests.

Each task is checked on examples that isolate one rule (the usage as a percentage, the preemptions shown
only when there were some, a hit rate of 0.0 still shown, preempted lookups and empty steps left out,
whole steps dropped oldest first...), then against the package on many cases: ``log_line`` against
:func:`paged_kv.serving.metrics.format_log_line` and ``CachingMetrics`` against
:class:`paged_kv.serving.metrics.CachingMetrics` (through the package's reference,
:mod:`paged_kv.reference.lesson15`). When an answer is wrong, the check runs the learner's code
beside the classic mistakes, written as small wrong implementations, and names the one it behaves like
(:func:`~paged_kv.checks._core.diagnose`)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from paged_kv.checks._core import Checker, diagnose, outcome, task
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.reference.lesson15 import CachingMetrics as PackageCachingMetrics
from paged_kv.reference.lesson15 import log_line as package_line

# ------------------------------------------------------------------------------- Task 1

LINE_RULE = (
    "each throughput is tokens / seconds (0.0 when seconds <= 0); the line is 'Engine 000: Avg prompt "
    "throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d "
    "reqs, ' then 'Preemptions: %d, ' only when num_preemptions > 0, then 'GPU KV cache usage: %.1f%%' of "
    "kv_cache_usage * 100, then ', Prefix cache hit rate: %.1f%%' of the rate * 100 only when it is not "
    "None; the parts joined by ', '"
)
USAGE_NOT_PERCENT = (
    "kv_cache_usage is a fraction (0.425 for 42.5 % of the blocks): print kv_cache_usage * 100 with %.1f "
    "and a % sign, 'GPU KV cache usage: 42.5%'"
)
HIT_NOT_PERCENT = (
    "the hit rate is a fraction too: print prefix_cache_hit_rate * 100 with %.1f and a % sign, "
    "'Prefix cache hit rate: 50.0%'"
)
PREEMPTIONS_ALWAYS = (
    "vLLM shows 'Preemptions: N' only when the window preempted (num_preemptions > 0); with none, the "
    "part is left out"
)
ZERO_HIT_DROPPED = (
    "a hit rate of 0.0 is still a hit rate: the part is left out only when prefix_cache_hit_rate is None "
    "(no lookup yet). `if prefix_cache_hit_rate:` drops 0.0 too; test `is not None`"
)
DIVIDES_BY_ZERO = (
    "a window of 0 seconds has no throughput to divide by: vLLM's _get_throughput returns 0.0 when the "
    "time is not above 0, else tokens / seconds"
)
NOT_PER_SECOND = "a throughput is tokens per second: divide the window's tokens by its seconds"
SINGULAR = "vLLM writes 'reqs' whatever the count: 'Running: 1 reqs', no singular"
ENGINE_UNPADDED = "the engine index has three digits, 'Engine 000: ' ('{:03d}'.format(0)), not 'Engine 0: '"
PREEMPTIONS_LATE = (
    "the parts come in vLLM's order: the counts of requests, then 'Preemptions: N', then the KV cache "
    "usage, then the hit rate"
)


def _line(
    prompt_tokens: int,
    generation_tokens: int,
    seconds: float,
    running: int,
    waiting: int,
    usage: float,
    num_preemptions: int = 0,
    prefix_cache_hit_rate: float | None = None,
    *,
    usage_percent: bool = True,
    hit_percent: bool = True,
    preemptions_always: bool = False,
    zero_hit_dropped: bool = False,
    guard_zero: bool = True,
    per_second: bool = True,
    singular: bool = False,
    padded: bool = True,
    preemptions_late: bool = False,
) -> str:
    """The line, or a classic mistake (a keyword changed)."""

    def throughput(tokens: int) -> float:
        if not per_second:
            return float(tokens)
        if guard_zero and seconds <= 0:
            return 0.0
        return tokens / seconds

    def reqs(count: int) -> str:
        return "req" if singular and count == 1 else "reqs"

    parts = [
        f"Avg prompt throughput: {throughput(prompt_tokens):.1f} tokens/s",
        f"Avg generation throughput: {throughput(generation_tokens):.1f} tokens/s",
        f"Running: {running} {reqs(running)}",
        f"Waiting: {waiting} {reqs(waiting)}",
    ]
    preempted = [f"Preemptions: {num_preemptions}"] if num_preemptions > 0 or preemptions_always else []
    usage_part = [f"GPU KV cache usage: {usage * 100 if usage_percent else usage:.1f}%"]
    parts += usage_part + preempted if preemptions_late else preempted + usage_part
    shown = bool(prefix_cache_hit_rate) if zero_hit_dropped else prefix_cache_hit_rate is not None
    if shown:
        rate = prefix_cache_hit_rate * 100 if hit_percent else prefix_cache_hit_rate
        parts.append(f"Prefix cache hit rate: {rate:.1f}%")
    return ("Engine 000: " if padded else "Engine 0: ") + ", ".join(parts)


LINE_MISTAKES: list[tuple[Callable[..., str], str]] = [
    (lambda *a, **k: _line(*a, **k, usage_percent=False), USAGE_NOT_PERCENT),
    (lambda *a, **k: _line(*a, **k, hit_percent=False), HIT_NOT_PERCENT),
    (lambda *a, **k: _line(*a, **k, preemptions_always=True), PREEMPTIONS_ALWAYS),
    (lambda *a, **k: _line(*a, **k, zero_hit_dropped=True), ZERO_HIT_DROPPED),
    (lambda *a, **k: _line(*a, **k, guard_zero=False), DIVIDES_BY_ZERO),
    (lambda *a, **k: _line(*a, **k, per_second=False), NOT_PER_SECOND),
    (lambda *a, **k: _line(*a, **k, singular=True), SINGULAR),
    (lambda *a, **k: _line(*a, **k, padded=False), ENGINE_UNPADDED),
    (lambda *a, **k: _line(*a, **k, preemptions_late=True), PREEMPTIONS_LATE),
]

# (positional arguments, num_preemptions, prefix_cache_hit_rate, why)
LINE_EXAMPLES: list[tuple[tuple, int | None, float | None, str]] = [
    ((1250, 300, 10.0, 2, 1, 0.425), None, None, "a window of 10 s: 125 and 30 tokens a second"),
    ((0, 48, 10.0, 3, 0, 0.9), 2, None, "two preemptions in the window, before the usage"),
    ((1250, 300, 10.0, 2, 1, 0.425), None, 0.5, "the prefix cache was looked up: its hit rate last"),
    ((1250, 300, 10.0, 2, 1, 0.425), None, 0.0, "a hit rate of 0.0 is shown: the cache was looked up"),
    ((1250, 300, 10.0, 2, 1, 0.425), 0, None, "no preemption: no 'Preemptions' part"),
    ((500, 20, 0.0, 1, 0, 0.25), None, None, "no time passed: vLLM writes 0.0 tokens/s"),
    ((1, 2, 3.0, 0, 4, 0.1234), None, 1 / 3, "one decimal everywhere"),
    ((0, 0, 10.0, 1, 1, 0.0), None, None, "an idle engine; one request is still '1 reqs'"),
    ((4096, 512, 2.5, 32, 7, 1.0), 5, 0.875, "a full pool: every part"),
]


def _line_args(case: tuple) -> tuple[tuple, dict]:
    args, preemptions, rate, _ = case
    keywords: dict = {}
    if preemptions is not None:
        keywords["num_preemptions"] = preemptions
    if rate is not None:
        keywords["prefix_cache_hit_rate"] = rate
    return args, keywords


def _line_call(args: tuple, keywords: dict) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in keywords.items()]
    return f"log_line({', '.join(shown)})"


def _random_windows(count: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        args = (
            rng.randint(0, 20000),
            rng.randint(0, 5000),
            rng.choice((0.0, 0.5, 1.0, 3.0, 5.0, 10.0, 10.25)),
            rng.randint(0, 64),
            rng.randint(0, 64),
            rng.randint(0, 1000) / 1000,
        )
        preemptions = rng.choice((None, 0, 0, 1, 3, 12))
        rate = rng.choice((None, None, 0.0, 1.0, rng.randint(0, 1000) / 1000))
        cases.append((args, preemptions, rate, "a random window"))
    return cases


def _line_hint(line: Callable[..., object]) -> str:
    cases = [_line_args(case) for case in LINE_EXAMPLES + _random_windows(100, 41)]

    def probe(fn: Callable[..., object]) -> list:
        return [outcome(lambda a=a, k=k: fn(*a, **k)) for a, k in cases]

    return diagnose(line, LINE_MISTAKES, probe, LINE_RULE)


@task("15.log_line", "vLLM's periodic log line", needs=("log_line",))
def _log_line(c: Checker, line) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _line_hint(line)

    def expect(case: tuple) -> None:
        args, keywords = _line_args(case)
        c.equal(
            f"{_line_call(args, keywords)}  # {case[3]}",
            lambda: line(*args, **keywords),
            package_line(*args, **keywords),
            hint,
        )

    for case in LINE_EXAMPLES:
        expect(case)
    cases = _random_windows(200, 14)
    call = f"log_line(...) on {len(cases)} random windows against the package's format_log_line"

    def first_wrong() -> tuple | None:
        for case in cases:
            args, keywords = _line_args(case)
            if line(*args, **keywords) != package_line(*args, **keywords):
                return case
        return None

    wrong = c.run(call, first_wrong, hint)
    if wrong is not None:
        expect(wrong)
    c.holds(call, wrong is None, "vLLM's line for every window", wrong, hint)


# ------------------------------------------------------------------------------- Task 2

CACHING_RULE = (
    "observe: a step whose stats.requests is 0 changes nothing; else append (requests, queries, hits) to "
    "query_queue and add them to the three sums, then, while the queue holds more than one step and "
    "aggregated_requests > max_recent_requests, pop the oldest step and subtract it. empty: "
    "aggregated_requests == 0; hit_rate: aggregated_query_hit / aggregated_query_total, 0.0 when no query"
)
COUNTS_PREEMPTED = (
    "a resumed request's lookup does not count: use stats.requests, stats.queries and stats.hits only, "
    "never the preempted_ fields (vLLM's hit rate is that of first lookups; a resumed request finds its "
    "own blocks again and would inflate it)"
)
EMPTY_STEPS_QUEUED = (
    "a step without lookups (stats.requests == 0) must change nothing: return before appending it. A "
    "queued empty step counts as a step, so the step before it (which the window keeps whole, however "
    "many requests it has) is dropped"
)
WINDOW_OF_STEPS = (
    "the window holds the most recent max_recent_requests requests, not steps: compare "
    "aggregated_requests with max_recent_requests, not len(query_queue)"
)
DROPS_THE_LATEST = (
    "the newest step is always kept, even with more requests than the window: drop old steps only while "
    "the queue holds more than one (len(query_queue) > 1 and aggregated_requests > max_recent_requests)"
)
DROPS_ONE = (
    "one new step may push out several old ones: drop in a while loop, until aggregated_requests is at "
    "most max_recent_requests (or one step is left), not once with an if"
)
DROPS_AT_THE_LIMIT = (
    "a window of max_recent_requests holds exactly that many: drop while aggregated_requests > "
    "max_recent_requests, not >="
)
MEAN_OF_RATES = (
    "the hit rate is the window's hits over its queries, in tokens (aggregated_query_hit / "
    "aggregated_query_total), not the mean of each step's rate: a long prompt weighs more than a short one"
)
NO_ZERO_GUARD = (
    "before any query there is no rate to divide: hit_rate is 0.0 when aggregated_query_total is 0"
)


def _metrics_class(
    *,
    count_preempted: bool = False,
    queue_empty_steps: bool = False,
    window_of_steps: bool = False,
    keep_latest: bool = True,
    loop: bool = True,
    strict: bool = True,
    mean_of_rates: bool = False,
    guard_zero: bool = True,
) -> type:
    """The rule as a class, or a classic mistake (a keyword changed)."""

    class Metrics:
        def __init__(self, max_recent_requests: int = 1000) -> None:
            self.max_recent_requests = max_recent_requests
            self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0
            self.query_queue: deque = deque()

        def _over(self) -> bool:
            size = len(self.query_queue) if window_of_steps else self.aggregated_requests
            over = size > self.max_recent_requests if strict else size >= self.max_recent_requests
            return over and (len(self.query_queue) > 1 or not keep_latest) and bool(self.query_queue)

        def observe(self, stats: PrefixCacheStats) -> None:
            requests, queries, hits = stats.requests, stats.queries, stats.hits
            if count_preempted:
                requests += stats.preempted_requests
                queries += stats.preempted_queries
                hits += stats.preempted_hits
            if requests == 0 and not queue_empty_steps:
                return
            self.query_queue.append((requests, queries, hits))
            self.aggregated_requests += requests
            self.aggregated_query_total += queries
            self.aggregated_query_hit += hits
            while self._over():
                old = self.query_queue.popleft()
                self.aggregated_requests -= old[0]
                self.aggregated_query_total -= old[1]
                self.aggregated_query_hit -= old[2]
                if not loop:
                    break

        @property
        def empty(self) -> bool:
            return self.aggregated_requests == 0

        @property
        def hit_rate(self) -> float:
            if mean_of_rates:
                rates = [h / q for _, q, h in self.query_queue if q]
                return sum(rates) / len(rates) if rates else 0.0
            if guard_zero and self.aggregated_query_total == 0:
                return 0.0
            return self.aggregated_query_hit / self.aggregated_query_total

    return Metrics


CACHING_MISTAKES: list[tuple[type, str]] = [
    (_metrics_class(guard_zero=False), NO_ZERO_GUARD),
    (_metrics_class(count_preempted=True), COUNTS_PREEMPTED),
    (_metrics_class(queue_empty_steps=True), EMPTY_STEPS_QUEUED),
    (_metrics_class(window_of_steps=True), WINDOW_OF_STEPS),
    (_metrics_class(keep_latest=False), DROPS_THE_LATEST),
    (_metrics_class(loop=False), DROPS_ONE),
    (_metrics_class(strict=False), DROPS_AT_THE_LIMIT),
    (_metrics_class(mean_of_rates=True), MEAN_OF_RATES),
]


def S(requests: int = 0, queries: int = 0, hits: int = 0, **preempted: int) -> PrefixCacheStats:
    """One step's lookups: ``S(1, 10, 5)`` is one request that looked up 10 tokens and found 5."""
    return PrefixCacheStats(requests=requests, queries=queries, hits=hits, **preempted)


def _show(stats: PrefixCacheStats) -> str:
    fields = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")
    shown = [f"{name}={getattr(stats, name)}" for name in fields if getattr(stats, name)]
    return f"PrefixCacheStats({', '.join(shown)})"


# (max_recent_requests or None for the default, the steps, why): each isolates one rule
CACHING_SCENARIOS: list[tuple[int | None, list[PrefixCacheStats], str]] = [
    (None, [], "nothing observed yet: empty, and a hit rate of 0.0"),
    (None, [S(1, 32, 16)], "one request found 16 of its 32 tokens"),
    (None, [S(1, 32, 16), S(), S(preempted_requests=1, preempted_queries=40, preempted_hits=40)],
     "a step without lookups, then a resumed request's lookup: neither counts"),
    (None, [S(1, 10, 5, preempted_requests=2, preempted_queries=50, preempted_hits=50)],
     "a step with first and resumed lookups: only the first count"),
    (None, [S(1, 30, 0), S(1, 10, 5)], "hits over queries, in tokens: 5 of 40"),
    (2, [S(1, 10, 10), S(1, 10, 0), S(1, 10, 5)], "a window of 2 requests: the oldest step goes"),
    (3, [S(2, 20, 20), S(2, 20, 0)], "4 requests in a window of 3: the oldest step goes whole"),
    (2, [S(5, 100, 40), S(), S(1, 10, 10)],
     "the newest step stays, even with more requests than the window; an empty step changes nothing"),
    (4, [S(1, 10, 10), S(1, 10, 10), S(1, 10, 10), S(3, 10, 0)], "one step pushes out two"),
    (None, [S(1, 10, 0)] + [S(1, 10, 10)] * 999 + [S(1, 20, 20)],
     "the default window holds 1,000 requests: the 1,001st pushes out the first"),
]  # fmt: skip


def _random_scenarios(count: int, seed: int) -> list[tuple[int | None, list[PrefixCacheStats], str]]:
    rng = random.Random(seed)
    scenarios = []
    for _ in range(count):
        steps = []
        for _ in range(rng.randint(1, 12)):
            requests = rng.choice((0, 0, 1, 1, 2, 3, 5))
            queries = sum(rng.randint(1, 64) for _ in range(requests))
            preempted = rng.choice((0, 0, 1))
            preempted_queries = rng.randint(1, 64) * preempted
            steps.append(
                S(
                    requests,
                    queries,
                    rng.randint(0, queries),
                    preempted_requests=preempted,
                    preempted_queries=preempted_queries,
                    preempted_hits=rng.randint(0, preempted_queries),
                )
            )
        scenarios.append((rng.choice((1, 2, 3, 4, 6, 10)), steps, "random steps"))
    return scenarios


def _new(cls: type, window: int | None) -> object:
    return cls() if window is None else cls(max_recent_requests=window)


def _trace(cls: type, window: int | None, steps: list[PrefixCacheStats]) -> list:
    """``(empty, hit_rate)`` before the first step and after each, or the error's name."""
    metrics = _new(cls, window)
    seen = [(outcome(lambda: metrics.empty), outcome(lambda: metrics.hit_rate))]
    for stats in steps:
        try:
            metrics.observe(stats)  # type: ignore[attr-defined]
        except NotImplementedError:
            raise
        except Exception as error:  # part of the behaviour: the run stops there
            seen.append(type(error).__name__)
            break
        seen.append((outcome(lambda: metrics.empty), outcome(lambda: metrics.hit_rate)))
    return seen


def _caching_hint(cls: type) -> str:
    scenarios = CACHING_SCENARIOS + _random_scenarios(100, 41)

    def probe(candidate: Callable[..., object]) -> list:
        return [_trace(candidate, window, steps) for window, steps, _ in scenarios]  # type: ignore[arg-type]

    return diagnose(cls, CACHING_MISTAKES, probe, CACHING_RULE)


def _constructor(window: int | None) -> str:
    return "CachingMetrics()" if window is None else f"CachingMetrics(max_recent_requests={window})"


def _scenario(
    c: Checker, cls: type, window: int | None, steps: list[PrefixCacheStats], why: str, hint
) -> None:
    """Run one scenario step by step, checking ``empty`` and ``hit_rate`` before the first step and after
    each (after a run of equal steps, once, at its end)."""
    start = f"m = {_constructor(window)}"
    metrics = c.run(f"{start}  # {why}", lambda: _new(cls, window), hint)
    expected = _new(PackageCachingMetrics, window)
    for number in range(len(steps) + 1):
        if number:
            stats = steps[number - 1]
            c.run(f"m.observe({_show(stats)})  # {why}", lambda stats=stats: metrics.observe(stats), hint)
            expected.observe(stats)
            if number < len(steps) and steps[number] == stats:
                continue
        where = "; ".join(part for part in (start, _steps_text(steps[:number])) if part)
        c.equal(f"{where}; m.empty  # {why}", lambda: metrics.empty, expected.empty, hint)
        c.equal(f"{where}; m.hit_rate  # {why}", lambda: metrics.hit_rate, expected.hit_rate, hint)


def _steps_text(steps: list[PrefixCacheStats]) -> str:
    """The observe calls so far, a run of equal steps written once with its count."""
    runs: list[tuple[PrefixCacheStats, int]] = []
    for stats in steps:
        if runs and runs[-1][0] == stats:
            runs[-1] = (stats, runs[-1][1] + 1)
        else:
            runs.append((stats, 1))
    return "; ".join(
        f"m.observe({_show(stats)})" + (f" ({count} times)" if count > 1 else "") for stats, count in runs
    )


@task("15.CachingMetrics", "the prefix cache's hit rate over the recent requests", needs=("CachingMetrics",))
def _caching_metrics(c: Checker, cls) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _caching_hint(cls)

    for window, steps, why in CACHING_SCENARIOS:
        _scenario(c, cls, window, steps, why, hint)
    scenarios = _random_scenarios(200, 14)
    call = f"CachingMetrics on {len(scenarios)} random runs of steps against the package's CachingMetrics"

    def first_wrong() -> tuple | None:
        for window, steps, why in scenarios:
            if _trace(cls, window, steps) != _trace(PackageCachingMetrics, window, steps):
                return window, steps, why
        return None

    wrong = c.run(call, first_wrong, hint)
    if wrong is not None:
        _scenario(c, cls, *wrong, hint)
    c.holds(call, wrong is None, "the package's empty and hit_rate after every step", wrong, hint)

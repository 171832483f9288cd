"""vLLM's metrics by vLLM's names: what the engine measures each step and over a run, the line it logs,
and its Prometheus metrics as text (lessons 07, 14).

A serving engine is watched through a few numbers, and vLLM names them (vLLM 0.33.0):

* each step, the scheduler's :class:`SchedulerStats` (``vllm/v1/metrics/stats.py``): requests
  running and waiting, the **KV-cache usage** (the share of the pool's blocks in use, where a free
  block that still holds a cached prefix counts as free: so the usage falls back to 0 % after a
  burst although the prefix cache keeps its blocks), what the prefix cache found (a resumed
  request's lookup apart), and the step's preemptions and tokens;
* every few seconds, one line through Python's :mod:`logging` (vLLM's ``LoggingStatLogger`` in
  ``vllm/v1/metrics/loggers.py``): ``Engine 000: Avg prompt throughput: 12.5 tokens/s, Avg
  generation throughput: 3.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage:
  42.5%, Prefix cache hit rate: 50.0%`` (:func:`format_log_line`, :class:`LoggingStatLogger`);
* on ``/metrics``, counters, gauges and histograms in Prometheus' text format (vLLM's
  ``PrometheusStatLogger``): ``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running``,
  ``vllm:num_preemptions_total``, ``vllm:time_to_first_token_seconds_bucket{le="0.1"}``, ...

Every Prometheus family is declared once, here (:data:`METRICS` and :data:`REQUEST_SUCCESS_METRIC`,
each a :class:`MetricSpec`: vLLM 0.33.0's name, type, help text, labels and buckets), and both
texts are ``prometheus_client``'s, made from those specs: :meth:`RunMetrics.prometheus_text`, a
run's end (lesson 15), and the server's live ``/metrics``
(:class:`~paged_kv.entrypoints.openai.metrics.PrometheusStatLogger`, lesson 16). ``prometheus_client``
is in the course's extra, not a core dependency: it is imported when a metric is made or a text
rendered, never when this module is imported.

The online engine (:meth:`LLMEngine.step <paged_kv.serving.llm_engine.LLMEngine.step>`) makes one
:class:`SchedulerStats` per step (``EngineResult.scheduler_stats``), times each step on the wall
clock, logs the line every ``log_stats_interval`` steps or seconds when asked (logger
``paged_kv.engine``, INFO; off by default), logs a WARNING when it preempts (vLLM V0's text and
rule, :data:`PREEMPTION_WARNING`),
and gathers a run's metrics in a :class:`RunMetrics` (``EngineResult.metrics()``).
:func:`enable_engine_log` shows the engine's log lines in a notebook.
"""

from __future__ import annotations

import logging
import math
import sys
import types
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from paged_kv.core.prefix_cache import PrefixCacheStats

if TYPE_CHECKING:  # prometheus_client is the course's extra: imported only where a metric is made
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase
    from prometheus_client.metrics_core import Metric

# ------------------------------------------------------------------------------ vLLM's names

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
"""A gauge that holds a fraction, 0 to 1, despite its name ("KV-cache usage. 1 means 100 percent usage.")."""
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
"""A counter: exposed as ``vllm:num_preemptions_total``, as every counter gains ``_total``."""
PROMPT_TOKENS = "vllm:prompt_tokens"
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached"
GENERATION_TOKENS = "vllm:generation_tokens"
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_SUCCESS = "vllm:request_success"
"""A counter of finished requests, one series per ``finished_reason`` (the server's; a run has none)."""

LABEL_NAMES: tuple[str, ...] = ("model_name", "engine")
"""The labels of every series, as vLLM's ``PrometheusStatLogger`` names them: the served model's name
and the engine's index (``"0"``)."""
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FinishReason`` names (``vllm/v1/engine/__init__.py``): each a ``finished_reason`` series
of :data:`REQUEST_SUCCESS` from the start."""

TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""vLLM's buckets of ``vllm:time_to_first_token_seconds`` (``vllm/v1/metrics/buckets.py``)."""
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
"""vLLM's buckets of ``vllm:inter_token_latency_seconds``."""
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""vLLM's buckets of ``vllm:e2e_request_latency_seconds``."""

# ------------------------------------------------------------------------------ the Prometheus families

METRIC_TYPES = ("counter", "gauge", "histogram")
"""The kinds of metric the families here are: a type of :class:`MetricSpec`."""


@dataclass(frozen=True)
class MetricSpec:
    """How vLLM declares a metric family: its name, its type (``"counter"``, ``"gauge"``,
    ``"histogram"``), its help text, its label names and, for a histogram, its buckets.

    :meth:`create` makes the family a ``prometheus_client`` metric and :meth:`record` adds a value
    to one of its series, so every text of the family has these names, help, labels and buckets.

    Invariant: ``type`` is one of :data:`METRIC_TYPES`, and ``buckets`` are given exactly when it is
    ``"histogram"`` (a ValueError naming the field otherwise).
    """

    name: str
    type: str
    documentation: str
    buckets: tuple[float, ...] = ()
    labelnames: tuple[str, ...] = LABEL_NAMES

    def __post_init__(self) -> None:
        if self.type not in METRIC_TYPES:
            raise ValueError(f"type must be one of {', '.join(METRIC_TYPES)}, got {self.type!r}")
        if bool(self.buckets) != (self.type == "histogram"):
            raise ValueError(
                f"buckets go with a histogram and only with one, got {self.buckets!r} for a {self.type}"
            )

    def create(self, registry: CollectorRegistry) -> MetricWrapperBase:
        """The family as a ``prometheus_client`` metric in ``registry``, its series made by
        ``.labels(*values)``, one value for each of :attr:`labelnames`.

        Raises:
            ModuleNotFoundError: ``prometheus_client`` (the course's extra) is not installed.
        """
        client = _prometheus_client()
        kind = {"gauge": client.Gauge, "counter": client.Counter, "histogram": client.Histogram}[self.type]
        extra = {"buckets": self.buckets} if self.type == "histogram" else {}
        return kind(self.name, self.documentation, self.labelnames, registry=registry, **extra)

    def record(self, series: MetricWrapperBase, value: float | Sequence[float]) -> None:
        """Add ``value`` to ``series``, one series of :meth:`create`'s metric: a gauge is set to it, a
        counter grows by it, and a histogram observes each sample of it (a sequence of them)."""
        if self.type == "gauge":
            series.set(value)  # type: ignore[attr-defined]
        elif self.type == "counter":
            series.inc(value)  # type: ignore[attr-defined]
        else:
            for sample in value:  # type: ignore[union-attr]
                series.observe(sample)  # type: ignore[attr-defined]


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(NUM_REQUESTS_RUNNING, "gauge", "Number of requests in model execution batches."),
    MetricSpec(NUM_REQUESTS_WAITING, "gauge", "Number of requests waiting to be processed."),
    MetricSpec(KV_CACHE_USAGE_PERC, "gauge", "KV-cache usage. 1 means 100 percent usage."),
    MetricSpec(
        PREFIX_CACHE_QUERIES, "counter", "Prefix cache queries, in terms of number of queried tokens."
    ),
    MetricSpec(PREFIX_CACHE_HITS, "counter", "Prefix cache hits, in terms of number of cached tokens."),
    MetricSpec(
        EXTERNAL_PREFIX_CACHE_QUERIES,
        "counter",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
        "number of queried tokens.",
    ),
    MetricSpec(
        EXTERNAL_PREFIX_CACHE_HITS,
        "counter",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
        "number of cached tokens.",
    ),
    MetricSpec(NUM_PREEMPTIONS, "counter", "Cumulative number of preemption from the engine."),
    MetricSpec(PROMPT_TOKENS, "counter", "Number of prefill tokens processed."),
    MetricSpec(PROMPT_TOKENS_CACHED, "counter", "Number of cached prompt tokens (local + external)."),
    MetricSpec(GENERATION_TOKENS, "counter", "Number of generation tokens processed."),
    MetricSpec(
        TIME_TO_FIRST_TOKEN_SECONDS,
        "histogram",
        "Histogram of time to first token in seconds.",
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    MetricSpec(
        INTER_TOKEN_LATENCY_SECONDS,
        "histogram",
        "Histogram of inter-token latency in seconds.",
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    MetricSpec(
        E2E_REQUEST_LATENCY_SECONDS,
        "histogram",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS,
    ),
)
"""The engine's families, which a run's :meth:`RunMetrics.prometheus_text` and the server's
``/metrics`` both expose, in the order vLLM's ``PrometheusStatLogger`` declares them, each with
vLLM's help text, type, labels (:data:`LABEL_NAMES`) and buckets."""

REQUEST_SUCCESS_METRIC = MetricSpec(
    REQUEST_SUCCESS,
    "counter",
    "Count of successfully processed requests.",
    labelnames=(*LABEL_NAMES, "finished_reason"),
)
"""The server's count of finished requests by :data:`FINISH_REASONS` (vLLM's ``counter_request_success``);
a run's :class:`RunMetrics` does not keep finish reasons, so its text has none."""


def _prometheus_client() -> types.ModuleType:
    """``prometheus_client``, imported when first needed: it is the course's extra, not a core dependency."""
    try:
        import prometheus_client
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "vLLM's Prometheus metrics are made with prometheus_client, which is missing: it comes with "
            "the course's packages, pip install 'paged_kv[course]'",
            name="prometheus_client",
        ) from error
    return prometheus_client


class _WithoutCreated:
    """A registry's families without their ``_created`` series: a finished run's text is the same at
    every run, so it leaves out when each counter and histogram was made."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield family


ENGINE_LOGGER = "paged_kv.engine"
"""The name of the engine's logger: the periodic line at INFO, a preemption's warning at WARNING."""

PREEMPTION_WARNING = (
    "Sequence group %s is preempted by %s mode because there is not enough KV cache space. This can "
    "affect the end-to-end performance. Increase gpu_memory_utilization or tensor_parallel_size to "
    "provide more KV cache memory. total_num_cumulative_preemption=%d"
)
"""What a preemption logs, with the request id, the mode (``PreemptionMode.RECOMPUTE`` or
``PreemptionMode.SWAP``) and the preemptions so far: vLLM V0's warning (``Scheduler._preempt`` in
``vllm/core/scheduler.py``), logged as V0 logged it, for the first preemption and every
:data:`PREEMPTION_WARNING_EVERY`-th after. vLLM v1, 0.33.0 included, logs none: it counts them
(``vllm:num_preemptions``, the log line's ``Preemptions: N``)."""

PREEMPTION_WARNING_EVERY = 50
"""V0 warned when its count of preemptions so far was a multiple of 50: the 1st, the 51st, the 101st."""

PREEMPTION_MODES = {"recompute": "PreemptionMode.RECOMPUTE", "swap": "PreemptionMode.SWAP"}
"""The mode each way of preempting prints as in :data:`PREEMPTION_WARNING` (V0's enum)."""

logging.getLogger(ENGINE_LOGGER).addHandler(logging.NullHandler())  # a library's logger: silent by default


# ------------------------------------------------------------------------------ one step


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """One step as the scheduler saw it at its end, in vLLM's names (vLLM: ``SchedulerStats`` and, for
    the last four fields, the same step's ``IterationStats``, ``vllm/v1/metrics/stats.py``).

    Measured after the step's finished requests left and freed their blocks, as vLLM's
    ``Scheduler.make_stats`` is: ``num_running_reqs`` (running, swapped-in ones included),
    ``num_waiting_reqs`` (arrived, neither running nor swapped out), ``num_swapped_reqs`` (the
    course's swap: their K/V in host memory; vLLM v1 has none) and ``kv_cache_usage``, the
    memory's ``usage``: blocks in use over the pool's blocks, a fraction from 0 to 1, where a free
    block that still holds a cached prefix counts as free, and a hybrid model's null block is left
    out of both (vLLM: ``BlockPool.get_usage``). ``prefix_cache_stats`` counts the step's lookups,
    in tokens, a resumed request's apart (``preempted_queries``, ``preempted_hits``), and
    ``connector_prefix_cache_stats`` the KV connector's lookups past the device's hits (the host
    tier's; ``None``: no connector), vLLM's "External prefix cache hit rate".

    ``num_preempted_reqs`` counts the step's preemptions; ``num_generation_tokens`` the tokens it
    sampled (first tokens included); ``num_prompt_tokens`` the prompt tokens of the requests whose
    prefill ended with their first token in this step (vLLM counts a prompt once, when its first
    token comes; a prefill again after a preemption does not count), and
    ``num_cached_prompt_tokens`` those of them the prefix cache served at the request's first
    admission. :attr:`num_computed_prompt_tokens`, their difference, is what vLLM's "Avg prompt
    throughput" counts.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preempted_reqs: int = 0
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_swapped_reqs: int = 0
    connector_prefix_cache_stats: PrefixCacheStats | None = None

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens less the cached ones (vLLM: ``PromptTokenStats.computed``)."""
        return self.num_prompt_tokens - self.num_cached_prompt_tokens


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """A request that finished in a step (vLLM: ``FinishedRequestStats``): why (``"stop"``,
    ``"length"``, ``"abort"``), the seconds from its arrival, and the tokens it generated."""

    finish_reason: str
    e2e_latency: float
    num_generation_tokens: int


@dataclass(frozen=True, slots=True)
class IterationStats:
    """The latencies one step of the online engine completed, in wall-clock seconds (vLLM:
    ``IterationStats``, lesson 16): each first token's time since its request arrived, each later
    token's time since its request's previous one, and the requests that finished."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    time_to_first_tokens_iter: tuple[float, ...] = ()
    inter_token_latencies_iter: tuple[float, ...] = ()
    finished_requests: tuple[FinishedRequestStats, ...] = ()


# ------------------------------------------------------------------------------ the log line


def kv_cache_device(device: object) -> str:
    """The pool's name in the log line, as vLLM names it: ``"GPU"`` on CUDA, else the device type in
    capitals (``"CPU"``, ``"MPS"``)."""
    device_type = getattr(device, "type", str(device).split(":")[0])
    return "GPU" if device_type == "cuda" else device_type.upper()


def _log_line(
    prompt_throughput: float,
    generation_throughput: float,
    num_running_reqs: int,
    num_waiting_reqs: int,
    kv_cache_usage: float,
    num_preemptions: int,
    prefix_cache_hit_rate: float | None,
    kv_cache_device: str,
    engine_index: int,
    external_prefix_cache_hit_rate: float | None = None,
) -> tuple[str, list[int | float | str]]:
    """The format and arguments of the line, built as ``LoggingStatLogger.log`` builds them."""
    log_parts = [
        "Avg prompt throughput: %.1f tokens/s",
        "Avg generation throughput: %.1f tokens/s",
        "Running: %d reqs",
        "Waiting: %d reqs",
    ]
    log_args: list[int | float | str] = [
        prompt_throughput,
        generation_throughput,
        num_running_reqs,
        num_waiting_reqs,
    ]
    if num_preemptions > 0:
        log_parts.append("Preemptions: %d")
        log_args.append(num_preemptions)
    log_parts.append("%s KV cache usage: %.1f%%")
    log_args.extend([kv_cache_device, kv_cache_usage * 100])
    if prefix_cache_hit_rate is not None:
        log_parts.append("Prefix cache hit rate: %.1f%%")
        log_args.append(prefix_cache_hit_rate * 100)
    if external_prefix_cache_hit_rate is not None:
        log_parts.append("External prefix cache hit rate: %.1f%%")
        log_args.append(external_prefix_cache_hit_rate * 100)
    return "Engine {:03d}: ".format(engine_index) + ", ".join(log_parts), log_args  # noqa: UP032 (vLLM's)


def format_log_line(
    prompt_throughput: float,
    generation_throughput: float,
    num_running_reqs: int,
    num_waiting_reqs: int,
    kv_cache_usage: float,
    *,
    num_preemptions: int = 0,
    prefix_cache_hit_rate: float | None = None,
    kv_cache_device: str = "GPU",
    engine_index: int = 0,
    external_prefix_cache_hit_rate: float | None = None,
) -> str:
    """vLLM's periodic log line (``LoggingStatLogger.log``), exactly:

    ``Engine 000: Avg prompt throughput: 12.5 tokens/s, Avg generation throughput: 3.0 tokens/s,
    Running: 2 reqs, Waiting: 1 reqs, Preemptions: 1, GPU KV cache usage: 42.5%, Prefix cache hit
    rate: 50.0%``

    ``Preemptions`` appears when the interval preempted (``num_preemptions > 0``) and the hit rate
    when the prefix cache was looked up (not ``None``), then vLLM's ``External prefix cache hit rate:
    N%`` when a KV connector was (``external_prefix_cache_hit_rate``); ``kv_cache_usage`` and the hit
    rates are fractions, printed as percentages.
    """
    fmt, args = _log_line(
        prompt_throughput,
        generation_throughput,
        num_running_reqs,
        num_waiting_reqs,
        kv_cache_usage,
        num_preemptions,
        prefix_cache_hit_rate,
        kv_cache_device,
        engine_index,
        external_prefix_cache_hit_rate,
    )
    return fmt % tuple(args)


class CachingMetrics:
    """The prefix cache's hit rate over the most recent ``max_recent_requests`` first lookups (vLLM:
    ``CachingMetrics``): what the log line shows. A resumed request's lookup does not count, and a
    step without lookups changes nothing."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = self.aggregated_query_total = self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.requests == 0:
            return
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            old_requests, old_queries, old_hits = self.query_queue.popleft()
            self.aggregated_requests -= old_requests
            self.aggregated_query_total -= old_queries
            self.aggregated_query_hit -= old_hits

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total


def check_interval(interval: object) -> int | float | None:
    """``log_stats_interval`` as given, or a ValueError naming it: None (no log), a number of steps (an
    int of at least 1) or of seconds (a float above 0)."""
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not interval > 0:
        raise ValueError(
            f"log_stats_interval must be None, a number of steps (an int >= 1) or of seconds "
            f"(a float > 0), got {interval!r}"
        )
    return interval if isinstance(interval, int) else float(interval)


class LoggingStatLogger:
    """vLLM's periodic log line, from the steps' :class:`SchedulerStats` (vLLM: ``LoggingStatLogger``).

    :meth:`record` takes each step's stats and the engine's wall clock at its end (seconds since
    the run began), and logs the line when ``interval`` has passed since the last one: a number of
    steps (an int) or of seconds (a float; vLLM logs every ``VLLM_LOG_STATS_INTERVAL``, 10.0
    seconds). The throughputs are the interval's computed prompt tokens and generated tokens over
    its seconds; ``Running``, ``Waiting`` and the usage are the last step's; ``Preemptions`` the
    interval's; the hit rate that of the most recent 1,000 first lookups. As in vLLM, the line goes
    to DEBUG instead of INFO while the engine is idle (no token in this interval nor the one before).
    """

    def __init__(
        self,
        interval: int | float,
        *,
        kv_cache_device: str = "GPU",
        engine_index: int = 0,
        logger: logging.Logger | None = None,
    ) -> None:
        checked = check_interval(interval)
        if checked is None:
            raise ValueError("interval must be a number of steps or of seconds, got None")
        self.interval = checked
        self.kv_cache_device = kv_cache_device
        self.engine_index = engine_index
        self.logger = logger if logger is not None else logging.getLogger(ENGINE_LOGGER)
        self.prefix_caching_metrics = CachingMetrics()
        self.connector_prefix_caching_metrics = CachingMetrics()
        self.last_scheduler_stats = SchedulerStats()
        self.last_prompt_throughput = self.last_generation_throughput = 0.0
        self.engine_is_idle = False
        self._reset(0.0)

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_steps = 0
        self.num_prompt_tokens = self.num_generation_tokens = self.num_preemptions = 0

    def record(self, stats: SchedulerStats, now: float) -> None:
        """Take one step's stats, ``now`` being the wall clock at its end; log if the interval passed."""
        self.num_prompt_tokens += stats.num_computed_prompt_tokens
        self.num_generation_tokens += stats.num_generation_tokens
        self.num_preemptions += stats.num_preempted_reqs
        self.prefix_caching_metrics.observe(stats.prefix_cache_stats)
        if stats.connector_prefix_cache_stats is not None:
            self.connector_prefix_caching_metrics.observe(stats.connector_prefix_cache_stats)
        self.last_scheduler_stats = stats
        self.num_steps += 1
        if isinstance(self.interval, int):
            due = self.num_steps >= self.interval
        else:
            due = now - self.last_log_time >= self.interval
        if due:
            self.log(now)

    def flush(self, now: float) -> None:
        """Log the steps recorded since the last line, if any (the engine's end of a run)."""
        if self.num_steps:
            self.log(now)

    def _throughput(self, tokens: int, now: float) -> float:
        delta_time = now - self.last_log_time
        return float(tokens / delta_time) if delta_time > 0.0 else 0.0

    def log(self, now: float) -> None:
        """Log the line for the interval that ends at ``now``, and start the next one."""
        prompt_throughput = self._throughput(self.num_prompt_tokens, now)
        generation_throughput = self._throughput(self.num_generation_tokens, now)
        num_preemptions = self.num_preemptions
        self._reset(now)
        self.engine_is_idle = not any(
            (
                prompt_throughput,
                generation_throughput,
                self.last_prompt_throughput,
                self.last_generation_throughput,
            )
        )
        self.last_prompt_throughput, self.last_generation_throughput = (
            prompt_throughput,
            generation_throughput,
        )
        stats = self.last_scheduler_stats
        caching, external = self.prefix_caching_metrics, self.connector_prefix_caching_metrics
        fmt, args = _log_line(
            prompt_throughput,
            generation_throughput,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage,
            num_preemptions,
            None if caching.empty else caching.hit_rate,
            self.kv_cache_device,
            self.engine_index,
            None if external.empty else external.hit_rate,
        )
        log_fn = self.logger.debug if self.engine_is_idle else self.logger.info
        log_fn(fmt, *args)


def enable_engine_log(
    stream: TextIO | None = None, level: int = logging.INFO, fmt: str = "%(levelname)s %(message)s"
) -> logging.Handler:
    """Show the engine's log on ``stream`` (default: standard output, a notebook's cell output) from
    ``level`` on: the periodic line of an ``Engine(..., log_stats_interval=...)`` and the
    preemption warnings, which go nowhere by default. Calling it again replaces the handler it
    added; ``logging.getLogger("paged_kv.engine").removeHandler(handler)`` removes it.
    """
    logger = logging.getLogger(ENGINE_LOGGER)
    for handler in [h for h in logger.handlers if getattr(h, "_paged_kv_engine_log", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout if stream is None else stream)
    handler.setFormatter(logging.Formatter(fmt))
    handler._paged_kv_engine_log = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


# ------------------------------------------------------------------------------ a whole run


@dataclass(frozen=True)
class RunMetrics:
    """A run's metrics, as a scrape of vLLM's ``/metrics`` at its end reads them, and its latencies.

    The gauges are the last step's (``num_requests_running``, ``num_requests_waiting``,
    ``kv_cache_usage_perc``, a fraction); the counters the run's: ``num_preemptions``,
    ``prompt_tokens`` (each request's prompt, once, when its first token came), ``generation_tokens``
    (every sampled token) and ``prefix_cache_stats``, whose ``queries`` and ``hits`` are vLLM's
    ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (first lookups only; a resumed
    request's lookups are the ``preempted_`` counts, which vLLM does not export). The latencies,
    in seconds on the engine's wall clock, one per request or per token: time to first token (from
    the start of the request's arrival step to the end of the step that sampled its first token),
    inter-token latency (from the end of the step that sampled a request's token to the end of the
    step that sampled its next one) and end-to-end latency (arrival to the end of its last step).
    ``num_computed_prompt_tokens`` is ``prompt_tokens`` less those the prefix cache served at each
    request's first admission: what vLLM's "Avg prompt throughput" counts.
    """

    steps: int
    elapsed_seconds: float
    num_requests: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_stats: PrefixCacheStats
    time_to_first_token_seconds: tuple[float, ...] = ()
    inter_token_latency_seconds: tuple[float, ...] = ()
    e2e_request_latency_seconds: tuple[float, ...] = ()
    num_computed_prompt_tokens: int = 0
    external_prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    """The KV connector's lookups past the device's hits, summed over the run (the host tier's;
    zero without one): ``vllm:external_prefix_cache_queries`` and ``_hits``."""

    @property
    def prefix_cache_queries(self) -> int:
        return self.prefix_cache_stats.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.prefix_cache_stats.hits

    @property
    def request_throughput(self) -> float:
        """Finished requests per second (vLLM's benchmark: ``request_throughput``)."""
        return self.num_requests / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        """Generated tokens per second (vLLM's benchmark: ``output_throughput``)."""
        return self.generation_tokens / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        """Prompt and generated tokens per second (vLLM's benchmark: ``total_token_throughput``)."""
        total = self.prompt_tokens + self.generation_tokens
        return total / self.elapsed_seconds if self.elapsed_seconds > 0 else 0.0

    def prometheus_text(self, model_name: str = "paged_kv", engine: int = 0) -> str:
        """The run's metrics in Prometheus' text format (version 0.0.4), as a scrape of vLLM's
        ``/metrics`` at the run's end reads them: :data:`METRICS`, each with its ``# HELP`` and
        ``# TYPE`` lines, labelled ``model_name`` and ``engine`` as vLLM labels them, a counter's name
        ending in ``_total``, a histogram as cumulative ``_bucket`` lines (``le``, up to ``+Inf``),
        ``_count`` and ``_sum``. ``prometheus_client`` writes the text, from the specs the server's
        ``/metrics`` is made from (:meth:`MetricSpec.create`, :meth:`MetricSpec.record`), without
        its ``_created`` series.

        Raises:
            ModuleNotFoundError: ``prometheus_client`` (the course's extra) is not installed.
        """
        values: dict[str, float | Sequence[float]] = {
            NUM_REQUESTS_RUNNING: self.num_requests_running,
            NUM_REQUESTS_WAITING: self.num_requests_waiting,
            KV_CACHE_USAGE_PERC: self.kv_cache_usage_perc,
            PREFIX_CACHE_QUERIES: self.prefix_cache_stats.queries,
            PREFIX_CACHE_HITS: self.prefix_cache_stats.hits,
            EXTERNAL_PREFIX_CACHE_QUERIES: self.external_prefix_cache_stats.queries,
            EXTERNAL_PREFIX_CACHE_HITS: self.external_prefix_cache_stats.hits,
            NUM_PREEMPTIONS: self.num_preemptions,
            PROMPT_TOKENS: self.prompt_tokens,
            PROMPT_TOKENS_CACHED: self.prompt_tokens - self.num_computed_prompt_tokens,
            GENERATION_TOKENS: self.generation_tokens,
            TIME_TO_FIRST_TOKEN_SECONDS: self.time_to_first_token_seconds,
            INTER_TOKEN_LATENCY_SECONDS: self.inter_token_latency_seconds,
            E2E_REQUEST_LATENCY_SECONDS: self.e2e_request_latency_seconds,
        }
        prometheus_client = _prometheus_client()
        registry = prometheus_client.CollectorRegistry()
        for spec in METRICS:
            spec.record(spec.create(registry).labels(model_name, str(engine)), values[spec.name])
        return prometheus_client.generate_latest(_WithoutCreated(registry)).decode()

    def summary(self) -> str:
        """The run in the layout of ``vllm bench serve``'s result (``vllm/benchmarks/serve.py``): requests,
        duration, tokens, throughputs, then mean, median and P99 of TTFT, ITL and E2EL in ms."""
        rows = [
            "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
            "{:<40} {:<10}".format("Successful requests:", self.num_requests),
            "{:<40} {:<10.2f}".format("Benchmark duration (s):", self.elapsed_seconds),
            "{:<40} {:<10}".format("Total input tokens:", self.prompt_tokens),
            "{:<40} {:<10}".format("Total generated tokens:", self.generation_tokens),
            "{:<40} {:<10.2f}".format("Request throughput (req/s):", self.request_throughput),
            "{:<40} {:<10.2f}".format("Output token throughput (tok/s):", self.output_throughput),
            "{:<40} {:<10.2f}".format("Total token throughput (tok/s):", self.total_token_throughput),
        ]
        for short, header, values in (
            ("TTFT", "Time to First Token", self.time_to_first_token_seconds),
            ("ITL", "Inter-token Latency", self.inter_token_latency_seconds),
            ("E2EL", "End-to-end Latency", self.e2e_request_latency_seconds),
        ):
            rows.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
            rows.append("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", _mean(values) * 1000))
            rows.append("{:<40} {:<10.2f}".format(f"Median {short} (ms):", percentile(values, 50) * 1000))
            rows.append("{:<40} {:<10.2f}".format(f"P99 {short} (ms):", percentile(values, 99) * 1000))
        rows.append("=" * 50)
        return "\n".join(rows)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile of ``values``, interpolated linearly between the closest ranks (numpy's
    default, which vLLM's benchmark uses); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0

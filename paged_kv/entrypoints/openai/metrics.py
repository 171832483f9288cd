"""``GET /metrics``: the engine's steps as live Prometheus metrics, by vLLM's names (lesson 15).

vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``) turns each step's
``SchedulerStats`` and ``IterationStats`` into ``prometheus_client`` gauges, counters and
histograms; :class:`PrometheusStatLogger` does the same for the metrics of
:data:`paged_kv.serving.metrics.METRICS` (lesson 14's names, help texts, types and buckets) and
``vllm:request_success``:

* gauges, set from the step's ``SchedulerStats`` (measured after its finished requests left):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a
  fraction, 0 to 1);
* counters (exposed with ``_total``): ``vllm:num_preemptions``, ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits`` (tokens of first lookups), ``vllm:prompt_tokens`` (a prompt once,
  when its first token comes), ``vllm:generation_tokens``, and ``vllm:request_success``, one per
  finished completion by its ``finished_reason`` label (``stop``, ``length``, ``abort``...);
* histograms, in seconds: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
  and ``vllm:e2e_request_latency_seconds`` (one per finished completion).

Every series is labelled ``model_name`` and ``engine`` (``"0"``: one engine), as vLLM labels them.
Each logger owns its ``CollectorRegistry`` (``prometheus_client``'s global one is shared by a whole
process: two servers in one process, in a test or a notebook, would clash on it). The logger is
called in the engine's worker thread after every step; ``prometheus_client``'s metrics are
thread-safe, so a scrape on the event loop reads them as they are.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from paged_kv.serving.metrics import (
    E2E_REQUEST_LATENCY_SECONDS,
    GENERATION_TOKENS,
    INTER_TOKEN_LATENCY_SECONDS,
    KV_CACHE_USAGE_PERC,
    METRICS,
    NUM_PREEMPTIONS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    IterationStats,
    SchedulerStats,
)

REQUEST_SUCCESS = "vllm:request_success"
REQUEST_SUCCESS_HELP = "Count of successfully processed requests."
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
"""vLLM's ``FinishReason`` names: each a ``finished_reason`` of ``vllm:request_success`` from the start."""
LABEL_NAMES = ("model_name", "engine")


class PrometheusStatLogger:
    """A stat logger for :attr:`AsyncLLM.stat_loggers <paged_kv.serving.async_llm.AsyncLLM.stat_loggers>`
    that keeps vLLM's metrics in its own :attr:`registry` (see the module).

    Invariant: each counter is the sum of what every step recorded since the logger was made.
    """

    content_type = CONTENT_TYPE_LATEST
    """The media type of :meth:`render`'s text."""

    def __init__(self, model_name: str, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.labels = (model_name, str(engine_index))
        specs = {spec.name: spec for spec in METRICS}
        metrics = {}
        for name, spec in specs.items():
            kind = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[spec.type]
            extra = {"buckets": spec.buckets} if spec.type == "histogram" else {}
            metric = kind(name, spec.documentation, LABEL_NAMES, registry=self.registry, **extra)
            metrics[name] = metric.labels(*self.labels)
        self.metrics = metrics
        success = Counter(
            REQUEST_SUCCESS, REQUEST_SUCCESS_HELP, (*LABEL_NAMES, "finished_reason"), registry=self.registry
        )
        self.request_success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}

    def __call__(self, stats: SchedulerStats, iteration: IterationStats) -> None:
        """Record one step (vLLM: ``PrometheusStatLogger.record``)."""
        m = self.metrics
        m[NUM_REQUESTS_RUNNING].set(stats.num_running_reqs)
        m[NUM_REQUESTS_WAITING].set(stats.num_waiting_reqs)
        m[KV_CACHE_USAGE_PERC].set(stats.kv_cache_usage)
        m[PREFIX_CACHE_QUERIES].inc(stats.prefix_cache_stats.queries)
        m[PREFIX_CACHE_HITS].inc(stats.prefix_cache_stats.hits)
        m[NUM_PREEMPTIONS].inc(stats.num_preempted_reqs)
        m[PROMPT_TOKENS].inc(iteration.num_prompt_tokens)
        m[GENERATION_TOKENS].inc(iteration.num_generation_tokens)
        for seconds in iteration.time_to_first_tokens_iter:
            m[TIME_TO_FIRST_TOKEN_SECONDS].observe(seconds)
        for seconds in iteration.inter_token_latencies_iter:
            m[INTER_TOKEN_LATENCY_SECONDS].observe(seconds)
        for finished in iteration.finished_requests:
            counter = self.request_success.get(finished.finish_reason)
            if counter is not None:
                counter.inc()
            m[E2E_REQUEST_LATENCY_SECONDS].observe(finished.e2e_latency)

    def render(self) -> bytes:
        """The registry in Prometheus' text format (``prometheus_client.generate_latest``)."""
        return generate_latest(self.registry)

"""``GET /metrics``: the engine's steps as live Prometheus metrics, by vLLM's names (lesson 16).

vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``) turns each step's
``SchedulerStats`` and ``IterationStats`` into ``prometheus_client`` gauges, counters and
histograms; :class:`PrometheusStatLogger` does the same for the families declared in
:mod:`paged_kv.serving.metrics` (:data:`~paged_kv.serving.metrics.METRICS`, whose names, help
texts, types and buckets lesson 15's run text has too, and
:data:`~paged_kv.serving.metrics.REQUEST_SUCCESS_METRIC`), each made and fed by its
:class:`~paged_kv.serving.metrics.MetricSpec`:

* gauges, set from the step's ``SchedulerStats`` (measured after its finished requests left):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a
  fraction, 0 to 1);
* counters (exposed with ``_total``): ``vllm:num_preemptions``, ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits`` (tokens of first lookups), ``vllm:prompt_tokens`` (a prompt once,
  when its first token comes), ``vllm:prompt_tokens_cached`` (those the prefix cache served at
  the request's first admission), ``vllm:generation_tokens``, and ``vllm:request_success``, one per
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

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.serving.metrics import (
    E2E_REQUEST_LATENCY_SECONDS,
    EXTERNAL_PREFIX_CACHE_HITS,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    FINISH_REASONS,
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
    PROMPT_TOKENS_CACHED,
    REQUEST_SUCCESS_METRIC,
    TIME_TO_FIRST_TOKEN_SECONDS,
    IterationStats,
    SchedulerStats,
)


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
        self.metrics = {spec.name: spec.create(self.registry).labels(*self.labels) for spec in METRICS}
        success = REQUEST_SUCCESS_METRIC.create(self.registry)
        self.request_success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}

    def __call__(self, stats: SchedulerStats, iteration: IterationStats) -> None:
        """Record one step (vLLM: ``PrometheusStatLogger.record``)."""
        external = stats.connector_prefix_cache_stats or PrefixCacheStats()  # no connector: no lookups
        values = {
            NUM_REQUESTS_RUNNING: stats.num_running_reqs,
            NUM_REQUESTS_WAITING: stats.num_waiting_reqs,
            KV_CACHE_USAGE_PERC: stats.kv_cache_usage,
            PREFIX_CACHE_QUERIES: stats.prefix_cache_stats.queries,
            PREFIX_CACHE_HITS: stats.prefix_cache_stats.hits,
            EXTERNAL_PREFIX_CACHE_QUERIES: external.queries,
            EXTERNAL_PREFIX_CACHE_HITS: external.hits,
            NUM_PREEMPTIONS: stats.num_preempted_reqs,
            PROMPT_TOKENS: iteration.num_prompt_tokens,
            PROMPT_TOKENS_CACHED: stats.num_cached_prompt_tokens,
            GENERATION_TOKENS: iteration.num_generation_tokens,
            TIME_TO_FIRST_TOKEN_SECONDS: iteration.time_to_first_tokens_iter,
            INTER_TOKEN_LATENCY_SECONDS: iteration.inter_token_latencies_iter,
            E2E_REQUEST_LATENCY_SECONDS: [finished.e2e_latency for finished in iteration.finished_requests],
        }
        for spec in METRICS:
            spec.record(self.metrics[spec.name], values[spec.name])
        for finished in iteration.finished_requests:
            counter = self.request_success.get(finished.finish_reason)
            if counter is not None:
                counter.inc()

    def render(self) -> bytes:
        """The registry in Prometheus' text format (``prometheus_client.generate_latest``)."""
        return generate_latest(self.registry)

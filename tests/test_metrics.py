"""vLLM's metrics by vLLM's names: the names themselves, the log line, the usage, preemptions, the
prefix cache's split, the Prometheus text and the hybrid pool's null block (lessons 07, 15)."""

from __future__ import annotations

import io
import logging
import math
import re
import subprocess
import sys

import pytest

from paged_kv.core.kv_cache_groups import kv_cache_groups
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving import metrics
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.engine_result import EngineResult
from paged_kv.serving.metrics import (
    PREEMPTION_WARNING,
    CachingMetrics,
    FinishedRequestStats,
    IterationStats,
    LoggingStatLogger,
    MetricSpec,
    RunMetrics,
    SchedulerStats,
    format_log_line,
    kv_cache_device,
    percentile,
)
from paged_kv.serving.request import EngineCoreRequest
from tests.helpers import built

pytestmark = [pytest.mark.lesson07, pytest.mark.lesson15]

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128)
SYSTEM = list(range(100, 116))  # a 16-token shared prefix: 4 blocks of 4


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=1)


def burst(n: int = 6, new_tokens: int = 6) -> list[EngineRequest]:
    """``n`` requests arriving at once, a shared system prompt and a question of their own each."""
    return [EngineRequest(f"r{i}", [*SYSTEM, 200 + i, 201 + i, 202 + i], new_tokens) for i in range(n)]


def run_capturing(engine: Engine, requests: list[EngineRequest]) -> tuple[EngineResult, object]:
    """Run ``engine`` and return its result and the run's memory, to look at after the run."""
    made = built(engine)
    result = engine.run(requests)
    return result, made[0].engine_core.memory


def preempting(model: TinyGPT, caplog=None, **settings) -> EngineResult:
    """A run on a pool too small for the burst: the newest requests are preempted."""
    engine = Engine(model, num_blocks=12, block_size=4, **settings)
    return engine.run(burst(6, new_tokens=12))


# ------------------------------------------------------------------------------ the names


def test_the_names_are_vllm_0_33_0s() -> None:
    # vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__ (vLLM 0.33.0): each name, type and help.
    declared = {spec.name: (spec.type, spec.documentation) for spec in metrics.METRICS}
    assert declared == {
        "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
        "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
        "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
        "vllm:prefix_cache_queries": (
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
        ),
        "vllm:prefix_cache_hits": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
        "vllm:external_prefix_cache_queries": (
            "counter",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.",
        ),
        "vllm:external_prefix_cache_hits": (
            "counter",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
            "number of cached tokens.",
        ),
        "vllm:num_preemptions": ("counter", "Cumulative number of preemption from the engine."),
        "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed."),
        "vllm:prompt_tokens_cached": ("counter", "Number of cached prompt tokens (local + external)."),
        "vllm:generation_tokens": ("counter", "Number of generation tokens processed."),
        "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
        "vllm:inter_token_latency_seconds": ("histogram", "Histogram of inter-token latency in seconds."),
        "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of e2e request latency in seconds."),
    }
    assert (metrics.KV_CACHE_USAGE_PERC, metrics.NUM_PREEMPTIONS) == (
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
    )
    # vllm/v1/metrics/buckets.py
    buckets = {spec.name: spec.buckets for spec in metrics.METRICS if spec.type == "histogram"}
    assert buckets["vllm:time_to_first_token_seconds"] == (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    )  # fmt: skip
    assert buckets["vllm:inter_token_latency_seconds"] == (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0,
    )  # fmt: skip
    assert buckets["vllm:e2e_request_latency_seconds"] == (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0, 1920.0, 7680.0,
    )  # fmt: skip
    # vllm/v1/metrics/stats.py: SchedulerStats' and PrefixCacheStats' fields of these names.
    assert {"num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "prefix_cache_stats"} <= set(
        SchedulerStats.__dataclass_fields__
    )
    assert list(PrefixCacheStats.__dataclass_fields__) == [
        "requests",
        "queries",
        "hits",
        "preempted_requests",
        "preempted_queries",
        "preempted_hits",
    ]
    assert metrics.ENGINE_LOGGER == "paged_kv.engine"
    # Every family is labelled as vLLM labels it; the server's vllm:request_success has its reasons.
    assert {spec.labelnames for spec in metrics.METRICS} == {("model_name", "engine")}
    success = metrics.REQUEST_SUCCESS_METRIC
    assert (success.name, success.type, success.documentation, success.labelnames) == (
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        ("model_name", "engine", "finished_reason"),
    )
    # vllm/v1/engine/__init__.py: FINISH_REASON_STRINGS
    assert metrics.FINISH_REASONS == ("stop", "length", "abort", "error", "repetition")


@pytest.mark.parametrize(
    ("kind", "buckets", "message"),
    [
        ("summary", (), "type must be one of counter, gauge, histogram, got 'summary'"),
        ("histogram", (), "buckets go with a histogram and only with one, got () for a histogram"),
        ("gauge", (1.0,), "buckets go with a histogram and only with one, got (1.0,) for a gauge"),
    ],
)
def test_a_metric_spec_refuses_what_prometheus_could_not_declare(kind, buckets, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        MetricSpec("vllm:x", kind, "help", buckets)


# ------------------------------------------------------------------------------ the log line


def test_the_log_line_is_vllms() -> None:
    line = format_log_line(
        12.5, 3.0, 2, 1, 0.425, num_preemptions=1, prefix_cache_hit_rate=0.5, kv_cache_device="GPU"
    )
    assert line == (
        "Engine 000: Avg prompt throughput: 12.5 tokens/s, Avg generation throughput: 3.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, Preemptions: 1, GPU KV cache usage: 42.5%, "
        "Prefix cache hit rate: 50.0%"
    )
    # No preemption in the interval, no lookup ever: those parts are left out, as vLLM leaves them.
    assert format_log_line(0.0, 1234.56, 0, 0, 0.0) == (
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1234.6 tokens/s, "
        "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%"
    )
    assert format_log_line(1, 1, 1, 1, 1.0, kv_cache_device="CPU", engine_index=3).startswith("Engine 003: ")
    assert [kv_cache_device(d) for d in ("cuda", "cuda:1", "cpu", "mps")] == ["GPU", "GPU", "CPU", "MPS"]


def test_the_engine_logs_the_line_every_n_steps_and_stays_quiet_by_default(model, caplog) -> None:
    caplog.set_level(logging.INFO, logger="paged_kv.engine")
    requests = burst(4)
    quiet = Engine(model, num_blocks=64, block_size=4).run(requests)
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    caplog.clear()
    result = Engine(model, num_blocks=64, block_size=4, log_stats_interval=3).run(requests)
    lines = [r.getMessage() for r in caplog.records if r.name == "paged_kv.engine"]
    assert len(lines) == math.ceil(result.steps / 3)  # every 3 steps, and the rest at the end
    pattern = re.compile(
        r"Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
        r"Running: \d+ reqs, Waiting: \d+ reqs, CPU KV cache usage: \d+\.\d%$"
    )
    assert all(pattern.match(line) for line in lines), lines
    assert lines[-1].endswith("Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%")
    assert quiet.tokens == result.tokens
    caplog.clear()
    Engine(model, num_blocks=64, block_size=4, log_stats_interval=1e9).run(requests)  # seconds: only the end
    assert len([r for r in caplog.records if r.name == "paged_kv.engine"]) == 1


def test_enable_engine_log_shows_the_lines(model) -> None:
    stream = io.StringIO()
    logger = logging.getLogger("paged_kv.engine")
    handler = metrics.enable_engine_log(stream)
    try:
        assert metrics.enable_engine_log(stream) is not handler  # replaced, not added twice
        Engine(model, num_blocks=64, block_size=4, log_stats_interval=1000).run(burst(2))
    finally:
        for h in [h for h in logger.handlers if not isinstance(h, logging.NullHandler)]:
            logger.removeHandler(h)
        logger.setLevel(logging.NOTSET)
    assert stream.getvalue().startswith("INFO Engine 000: Avg prompt throughput: ")
    assert stream.getvalue().count("\n") == 1


@pytest.mark.parametrize("interval", [0, -1, 0.0, True, "5", float("nan")])
def test_a_bad_log_stats_interval_is_refused(model, interval) -> None:
    with pytest.raises(ValueError, match="log_stats_interval"):
        Engine(model, num_blocks=8, block_size=4, log_stats_interval=interval)


def test_the_logger_computes_throughputs_from_the_wall_clock(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="paged_kv.engine")
    logger = LoggingStatLogger(2.0, kv_cache_device="GPU")  # seconds
    found = PrefixCacheStats(requests=2, queries=40, hits=30, preempted_requests=1, preempted_queries=20)
    logger.record(SchedulerStats(3, 1, 0.25, found, 1, 3, 40, 30), now=1.0)  # not yet due
    assert not caplog.records
    logger.record(SchedulerStats(3, 0, 0.5, PrefixCacheStats(), 0, 3), now=2.5)
    assert [r.getMessage() for r in caplog.records] == [
        "Engine 000: Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 2.4 tokens/s, "
        "Running: 3 reqs, Waiting: 0 reqs, Preemptions: 1, GPU KV cache usage: 50.0%, "
        "Prefix cache hit rate: 75.0%"  # 30 / 40: the preempted lookup apart
    ]
    assert caplog.records[0].levelno == logging.INFO
    caplog.clear()
    logger.record(SchedulerStats(), now=5.0)
    logger.record(SchedulerStats(), now=7.5)
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]  # idle twice: DEBUG


def test_caching_metrics_keep_the_most_recent_requests() -> None:
    caching = CachingMetrics(max_recent_requests=3)
    assert caching.empty and caching.hit_rate == 0.0
    caching.observe(PrefixCacheStats(requests=2, queries=10, hits=10))
    caching.observe(PrefixCacheStats(preempted_requests=5, preempted_queries=50))  # no first lookup
    caching.observe(PrefixCacheStats(requests=2, queries=10, hits=0))
    assert (caching.aggregated_requests, caching.hit_rate) == (2, 0.0)  # the oldest dropped


# ------------------------------------------------------------------------------ the usage


def test_the_usage_falls_to_0_after_a_burst_though_the_prefix_cache_keeps_its_blocks(model) -> None:
    engine = Engine(model, num_blocks=32, block_size=4, enable_prefix_caching=True)
    result, memory = run_capturing(engine, burst(6))
    assert max(result.kv_cache_usage) > 0.3
    assert result.scheduler_stats[-1].kv_cache_usage == 0.0 == memory.usage
    assert memory.block_pool.prefix_cache.cached_blocks()  # cached blocks freed count free all the same
    assert memory.num_free_blocks == memory.num_blocks - 1  # all but the null block
    # Used blocks over the pool at each step's end: the blocks in use before the finished left, but
    # for theirs (used_blocks counts them before).
    finished_at = set(result.finished_step.values())
    for k, (stats, used) in enumerate(zip(result.scheduler_stats, result.used_blocks, strict=True)):
        usage = used / 31  # the null block counts in neither
        assert (
            stats.kv_cache_usage == pytest.approx(usage)
            if k not in finished_at
            else stats.kv_cache_usage < usage
        )
    metrics_ = result.metrics()
    assert metrics_.kv_cache_usage_perc == 0.0


def test_the_usage_of_a_hybrid_pool_leaves_the_null_block_out(model) -> None:
    groups = kv_cache_groups((4, None), 4)  # a sliding-window layer beside a full one
    memory = KVCacheManager(9, kv_cache_groups=groups)  # block 0 is the null block: 8 to give out
    assert memory.usage == 0.0  # the null block is held, and not counted
    request = EngineCoreRequest("a", 5, 1, tuple(range(5)))
    memory.allocate_slots(
        request, 5, request.prompt_token_ids, new_computed_blocks=memory.get_computed_blocks(request, None)
    )
    assert memory.num_free_blocks == 8 - 4  # two blocks in each group
    assert memory.usage == 4 / 8
    memory.free("a")
    assert memory.usage == 0.0
    hybrid = TinyGPT(GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128, sliding_windows=(4, None)))
    engine = Engine(hybrid, num_blocks=20, block_size=4, enable_prefix_caching=True)
    result, hybrid_memory = run_capturing(engine, burst(3))
    assert isinstance(hybrid_memory, KVCacheManager) and len(hybrid_memory.kv_cache_groups) == 2
    assert max(result.kv_cache_usage) > 0 and result.kv_cache_usage[-1] == 0.0  # not 1 / 20


# ------------------------------------------------------------------------------ preemptions


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemptions_are_counted_and_warned(model, caplog, preemption) -> None:
    caplog.set_level(logging.WARNING, logger="paged_kv.engine")
    result = preempting(model, preemption=preemption)
    assert result.num_preemptions == result.preemptions >= 2
    assert sum(stats.num_preempted_reqs for stats in result.scheduler_stats) == result.num_preemptions
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "paged_kv.engine"]
    assert len(warnings) == 1 < result.num_preemptions  # V0 warned of the 1st, the 51st, the 101st...
    assert all(r.msg == PREEMPTION_WARNING for r in warnings)
    mode = {"recompute": "PreemptionMode.RECOMPUTE", "swap": "PreemptionMode.SWAP"}[preemption]
    first = warnings[0].getMessage()
    assert re.fullmatch(
        rf"Sequence group r\d is preempted by {mode} mode because there is not enough KV cache space\. "
        r"This can affect the end-to-end performance\. Increase gpu_memory_utilization or "
        r"tensor_parallel_size to provide more KV cache memory\. total_num_cumulative_preemption=1",
        first,
    )
    assert warnings[0].args[2] == 1
    text = result.metrics().prometheus_text()
    assert (
        f'vllm:num_preemptions_total{{engine="0",model_name="paged_kv"}} {result.num_preemptions}.0' in text
    )


def test_a_long_run_warns_of_the_1st_and_the_51st_preemptions_as_v0_did(model, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="paged_kv.engine")
    # 20 requests that each grow to 11 of the 12 blocks: they preempt one another over and over.
    requests = [EngineRequest(f"r{i}", [i, i + 1, i + 2, i + 3], 40) for i in range(20)]
    result = Engine(model, num_blocks=12, block_size=4).run(requests)
    warned = [r.args[2] for r in caplog.records if r.name == "paged_kv.engine"]
    assert 51 <= result.num_preemptions < 101
    assert warned == [1, 51]


# ------------------------------------------------------------------------------ the prefix cache


def test_a_resumed_requests_lookup_counts_apart(model) -> None:
    result = preempting(model, enable_prefix_caching=True)
    stats = result.prefix_cache_stats
    assert stats.requests == 6  # one first lookup per request
    assert stats.preempted_requests == result.preemptions_by_reason["recompute"] > 0
    assert stats.queries == sum(len(r.prompt) for r in burst(6, new_tokens=12))
    assert stats.preempted_queries > 0 and stats.preempted_hits > 0
    # The engine's own totals count every lookup; vLLM's first ones only.
    assert result.prefix_cache_queries == stats.queries + stats.preempted_queries
    assert result.prefix_cache_hits == stats.hits + stats.preempted_hits
    assert stats.hit_rate == stats.hits / stats.queries != result.hit_rate
    metrics_ = result.metrics()
    assert (metrics_.prefix_cache_queries, metrics_.prefix_cache_hits) == (stats.queries, stats.hits)
    # vllm:prompt_tokens counts every prompt token once, vllm:prompt_tokens_cached those the cache
    # served at each first admission (the first lookups' hits), and the log line the rest.
    cached = metrics_.prompt_tokens - metrics_.num_computed_prompt_tokens
    assert cached == stats.hits > 0 and metrics_.prompt_tokens == stats.queries
    text = metrics_.prometheus_text()
    assert f'vllm:prompt_tokens_cached_total{{engine="0",model_name="paged_kv"}} {cached}.0' in text
    # Per step, the lookups add up to the run's.
    assert sum((s.prefix_cache_stats for s in result.scheduler_stats), PrefixCacheStats()) == stats


def test_the_scheduler_says_when_a_lookup_is_a_resumption() -> None:
    memory = KVCacheManager(16, 4, enable_caching=True)
    prompt = tuple(range(10))
    request = EngineCoreRequest("a", 10, 4, prompt)
    memory.allocate_slots(
        request, 10, prompt, new_computed_blocks=memory.get_computed_blocks(request, prompt)
    )
    assert memory.make_prefix_cache_stats() == PrefixCacheStats(requests=1, queries=10)
    memory.free("a")  # preempted by recompute: it comes back with a token it generated
    resumed = (*prompt, 7)
    computed = memory.get_computed_blocks(request, resumed)
    memory.allocate_slots(request, 3, resumed, new_computed_blocks=computed, preempted=True)
    assert memory.make_prefix_cache_stats() == PrefixCacheStats(
        preempted_requests=1, preempted_queries=11, preempted_hits=8
    )
    assert memory.prefix_cache_stats == PrefixCacheStats(1, 10, 0, 1, 11, 8)
    assert memory.make_prefix_cache_stats() == PrefixCacheStats()  # nothing since


def test_a_hybrid_models_resumed_lookups_count_apart_too() -> None:
    hybrid = TinyGPT(GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128, sliding_windows=(4, None)))
    result = Engine(hybrid, num_blocks=18, block_size=4, enable_prefix_caching=True).run(burst(6, 12))
    stats = result.prefix_cache_stats
    assert (stats.requests, stats.preempted_requests) == (6, result.preemptions) and result.preemptions
    assert result.prefix_cache_queries == stats.queries + stats.preempted_queries


# ------------------------------------------------------------------------------ latencies


def test_latencies_in_seconds_and_steps(model) -> None:
    requests = [*burst(3), EngineRequest("late", [*SYSTEM, 9], 4, arrival_step=5)]
    result = Engine(model, num_blocks=64, block_size=4).run(requests)
    starts, ends = result.step_start_seconds, result.step_end_seconds
    assert len(starts) == len(ends) == result.steps == len(result.scheduler_stats)
    assert all(0 <= s <= e for s, e in zip(starts, ends, strict=True))
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))  # steps do not overlap
    ttft = result.time_to_first_token_seconds
    assert list(ttft) == [r.request_id for r in requests]
    assert ttft["late"] == ends[result.first_token_step["late"]] - starts[5] > 0
    e2e = result.e2e_request_latency_seconds
    assert all(e2e[r] >= ttft[r] for r in ttft)
    # One inter-token latency per token after each request's first; one step each, never preempted.
    assert len(result.inter_token_latency_seconds) == result.generation_tokens - len(requests)
    assert result.inter_token_latency_steps == [1] * len(result.inter_token_latency_seconds)
    assert result.generation_tokens == sum(map(len, result.tokens.values()))
    assert result.prompt_tokens == sum(len(r.prompt) for r in requests)
    for stats, running, waiting, done in zip(
        result.scheduler_stats,
        result.running,
        result.waiting,
        [sum(1 for s in result.finished_step.values() if s == k) for k in range(result.steps)],
        strict=True,
    ):
        assert (stats.num_running_reqs, stats.num_waiting_reqs) == (running - done, waiting)


def test_a_token_after_a_preemption_waited_since_the_last_one(model) -> None:
    result = preempting(model)
    assert len(result.inter_token_latency_seconds) == result.generation_tokens - 6
    assert max(result.inter_token_latency_steps) > 1  # a resumed request's next token
    ends = result.step_end_seconds
    assert all(s > 0 for s in result.inter_token_latency_seconds)
    assert max(result.inter_token_latency_seconds) <= ends[-1]


# ------------------------------------------------------------------------------ Prometheus


SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*)\} (?P<value>\S+)$'
)


def test_the_prometheus_text_parses(model) -> None:
    result = preempting(model, enable_prefix_caching=True)
    text = result.metrics().prometheus_text(model_name="tiny-gpt")
    families: dict[str, str] = {}
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            families[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = dict(part.split("=", 1) for part in match["labels"].split(","))
        assert (labels["model_name"], labels["engine"]) == ('"tiny-gpt"', '"0"')
        samples[match["name"], labels.get("le", "")] = float(match["value"])
    assert families["vllm:num_preemptions_total"] == "counter"
    assert families["vllm:kv_cache_usage_perc"] == "gauge"
    assert families["vllm:time_to_first_token_seconds"] == "histogram"
    assert samples["vllm:num_preemptions_total", ""] == result.num_preemptions
    assert samples["vllm:prefix_cache_queries_total", ""] == result.prefix_cache_stats.queries
    assert samples["vllm:prefix_cache_hits_total", ""] == result.prefix_cache_stats.hits
    assert samples["vllm:generation_tokens_total", ""] == result.generation_tokens
    assert samples["vllm:kv_cache_usage_perc", ""] == 0.0
    for name, count in (
        ("vllm:time_to_first_token_seconds", 6),
        ("vllm:inter_token_latency_seconds", result.generation_tokens - 6),
        ("vllm:e2e_request_latency_seconds", 6),
    ):
        buckets = [v for (n, le), v in samples.items() if n == name + "_bucket"]
        assert buckets == sorted(buckets) and buckets[-1] == count == samples[name + "_count", ""]
        assert samples[name + "_bucket", '"+Inf"'] == count
    assert samples["vllm:time_to_first_token_seconds_sum", ""] == pytest.approx(
        sum(result.time_to_first_token_seconds.values())
    )


RUN = RunMetrics(
    steps=3,
    elapsed_seconds=1.5,
    num_requests=2,
    num_requests_running=1,
    num_requests_waiting=2,
    kv_cache_usage_perc=0.375,
    num_preemptions=4,
    prompt_tokens=1_234_567,
    generation_tokens=89,
    prefix_cache_stats=PrefixCacheStats(2, 40, 16, 1, 20, 8),
    time_to_first_token_seconds=(0.0005, 0.3, 3000.0),
    inter_token_latency_seconds=tuple((7 * i % 13) / 97 + 0.003 for i in range(40)),  # unsorted
    e2e_request_latency_seconds=(0.25, 9.0),
    num_computed_prompt_tokens=1_234_551,  # 16 served by the prefix cache
)
"""A run with a value in every family, an exponent (1.234567e+06) and samples past the last bucket."""


def test_the_prometheus_text_is_prometheus_clients() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    made = {}
    for spec in metrics.METRICS:
        kind = {"counter": "Counter", "gauge": "Gauge", "histogram": "Histogram"}[spec.type]
        extra = {"buckets": spec.buckets} if spec.buckets else {}
        made[spec.name] = getattr(prometheus_client, kind)(
            spec.name, spec.documentation, ["model_name", "engine"], registry=registry, **extra
        ).labels("m", "0")
    made["vllm:num_requests_running"].set(1)
    made["vllm:num_requests_waiting"].set(2)
    made["vllm:kv_cache_usage_perc"].set(0.375)
    made["vllm:prefix_cache_queries"].inc(40)
    made["vllm:prefix_cache_hits"].inc(16)
    made["vllm:num_preemptions"].inc(4)
    made["vllm:prompt_tokens"].inc(1_234_567)
    made["vllm:prompt_tokens_cached"].inc(16)
    made["vllm:generation_tokens"].inc(89)
    for name, values in (
        ("vllm:time_to_first_token_seconds", RUN.time_to_first_token_seconds),
        ("vllm:inter_token_latency_seconds", RUN.inter_token_latency_seconds),
        ("vllm:e2e_request_latency_seconds", RUN.e2e_request_latency_seconds),
    ):
        for value in values:
            made[name].observe(value)
    expected = prometheus_client.generate_latest(registry).decode()
    expected = "".join(line for line in expected.splitlines(keepends=True) if "_created" not in line)
    assert RUN.prometheus_text(model_name="m") == expected
    parser = pytest.importorskip("prometheus_client.parser")
    parsed = {f.name: f for f in parser.text_string_to_metric_families(expected)}
    assert parsed["vllm:num_preemptions"].type == "counter"


def test_a_runs_text_is_the_servers_after_one_step_of_the_same_values() -> None:
    """One path: the run's text and the server's /metrics come from the same specs through
    prometheus_client, so a logger fed the run's totals in one step serves the same lines (and, besides,
    the _created series and vllm:request_success that a run's text leaves out)."""
    pytest.importorskip("prometheus_client")
    from paged_kv.entrypoints.openai.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    logger(
        SchedulerStats(
            num_running_reqs=RUN.num_requests_running,
            num_waiting_reqs=RUN.num_requests_waiting,
            kv_cache_usage=RUN.kv_cache_usage_perc,
            prefix_cache_stats=RUN.prefix_cache_stats,
            num_preempted_reqs=RUN.num_preemptions,
            num_prompt_tokens=RUN.prompt_tokens,
            num_cached_prompt_tokens=RUN.prompt_tokens - RUN.num_computed_prompt_tokens,
        ),
        IterationStats(
            num_generation_tokens=RUN.generation_tokens,
            num_prompt_tokens=RUN.prompt_tokens,
            time_to_first_tokens_iter=RUN.time_to_first_token_seconds,
            inter_token_latencies_iter=RUN.inter_token_latency_seconds,
            finished_requests=tuple(
                FinishedRequestStats("stop", s, 1) for s in RUN.e2e_request_latency_seconds
            ),
        ),
    )
    text = logger.render().decode()
    served = [
        line
        for line in text.splitlines(keepends=True)
        if "_created" not in line and "vllm:request_success" not in line
    ]
    assert RUN.prometheus_text(model_name="m") == "".join(served)
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0' in text


def test_the_metrics_import_without_prometheus_client() -> None:
    """prometheus_client is the course's extra: the core's import path never needs it."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import paged_kv, paged_kv.serving.metrics, paged_kv.serving.engine\n"
        "from paged_kv.serving.metrics import METRICS\n"
        "print(len(METRICS))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "14"), done.stderr


def test_a_text_without_prometheus_client_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'paged_kv\[course\]'") as raised:
        RUN.prometheus_text()
    assert raised.value.name == "prometheus_client"


def test_percentiles() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5  # numpy's linear interpolation
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def test_the_summary_is_laid_out_as_vllm_bench_serve(model) -> None:
    summary = Engine(model, num_blocks=64, block_size=4).run(burst(3)).metrics().summary()
    lines = summary.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 3)
    assert [line[:40].strip() for line in lines[2:8]] == [
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total token throughput (tok/s):",
    ]
    assert "Mean TTFT (ms):" in summary and "P99 ITL (ms):" in summary and lines[-1] == "=" * 50

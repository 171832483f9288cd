"""Exercise 15 graded on the package: ``log_line`` turns a window's counts into throughputs as vLLM's
``LoggingStatLogger`` does (tokens over seconds, 0.0 for no time) and writes the line with
:func:`paged_kv.serving.metrics.format_log_line`; ``CachingMetrics`` is
:class:`paged_kv.serving.metrics.CachingMetrics`, fed :class:`~paged_kv.core.prefix_cache.PrefixCacheStats`.
"""

from paged_kv.serving.metrics import CachingMetrics
from paged_kv.serving.metrics import format_log_line as _format_log_line

__all__ = ["CachingMetrics", "log_line"]


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
    """vLLM's periodic line for one window: the tokens over its seconds, the last step's gauges."""

    def throughput(tokens: int) -> float:
        return float(tokens / seconds) if seconds > 0 else 0.0

    return _format_log_line(
        throughput(prompt_tokens),
        throughput(generation_tokens),
        num_running_reqs,
        num_waiting_reqs,
        kv_cache_usage,
        num_preemptions=num_preemptions,
        prefix_cache_hit_rate=prefix_cache_hit_rate,
    )

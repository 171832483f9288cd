"""The throughputs divided by the window's seconds without a guard: a window of 0 s raises
ZeroDivisionError where vLLM writes 0.0 tokens/s."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.log_line"
MESSAGE = "a window of 0 seconds has no throughput to divide by"


def log_line(
    prompt_tokens,
    generation_tokens,
    seconds,
    num_running_reqs,
    num_waiting_reqs,
    kv_cache_usage,
    num_preemptions=0,
    prefix_cache_hit_rate=None,
):
    parts = [
        f"Avg prompt throughput: {prompt_tokens / seconds:.1f} tokens/s",  # the mistake: seconds may be 0
        f"Avg generation throughput: {generation_tokens / seconds:.1f} tokens/s",
        f"Running: {num_running_reqs} reqs",
        f"Waiting: {num_waiting_reqs} reqs",
    ]
    if num_preemptions > 0:
        parts.append(f"Preemptions: {num_preemptions}")
    parts.append(f"GPU KV cache usage: {kv_cache_usage * 100:.1f}%")
    if prefix_cache_hit_rate is not None:
        parts.append(f"Prefix cache hit rate: {prefix_cache_hit_rate * 100:.1f}%")
    return "Engine 000: " + ", ".join(parts)

"""The KV-cache usage printed as the fraction it is: 'GPU KV cache usage: 0.4%' for 42.5 % of the blocks."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.log_line"
MESSAGE = "kv_cache_usage is a fraction"


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
    parts.append(f"GPU KV cache usage: {kv_cache_usage:.1f}%")  # the mistake: not times 100
    if prefix_cache_hit_rate is not None:
        parts.append(f"Prefix cache hit rate: {prefix_cache_hit_rate * 100:.1f}%")
    return "Engine 000: " + ", ".join(parts)

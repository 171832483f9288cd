"""'Preemptions: 0' in every line: vLLM shows the part only when the window preempted."""

from paged_kv.reference.lesson15 import *  # every other task stays right

BREAKS = "15.log_line"
MESSAGE = "only when the window preempted"


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
        f"Preemptions: {num_preemptions}",  # the mistake: also when there were none
        f"GPU KV cache usage: {kv_cache_usage * 100:.1f}%",
    ]
    if prefix_cache_hit_rate is not None:
        parts.append(f"Prefix cache hit rate: {prefix_cache_hit_rate * 100:.1f}%")
    return "Engine 000: " + ", ".join(parts)

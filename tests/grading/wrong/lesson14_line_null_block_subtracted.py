"""Leaving the null block out of the line's concurrency, which vLLM 0.33.0 counts among the pool's blocks."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.startup_line"
MESSAGE = "counts every block of the pool, the null block too"


def startup_line(available_memory, bytes_per_block, block_size, max_model_len):
    per_request = -(-max_model_len // block_size)
    if (per_request + 1) * bytes_per_block > available_memory:
        raise ValueError("one request does not fit besides the null block")
    blocks = available_memory // bytes_per_block
    concurrency = (blocks - 1) / per_request
    tokens = int(concurrency * max_model_len)
    line = (
        f"GPU KV cache size: {tokens:,} tokens, "
        f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    )
    return {"num_gpu_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency, "line": line}

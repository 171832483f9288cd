"""Checking that one request fits the whole pool, forgetting the null block the pool keeps back."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.startup_line"
MESSAGE = "reserve the null block before the check"


def startup_line(available_memory, bytes_per_block, block_size, max_model_len):
    per_request = -(-max_model_len // block_size)
    if available_memory <= 0 or per_request * bytes_per_block > available_memory:
        raise ValueError("one request does not fit")
    blocks = available_memory // bytes_per_block
    concurrency = blocks / per_request
    tokens = int(concurrency * max_model_len)
    line = (
        f"GPU KV cache size: {tokens:,} tokens, "
        f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    )
    return {"num_gpu_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency, "line": line}

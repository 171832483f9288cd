"""The line's tokens as the pool's slots, blocks * block_size, instead of the concurrency times the length."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.startup_line"
MESSAGE = "not num_gpu_blocks * block_size"


def startup_line(available_memory, bytes_per_block, block_size, max_model_len):
    per_request = -(-max_model_len // block_size)
    if (per_request + 1) * bytes_per_block > available_memory:
        raise ValueError("one request does not fit besides the null block")
    blocks = available_memory // bytes_per_block
    concurrency = blocks / per_request
    tokens = blocks * block_size
    line = (
        f"GPU KV cache size: {tokens:,} tokens, "
        f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    )
    return {"num_gpu_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency, "line": line}

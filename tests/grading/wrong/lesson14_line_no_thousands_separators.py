"""Writing the token counts without vLLM's thousands separators: 51808 tokens, not 51,808."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.startup_line"
MESSAGE = "thousands separators"


def startup_line(available_memory, bytes_per_block, block_size, max_model_len):
    per_request = -(-max_model_len // block_size)
    if (per_request + 1) * bytes_per_block > available_memory:
        raise ValueError("one request does not fit besides the null block")
    blocks = available_memory // bytes_per_block
    concurrency = blocks / per_request
    tokens = int(concurrency * max_model_len)
    line = (
        f"GPU KV cache size: {tokens} tokens, Maximum concurrency for {max_model_len} tokens per request: "
        f"{concurrency:.2f}x"
    )
    return {"num_gpu_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency, "line": line}

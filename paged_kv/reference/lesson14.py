"""Exercise 14 graded on the package: ``block_bytes`` and ``startup_line`` are the arithmetic of
:func:`paged_kv.kv.startup.kv_cache_report`, vLLM 0.33.0's at start-up (its
:func:`~paged_kv.kv.startup.model_shape`, :func:`~paged_kv.kv.startup.kv_heads_per_gpu` and
:func:`~paged_kv.kv.startup.startup_lines`); ``common_block_size`` is
:func:`paged_kv.kv.block_size.common_block_size` (vLLM's ``Platform._preferred_block_size_for_backends``),
which also takes backends by name.
"""

from paged_kv.core.block import blocks_for_tokens
from paged_kv.kv import startup as _startup
from paged_kv.kv.block_size import MultipleOf, common_block_size

__all__ = ["DTYPE_BYTES", "MultipleOf", "block_bytes", "common_block_size", "startup_line"]

DTYPE_BYTES = {name: size for name, size in _startup.KV_CACHE_DTYPE_BYTES.items() if size is not None}
"""The bytes of one number in each ``kv_cache_dtype`` but ``"auto"``, as the exercise gives them."""


def block_bytes(
    config: dict, block_size: int = 16, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
) -> int:
    """The bytes one block of ``block_size`` tokens takes on one GPU: K and V of its heads in every layer."""
    shape = _startup.model_shape(config)
    heads = _startup.kv_heads_per_gpu(shape.num_heads, shape.num_kv_heads, tensor_parallel_size)
    size = _startup.KV_CACHE_DTYPE_BYTES[kv_cache_dtype] or shape.dtype.itemsize
    return 2 * shape.num_layers * heads * shape.head_dim * block_size * size


def startup_line(available_memory: int, bytes_per_block: int, block_size: int, max_model_len: int) -> dict:
    """vLLM's pool and its line for a model whose layers all attend fully; ``ValueError`` when one
    request of ``max_model_len`` does not fit besides the null block."""
    per_request = blocks_for_tokens(max_model_len, block_size)
    if (per_request + 1) * bytes_per_block > available_memory:
        raise ValueError(
            f"one request of {max_model_len} tokens needs {per_request} blocks besides the null block, "
            f"and {available_memory} bytes hold {max(available_memory, 0) // bytes_per_block} blocks in all"
        )
    blocks = available_memory // bytes_per_block
    concurrency = blocks / per_request
    tokens = int(concurrency * max_model_len)
    line = _startup.startup_lines(available_memory, tokens, max_model_len, concurrency)[1]
    return {"num_gpu_blocks": blocks, "kv_cache_tokens": tokens, "max_concurrency": concurrency, "line": line}

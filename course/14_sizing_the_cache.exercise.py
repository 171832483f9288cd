# %% [markdown]
# # Exercise 14 · Sizing the cache at start-up
#
# In this exercise you write three pieces of vLLM's start-up from lesson 14: the bytes of one block on
# one GPU, the pool and the line vLLM logs, and the block size it picks for a model whose attention
# layers use several backends. Each task says what to build and how it is checked; the cell after it
# runs the check and prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The package has the same pieces in `paged_kv.kv_cache_report` and
# `paged_kv.kv.block_size` (`common_block_size`); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/14_sizing_the_cache.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
import itertools
import math

from paged_kv.checks import check
from paged_kv.kv.block_size import BACKEND_BLOCK_SIZES, MultipleOf

# %% [markdown]
# ## Task 1 · The bytes of one block on one GPU
#
# Write `block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1)`: the bytes
# one block of `block_size` tokens takes on one GPU, K and V of every layer. `config` is a model's
# `config.json` as a dict, with `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
# `hidden_size`, `torch_dtype` and, in some models, `head_dim` (without it, the head size is
# `hidden_size // num_attention_heads`). `kv_cache_dtype` is `"auto"` (the config's `torch_dtype`) or
# one of the keys of `DTYPE_BYTES`. With `tensor_parallel_size` GPUs, each keeps
# `num_key_value_heads // tensor_parallel_size` K/V heads of every block, and one at least: with more
# GPUs than K/V heads, vLLM replicates them.
#
# **Checked:** Llama-3-8B (2 MiB), SmolLM2-135M, Qwen3-0.6B (whose `head_dim` is 128, not 1024 // 16),
# blocks of 32, fp8 against bfloat16 (half), and Llama-3-8B at tensor parallel sizes 2, 8 and 16.

# %%
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def block_bytes(
    config: dict, block_size: int = 16, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1
) -> int:
    """The bytes of one block of block_size tokens on one GPU: K and V of its K/V heads in every layer."""
    ### BEGIN SOLUTION: 2 (K and V) * layers * K/V heads on this GPU * head_dim * block_size * bytes a number
    dtype = config["torch_dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = max(1, config["num_key_value_heads"] // tensor_parallel_size)
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * block_size * DTYPE_BYTES[dtype]
    ### END SOLUTION


# %%
check("14.block_bytes", block_bytes)

# %% [markdown]
# ## Task 2 · The pool and vLLM's start-up line
#
# Write `startup_line(available_memory, bytes_per_block, block_size, max_model_len)` for a model whose
# layers all attend fully. Return a dict with
#
# * `num_gpu_blocks`: the whole blocks that fit in `available_memory`;
# * `max_concurrency`: how many requests of `max_model_len` tokens the pool holds at once, the blocks
#   over the blocks one such request needs (a float);
# * `kv_cache_tokens`: `int(max_concurrency * max_model_len)`;
# * `line`: vLLM 0.33.0's line, `GPU KV cache size: 51,808 tokens, Maximum concurrency for 8,192
#   tokens per request: 6.32x`, with thousands separators and two decimals.
#
# Raise `ValueError` when one request of `max_model_len` does not fit: the pool keeps its null block
# back, so the request's blocks must fit besides it. The line counts the null block among the pool's,
# as vLLM 0.33.0's does.
#
# **Checked:** Llama-3-8B on a 24 GB GPU (6,791,251,559 bytes available, blocks of 2 MiB, 8,192
# tokens), a pool of 6.5 requests, a `max_model_len` of 1,000, pools of 513 and 512 blocks, and pools
# of one block, none and less than none.

# %%
MiB = 2**20


def startup_line(available_memory: int, bytes_per_block: int, block_size: int, max_model_len: int) -> dict:
    """vLLM's pool and its start-up line; ValueError when one request does not fit besides the null block."""
    ### BEGIN SOLUTION: blocks = available // bytes_per_block; one request needs ceil(max_model_len / block_size)
    per_request = -(-max_model_len // block_size)
    if (per_request + 1) * bytes_per_block > available_memory:
        raise ValueError(f"one request of {max_model_len} tokens does not fit besides the null block")
    num_gpu_blocks = available_memory // bytes_per_block
    max_concurrency = num_gpu_blocks / per_request
    kv_cache_tokens = int(max_concurrency * max_model_len)
    line = (
        f"GPU KV cache size: {kv_cache_tokens:,} tokens, "
        f"Maximum concurrency for {max_model_len:,} tokens per request: {max_concurrency:.2f}x"
    )
    return {
        "num_gpu_blocks": num_gpu_blocks,
        "kv_cache_tokens": kv_cache_tokens,
        "max_concurrency": max_concurrency,
        "line": line,
    }
    ### END SOLUTION


# %%
check("14.startup_line", startup_line)

# %% [markdown]
# ## Task 3 · The block size every backend accepts
#
# An attention backend runs its kernels on some block sizes only, and lists them: each entry is an
# exact size, an `int` such as `64`, or `MultipleOf(n)`, any multiple of `n` tokens. A backend
# **accepts** a block size for the cache when the size is a multiple of the base of one of its
# entries: `n` for the int `n` and for `MultipleOf(n)` alike (a cache block of 128 tokens runs as two
# kernel blocks of 64). A backend with an empty list accepts any size. `size.base` is the base of a
# `MultipleOf`.
#
# vLLM starts from a default, 16 on a GPU (128 on the CPU), and picks:
#
# * for **one backend**: the default if the backend accepts it, else the base of its smallest entry;
# * for **several backends** (a model whose layers use different ones): the default if every backend
#   accepts it; else it takes every choice of one entry per backend (`itertools.product`), the least
#   common multiple of their bases (`math.lcm`; a backend without entries counts as 1), and returns
#   the smallest of those candidates that every backend accepts.
#
# Write `common_block_size(backends, default_block_size=16)`: `backends` is a list of backends, each
# a list of `int`s and `MultipleOf`s; return the block size, an `int`. `BACKEND_BLOCK_SIZES` has vLLM's
# real lists by name: `BACKEND_BLOCK_SIZES["FLASHINFER"]` is `(16, 32, 64)`, `BACKEND_BLOCK_SIZES["FLASHMLA"]`
# is `(64,)`. With this rule the smallest candidate is always accepted (can you see why?); vLLM checks
# anyway, since a backend may narrow its rule (CPU_MLA accepts 16 and no multiple of it), and raises a
# `ValueError` when no candidate fits.
#
# This is `_preferred_block_size_for_backends` in `vllm/platforms/interface.py`, which
# `update_block_size_for_backend` calls with `CacheConfig.DEFAULT_BLOCK_SIZE` unless the user gave
# `--block-size`. A backend's list is its `get_supported_kernel_block_sizes`, and the rule for
# accepting a size is `supports_block_size`, both in `vllm/v1/attention/backend.py`.
#
# **Checked:** vLLM's backends alone (FlashAttention 16, FlashInfer 16, FlashMLA 64, CUTLASS MLA 128,
# CPU attention 128 from the CPU's default and 32 from 16) and together (FlashInfer with FlashMLA 64,
# FlashInfer with CUTLASS MLA 128, Triton with CPU attention 32, two that accept the default); a backend
# without entries; cases where the least common multiple matters (`[24]` with `[MultipleOf(16)]` is
# 48; `[24, 32]` with `[MultipleOf(16)]` is 32, the smallest candidate; three backends); that the result
# is an `int`; and agreement with the package's `common_block_size` on 300 random models.


# %%
def common_block_size(backends: list[list], default_block_size: int = 16) -> int:
    """The block size vLLM picks for a model whose attention layers use these backends."""

    ### BEGIN SOLUTION: base(s) = s.base for a MultipleOf, else s; a backend accepts b when its list is empty or b % base(s) == 0 for some s. One backend: the default if accepted, else min of its bases. Several: the default if all accept it; else the sorted lcms of itertools.product of the bases ([1] for an empty list), the first every backend accepts
    def base(size):
        return size.base if isinstance(size, MultipleOf) else size

    def accepts(sizes, block_size):
        return not sizes or any(block_size % base(size) == 0 for size in sizes)

    if len(backends) == 1:
        sizes = backends[0]
        if accepts(sizes, default_block_size):
            return default_block_size
        return min(base(size) for size in sizes)
    if all(accepts(sizes, default_block_size) for sizes in backends):
        return default_block_size
    choices = [[base(size) for size in sizes] or [1] for sizes in backends]
    for candidate in sorted({math.lcm(*choice) for choice in itertools.product(*choices)}):
        if all(accepts(sizes, candidate) for sizes in backends):
            return candidate
    raise ValueError(f"the backends share no block size: {backends}")
    ### END SOLUTION


# %%
check("14.common_block_size", common_block_size)

# %% [markdown]
# ## Putting it together
#
# Llama-3-8B's cache on a 24 GB GPU with your tasks 1 and 2, from lesson 14's 6,791,251,559 bytes
# available: try fp8, or `tensor_parallel_size=2` (each GPU then also holds half the weights, so it
# has more memory available than this). Then the block size vLLM would pick for a few models, from
# vLLM's own lists: try other backends.

# %%
llama_3_8b = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
block = block_bytes(llama_3_8b)
print(startup_line(6_791_251_559, block, 16, 8192)["line"])

for names, default in [
    (["FLASH_ATTN"], 16),
    (["CPU_ATTN"], 128),
    (["FLASHINFER", "FLASHMLA"], 16),
    (["FLASHINFER", "CUTLASS_MLA"], 16),
]:
    backends = [list(BACKEND_BLOCK_SIZES[name]) for name in names]
    print(f"{' + '.join(names)} from {default}: blocks of {common_block_size(backends, default)} tokens")

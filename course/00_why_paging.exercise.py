# %% [markdown]
# # Exercise 00 · Why paging?
#
# In this exercise you write the arithmetic of lesson 00 yourself: how many blocks a request needs,
# what a paged cache reserves and wastes, what one contiguous slot per request reserves and wastes,
# and then vLLM's start-up sizing: the bytes of one block on one GPU, and the pool and the line vLLM
# logs. Each task says what to build and how it is checked; the cell after it runs the check and
# prints a tick, or tells you which call gave which wrong answer.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished package has its own versions of these functions
# (`paged_kv.blocks_for_tokens`, `paged_kv.fragmentation_report`, `paged_kv.kv_cache_report`); try
# without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/00_why_paging.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · Blocks for a number of tokens
#
# Write `blocks_for_tokens(num_tokens, block_size)`: how many blocks of `block_size` token slots
# hold `num_tokens` tokens. Zero tokens need zero blocks; 16 tokens fit in one block of 16, the 17th
# needs a second. Use integer arithmetic only (no `math.ceil` of a float).
#
# **Checked:** the results for 0, 1, 16, 17, 33 and 41 tokens in blocks of 16, for blocks of 1, and
# that the result is an `int`.


# %%
def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size), in integers."""
    ### BEGIN SOLUTION: return the ceiling of num_tokens / block_size using only // (hint: -(-a // b))
    return -(-num_tokens // block_size)
    ### END SOLUTION


# %%
check("00.blocks_for_tokens", blocks_for_tokens)

# %% [markdown]
# ## Task 2 · What a paged cache reserves and wastes
#
# Write `paged_usage(request_tokens, block_size)` for a list of request lengths, each a request's
# final length (it is done growing, so no slot is reservation for tokens to come). Return a dict with
#
# * `used_blocks`: the blocks all requests hold together;
# * `reserved_tokens`: the slots in those blocks;
# * `internal_fragmentation_tokens`: reserved slots that hold no token, all beyond the final lengths;
# * `block_utilization`: tokens held divided by slots reserved (0.0 when nothing is reserved).
#
# **Checked:** the six requests of the lesson, `[9, 17, 33, 5, 41, 12]` in blocks of 16 (11 blocks,
# 176 slots, 59 wasted), a single request, and an empty list.


# %%
def paged_usage(request_tokens: list[int], block_size: int) -> dict:
    """Blocks, slots and waste when every request holds whole blocks."""
    ### BEGIN SOLUTION: count blocks per request with blocks_for_tokens, then derive the slots and the waste
    used_blocks = sum(blocks_for_tokens(tokens, block_size) for tokens in request_tokens)
    reserved = used_blocks * block_size
    held = sum(request_tokens)
    return {
        "used_blocks": used_blocks,
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "block_utilization": held / reserved if reserved else 0.0,
    }
    ### END SOLUTION


# %%
check("00.paged_usage", paged_usage)

# %% [markdown]
# ## Task 3 · What contiguous slots reserve and waste
#
# Write `contiguous_usage(request_tokens, slot_tokens=None)`: every request reserves one slot of
# `slot_tokens` tokens, by default as long as the longest request. Return a dict with
# `reserved_tokens`, `internal_fragmentation_tokens` and `utilization` (0.0 when nothing is
# reserved).
#
# **Checked:** the lesson's six requests (246 slots, 129 wasted), the three requests of 300, 5,000
# and 70 tokens in 8,000-token slots from the lesson's section 2, and an empty list.


# %%
def contiguous_usage(request_tokens: list[int], slot_tokens: int | None = None) -> dict:
    """Slots and waste when every request reserves one contiguous slot."""
    ### BEGIN SOLUTION: default the slot to max(request_tokens) (0 for no requests); reserve one per request
    slot = max(request_tokens, default=0) if slot_tokens is None else slot_tokens
    reserved = slot * len(request_tokens)
    held = sum(request_tokens)
    return {
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "utilization": held / reserved if reserved else 0.0,
    }
    ### END SOLUTION


# %%
check("00.contiguous_usage", contiguous_usage)

# %% [markdown]
# ## Task 4 · The bytes of one block on one GPU
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
check("00.block_bytes", block_bytes)

# %% [markdown]
# ## Task 5 · The pool and vLLM's start-up line
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
check("00.startup_line", startup_line)

# %% [markdown]
# ## Putting it together
#
# With the first three tasks done, this compares the two layouts on the lesson's requests. Try other
# requests and block sizes: when does paging waste *more* than the contiguous baseline? The last lines
# size Llama-3-8B's cache on a 24 GB GPU with your tasks 4 and 5: try fp8, or `tensor_parallel_size=2`
# (each GPU then also holds half the weights, so it has more memory available than this).

# %%
requests = [9, 17, 33, 5, 41, 12]
paged = paged_usage(requests, block_size=16)
contiguous = contiguous_usage(requests)
print(f"paged:      {paged['reserved_tokens']} slots, {paged['internal_fragmentation_tokens']} wasted")
print(
    f"contiguous: {contiguous['reserved_tokens']} slots, {contiguous['internal_fragmentation_tokens']} wasted"
)

llama_3_8b = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
block = block_bytes(llama_3_8b)
print(startup_line(6_791_251_559, block, 16, 8192)["line"])

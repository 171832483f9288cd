"""Checks of exercise 00: the waste arithmetic of paged and contiguous layouts, and vLLM's start-up sizing.

The last two tasks are the arithmetic of :mod:`paged_kv.kv.startup` (vLLM 0.33.0's ``get_kv_cache_configs``
and ``update_kv_cache_capacity``): the bytes of one block on one GPU, and the pool and the line vLLM logs.
When an answer is wrong, the check runs the learner's code beside the classic mistakes, written as small
wrong implementations, and names the one it behaves like (:func:`~paged_kv.checks._core.diagnose`).
"""

from __future__ import annotations

from collections.abc import Callable

from paged_kv.checks._core import Checker, answers, diagnose, task

SEED_REQUESTS = [9, 17, 33, 5, 41, 12]
CEILING_HINT = "ceil(n / b) in integers is -(-n // b) or (n + b - 1) // b"
CEILING_MISTAKES = [
    (
        lambda n, b: n // b,
        "n // b rounds down and leaves the last tokens without a slot (17 tokens in blocks of 16 need 2 "
        f"blocks); round up: {CEILING_HINT}",
    ),
    (
        lambda n, b: n // b + 1,
        "n // b + 1 is one block too many whenever n is a multiple of b (0 tokens need no block, 16 "
        f"tokens one block of 16); {CEILING_HINT}",
    ),
    (
        lambda n, b: round(n / b),
        f"round(n / b) rounds to the nearest block count, down for 17 tokens in blocks of 16; {CEILING_HINT}",
    ),
]
# Both sides of every block boundary, for blocks of 1, 3, 4 and 16.
CEILING_PROBES = [(n, b) for b in (1, 3, 4, 16) for n in range(0, 3 * b + 2)]


@task("00.blocks_for_tokens", "blocks for a number of tokens")
def _blocks_for_tokens(c: Checker, blocks_for_tokens) -> None:
    result = c.run("blocks_for_tokens(33, 16)", lambda: blocks_for_tokens(33, 16), CEILING_HINT)
    c.holds(
        "type(blocks_for_tokens(33, 16))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a count of blocks is an int, not a float: `/` is true division (33 / 16 is 2.0625) and "
        "numpy's ceil returns a float; stay in integers with -(-n // b)",
    )
    for tokens, size, expected, hint in [
        (0, 16, 0, "zero tokens need zero blocks"),
        (1, 16, 1, "one token needs a block"),
        (16, 16, 1, "16 tokens fill exactly one block of 16, the second block starts with the 17th token"),
        (17, 16, 2, "the 17th token needs a second block"),
        (33, 16, 3, "33 tokens need 3 blocks of 16"),
        (41, 16, 3, "41 tokens need 3 blocks of 16"),
        (5, 1, 5, "with blocks of 1, every token is a block"),
    ]:
        c.equal(
            f"blocks_for_tokens({tokens}, {size})",
            lambda tokens=tokens, size=size: blocks_for_tokens(tokens, size),
            expected,
            lambda hint=hint: (
                diagnose(blocks_for_tokens, CEILING_MISTAKES, answers(CEILING_PROBES, int), "")
                or f"{hint}; {CEILING_HINT}"
            ),
        )


@task("00.paged_usage", "what a paged cache reserves and wastes")
def _paged_usage(c: Checker, paged_usage) -> None:
    c.equal(
        f"paged_usage({SEED_REQUESTS}, 16)",
        lambda: paged_usage(SEED_REQUESTS, 16),
        {
            "used_blocks": 11,
            "reserved_tokens": 176,
            "internal_fragmentation_tokens": 59,
            "block_utilization": 117 / 176,
        },
        "each request holds its own blocks_for_tokens(tokens, 16) blocks, rounded up per request "
        "(not blocks_for_tokens of the total: a block holds one request's tokens); reserved = blocks * 16",
    )
    c.equal(
        "paged_usage([9], 16)",
        lambda: paged_usage([9], 16),
        {
            "used_blocks": 1,
            "reserved_tokens": 16,
            "internal_fragmentation_tokens": 7,
            "block_utilization": 9 / 16,
        },
    )
    c.equal(
        "paged_usage([], 16)",
        lambda: paged_usage([], 16),
        {
            "used_blocks": 0,
            "reserved_tokens": 0,
            "internal_fragmentation_tokens": 0,
            "block_utilization": 0.0,
        },
        "with nothing reserved, utilization is 0.0 (avoid dividing by zero)",
    )


@task("00.contiguous_usage", "what contiguous slots reserve and waste")
def _contiguous_usage(c: Checker, contiguous_usage) -> None:
    c.equal(
        f"contiguous_usage({SEED_REQUESTS})",
        lambda: contiguous_usage(SEED_REQUESTS),
        {"reserved_tokens": 246, "internal_fragmentation_tokens": 129, "utilization": 117 / 246},
        "by default every request reserves a slot as long as the longest one, 41 tokens, not as long as "
        "itself",
    )
    c.equal(
        "contiguous_usage([300, 5000, 70], slot_tokens=8000)",
        lambda: contiguous_usage([300, 5000, 70], slot_tokens=8000),
        {"reserved_tokens": 24000, "internal_fragmentation_tokens": 18630, "utilization": 5370 / 24000},
        "when slot_tokens is given, every request reserves exactly that",
    )
    c.equal(
        "contiguous_usage([])",
        lambda: contiguous_usage([]),
        {"reserved_tokens": 0, "internal_fragmentation_tokens": 0, "utilization": 0.0},
        "max([]) fails: use max(request_tokens, default=0)",
    )


# ------------------------------------------------------------------------------ Task 4

LLAMA_3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "torch_dtype": "bfloat16",
}
QWEN3_0_6B = {  # its head_dim, 128, is not hidden_size // num_attention_heads (64)
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}
CONFIGS = {"LLAMA_3_8B": LLAMA_3_8B, "SMOLLM2_135M": SMOLLM2_135M, "QWEN3_0_6B": QWEN3_0_6B}
_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
BLOCK_RULE = (
    "one block on one GPU is 2 * num_hidden_layers * kv_heads * head_dim * block_size * bytes, with "
    "kv_heads = max(1, num_key_value_heads // tensor_parallel_size) and the bytes of kv_cache_dtype "
    "('auto': the config's torch_dtype)"
)


def _block(
    k_and_v=2, heads_key="num_key_value_heads", tp_twice=False, head_dim=True, cache_dtype=True, floor=1
):
    def block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1):
        dtype = config["torch_dtype"] if kv_cache_dtype == "auto" or not cache_dtype else kv_cache_dtype
        size = (config.get("head_dim") if head_dim else None) or config["hidden_size"] // config[
            "num_attention_heads"
        ]
        heads = max(floor, config[heads_key] // tensor_parallel_size)
        total = k_and_v * config["num_hidden_layers"] * heads * size * block_size * _BYTES[dtype]
        return total // tensor_parallel_size if tp_twice else total

    return block_bytes


BLOCK_MISTAKES = [
    (
        _block(k_and_v=1),
        "a block holds K and V, two vectors a token, a K/V head and a layer: you forgot the factor 2 of "
        f"K and V; {BLOCK_RULE}",
    ),
    (
        _block(heads_key="num_attention_heads"),
        "count the K/V heads, num_key_value_heads, not the query heads num_attention_heads: with "
        "grouped-query attention several query heads read one K/V head, and only K/V is cached "
        f"(Llama-3-8B: 32 query heads, 8 K/V heads); {BLOCK_RULE}",
    ),
    (
        _block(tp_twice=True),
        "you divided by tensor_parallel_size twice: each GPU keeps num_key_value_heads // tp heads of "
        "every block, and that already is its share, so the bytes are not divided by tp again "
        f"(Llama-3-8B at tp 2: 1 MiB, not 512 KiB); {BLOCK_RULE}",
    ),
    (
        _block(head_dim=False),
        "use the config's head_dim when it gives one: Qwen3-0.6B's is 128, twice hidden_size // "
        f"num_attention_heads = 64; only a config without head_dim falls back on that; {BLOCK_RULE}",
    ),
    (
        _block(cache_dtype=False),
        "kv_cache_dtype decides the bytes of a cached number: 'fp8' (and 'fp8_e4m3', 'fp8_e5m2') is one "
        "byte whatever the model's dtype; only 'auto' means the config's torch_dtype. An fp8 block is half "
        f"a bfloat16 one; {BLOCK_RULE}",
    ),
    (
        _block(floor=0),
        "with more GPUs than K/V heads vLLM replicates them: each GPU keeps one head, "
        "max(1, num_key_value_heads // tensor_parallel_size) (ModelConfig.get_num_kv_heads), never 0 "
        f"(Llama-3-8B at tp 16: as at tp 8); {BLOCK_RULE}",
    ),
]
BLOCK_PROBES = [
    (config, block_size, cache_dtype, tp)
    for config in (LLAMA_3_8B, SMOLLM2_135M, QWEN3_0_6B)
    for block_size in (16, 32)
    for cache_dtype in ("auto", "fp8")
    for tp in ((1, 2, 8, 16) if config is LLAMA_3_8B else (1, 3) if config is SMOLLM2_135M else (1, 2))
]


@task("00.block_bytes", "the bytes of one block on one GPU")
def _block_bytes(c: Checker, block_bytes) -> None:
    def hint(default: str) -> Callable[[], str]:
        return lambda: diagnose(
            block_bytes, BLOCK_MISTAKES, answers(BLOCK_PROBES, int), f"{default}; {BLOCK_RULE}"
        )

    result = c.run("block_bytes(LLAMA_3_8B)", lambda: block_bytes(LLAMA_3_8B), BLOCK_RULE)
    c.holds(
        "type(block_bytes(LLAMA_3_8B))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a count of bytes is an int: multiply integers, and divide with // if you divide",
    )
    for call, thunk, expected, why in [
        (
            "block_bytes(LLAMA_3_8B)",
            lambda: block_bytes(LLAMA_3_8B),
            2 * 2**20,
            "Llama-3-8B's block is 2 MiB",
        ),
        (
            "block_bytes(SMOLLM2_135M)",
            lambda: block_bytes(SMOLLM2_135M),
            368640,
            "30 layers, 3 K/V heads of 64",
        ),
        (
            "block_bytes(QWEN3_0_6B)",
            lambda: block_bytes(QWEN3_0_6B),
            1835008,
            "28 layers, 8 K/V heads of 128",
        ),
        ("block_bytes(LLAMA_3_8B, 32)", lambda: block_bytes(LLAMA_3_8B, 32), 4 * 2**20, "twice the tokens"),
        (
            "block_bytes(LLAMA_3_8B, kv_cache_dtype='fp8')",
            lambda: block_bytes(LLAMA_3_8B, kv_cache_dtype="fp8"),
            2**20,
            "fp8 is one byte a number",
        ),
        (
            "block_bytes(LLAMA_3_8B, kv_cache_dtype='fp8_e5m2')",
            lambda: block_bytes(LLAMA_3_8B, kv_cache_dtype="fp8_e5m2"),
            2**20,
            "fp8_e5m2 is one byte a number too",
        ),
        (
            "block_bytes(LLAMA_3_8B, tensor_parallel_size=2)",
            lambda: block_bytes(LLAMA_3_8B, tensor_parallel_size=2),
            2**20,
            "at tp 2 each GPU keeps 4 of the 8 K/V heads",
        ),
        (
            "block_bytes(LLAMA_3_8B, tensor_parallel_size=8)",
            lambda: block_bytes(LLAMA_3_8B, tensor_parallel_size=8),
            2**18,
            "at tp 8 each GPU keeps 1 of the 8 K/V heads",
        ),
        (
            "block_bytes(LLAMA_3_8B, tensor_parallel_size=16)",
            lambda: block_bytes(LLAMA_3_8B, tensor_parallel_size=16),
            2**18,
            "at tp 16 each K/V head is on two GPUs: each keeps one",
        ),
    ]:
        c.equal(call, thunk, expected, hint(why))
    fp8 = block_bytes(LLAMA_3_8B, kv_cache_dtype="fp8")  # checked above
    bf16 = c.run(
        "block_bytes(LLAMA_3_8B, kv_cache_dtype='bfloat16')",
        lambda: block_bytes(LLAMA_3_8B, kv_cache_dtype="bfloat16"),
        hint("'bfloat16' is two bytes a number"),
    )
    c.holds(
        "block_bytes(LLAMA_3_8B, kv_cache_dtype='bfloat16') // block_bytes(LLAMA_3_8B, kv_cache_dtype='fp8')",
        bf16 == 2 * fp8,
        "2: an fp8 block is half a bfloat16 one",
        f"{bf16} // {fp8}",
        hint("'bfloat16' is two bytes a number, like the config's own dtype"),
    )


# ------------------------------------------------------------------------------ Task 5

MiB = 2**20
LINE_RULE = (
    "num_gpu_blocks = available_memory // bytes_per_block; max_concurrency = num_gpu_blocks / "
    "ceil(max_model_len / block_size); kv_cache_tokens = int(max_concurrency * max_model_len); the line is "
    "f'GPU KV cache size: {kv_cache_tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per "
    "request: {max_concurrency:.2f}x'"
)


def _line(
    decimals=True, floor=False, commas=True, tokens_from_blocks=False, subtract_null=False, reserve=True
):
    def startup_line(available_memory, bytes_per_block, block_size, max_model_len):
        per_request = -(-max_model_len // block_size)
        if (per_request + reserve) * bytes_per_block > available_memory or available_memory < bytes_per_block:
            raise ValueError("one request does not fit")
        blocks = available_memory // bytes_per_block
        usable = blocks - 1 if subtract_null else blocks
        concurrency = usable // per_request if floor else usable / per_request
        tokens = usable * block_size if tokens_from_blocks else int(concurrency * max_model_len)
        shown = f"{concurrency:.2f}" if decimals else f"{round(concurrency, 2)}"
        counts = (f"{tokens:,}", f"{max_model_len:,}") if commas else (f"{tokens}", f"{max_model_len}")
        line = _expected_line(*counts, shown)
        return {
            "num_gpu_blocks": blocks,
            "kv_cache_tokens": tokens,
            "max_concurrency": concurrency,
            "line": line,
        }

    return startup_line


TWO_DECIMALS = (
    "write the concurrency with two decimals, f'{max_concurrency:.2f}x' as vLLM's '%.2fx' does (6.50x), "
    "and keep max_concurrency itself the exact num_gpu_blocks / blocks_per_request: "
)
LINE_MISTAKES = [
    (_line(decimals=False), TWO_DECIMALS + f"round(max_concurrency, 2) shows 6.5x, not 6.50x; {LINE_RULE}"),
    (
        _line(floor=True),
        TWO_DECIMALS + f"// gives a whole number of requests (6.00x where vLLM shows 6.32x); {LINE_RULE}",
    ),
    (
        _line(commas=False),
        "vLLM writes both counts with thousands separators, f'{kv_cache_tokens:,}' and f'{max_model_len:,}' "
        f"(51,808 tokens, 8,192 tokens per request); {LINE_RULE}",
    ),
    (
        _line(tokens_from_blocks=True),
        "the line's tokens are int(max_concurrency * max_model_len) (vLLM's get_kv_cache_capacity), not "
        "num_gpu_blocks * block_size: they differ when max_model_len is not a multiple of block_size "
        f"(1,000 tokens take 63 blocks of 16, 1,008 slots); {LINE_RULE}",
    ),
    (
        _line(subtract_null=True),
        "vLLM 0.33.0's line counts every block of the pool, the null block too: max_concurrency = "
        "num_gpu_blocks / blocks_per_request, not (num_gpu_blocks - 1) / ...; the null block is reserved "
        f"only by the check that one request fits; {LINE_RULE}",
    ),
    (
        _line(reserve=False),
        "reserve the null block before the check: the pool keeps it back for good, so one request fits "
        "only when (blocks_per_request + 1) * bytes_per_block <= available_memory (512 blocks of 2 MiB "
        f"cannot hold a request of 8,192 tokens); {LINE_RULE}",
    ),
]
LLAMA_24GB = 6_791_251_559  # kv_cache_report's available memory for Llama-3-8B on a 24 GB GPU at 0.9
LINE_PROBES = [
    (LLAMA_24GB, 2 * MiB, 16, 8192),
    (LLAMA_24GB, 2 * MiB, 16, 1000),
    (3328 * 2 * MiB, 2 * MiB, 16, 8192),
    (513 * 2 * MiB, 2 * MiB, 16, 8192),
    (512 * 2 * MiB, 2 * MiB, 16, 8192),
    (2 * MiB, 2 * MiB, 16, 16),
    (368640 * 1000, 368640, 16, 512),
]


def _outcomes(fn) -> list:
    """What ``fn`` does on every probe: its dict, or the name of the error it raised."""
    seen = []
    for case in LINE_PROBES:
        try:
            seen.append(fn(*case))
        except ValueError:
            seen.append("ValueError")
    return seen


def _expected_line(tokens: str, length: str, concurrency: str) -> str:
    """vLLM's line with its three numbers already written out."""
    line = f"GPU KV cache size: {tokens} tokens, Maximum concurrency for {length} tokens per request: "
    return f"{line}{concurrency}x"


@task("00.startup_line", "vLLM's pool and its start-up line")
def _startup_line(c: Checker, startup_line) -> None:
    def hint(default: str) -> Callable[[], str]:
        return lambda: diagnose(startup_line, LINE_MISTAKES, _outcomes, f"{default}; {LINE_RULE}")

    for call, args, expected, why in [
        (
            "startup_line(6_791_251_559, 2 * MiB, 16, 8192)",
            (LLAMA_24GB, 2 * MiB, 16, 8192),
            {
                "num_gpu_blocks": 3238,
                "kv_cache_tokens": 51808,
                "max_concurrency": 3238 / 512,
                "line": _expected_line("51,808", "8,192", "6.32"),
            },
            "Llama-3-8B on a 24 GB GPU: 3,238 blocks of 2 MiB, 512 for one request of 8,192 tokens",
        ),
        (
            "startup_line(3328 * 2 * MiB, 2 * MiB, 16, 8192)",
            (3328 * 2 * MiB, 2 * MiB, 16, 8192),
            {
                "num_gpu_blocks": 3328,
                "kv_cache_tokens": 53248,
                "max_concurrency": 6.5,
                "line": _expected_line("53,248", "8,192", "6.50"),
            },
            "3,328 blocks hold 6.5 requests of 512 blocks",
        ),
        (
            "startup_line(6_791_251_559, 2 * MiB, 16, 1000)",
            (LLAMA_24GB, 2 * MiB, 16, 1000),
            {
                "num_gpu_blocks": 3238,
                "kv_cache_tokens": 51396,
                "max_concurrency": 3238 / 63,
                "line": _expected_line("51,396", "1,000", "51.40"),
            },
            "a request of 1,000 tokens takes 63 blocks of 16",
        ),
        (
            "startup_line(513 * 2 * MiB, 2 * MiB, 16, 8192)",
            (513 * 2 * MiB, 2 * MiB, 16, 8192),
            {
                "num_gpu_blocks": 513,
                "kv_cache_tokens": 8208,
                "max_concurrency": 513 / 512,
                "line": _expected_line("8,208", "8,192", "1.00"),
            },
            "513 blocks: the null block and one request of 512; the line counts all 513",
        ),
    ]:
        c.equal(call, lambda args=args: startup_line(*args), expected, hint(why))
    for call, args, why in [
        (
            "startup_line(512 * 2 * MiB, 2 * MiB, 16, 8192)",
            (512 * 2 * MiB, 2 * MiB, 16, 8192),
            "512 blocks: one is the null block, so a request of 512 blocks does not fit",
        ),
        ("startup_line(2 * MiB, 2 * MiB, 16, 16)", (2 * MiB, 2 * MiB, 16, 16), "one block, the null block"),
        ("startup_line(0, 2 * MiB, 16, 16)", (0, 2 * MiB, 16, 16), "no memory at all"),
        (
            "startup_line(-2**30, 2 * MiB, 16, 16)",
            (-(2**30), 2 * MiB, 16, 16),
            "less than nothing: the weights",
        ),
    ]:
        c.raises(call, lambda args=args: startup_line(*args), ValueError, hint(why))

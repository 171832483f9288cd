"""Checks of exercise 14: vLLM's start-up sizing, and the block size every backend accepts.

The first two tasks are the arithmetic of :mod:`paged_kv.kv.startup` (vLLM 0.33.0's ``get_kv_cache_configs``
and ``update_kv_cache_capacity``): the bytes of one block on one GPU, and the pool and the line vLLM logs.
The third is vLLM's choice of a block size every attention backend accepts, checked against
:func:`paged_kv.kv.block_size.common_block_size` with vLLM 0.33.0's real backend lists among the cases
(:data:`~paged_kv.kv.block_size.BACKEND_BLOCK_SIZES`), through :mod:`paged_kv.reference.lesson14`. When an
answer is wrong, the check runs the learner's code beside the classic mistakes, written as small wrong
implementations, and names the one it behaves like (:func:`~paged_kv.checks._core.diagnose`).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

from paged_kv.checks._core import Checker, answers, diagnose, outcome, task
from paged_kv.kv.block_size import BACKEND_BLOCK_SIZES, EXACT_SIZES_ONLY, MultipleOf
from paged_kv.reference.lesson14 import common_block_size as package_common

# ------------------------------------------------------------------------------ Task 1

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


@task("14.block_bytes", "the bytes of one block on one GPU")
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


# ------------------------------------------------------------------------------ Task 2

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


@task("14.startup_line", "vLLM's pool and its start-up line")
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


# ------------------------------------------------------------------------------- Task 3

COMMON_RULE = (
    "one backend: the default if it accepts it, else its smallest size's base; several: the default if "
    "every backend accepts it, else the smallest math.lcm of one size per backend (a backend without sizes "
    "counts as 1) that every backend accepts. A backend accepts a size that is a multiple of the base of "
    "one of its entries (an int n or MultipleOf(n) alike); an empty list accepts any"
)
DEFAULT_IGNORED = (
    "the default wins whenever every backend accepts it: vLLM keeps default_block_size (16 on a GPU, 128 "
    "on the CPU) when each backend supports it and only then looks for another size, so CPU_ATTN "
    "([MultipleOf(32)]) on the CPU keeps 128, not 32"
)
MAX_NOT_LCM = (
    "a size every backend accepts is a common multiple of one size from each: combine a choice with "
    "math.lcm, not max (24 and 16 give lcm 48; 24 is no multiple of 16)"
)
INTS_EXACT = (
    "an int in a backend's list accepts its multiples too when vLLM picks the manager's block size "
    "(AttentionBackend.supports_block_size: block_size % size == 0), since the worker splits a manager "
    "block into kernel blocks: FlashInfer ([16, 32, 64]) accepts 128, so FlashInfer with CUTLASS_MLA "
    "([128]) gets 128. Only the kernel block (select_common_block_size) needs an int to match exactly"
)
FIRST_CANDIDATE = (
    "take the smallest candidate, not the first one found: sort the LCMs (sorted({...})) before trying "
    "them; [64, 16] with [MultipleOf(24)] gives 48 (lcm(16, 24)), not 192 (lcm(64, 24))"
)
SMALLEST_ONLY = (
    "try every choice of one size per backend (itertools.product), not only each backend's smallest: "
    "[24, 32] with [MultipleOf(16)] gives 32 (lcm(32, 16)), smaller than lcm(24, 16) = 48"
)
EMPTY_NOT_ANY = (
    "a backend without sizes accepts any block size: let an empty list accept every size and count it as "
    "1 in the LCMs (vLLM: `or [1]`), so [] with [64] gives 64"
)


def _base(size: object) -> int:
    return size.base if isinstance(size, MultipleOf) else size  # type: ignore[return-value]


def _common(
    backends: list,
    default: int = 16,
    *,
    use_default: bool = True,
    combine: Callable[..., int] = math.lcm,
    ints_exact: bool = False,
    smallest_first: bool = True,
    each_smallest_only: bool = False,
    empty_is_any: bool = True,
) -> int:
    """The rule, or a classic mistake (a keyword changed)."""

    def accepts(sizes: list, size: int) -> bool:
        if not sizes:
            return empty_is_any
        return any(
            size == s if ints_exact and not isinstance(s, MultipleOf) else size % _base(s) == 0 for s in sizes
        )

    if use_default:
        if len(backends) == 1:
            sizes = backends[0]
            return default if accepts(sizes, default) else min(_base(s) for s in sizes)
        if all(accepts(sizes, default) for sizes in backends):
            return default
    choices = [[_base(s) for s in sizes] or ([1] if empty_is_any else []) for sizes in backends]
    if each_smallest_only:
        choices = [[min(choice)] if choice else [] for choice in choices]
    found = [combine(*choice) for choice in itertools.product(*choices)]
    ordered = sorted(set(found)) if smallest_first else list(dict.fromkeys(found))
    for candidate in ordered:
        if all(accepts(sizes, candidate) for sizes in backends):
            return candidate
    raise ValueError("no common block size")


COMMON_MISTAKES: list[tuple[Callable[..., int], str]] = [
    (lambda b, d=16: _common(b, d, use_default=False), DEFAULT_IGNORED),
    (lambda b, d=16: _common(b, d, combine=max), MAX_NOT_LCM),
    (lambda b, d=16: _common(b, d, ints_exact=True), INTS_EXACT),
    (lambda b, d=16: _common(b, d, smallest_first=False), FIRST_CANDIDATE),
    (lambda b, d=16: _common(b, d, each_smallest_only=True), SMALLEST_ONLY),
    (lambda b, d=16: _common(b, d, empty_is_any=False), EMPTY_NOT_ANY),
]


def _real(*names: str) -> list[list]:
    return [list(BACKEND_BLOCK_SIZES[name]) for name in names]


M = MultipleOf
# (backends, default_block_size, why): vLLM's backends first, then cases where the LCM matters
COMMON_EXAMPLES: list[tuple[list, int, str]] = [
    (_real("FLASH_ATTN"), 16, "FlashAttention alone: 16 is a multiple of 16"),
    (_real("FLASHINFER"), 16, "FlashInfer alone accepts the default"),
    (_real("FLASHMLA"), 16, "FlashMLA alone: 16 is no multiple of 64, so its smallest size"),
    (_real("CUTLASS_MLA"), 16, "CUTLASS MLA alone: its one size"),
    (_real("CPU_ATTN"), 128, "the CPU platform starts from 128, a multiple of 32"),
    (_real("CPU_ATTN"), 16, "CPU attention from 16: 16 is no multiple of 32"),
    (_real("FLASH_ATTN", "FLASHINFER"), 16, "both accept the default"),
    (_real("FLASHINFER", "FLASHMLA"), 16, "FlashMLA refuses 16; lcm(16, 64) = 64, which FlashInfer accepts"),
    (_real("FLASHINFER", "CUTLASS_MLA"), 16, "an exact 16 accepts 128, a multiple of it"),
    (_real("TRITON_ATTN", "CPU_ATTN"), 16, "lcm(16, 32) = 32"),
    (_real("FLASH_ATTN", "FLASHINFER"), 128, "from 128: both accept it"),
    ([[], [64]], 16, "a backend without sizes accepts any size"),
    ([[], []], 16, "no sizes at all: the default"),
    ([[24], [M(16)]], 16, "24 is no multiple of 16: lcm(24, 16) = 48"),
    ([[24, 32], [M(16)]], 16, "the candidates are 48 and 32: the smallest is 32"),
    ([[64, 16], [M(24)]], 16, "the candidates are 192 and 48: the smallest is 48"),
    ([[M(3)], [M(4)], [M(5)]], 16, "three backends: lcm(3, 4, 5) = 60"),
    ([[M(48)], [M(32)]], 128, "128 is no multiple of 48: lcm(48, 32) = 96"),
]


def _random_backends(count: int, seed: int) -> list[tuple[list, int]]:
    """Random models: one to three backends, each a real backend's list or a random one."""
    rng = random.Random(seed)
    real = sorted(set(BACKEND_BLOCK_SIZES) - EXACT_SIZES_ONLY)
    cases = []
    for _ in range(count):
        backends = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.4:
                backends.append(list(BACKEND_BLOCK_SIZES[rng.choice(real)]))
            else:
                sizes = [
                    rng.choice((4, 8, 12, 16, 24, 32, 48, 64, 96, 128)) for _ in range(rng.randint(0, 3))
                ]
                backends.append([M(s) if rng.random() < 0.4 else s for s in sizes])
        cases.append((backends, rng.choice((16, 16, 32, 128, 24))))
    return cases


def _common_hint(common: Callable[..., object]) -> str:
    cases = [(backends, default) for backends, default, _ in COMMON_EXAMPLES] + _random_backends(200, 140)

    def probe(fn: Callable[..., object]) -> list:
        return [outcome(lambda b=b, d=d: fn([list(x) for x in b], d)) for b, d in cases]

    return diagnose(common, COMMON_MISTAKES, probe, COMMON_RULE)


def _call(backends: list, default: int) -> str:
    return f"common_block_size({backends!r}" + (")" if default == 16 else f", {default})")


@task("14.common_block_size", "the block size every backend accepts", needs=("common_block_size",))
def _common_block_size(c: Checker, common) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _common_hint(common)

    def expect(backends: list, default: int, why: str) -> None:
        c.equal(
            f"{_call(backends, default)}  # {why}",
            lambda: common([list(b) for b in backends], default),
            package_common(backends, default),
            hint,
        )

    for backends, default, why in COMMON_EXAMPLES:
        expect(backends, default, why)
    result = c.run("common_block_size([[64]])", lambda: common([[64]]))
    c.holds(
        "type(common_block_size([[64]]))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a block size is an int: math.lcm and min of ints are ints",
    )
    cases = _random_backends(300, 14)
    call = f"common_block_size(...) on {len(cases)} random models against the package's common_block_size"

    def first_wrong() -> tuple | None:
        for backends, default in cases:
            if common([list(b) for b in backends], default) != package_common(backends, default):
                return backends, default
        return None

    wrong = c.run(call, first_wrong, hint)
    if wrong is not None:
        expect(*wrong, "a random model")
    c.holds(call, wrong is None, "the package's block size for every model", wrong, hint)

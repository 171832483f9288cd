"""An fp8 KV cache: what it saves and what it costs (lesson 10, issue 23).

1. **Bytes.** A block of Llama-3-8B's shape (32 layers, 8 K/V heads of 128, blocks of 16 tokens) in
   fp8 against bfloat16 and float32 (:class:`~paged_kv.kv.sizing.KVCacheSpec`; exact, 2x and 4x),
   and the tokens a budget of 16 GiB holds.
2. **Attention error.** Decode attention (``paged_attention``, ``"auto"``) over a cache quantized to
   ``fp8_e4m3`` and ``fp8_e5m2`` (scales 1.0) against ``scaled_dot_product_attention`` over the
   float32 K/V: ``batch`` sequences of ``context`` random N(0, 1) tokens, 32 query heads over 8 K/V
   heads of 64 (a Llama-3 layer's grouping), blocks scattered over the pool. Reported: the largest
   absolute error, against SDPA's largest output, and the relative error ``|out - SDPA| / |SDPA|``
   (Frobenius norms), against a bfloat16 cache's (bfloat16 queries and K/V, same data).
3. **Greedy tokens.** ``generate`` with an fp8 cache (``kv_cache_dtype="fp8"`` with vLLM's default
   scales of 1.0, the same with ``calculate_kv_scales=True``, and ``"fp8_e5m2"``) against the
   32-bit cache, on the tiny GPT (``TinyGPT(GPTConfig(), seed=0)``) and the tiny Hugging Face Llama
   of ``tests/test_hf_models.py`` (2 layers, 4 query heads over 2 K/V heads of 16, random weights):
   ``num_prompts`` seeded prompts of 4 to 40 tokens, ``max_new_tokens`` each. Reported: the share of
   requests whose tokens all agree, the share of tokens that agree position by position (after a
   request's first disagreement the contexts differ, so its later tokens mostly differ too), and the
   largest logit difference while a request's inputs were still the same (up to its first
   disagreement), against the 32-bit run's median gap between its two largest logits: random
   weights give nearly flat logits, whose near ties a small error flips.

Counts and errors, not times: the rows are the same on every run of one machine (another device
rounds differently). ``tests/test_fp8.py`` holds the agreement above a floor.

    .venv/bin/python bench/bench_fp8.py
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, text_table

from paged_kv.attention.paged import paged_attention
from paged_kv.kv.fp8 import quantize
from paged_kv.kv.sizing import KVCacheSpec
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.tiny_gpt import TinyGPT

GIB = 1024**3
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
#: The fp8 caches compared with the 32-bit one: (label, generate's keywords).
CACHES = (
    ("fp8_e4m3, scales 1.0", {"kv_cache_dtype": "fp8"}),
    ("fp8_e4m3, calculate_kv_scales", {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}),
    ("fp8_e5m2, scales 1.0", {"kv_cache_dtype": "fp8_e5m2"}),
)


def bytes_rows(block_size: int = 16, budget: int = 16 * GIB) -> list[Row]:
    """Llama-3-8B's block and the tokens ``budget`` holds, fp8 against bfloat16 and float32."""
    shape = (32, 8, 128)  # layers, K/V heads, head size
    fp8 = KVCacheSpec(*shape, torch.float8_e4m3fn)
    rows = []
    for dtype, ratio in ((torch.bfloat16, 2), (torch.float32, 4)):
        name = str(dtype).removeprefix("torch.")
        ours, theirs = fp8.bytes_per_block(block_size), KVCacheSpec(*shape, dtype).bytes_per_block(block_size)
        what = f"bytes per block of {block_size}, Llama-3-8B: fp8 against {name}, ratio {name} / fp8"
        rows.append(
            Row(what, ours / 1024, theirs / 1024, theirs / ours, f"= {ratio}x", theirs == ratio * ours, "KiB")
        )
    tokens = fp8.num_blocks(budget, block_size) * block_size
    bf16_tokens = KVCacheSpec(*shape, torch.bfloat16).num_blocks(budget, block_size) * block_size
    what = f"tokens {budget // GIB} GiB holds, Llama-3-8B: fp8 against bfloat16, ratio fp8 / bfloat16"
    rows.append(
        Row(what, tokens / 1000, bf16_tokens / 1000, tokens / bf16_tokens, "= 2x", tokens == 2 * bf16_tokens,
            unit="k tokens")
    )  # fmt: skip
    return rows


@dataclass(frozen=True)
class AttentionError:
    """Decode attention over a cache against SDPA over the float32 K/V."""

    max_abs: float  # the largest |out - SDPA|
    relative: float  # |out - SDPA| / |SDPA|, Frobenius norms
    largest: float  # SDPA's largest |output|


def attention_errors(
    batch: int, context: int, heads: tuple[int, int], head_dim: int, block_size: int, seed: int = 0
) -> dict[str, AttentionError]:
    """The error of each format's cache (and of a bfloat16 one) on one seeded decode batch."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(batch, num_kv_heads, context, head_dim, generator=gen) for _ in "kv")
    query = torch.randn(batch, num_heads, head_dim, generator=gen)
    sdpa = F.scaled_dot_product_attention(query[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    per_row = -(-context // block_size)
    tables = torch.randperm(batch * per_row, generator=gen).view(batch, per_row)
    padded = per_row * block_size - context

    def pooled(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, tokens, dim) -> scattered blocks
        blocks = F.pad(t, (0, 0, 0, padded)).view(batch, num_kv_heads, per_row, block_size, head_dim)
        pool = torch.empty(batch * per_row, num_kv_heads, block_size, head_dim)
        pool[tables] = blocks.transpose(1, 2)
        return pool

    pool_k, pool_v = pooled(k), pooled(v)
    lens = [context] * batch
    outputs = {
        name: paged_attention(query, quantize(pool_k, 1.0, dtype), quantize(pool_v, 1.0, dtype), tables, lens)
        for name, dtype in FORMATS.items()
    }
    bf16 = torch.bfloat16
    outputs["bfloat16"] = paged_attention(query.to(bf16), pool_k.to(bf16), pool_v.to(bf16), tables, lens)
    errors = {}
    for name, out in outputs.items():
        error = out.float() - sdpa
        errors[name] = AttentionError(
            float(error.abs().max()), float(error.norm() / sdpa.norm()), float(sdpa.abs().max())
        )
    return errors


def attention_rows(
    batch: int, context: int, heads: tuple[int, int], head_dim: int, block_size: int
) -> list[Row]:
    errors = attention_errors(batch, context, heads, head_dim, block_size)
    rows = []
    for name in FORMATS:
        error, bf16 = errors[name], errors["bfloat16"]
        what = f"decode attention over a cache of {name} against SDPA over float32"
        rows.append(
            Row(f"{what}: largest |error|, against SDPA's largest |output|",
                error.max_abs * 1e3, error.largest * 1e3, error.max_abs / error.largest, "—", None,
                unit="10^-3")
        )  # fmt: skip
        rows.append(
            Row(f"{what}: relative error |out - SDPA| / |SDPA|, against a bfloat16 cache's",
                error.relative * 100, bf16.relative * 100, error.relative / bf16.relative, "—", None,
                unit="%")
        )  # fmt: skip
    return rows


@dataclass(frozen=True)
class Agreement:
    """Greedy tokens with an fp8 cache against the 32-bit cache's."""

    requests: float  # the share of requests whose tokens all agree
    tokens: float  # the share of tokens that agree, position by position
    logit_diff: float  # the largest |logit difference| while a request's inputs were the same
    margin: float  # the 32-bit run's median gap between its two largest logits


def agreement(model, prompts: list[list[int]], max_new_tokens: int, **options) -> Agreement:
    """``generate`` with the cache ``options`` describe against the 32-bit cache, on ``prompts``."""
    ref = generate(model, prompts, max_new_tokens)
    out = generate(model, prompts, max_new_tokens, **options)
    pairs = list(zip(out.tokens, ref.tokens, strict=True))
    same = sum(a == b for a, b in pairs) / len(pairs)
    tokens = [x == y for a, b in pairs for x, y in zip(a, b, strict=True)]
    diff = 0.0
    for i, (a, b) in enumerate(pairs):  # the steps up to the first disagreement: the same inputs
        steps = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a) - 1) + 1
        diff = max(diff, float((out.logits[:steps, i] - ref.logits[:steps, i]).abs().max()))
    top2 = ref.logits.topk(2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).median())
    return Agreement(same, sum(tokens) / len(tokens), diff, margin)


def prompts_of(num_prompts: int, seed: int = 0, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(4, longest))] for _ in range(num_prompts)]


def tiny_models() -> dict[str, torch.nn.Module]:
    """The tiny GPT and the tiny Llama of tests/test_hf_models.py (where transformers is installed)."""
    models = {"tiny GPT": TinyGPT(GPTConfig(), seed=0).eval()}
    try:
        from bench_hf import tiny_llama
    except ImportError:  # no transformers
        print("bench_fp8: transformers is not installed: no Llama rows")
        return models
    llama = tiny_llama(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_len=128)
    models["tiny HF Llama"] = llama
    return models


def agreement_rows(num_prompts: int, max_new_tokens: int) -> list[Row]:
    prompts = prompts_of(num_prompts)
    rows = []
    for model_name, model in tiny_models().items():
        for cache_name, options in CACHES:
            result = agreement(model, prompts, max_new_tokens, **options)
            what = f"greedy tokens, {model_name}, {cache_name}, against the 32-bit cache's"
            rows += [
                Row(f"{what}: requests whose tokens all agree", result.requests * 100, 100.0, result.requests,
                    "—", None, unit="%"),
                Row(f"{what}: tokens that agree, position by position", result.tokens * 100, 100.0,
                    result.tokens, "—", None, unit="%"),
                Row(f"{what}: largest logit difference up to a request's first disagreement, against the "
                    "median gap of the two largest logits", result.logit_diff * 1e3, result.margin * 1e3,
                    result.logit_diff / max(result.margin, 1e-12), "—", None, unit="10^-3"),
            ]  # fmt: skip
    return rows


def run(
    batch: int = 8,
    context: int = 1_024,
    heads: tuple[int, int] = (32, 8),
    head_dim: int = 64,
    block_size: int = 16,
    num_prompts: int = 32,
    max_new_tokens: int = 24,
) -> list[Row]:
    """The three sections (see the module)."""
    torch.manual_seed(0)
    return [
        *bytes_rows(block_size),
        *attention_rows(batch, context, heads, head_dim, block_size),
        *agreement_rows(num_prompts, max_new_tokens),
    ]


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"batch": 2, "context": 37, "heads": (4, 2), "head_dim": 8, "block_size": 4, "num_prompts": 3,
         "max_new_tokens": 3}  # fmt: skip


if __name__ == "__main__":
    print(text_table(run()))

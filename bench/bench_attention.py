"""Paged attention's backends against SDPA on the same data: decode, grouped-query decode, a packed step.

A batch of sequences (32 by default, 8 heads, head dim 64, 1,024 tokens of context, block size 16)
has its K/V in a paged cache whose blocks are scattered over the pool (a random permutation), and
the same K/V as contiguous ``(batch, heads, tokens, head_dim)`` tensors. One decode step (one query
token per sequence) is computed by each backend that runs on the CPU and by contiguous
``scaled_dot_product_attention``; each must agree with SDPA (``allclose``) before anything is
timed. They are then timed interleaved, round by round (``paged_kv.timing.compare_times``: a burst
of load slows every contender of the round alike), and each ratio is the median of the rounds'
ratios, the smallest and the largest round's in brackets. The target on the CPU: the platform's
default backend (``CPU_ATTN``, the compiled kernel, where a C compiler is found) at most
:data:`TARGET_SLOWDOWN` times SDPA. ``IN_PLACE`` and ``GATHER`` are timed beside it for
information, and so is the gather alone, the copy a gathering kernel starts with; a row gives the
kernel's build time (``cc -O3 -march=native -fopenmp``, into a fresh cache folder). On CUDA (when
there is one) the default (``TRITON_ATTN`` with triton), ``FLEX_ATTENTION`` compiled and the gather
are timed against SDPA too, with a synchronize inside each sample.

A second batch has grouped-query attention (GQA), as Llama-3-8B does: 32 query heads over 8 KV
heads (batch 8, head dim 64, the same context and block size). The default backend is timed against
SDPA with ``enable_gqa=True`` over the contiguous K/V and, for information, against SDPA over K/V
repeated to the 32 query heads (``repeat_interleave``, what a model without GQA support does).

A third batch is one engine step as vLLM v1 runs it: decodes (32 by default, the same heads, context
and block size) and one prompt chunk (256 tokens at the end of 1,024) packed together, the
``paged_prefill_attention`` of a forward that mixes both. The default backend is timed against the
same work as two calls (the decodes alone and the chunk alone, each by the default), and
``GATHER`` (every row padded to the chunk's 256 queries) and ``IN_PLACE`` (the chunk's queries
meet every block of the pool) against the default.

    .venv/bin/python bench/bench_attention.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, spread_of, text_table

from paged_kv.attention import cpu_build
from paged_kv.attention.paged import paged_attention, paged_prefill_attention
from paged_kv.attention.registry import default_backend
from paged_kv.timing import Timings, compare_times

TARGET_SLOWDOWN = 1.3
#: The backends timed on the CPU besides the default: the course's own two.
CPU_RIVALS = ("IN_PLACE", "GATHER")


def make_case(
    batch: int,
    num_heads: int,
    head_dim: int,
    context: int,
    block_size: int,
    seed: int = 0,
    num_kv_heads: int | None = None,
) -> dict[str, torch.Tensor]:
    """The same K/V laid out twice: paged (scattered blocks) and contiguous; and one query per sequence.

    Returns ``query`` ``(batch, heads, dim)``, ``k``/``v`` ``(batch, kv_heads, context, dim)``,
    ``k_cache``/``v_cache`` ``(num_blocks, kv_heads, block_size, dim)``, ``block_tables``
    ``(batch, blocks_per_seq)`` (a random permutation of every block id, so a sequence's blocks
    are scattered over the pool) and ``seq_lens`` ``(batch,)``. ``context`` need not be a
    multiple of ``block_size``: the last block of each sequence is then partly filled.
    ``num_kv_heads`` (default ``num_heads``) must divide ``num_heads``: fewer is grouped-query attention.
    """
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    k = torch.randn(batch, num_kv_heads, context, head_dim, generator=generator)
    v = torch.randn(batch, num_kv_heads, context, head_dim, generator=generator)
    query = torch.randn(batch, num_heads, head_dim, generator=generator)
    block_tables = torch.randperm(num_blocks, generator=generator).reshape(batch, per_seq)
    k_cache = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    for b in range(batch):
        for j in range(per_seq):
            tokens = slice(j * block_size, min((j + 1) * block_size, context))
            width = tokens.stop - tokens.start
            k_cache[block_tables[b, j], :, :width] = k[b, :, tokens]
            v_cache[block_tables[b, j], :, :width] = v[b, :, tokens]
    seq_lens = torch.full((batch,), context, dtype=torch.long)
    return {
        "query": query,
        "k": k,
        "v": v,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }


def paged(case: dict[str, torch.Tensor], backend: str | None = None) -> torch.Tensor:
    """The package's paged decode attention in ``backend`` (``None``: the platform's default),
    ``(batch, heads, dim)``."""
    return paged_attention(
        case["query"],
        case["k_cache"],
        case["v_cache"],
        case["block_tables"],
        case["seq_lens"],
        backend=backend,
    )


def contiguous(case: dict[str, torch.Tensor]) -> torch.Tensor:
    """The baseline: ``scaled_dot_product_attention`` of one query over the contiguous K/V (its own
    grouped-query attention, ``enable_gqa``, when the K/V have fewer heads than the query)."""
    grouped = case["k"].shape[1] != case["query"].shape[1]
    return F.scaled_dot_product_attention(
        case["query"][:, :, None], case["k"], case["v"], enable_gqa=grouped
    )[:, :, 0]


def repeated(case: dict[str, torch.Tensor]) -> torch.Tensor:
    """SDPA over K/V repeated to the query's heads (``repeat_interleave``, Hugging Face's ``repeat_kv``)."""
    group = case["query"].shape[1] // case["k"].shape[1]
    k, v = (case[name].repeat_interleave(group, dim=1) for name in ("k", "v"))
    return F.scaled_dot_product_attention(case["query"][:, :, None], k, v)[:, :, 0]


def gather_only(case: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Just the gather a copying kernel starts with: every sequence's blocks into contiguous K and V."""
    blocks = case["block_tables"]
    batch, n = blocks.shape
    _, heads, block_size, dim = case["k_cache"].shape
    return tuple(  # type: ignore[return-value]
        case[name][blocks].transpose(1, 2).reshape(batch, heads, n * block_size, dim)
        for name in ("k_cache", "v_cache")
    )


def check_equal(case: dict[str, torch.Tensor], backend: str | None = None) -> None:
    """Raise unless ``backend``'s paged attention equals SDPA on the same data."""
    if not torch.allclose(paged(case, backend), contiguous(case), atol=1e-5, rtol=1e-4):
        raise AssertionError(
            f"paged_attention ({backend or 'the default'}) differs from SDPA on the same K/V"
        )


def build_seconds() -> float:
    """The seconds the CPU kernel takes to build from its source into a fresh cache folder (the
    compiler's runs, the load included); afterwards the usual cached library is loaded again."""
    saved = os.environ.get("PAGED_KV_CACHE_DIR")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["PAGED_KV_CACHE_DIR"] = folder
        cpu_build.cache_clear()
        try:
            start = time.perf_counter()
            reason = cpu_build.unavailable_reason()
            seconds = time.perf_counter() - start
        finally:
            if saved is None:
                del os.environ["PAGED_KV_CACHE_DIR"]
            else:
                os.environ["PAGED_KV_CACHE_DIR"] = saved
            cpu_build.cache_clear()
    if reason:
        raise AssertionError(f"the CPU kernel could not be built: {reason}")
    return seconds


def ratio_row(name: str, timings: Timings, key: str, baseline: str, target: float | None = None) -> Row:
    """A row of ``key``'s median time against ``baseline``'s, the median of their rounds' ratios with
    its spread; with ``target``, whether that ratio is at most it."""
    pairs = zip(timings.samples[key], timings.samples[baseline], strict=True)
    ratio, spread = spread_of(a / b for a, b in pairs)
    met = None if target is None else ratio <= target
    return Row(
        name,
        timings.median(key) * 1e3,
        timings.median(baseline) * 1e3,
        ratio,
        "—" if target is None else f"<= {target}x",
        met,
        "ms",
        spread,
    )


def threads_on_cpu() -> str:
    threads = torch.get_num_threads()
    return f"CPU, {threads} thread{'s' if threads != 1 else ''}"


def run(
    batch: int = 32,
    num_heads: int = 8,
    head_dim: int = 64,
    context: int = 1_024,
    block_size: int = 16,
    repeats: int = 15,
    gqa_batch: int = 8,
    gqa_heads: tuple[int, int] = (32, 8),
    chunk: int = 256,
) -> list[Row]:
    """Time the backends, SDPA and the gather on the CPU (and CUDA when available), after checking
    them; the kernel's build; then the grouped-query batch (``gqa_batch`` sequences, ``gqa_heads`` =
    (query heads, KV heads)) and the mixed step (``batch`` decodes and a chunk of ``chunk`` tokens)."""
    case = make_case(batch, num_heads, head_dim, context, block_size)
    default = default_backend("cpu", torch.float32)
    for backend in (default, *CPU_RIVALS):
        check_equal(case, backend)
    contestants = {"sdpa": lambda: contiguous(case)}
    contestants |= {name: (lambda name=name: paged(case, name)) for name in (default, *CPU_RIVALS)}
    contestants["gather alone"] = lambda: gather_only(case)
    timings = compare_times(contestants, repeats=repeats, warmup=2)
    name = (
        f"paged decode attention (batch {batch}, {num_heads} heads, dim {head_dim}, context {context:,}, "
        f"block {block_size}, scattered, fp32) vs contiguous SDPA: {threads_on_cpu()}"
    )
    rows = [ratio_row(f"{name}, {default} (the default)", timings, default, "sdpa", TARGET_SLOWDOWN)]
    rows += [
        ratio_row(f"{name}, {rival}", timings, rival, "sdpa") for rival in CPU_RIVALS if rival != default
    ]
    rows.append(ratio_row(f"{name}, the gather of K/V alone", timings, "gather alone", "sdpa"))
    if default == "CPU_ATTN":
        seconds = build_seconds()
        built = (
            "CPU_ATTN's kernel built from its source (cc -O3 -march=native -fopenmp, a fresh cache folder)"
        )
        rows.append(Row(built, seconds, 1.0, seconds, "—", None, "s"))
    rows += gqa_rows(gqa_batch, *gqa_heads, head_dim, context, block_size, repeats)
    rows += mixed_step_rows(batch, num_heads, head_dim, context, chunk, block_size, repeats)
    if torch.cuda.is_available():
        rows += cuda_rows(case, name, repeats)
    return rows


def cuda_rows(case: dict[str, torch.Tensor], name: str, repeats: int) -> list[Row]:
    """The default backend on CUDA (``TRITON_ATTN`` with triton), ``FLEX_ATTENTION`` compiled and the
    gather alone, against SDPA on the GPU, synchronized in each sample."""
    on_cuda = {key: value.cuda() for key, value in case.items()}
    default = default_backend("cuda", torch.float32)
    for backend in {default, "FLEX_ATTENTION"}:
        check_equal(on_cuda, backend)
    contestants = {
        "sdpa": lambda: contiguous(on_cuda),
        default: lambda: paged(on_cuda, default),
        "FLEX_ATTENTION": lambda: paged(on_cuda, "FLEX_ATTENTION"),
        "gather alone": lambda: gather_only(on_cuda),
    }
    timings = compare_times(contestants, repeats=repeats * 2, warmup=5, number=10, device="cuda")
    title = name.replace(threads_on_cpu(), "CUDA (synchronized)")
    keys = dict.fromkeys([default, "FLEX_ATTENTION", "gather alone"])
    return [ratio_row(f"{title}, {key}", timings, key, "sdpa") for key in keys]


def gqa_rows(
    batch: int, num_heads: int, num_kv_heads: int, head_dim: int, context: int, block_size: int, repeats: int
) -> list[Row]:
    """The default backend's paged decode of a grouped-query batch against SDPA's ``enable_gqa`` and
    against repeated K/V."""
    case = make_case(batch, num_heads, head_dim, context, block_size, seed=1, num_kv_heads=num_kv_heads)
    check_equal(case)
    if not torch.allclose(repeated(case), contiguous(case), atol=1e-5, rtol=1e-4):
        raise AssertionError("SDPA over repeated K/V differs from SDPA with enable_gqa")
    timings = compare_times(
        {"paged": lambda: paged(case), "sdpa": lambda: contiguous(case), "repeated": lambda: repeated(case)},
        repeats=repeats,
    )
    name = (
        f"paged decode attention, GQA (batch {batch}, {num_heads} query heads over {num_kv_heads} KV heads, "
        f"dim {head_dim}, context {context:,}, block {block_size}, scattered, fp32), "
        f"{default_backend('cpu', torch.float32)}: {threads_on_cpu()}"
    )
    return [
        ratio_row(f"{name}, vs contiguous SDPA enable_gqa", timings, "paged", "sdpa"),
        ratio_row(
            f"{name}, vs contiguous SDPA over K/V repeated to {num_heads} heads", timings, "paged", "repeated"
        ),
    ]


def mixed_step_rows(
    batch: int, num_heads: int, head_dim: int, context: int, chunk: int, block_size: int, repeats: int
) -> list[Row]:
    """One packed step, ``batch`` decodes and a chunk of ``chunk`` tokens (all at ``context`` tokens):
    ``paged_prefill_attention`` in the default backend against the decodes and the chunk run apart,
    and the course's two backends against the default."""
    case = make_case(batch + 1, num_heads, head_dim, context, block_size, seed=2)
    query_lens = torch.tensor([1] * batch + [chunk])
    packed = torch.randn(batch + chunk, num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    cache = (case["k_cache"], case["v_cache"])
    tables, lens = case["block_tables"], case["seq_lens"]

    def step(backend: str | None = None) -> torch.Tensor:
        return paged_prefill_attention(packed, *cache, tables, lens, query_lens, backend=backend)

    def apart() -> torch.Tensor:
        decodes = paged_attention(packed[:batch], *cache, tables[:batch], lens[:batch])
        chunked = paged_prefill_attention(
            packed[batch:], *cache, tables[batch:], lens[batch:], query_lens[batch:]
        )
        return torch.cat([decodes, chunked])

    expected = paged_prefill_attention(packed, *cache, tables, lens, query_lens, backend="GATHER")
    for backend in (None, *CPU_RIVALS):
        if not torch.allclose(step(backend), expected, atol=1e-5, rtol=1e-4):
            raise AssertionError(f"the packed step's {backend or 'default'} differs from GATHER's")
    if not torch.allclose(apart(), expected, atol=1e-5, rtol=1e-4):
        raise AssertionError("the decodes and the chunk apart differ from the packed step")
    contestants = {"default": step, "apart": apart} | {
        name: (lambda name=name: step(name)) for name in CPU_RIVALS
    }
    timings = compare_times(contestants, repeats=max(3, repeats // 5))
    default = default_backend("cpu", torch.float32)
    name = (
        f"one packed step, {batch} decodes and a chunk of {chunk} (heads {num_heads}, dim {head_dim}, "
        f"context {context:,}, block {block_size}, fp32), paged_prefill_attention: {threads_on_cpu()}"
    )
    rows = [
        ratio_row(
            f"{name}, {default} (the default) vs the decodes and the chunk apart", timings, "default", "apart"
        )
    ]
    rows += [ratio_row(f"{name}, {rival} vs {default}", timings, rival, "default") for rival in CPU_RIVALS]
    return rows


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {
    "batch": 2,
    "num_heads": 2,
    "head_dim": 8,
    "context": 37,
    "block_size": 4,
    "repeats": 3,
    "gqa_batch": 2,
    "gqa_heads": (4, 2),
    "chunk": 9,
}


if __name__ == "__main__":
    print(text_table(run()))

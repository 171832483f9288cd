"""Paged decode attention: ``paged_kv.attention.paged.paged_attention`` against SDPA on the same data.

A batch of sequences (32 by default, 8 heads, head dim 64, 1,024 tokens of context, block size 16)
has its K/V in a paged cache whose blocks are scattered over the pool (a random permutation), and
the same K/V as contiguous ``(batch, heads, tokens, head_dim)`` tensors. One decode step (one query
token per sequence) is computed both ways; they must agree (``allclose``) before anything is timed.
The target on the CPU is paged no more than 1.5 times slower than contiguous
``scaled_dot_product_attention`` (the vLLM paper reports 20 to 26 % kernel overhead on a GPU). The
package reads the blocks in place here (its ``"auto"`` strategy); the gather a copying kernel would
start with is timed alone as well, for information. On CUDA (when there is one) they are timed too,
with a synchronize inside each timed call, and so is the FlexAttention path (``strategy="flex"``,
compiled), after it is checked against SDPA.

A second batch has grouped-query attention (GQA), as Llama-3-8B does: 32 query heads over 8 KV
heads (batch 8, head dim 64, the same context and block size), so the cache and the contiguous
K/V hold 8 heads. Paged decode (``"auto"``) is timed against SDPA with ``enable_gqa=True`` over
the contiguous K/V, and, for information, against SDPA over K/V repeated to the 32 query heads
(``repeat_interleave``, what a model without GQA support does, copy included). The three are
timed interleaved, round by round (``paged_kv.timing.compare_times``), and each ratio is the
median of the rounds' ratios.

A third batch is one engine step as vLLM v1 runs it: decodes (32 by default, the same heads, context
and block size) and one prompt chunk (256 tokens at the end of 1,024) packed together, the
``paged_prefill_attention`` of a forward that mixes both. Its ``"auto"`` strategy (the decodes as a
decode batch, read in place, and only the chunk gathered) is timed against the same work as two
calls, the decodes alone and the chunk alone, and against ``"gather"`` (every row padded to the
chunk's 256 queries) and ``"in_place"`` (the chunk's queries meet every block of the pool).

    .venv/bin/python bench/bench_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, median_time, text_table

from paged_kv.attention.paged import paged_attention, paged_prefill_attention
from paged_kv.timing import compare_times

TARGET_SLOWDOWN = 1.5


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
    are scattered over the pool) and ``context_lens`` ``(batch,)``. ``context`` need not be a
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
    context_lens = torch.full((batch,), context, dtype=torch.long)
    return {
        "query": query,
        "k": k,
        "v": v,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "context_lens": context_lens,
    }


def paged(case: dict[str, torch.Tensor]) -> torch.Tensor:
    """The package's paged decode attention, ``(batch, heads, dim)``."""
    return paged_attention(
        case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"]
    )


def flex(case: dict[str, torch.Tensor]) -> torch.Tensor:
    """The optional CUDA path: FlexAttention over the pool with a block mask, ``(batch, heads, dim)``."""
    return paged_attention(
        case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["context_lens"],
        strategy="flex",
    )  # fmt: skip


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
    """Just the gather the paged kernel starts with: every sequence's blocks into contiguous K and V."""
    blocks = case["block_tables"]
    batch, n = blocks.shape
    _, heads, block_size, dim = case["k_cache"].shape
    return tuple(  # type: ignore[return-value]
        case[name][blocks].transpose(1, 2).reshape(batch, heads, n * block_size, dim)
        for name in ("k_cache", "v_cache")
    )


def check_equal(case: dict[str, torch.Tensor]) -> None:
    """Raise unless the paged attention equals SDPA on the same data."""
    if not torch.allclose(paged(case), contiguous(case), atol=1e-5, rtol=1e-4):
        raise AssertionError("paged_attention differs from scaled_dot_product_attention on the same K/V")


def run(
    batch: int = 32,
    num_heads: int = 8,
    head_dim: int = 64,
    context: int = 1_024,
    block_size: int = 16,
    repeats: int = 9,
    gqa_batch: int = 8,
    gqa_heads: tuple[int, int] = (32, 8),
    chunk: int = 256,
) -> list[Row]:
    """Time paged attention, SDPA and the gather on the CPU (and CUDA when available), after checking them;
    then the grouped-query batch (``gqa_batch`` sequences, ``gqa_heads`` = (query heads, KV heads)),
    and the mixed step (``batch`` decodes and a chunk of ``chunk`` tokens)."""
    case = make_case(batch, num_heads, head_dim, context, block_size)
    check_equal(case)
    sdpa = median_time(lambda: contiguous(case), repeats=repeats, warmup=2)
    paged_time = median_time(lambda: paged(case), repeats=repeats, warmup=2)
    gather = median_time(lambda: gather_only(case), repeats=repeats, warmup=2)
    threads = torch.get_num_threads()
    name = (
        f"paged decode attention (batch {batch}, {num_heads} heads, dim {head_dim}, context {context:,}, "
        f"block {block_size}, scattered, fp32) vs contiguous SDPA"
    )
    cpu = f"CPU, {threads} thread{'s' if threads != 1 else ''}"
    target = f"<= {TARGET_SLOWDOWN}x"
    rows = [
        Row(f"{name}: {cpu}", paged_time * 1e3, sdpa * 1e3, paged_time / sdpa,
            target, paged_time / sdpa <= TARGET_SLOWDOWN, "ms"),
        Row(f"{name}: {cpu}, the gather of K/V alone", gather * 1e3, sdpa * 1e3, gather / sdpa,
            "—", None, "ms"),
    ]  # fmt: skip
    rows += gqa_rows(gqa_batch, *gqa_heads, head_dim, context, block_size, repeats)
    rows += mixed_step_rows(batch, num_heads, head_dim, context, chunk, block_size, repeats)
    if torch.cuda.is_available():
        on_cuda = {key: value.cuda() for key, value in case.items()}
        check_equal(on_cuda)

        def synchronized(fn):
            def call() -> None:
                fn(on_cuda)
                torch.cuda.synchronize()

            return call

        cuda_sdpa = median_time(synchronized(contiguous), repeats=repeats * 2, warmup=5, number=10)
        cuda_paged = median_time(synchronized(paged), repeats=repeats * 2, warmup=5, number=10)
        cuda_gather = median_time(synchronized(gather_only), repeats=repeats * 2, warmup=5, number=10)
        if not torch.allclose(flex(on_cuda), contiguous(on_cuda), atol=1e-4, rtol=1e-4):
            raise AssertionError("the FlexAttention path differs from scaled_dot_product_attention")
        cuda_flex = median_time(synchronized(flex), repeats=repeats * 2, warmup=5, number=10)
        rows += [
            Row(f"{name}: CUDA (synchronized), FlexAttention compiled", cuda_flex * 1e3,
                cuda_sdpa * 1e3, cuda_flex / cuda_sdpa, "—", None, "ms"),
            Row(f"{name}: CUDA (synchronized)", cuda_paged * 1e3, cuda_sdpa * 1e3,
                cuda_paged / cuda_sdpa, "—", None, "ms"),
            Row(f"{name}: CUDA (synchronized), the gather alone", cuda_gather * 1e3,
                cuda_sdpa * 1e3, cuda_gather / cuda_sdpa, "—", None, "ms"),
        ]  # fmt: skip
    return rows


def gqa_rows(
    batch: int, num_heads: int, num_kv_heads: int, head_dim: int, context: int, block_size: int, repeats: int
) -> list[Row]:
    """Paged decode of a grouped-query batch against SDPA's ``enable_gqa`` and against repeated K/V."""
    case = make_case(batch, num_heads, head_dim, context, block_size, seed=1, num_kv_heads=num_kv_heads)
    check_equal(case)
    if not torch.allclose(repeated(case), contiguous(case), atol=1e-5, rtol=1e-4):
        raise AssertionError("SDPA over repeated K/V differs from SDPA with enable_gqa")
    # Interleaved round by round (the course's timer): a burst of load on this shared machine slows
    # all three in the same round instead of one of them.
    timings = compare_times(
        {"paged": lambda: paged(case), "sdpa": lambda: contiguous(case), "repeated": lambda: repeated(case)},
        repeats=repeats,
    )
    paged_time, sdpa, repeat_time = (timings.median(key) for key in ("paged", "sdpa", "repeated"))
    threads = torch.get_num_threads()
    name = (
        f"paged decode attention, GQA (batch {batch}, {num_heads} query heads over {num_kv_heads} KV heads, "
        f"dim {head_dim}, context {context:,}, block {block_size}, scattered, fp32): "
        f"CPU, {threads} thread{'s' if threads != 1 else ''}"
    )
    return [
        Row(f"{name}, vs contiguous SDPA enable_gqa", paged_time * 1e3, sdpa * 1e3,
            timings.ratio("paged", "sdpa"), "—", None, "ms"),
        Row(f"{name}, vs contiguous SDPA over K/V repeated to {num_heads} heads", paged_time * 1e3,
            repeat_time * 1e3, timings.ratio("paged", "repeated"), "—", None, "ms"),
    ]  # fmt: skip


def mixed_step_rows(
    batch: int, num_heads: int, head_dim: int, context: int, chunk: int, block_size: int, repeats: int
) -> list[Row]:
    """One packed step, ``batch`` decodes and a chunk of ``chunk`` tokens (all at ``context`` tokens):
    ``paged_prefill_attention``'s strategies against the decodes and the chunk run apart."""
    case = make_case(batch + 1, num_heads, head_dim, context, block_size, seed=2)
    query_lens = torch.tensor([1] * batch + [chunk])
    packed = torch.randn(batch + chunk, num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    cache = (case["k_cache"], case["v_cache"])
    tables, lens = case["block_tables"], case["context_lens"]

    def step(strategy: str) -> torch.Tensor:
        return paged_prefill_attention(packed, *cache, tables, lens, query_lens, strategy=strategy)

    def apart() -> torch.Tensor:
        decodes = paged_attention(packed[:batch], *cache, tables[:batch], lens[:batch])
        chunked = paged_prefill_attention(
            packed[batch:], *cache, tables[batch:], lens[batch:], query_lens[batch:], strategy="gather"
        )
        return torch.cat([decodes, chunked])

    expected = apart()
    for strategy in ("auto", "gather", "in_place"):
        if not torch.allclose(step(strategy), expected, atol=1e-5, rtol=1e-4):
            raise AssertionError(
                f"the packed step's {strategy!r} differs from the decodes and the chunk apart"
            )
    timings = compare_times(
        {
            "auto": lambda: step("auto"),
            "apart": apart,
            "gather": lambda: step("gather"),
            "in_place": lambda: step("in_place"),
        },
        repeats=max(3, repeats // 3),
    )
    threads = torch.get_num_threads()
    name = (
        f"one packed step, {batch} decodes and a chunk of {chunk} (heads {num_heads}, dim {head_dim}, "
        f"context {context:,}, block {block_size}, fp32), paged_prefill_attention: "
        f"CPU, {threads} thread{'s' if threads != 1 else ''}"
    )
    auto = timings.median("auto")
    return [
        Row(f"{name}, auto vs the decodes and the chunk apart", auto * 1e3, timings.median("apart") * 1e3,
            timings.ratio("auto", "apart"), "—", None, "ms"),
        Row(f"{name}, gather vs auto", timings.median("gather") * 1e3, auto * 1e3,
            timings.ratio("gather", "auto"), "—", None, "ms"),
        Row(f"{name}, in_place vs auto", timings.median("in_place") * 1e3, auto * 1e3,
            timings.ratio("in_place", "auto"), "—", None, "ms"),
    ]  # fmt: skip


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

"""The Triton decode kernel (lesson 12): compiled on CUDA against the other backends; interpreted on a CPU.

On CUDA (when there is one) the kernel, ``paged_attention(..., backend="TRITON_ATTN")``, is timed at
``bench_attention``'s sizes (batch 32, 8 heads, head dim 64, context 1,024, block size 16, the
blocks a random permutation of the pool, fp32) against contiguous ``scaled_dot_product_attention``
over the same K/V, FlexAttention (``backend="FLEX_ATTENTION"``, compiled) and the course's in-place
backend (``backend="IN_PLACE"``). Each is checked against SDPA first; the four are then timed
interleaved, round by round, with a synchronize in each sample (``paged_kv.timing.compare_times``),
and each ratio is the median of the rounds' kernel time over the other's: below 1, the kernel is
faster. Without a GPU these rows are skipped, and the run says so.

On the CPU the kernel runs in Triton's interpreter, which executes each program with numpy: it is
timed at lesson 12's sizes (4 sequences of up to 4 blocks of 16 tokens, seeded lengths, 4 heads of
head dim 16) beside the reference ``backend="GATHER"`` on the same inputs, for scale only: the
interpreter is for writing and checking a kernel, not for speed, so there is no target. The row
runs with one torch thread: with two, the gather's tiny operations, alternating with the interpreter's
numpy, took either about 1 ms or about 37 ms from one process to the next on this 2-core machine.

Triton fixes its mode, compiler or interpreter, when it is first imported; so without a GPU this
module (and ``run_all.py``, before any benchmark imports transformers, which imports triton) sets
``TRITON_INTERPRET=1`` first (:func:`_timing.interpret_triton_without_a_gpu`).

    .venv/bin/python bench/bench_triton.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, interpret_triton_without_a_gpu, text_table
from bench_attention import contiguous, make_case

from paged_kv.attention.paged import paged_attention
from paged_kv.attention.triton_decode import triton_available, triton_interpreted
from paged_kv.timing import compare_times

interpret_triton_without_a_gpu()

#: The backends the compiled kernel is compared with on CUDA, besides contiguous SDPA.
CUDA_RIVALS = ("FLEX_ATTENTION", "IN_PLACE")


def attention(case: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``paged_attention`` of the case's paged cache in backend ``name``, ``(batch, heads, dim)``."""
    return paged_attention(
        case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
        backend=name,
    )  # fmt: skip


def check_close(case: dict[str, torch.Tensor], name: str, expected: torch.Tensor) -> None:
    """Raise unless backend ``name`` gives ``expected`` on the case."""
    if not torch.allclose(attention(case, name), expected, atol=1e-4, rtol=1e-4):
        raise AssertionError(f"backend {name!r} differs from the expected attention on the same K/V")


def lesson_case(
    batch: int, num_heads: int, head_dim: int, block_size: int, max_blocks: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Lesson 12's inputs: ``batch`` sequences of seeded lengths from 1 to ``max_blocks`` full blocks
    (the first one full, so a sequence reads every block of its table), scattered over the pool."""
    case = make_case(batch, num_heads, head_dim, max_blocks * block_size, block_size, seed=seed)
    lengths = torch.randint(
        1, max_blocks * block_size + 1, (batch,), generator=torch.Generator().manual_seed(seed)
    )
    lengths[0] = max_blocks * block_size
    case["seq_lens"] = lengths
    return case


def cpu_rows(
    batch: int, num_heads: int, head_dim: int, block_size: int, max_blocks: int, repeats: int
) -> list[Row]:
    """The interpreted kernel against the gather, at lesson 12's sizes, for information."""
    case = lesson_case(batch, num_heads, head_dim, block_size, max_blocks)
    check_close(case, "TRITON_ATTN", attention(case, "GATHER"))
    timings = compare_times(
        {"triton": lambda: attention(case, "TRITON_ATTN"), "gather": lambda: attention(case, "GATHER")},
        repeats=repeats,
        threads=1,
    )
    name = (
        f"Triton kernel in Triton's interpreter (lesson 12's sizes: {batch} sequences of up to {max_blocks} "
        f"blocks of {block_size}, {num_heads} heads of dim {head_dim}, fp32) vs backend='GATHER': "
        "CPU, 1 thread"
    )
    return [
        Row(name, timings.median("triton") * 1e3, timings.median("gather") * 1e3,
            timings.ratio("triton", "gather"), "—", None, "ms"),
    ]  # fmt: skip


def cuda_rows(
    batch: int, num_heads: int, head_dim: int, context: int, block_size: int, repeats: int
) -> list[Row]:
    """The compiled kernel against SDPA, FlexAttention and the in-place backend, on the GPU."""
    case = {
        key: value.cuda() for key, value in make_case(batch, num_heads, head_dim, context, block_size).items()
    }
    expected = contiguous(case)
    for name in ("TRITON_ATTN", *CUDA_RIVALS):
        check_close(case, name, expected)
    contestants = {"triton": lambda: attention(case, "TRITON_ATTN"), "sdpa": lambda: contiguous(case)}
    contestants |= {name: (lambda name=name: attention(case, name)) for name in CUDA_RIVALS}
    timings = compare_times(contestants, repeats=repeats * 2, warmup=5, number=10, device="cuda")
    title = (
        f"Triton kernel, compiled (batch {batch}, {num_heads} heads, dim {head_dim}, context {context:,}, "
        f"block {block_size}, scattered, fp32): CUDA (synchronized), {torch.cuda.get_device_name(0)}"
    )
    labels = {"sdpa": "contiguous SDPA"} | {name: f"backend='{name}'" for name in CUDA_RIVALS}
    return [
        Row(f"{title}, vs {label}", timings.median("triton") * 1e3, timings.median(key) * 1e3,
            timings.ratio("triton", key), "—", None, "ms")
        for key, label in labels.items()
    ]  # fmt: skip


def run(
    batch: int = 4,
    num_heads: int = 4,
    head_dim: int = 16,
    block_size: int = 16,
    max_blocks: int = 4,
    repeats: int = 9,
    cuda_sizes: tuple[int, int, int, int, int] = (32, 8, 64, 1_024, 16),
) -> list[Row]:
    """The CPU row at lesson 12's sizes where Triton interprets, or the CUDA rows at ``cuda_sizes``
    (batch, heads, head dim, context, block size) where it compiles for a GPU; the run prints which
    rows it skipped, and gives no row, with a note, where triton is not installed."""
    if not triton_available():
        print("bench_triton: triton is not installed (Linux wheels only): no row")
        return []
    if torch.cuda.is_available() and not triton_interpreted():
        print("bench_triton: Triton compiles in this process (a GPU is visible): the interpreter's CPU row "
              "is skipped (CUDA_VISIBLE_DEVICES= gives it)")  # fmt: skip
        return cuda_rows(*cuda_sizes, repeats=repeats)
    skipped = "no CUDA device" if not torch.cuda.is_available() else "Triton interprets in this process"
    print(f"bench_triton: {skipped}: the compiled kernel vs SDPA, FLEX_ATTENTION and IN_PLACE is skipped")
    return cpu_rows(batch, num_heads, head_dim, block_size, max_blocks, repeats)


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {
    "batch": 2,
    "num_heads": 2,
    "head_dim": 8,
    "block_size": 4,
    "max_blocks": 2,
    "repeats": 3,
    "cuda_sizes": (2, 2, 8, 37, 4),
}


if __name__ == "__main__":
    print(text_table(run()))

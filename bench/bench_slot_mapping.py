"""Slot mapping for one long sequence: ``paged_kv.kv.slots.slot_mapping`` against a per-token Python loop.

The sequence holds 8,192 tokens in scattered physical blocks (block size 16). The vectorised
mapping must give the same slots as the loop and be at least 20 times faster on the CPU; on CUDA
(when there is one) it is timed too, with a synchronize inside each timed call.

    .venv/bin/python bench/bench_slot_mapping.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, median_time, text_table

from paged_kv.kv.slots import slot_mapping
from paged_kv.timing import torch_threads

TARGET_SPEEDUP = 20.0


def loop_slot_mapping(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The baseline, one Python iteration per token: ``block_table[p // bs] * bs + p % bs``."""
    slots = []
    for position in range(num_tokens):
        logical_block, offset = divmod(position, block_size)
        slots.append(block_table[logical_block] * block_size + offset)
    return slots


def scattered_block_table(num_tokens: int, block_size: int, seed: int = 0) -> list[int]:
    """The block ids of a sequence of ``num_tokens`` tokens, drawn at random from a pool four times larger."""
    num_blocks = -(-num_tokens // block_size)
    return random.Random(seed).sample(range(4 * num_blocks), num_blocks)


def run(num_tokens: int = 8_192, block_size: int = 16, repeats: int = 15, threads: int = 1) -> list[Row]:
    """Time both on the CPU (and the vectorised one on CUDA when available); check they agree.

    The CPU timings use ``threads`` torch threads (1 by default): at 8,192 elements intra-op
    parallelism gains little, and on a shared, busy machine its thread pool stalls for
    milliseconds at random, which no median hides.
    """
    with torch_threads(threads):
        return _measure(num_tokens, block_size, repeats, threads)


def _measure(num_tokens: int, block_size: int, repeats: int, threads: int) -> list[Row]:
    table_list = scattered_block_table(num_tokens, block_size)
    expected = loop_slot_mapping(table_list, num_tokens, block_size)
    table = torch.tensor(table_list, dtype=torch.long)
    positions = torch.arange(num_tokens)
    if slot_mapping(table, positions, block_size).tolist() != expected:
        raise AssertionError("the vectorised slot mapping differs from the per-token loop")

    loop = median_time(lambda: loop_slot_mapping(table_list, num_tokens, block_size), repeats=repeats)
    vectorised = median_time(lambda: slot_mapping(table, positions, block_size), repeats=repeats, number=20)
    from_list = median_time(
        lambda: slot_mapping(torch.tensor(table_list), torch.arange(num_tokens), block_size),
        repeats=repeats,
        number=20,
    )
    target = f">= {TARGET_SPEEDUP:.0f}x"
    name = f"slot mapping, {num_tokens:,} tokens (block {block_size}) vs per-token loop"
    cpu = f"CPU, {threads} thread{'s' if threads != 1 else ''}"
    rows = [
        Row(f"{name}: {cpu}, tensors", vectorised * 1e6, loop * 1e6, loop / vectorised, target,
            loop / vectorised >= TARGET_SPEEDUP),
        Row(f"{name}: {cpu}, tensors built from lists", from_list * 1e6, loop * 1e6, loop / from_list, "—",
            None),
    ]  # fmt: skip
    if torch.cuda.is_available():
        cuda_table, cuda_positions = table.cuda(), positions.cuda()
        if slot_mapping(cuda_table, cuda_positions, block_size).tolist() != expected:
            raise AssertionError("the CUDA slot mapping differs from the per-token loop")

        def on_cuda() -> None:
            slot_mapping(cuda_table, cuda_positions, block_size)
            torch.cuda.synchronize()

        cuda = median_time(on_cuda, repeats=repeats, warmup=5, number=20)
        rows.append(Row(f"{name}: CUDA (synchronized)", cuda * 1e6, loop * 1e6, loop / cuda, "—", None))
    return rows


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"num_tokens": 100, "block_size": 4, "repeats": 3}


if __name__ == "__main__":
    print(text_table(run()))

"""Prefix caching: O(1) removal from the middle of the free list, and what a shared system prompt saves.

1. A prefix-cache hit on a cached block that sits on the free list takes it out of the *middle* of
   the list. ``BlockAllocator.take`` + ``free`` at 1,000 and at 100,000 free blocks, against
   :class:`DequeFreeList`, the free list as a ``deque`` (what ``BlockAllocator`` used before) whose
   ``remove`` scans the list: the linked list's cost must stay flat, the deque's grows with the pool.
   The price, shown for information: plain ``allocate`` + ``free`` against the deque's.
2. A serving workload where every request starts with the same 256-token system prompt, followed
   by a ShareGPT-shaped user prompt (block size 16): prefill tokens computed with prefix caching
   against without, the hit rate in tokens against the ideal (every request but the first finds
   the whole system prompt), and the allocator's time per request, hashing included. The workload
   and the serving loop are :mod:`paged_kv.simulation.sharing`'s, which lesson 08 also runs.

    .venv/bin/python bench/bench_prefix_cache.py
"""

from __future__ import annotations

import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, flatness_rows, median_time, text_table
from bench_allocator import PopFrontAllocator, allocate_free_time

from paged_kv import BlockAllocator
from paged_kv.simulation.sharing import ideal_cached_tokens, serve, system_prompt_requests

HIT_RATE_TARGET = 0.99  # the share of the ideal hit rate the workload must reach


class DequeFreeList(PopFrontAllocator):
    """The baseline: a FIFO free list kept in a ``deque`` and ref counts in a list.

    ``allocate`` pops the head and ``free`` appends at the tail in O(1), each one C call; ``take``
    finds the block with ``deque.remove``, which walks the deque from its head: O(n).
    """

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.free_block_ids: deque[int] = deque(self.free_block_ids)

    def allocate(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("no free block")
        block_id = self.free_block_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def take(self, block_id: int) -> None:
        if self.ref_counts[block_id]:
            raise ValueError(f"block {block_id} is in use")
        self.free_block_ids.remove(block_id)
        self.ref_counts[block_id] = 1


def middle_blocks(num_blocks: int, count: int, seed: int = 0) -> list[int]:
    """``count`` seeded block ids from the middle half of a pool (positions ``n/4 .. 3n/4``)."""
    rng = random.Random(seed)
    return [rng.randrange(num_blocks // 4, 3 * num_blocks // 4) for _ in range(count)]


def take_free_time(pool: BlockAllocator | DequeFreeList, block_ids: list[int], repeats: int) -> float:
    """Median seconds of one ``take(b)`` + ``free(b)`` pair on a pool whose blocks are all free.

    Each freed block goes to the tail, so later ids drawn from the middle of the *ids* still sit
    in the middle of the *list* on average.
    """

    def pairs() -> None:
        take, free = pool.take, pool.free
        for block_id in block_ids:
            take(block_id)
            free(block_id)

    return median_time(pairs, repeats=repeats, warmup=1) / len(block_ids)


def run(
    pool_sizes: tuple[int, int] = (1_000, 100_000),
    pairs: int = 300,
    repeats: int = 7,
    num_requests: int = 200,
    system_tokens: int = 256,
    block_size: int = 16,
    num_blocks: int = 2_048,
    max_running: int = 32,
    scale: int = 1,
    serve_repeats: int = 3,
) -> list[Row]:
    """Measure both benchmarks and return their rows."""
    rows = []
    times: dict[str, dict[int, float]] = {"linked": {}, "deque": {}}
    for size in pool_sizes:
        block_ids = middle_blocks(size, pairs)
        times["linked"][size] = take_free_time(BlockAllocator(size), block_ids, repeats)
        times["deque"][size] = take_free_time(DequeFreeList(size), block_ids, repeats)
        rows.append(
            Row(
                f"take a free block from the middle of the free list + free it, {size:,} blocks: "
                "pairs/s, doubly linked list vs deque.remove",
                1 / times["linked"][size],
                1 / times["deque"][size],
                times["deque"][size] / times["linked"][size],
                "—",
                None,
                unit="pairs/s",
            )
        )
    small, large = pool_sizes
    linked, plain = (
        allocate_free_time(pool(small), 10 * pairs, repeats) for pool in (BlockAllocator, DequeFreeList)
    )
    rows.append(
        Row(
            f"allocate+free (head and tail only) at {small:,} blocks: pairs/s, doubly linked list vs deque",
            1 / linked,
            1 / plain,
            plain / linked,
            "—",
            None,
            unit="pairs/s",
        )
    )
    labels = {"linked": "BlockAllocator (doubly linked)", "deque": "deque.remove, for contrast"}
    rows += flatness_rows("take+free from the middle,", times, small, large, labels, package="linked")

    requests = system_prompt_requests(num_requests, system_tokens, scale=scale)
    results = {
        caching: serve(requests, num_blocks, block_size, max_running, caching) for caching in (True, False)
    }
    with_cache, without = results[True], results[False]
    user = "ShareGPT-shaped user prompt" + (f" (/ {scale})" if scale != 1 else "")
    name = (
        f"{num_requests} requests: a shared {system_tokens}-token system prompt + a {user}, "
        f"block {block_size}, {num_blocks:,} blocks, {max_running} running"
    )
    ideal_hits = ideal_cached_tokens(requests, block_size)
    hit_rate = with_cache.hit_rate  # per prompt token looked up: a preempted request is looked up again
    ideal_rate = ideal_hits / sum(len(request.token_ids) for request in requests)
    timed = {
        caching: median_time(
            lambda caching=caching: serve(requests, num_blocks, block_size, max_running, caching),
            repeats=serve_repeats,
            warmup=0,
        )
        / num_requests
        for caching in (True, False)
    }
    rows += [
        Row(f"{name}: prefill tokens computed, prefix caching vs none",
            with_cache.computed_tokens, without.computed_tokens,
            without.computed_tokens / with_cache.computed_tokens, "—", None, "tokens"),
        Row(f"{name}: hit rate in prompt tokens vs the ideal (the system prompt, for all but the first)",
            100 * hit_rate, 100 * ideal_rate, hit_rate / ideal_rate, f">= {HIT_RATE_TARGET}x",
            hit_rate / ideal_rate >= HIT_RATE_TARGET, "%"),
        Row(f"{name}: serving time per request (scheduler and allocator), prefix caching vs none",
            timed[True] * 1e6, timed[False] * 1e6, timed[True] / timed[False], "—", None),
    ]  # fmt: skip
    return rows


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {
    "pool_sizes": (100, 1_000),
    "pairs": 30,
    "repeats": 3,
    "num_requests": 12,
    "system_tokens": 32,
    "block_size": 4,
    "num_blocks": 256,
    "max_running": 4,
    "scale": 8,
    "serve_repeats": 1,
}


if __name__ == "__main__":
    print(text_table(run()))

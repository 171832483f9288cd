"""Hybrid models: what managing the KV cache per KV-cache group saves (lesson 13, issue 22).

A sliding-window layer never reads a token older than its window, so vLLM 0.33.0 manages a hybrid
model's layers in KV-cache groups (:mod:`paged_kv.core.kv_cache_groups`): a sliding-window group
gives back the blocks that leave its window, and only the full-attention groups hold a request's
whole length. The baseline is the same model with every layer treated as full attention (vLLM with
``--disable-hybrid-kv-cache-manager``): one block table, every block holding every layer.

1. **Served, no model.** A Gemma-3-shaped model (``num_layers`` layers, every ``full_every``-th
   full attention, the others a sliding window of ``sliding_window`` tokens) serves long prompts
   (``prompt_range`` tokens, seeded uniform) with ShareGPT-shaped outputs, all arriving at once,
   through the package's :class:`~paged_kv.serving.scheduler.Scheduler` under a token budget and
   :class:`~paged_kv.serving.model_runner.CountingRunner`. Two memories of the **same K/V bytes**:
   a :class:`~paged_kv.core.kv_cache_manager.KVCacheManager` given the hybrid KV-cache groups
   (a :class:`~paged_kv.core.kv_cache_coordinator.HybridKVCacheCoordinator` over one ``BlockPool``
   of ``N_h`` blocks, a block costing ``num_tensors(groups)`` layers' pages), against the same
   manager with one full-attention group (a ``UnitaryKVCacheCoordinator`` over ``N_f`` blocks, a
   block costing all ``num_layers`` layers' pages), with ``N_h = N_f * num_layers // num_tensors``
   (rounded down: the hybrid pool never has more bytes; each pool's null block is one of its
   blocks). Measured: the requests running per step (peak and mean), the K/V bytes the memory
   holds per running request (real blocks in use, the null block excluded, times a block's bytes,
   over the running requests; averaged over the steps) and the steps to serve everything. Beside them,
   the arithmetic for a decoding request of the run's mean length. At every step the blocks in use must
   equal the sum, over the running requests, of :func:`blocks_held` (raises otherwise).
2. **Gemma 3 27B's published shape**, computed: per-request K/V bytes at 32k and 128k tokens,
   decoding and, under vLLM's admission cap, prefilling in chunks of a token budget.
3. **The arithmetic against the coordinator**: a request of Gemma 3 27B's grouping prefilled in
   chunks and decoded on a :class:`~paged_kv.core.kv_cache_manager.KVCacheManager` of its groups; after
   every call each group holds exactly :func:`sliding_blocks_held` / ``ceil(L / block_size)`` real
   blocks (raises otherwise), and the row compares its final holding with :func:`request_blocks`.

Counts and arithmetic, not times: the rows are the same on every machine.

    .venv/bin/python bench/bench_hybrid.py
"""

from __future__ import annotations

import random
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, text_table

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_pool import NULL_BLOCK
from paged_kv.core.kv_cache_groups import KVCacheGroupSpec, SlidingWindowSpec, kv_cache_groups, num_tensors
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.kv.sizing import KVCacheSpec
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler
from paged_kv.simulation.workload import SHAREGPT, sample_requests

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class HybridShape:
    """A model in Gemma 3's pattern: layer ``i`` attends fully when ``(i + 1) % full_every == 0``
    (Hugging Face's ``sliding_window_pattern``), else over the last ``sliding_window`` tokens."""

    name: str
    num_layers: int
    full_every: int
    sliding_window: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(
            None if (layer + 1) % self.full_every == 0 else self.sliding_window
            for layer in range(self.num_layers)
        )

    def groups(self, block_size: int) -> tuple[KVCacheGroupSpec, ...]:
        """vLLM's KV-cache groups of the model (per-group management)."""
        return kv_cache_groups(self.layer_windows, block_size)

    def all_full(self, block_size: int) -> tuple[KVCacheGroupSpec, ...]:
        """Every layer treated as full attention: one group of every layer."""
        return kv_cache_groups([None] * self.num_layers, block_size)

    def page_bytes(self, block_size: int) -> int:
        """One block of one layer: ``2 * block_size * num_kv_heads * head_dim * dtype size``."""
        return KVCacheSpec(1, self.num_kv_heads, self.head_dim, self.dtype).bytes_per_block(block_size)

    def describe(self, block_size: int) -> str:
        """The shape and its grouping, for a row's name."""
        groups = self.groups(block_size)
        sizes = "/".join(str(len(g.layers)) for g in groups)
        full = sum(w is None for w in self.layer_windows)
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.name} ({self.num_layers} layers, {full} full, window {self.sliding_window}, "
            f"{self.num_kv_heads} K/V heads x {self.head_dim}, {dtype}, block {block_size}; {len(groups)} "
            f"groups of {sizes} layers, {num_tensors(groups)} tensors)"
        )

    def block_bytes(self, groups: Sequence[KVCacheGroupSpec], block_size: int) -> int:
        """One block of a pool for ``groups``: ``num_tensors(groups)`` layers' pages."""
        return num_tensors(groups) * self.page_bytes(block_size)


GEMMA3_27B = HybridShape("Gemma 3 27B", 62, 6, 1024, 16, 128)
"""Gemma 3 27B's published shape: 62 layers, every 6th full attention (10 full, 52 sliding), 16 K/V
heads of 128, a sliding window of 1,024 tokens, bf16."""


# ------------------------------------------------------------------------------------ the arithmetic


def sliding_bound(spec: SlidingWindowSpec, num_tokens: int, in_flight: int) -> int:
    """The most real blocks a sliding-window group holds for a request of ``num_tokens`` tokens while
    a step computes ``in_flight`` of them: ``min(ceil(L / bs), ceil((W - 1 + in_flight) / bs) + 1)``
    (vLLM's ``max_admission_blocks_per_request``: the window's earlier tokens and the step's, one
    more block because the window need not start at a block's edge). A bound: the exact count,
    :func:`sliding_blocks_held`, is one block less where the window's first token starts a block,
    and never reaches it where ``(W - 2 + in_flight) % bs == 0`` (then the +1 is never needed)."""
    return min(
        blocks_for_tokens(num_tokens, spec.block_size),
        spec.max_admission_blocks_per_request(in_flight, num_tokens),
    )


def request_blocks(groups: Sequence[KVCacheGroupSpec], num_tokens: int, in_flight: int) -> int:
    """The most real blocks a request of ``num_tokens`` tokens holds over every group while a step
    computes ``in_flight`` of its tokens: ``ceil(L / bs)`` in a full-attention group,
    :func:`sliding_bound` in a sliding-window one."""
    return sum(
        sliding_bound(g.spec, num_tokens, in_flight)
        if isinstance(g.spec, SlidingWindowSpec)
        else blocks_for_tokens(num_tokens, g.spec.block_size)
        for g in groups
    )


def sliding_blocks_held(spec: SlidingWindowSpec, num_computed: int, num_tokens: int) -> int:
    """The real blocks a sliding-window group holds, exactly, after the request grew from
    ``num_computed`` tokens to ``num_tokens`` in one allocation: its ``ceil(num_tokens / bs)``
    blocks less those wholly before the window of the token at ``num_computed``,
    ``max(0, num_computed - W + 1) // bs`` (freed before the new ones are taken)."""
    size = spec.block_size
    return blocks_for_tokens(num_tokens, size) - spec.num_skipped_tokens(num_computed) // size


def blocks_held(groups: Sequence[KVCacheGroupSpec], num_computed: int, num_tokens: int) -> int:
    """The real blocks a request holds over every group, exactly, after it grew from
    ``num_computed`` to ``num_tokens`` tokens in its last allocation (``num_computed`` 0 for a
    request admitted in this one)."""
    total = 0
    for group in groups:
        if isinstance(group.spec, SlidingWindowSpec):
            total += sliding_blocks_held(group.spec, num_computed, num_tokens)
        else:
            total += blocks_for_tokens(num_tokens, group.spec.block_size)
    return total


def check_coordinator(
    groups: Sequence[KVCacheGroupSpec], num_prompt_tokens: int, chunk: int, num_decode: int
) -> tuple[int, int]:
    """Prefill a request of ``num_prompt_tokens`` in chunks of ``chunk`` on a coordinator of
    ``groups`` (a pool just big enough), then decode ``num_decode`` tokens; after every call check
    each group's real blocks against :func:`sliding_blocks_held` (or ``ceil(L / bs)``), the pool's
    blocks in use against their sum and :func:`request_blocks` as a bound. Returns the real blocks
    held at the end and :func:`request_blocks` of the final length with one token in flight.

    Raises:
        AssertionError: the coordinator and the arithmetic disagree.
    """
    size = groups[0].spec.block_size
    num_blocks = 1 + request_blocks(groups, num_prompt_tokens + num_decode, chunk)
    memory = KVCacheManager(num_blocks, kv_cache_groups=groups, max_in_flight_tokens=chunk)
    request = EngineCoreRequest("r", num_prompt_tokens, num_decode + 1)
    steps = [min(chunk, num_prompt_tokens - start) for start in range(0, num_prompt_tokens, chunk)]
    held = 0
    for num_new in steps + [1] * num_decode:
        start = held
        gained = memory.allocate_slots(request, num_new)
        assert gained is not None, f"the pool of {num_blocks} blocks refused {num_new} tokens at {start}"
        held += num_new
        real = [sum(b != NULL_BLOCK for b in ids) for ids in memory.get_block_ids("r")]
        for group, count in zip(groups, real, strict=True):
            if isinstance(group.spec, SlidingWindowSpec):
                expected = sliding_blocks_held(group.spec, start, held)
            else:
                expected = blocks_for_tokens(held, size)
            assert count == expected, (
                f"group {group.layers} holds {count} blocks at {held} tokens, not {expected}"
            )
        assert sum(real) == blocks_held(groups, start, held) == num_blocks - 1 - memory.num_free_blocks
        assert sum(real) <= request_blocks(groups, held, num_new)
    return sum(real), request_blocks(groups, held, 1)


# --------------------------------------------------------------------------------------- serving


def long_prompt_requests(
    num_requests: int, prompt_range: tuple[int, int], seed: int = 0
) -> list[EngineCoreRequest]:
    """``num_requests`` requests: prompts of ``prompt_range`` tokens (seeded uniform), outputs the
    ShareGPT-shaped ones of ``sample_requests(SHAREGPT, num_requests, seed)``."""
    rng = random.Random(seed)
    return [
        EngineCoreRequest(r.request_id, rng.randint(*prompt_range), r.output_tokens)
        for r in sample_requests(SHAREGPT, num_requests, seed)
    ]


@dataclass(frozen=True)
class Served:
    """One run, per step: the requests running, the real blocks in use and the tokens the running
    requests hold (after the step's scheduling, before the finished leave)."""

    running: tuple[int, ...]
    blocks: tuple[int, ...]
    tokens: tuple[int, ...]
    preemptions: int

    @property
    def steps(self) -> int:
        return len(self.running)

    @property
    def peak_running(self) -> int:
        return max(self.running)

    @property
    def mean_running(self) -> float:
        return statistics.fmean(self.running)

    def bytes_per_request(self, block_bytes: int) -> float:
        """Blocks in use times ``block_bytes`` over the running requests, averaged over the steps."""
        return statistics.fmean(b * block_bytes / n for b, n in zip(self.blocks, self.running, strict=True))

    @property
    def mean_tokens(self) -> float:
        """Tokens held per running request, averaged over the steps."""
        return statistics.fmean(t / n for t, n in zip(self.tokens, self.running, strict=True))


def serve(
    memory: KVCacheManager,
    groups: Sequence[KVCacheGroupSpec],
    requests: Sequence[EngineCoreRequest],
    budget: int,
) -> Served:
    """Serve ``requests``, all arriving at once, on ``memory`` with ``Scheduler(memory,
    max_num_batched_tokens=budget)`` and ``CountingRunner`` (as ``run_steps`` does). At every step
    the real blocks in use must be the sum of :func:`blocks_held` over the running requests."""
    scheduler, runner = Scheduler(memory, max_num_batched_tokens=budget), CountingRunner()
    for request in requests:
        scheduler.add_request(request)
    block_size = memory.block_size
    start: dict[object, int] = {}  # request id -> its tokens before its last allocation
    running, blocks, tokens, preemptions = [], [], [], 0
    while scheduler.has_unfinished_requests:
        output = scheduler.schedule()
        scheduled = output.num_scheduled_tokens
        expected = held_tokens = 0
        for request in scheduler.running:  # a request holds slots for its computed tokens
            computed = request.num_computed_tokens
            if request.request_id in scheduled:
                start[request.request_id] = computed - scheduled[request.request_id]
            expected += blocks_held(groups, start[request.request_id], computed)
            held_tokens += computed
        result = scheduler.update_from_output(output, runner.execute_model(output))
        in_use = result.reserved_tokens // block_size  # the null block excluded
        if in_use != expected:
            raise AssertionError(
                f"step {result.step}: {in_use} blocks in use, the arithmetic says {expected}"
            )
        running.append(result.num_running)
        blocks.append(in_use)
        tokens.append(held_tokens)
        preemptions += len(output.preemptions)
    return Served(tuple(running), tuple(blocks), tuple(tokens), preemptions)


# ------------------------------------------------------------------------------------------- rows


def served_rows(
    shape: HybridShape,
    block_size: int,
    full_pool_blocks: int,
    budget: int,
    num_requests: int,
    prompt_range: tuple[int, int],
    seed: int,
) -> list[Row]:
    """Section 1: the same requests on both memories of the same bytes."""
    hybrid, full = shape.groups(block_size), shape.all_full(block_size)
    hybrid_block, full_block = shape.block_bytes(hybrid, block_size), shape.block_bytes(full, block_size)
    hybrid_pool_blocks = full_pool_blocks * shape.num_layers // num_tensors(hybrid)  # the same bytes
    assert hybrid_pool_blocks * hybrid_block <= full_pool_blocks * full_block
    requests = long_prompt_requests(num_requests, prompt_range, seed)
    per_group = KVCacheManager(hybrid_pool_blocks, kv_cache_groups=hybrid, max_in_flight_tokens=budget)
    h = serve(per_group, hybrid, requests, budget)
    f = serve(KVCacheManager(full_pool_blocks, block_size), full, requests, budget)
    outputs = [r.max_tokens for r in requests]
    name = (
        f"{shape.describe(block_size)}, {num_requests} requests at once (prompts {prompt_range[0]:,}-"
        f"{prompt_range[1]:,}, ShareGPT outputs {min(outputs):,}-{max(outputs):,}), budget {budget:,}, "
        f"{full_pool_blocks * full_block / MIB:,.0f} MiB of K/V: per-group {hybrid_pool_blocks:,} blocks x "
        f"{num_tensors(hybrid)} layers vs all-full {full_pool_blocks:,} x {shape.num_layers} "
        f"({h.preemptions} vs {f.preemptions} preemptions)"
    )
    hybrid_bytes, full_bytes = h.bytes_per_request(hybrid_block), f.bytes_per_request(full_block)
    length = round(h.mean_tokens)
    predicted_hybrid = request_blocks(hybrid, length, 1) * hybrid_block
    predicted_full = request_blocks(full, length, 1) * full_block
    return [
        Row(f"{name}: peak concurrent requests, ratio per-group / all-full",
            h.peak_running, f.peak_running, h.peak_running / f.peak_running, "—", None, "reqs"),
        Row(f"{name}: mean concurrent requests, ratio per-group / all-full",
            h.mean_running, f.mean_running, h.mean_running / f.mean_running, "—", None, "reqs"),
        Row(f"{name}: K/V held per running request (real blocks in use x block bytes / running, "
            "mean over steps), ratio all-full / per-group",
            hybrid_bytes / MIB, full_bytes / MIB, full_bytes / hybrid_bytes, "—", None, "MiB"),
        Row(f"{name}: steps to serve every request, ratio all-full / per-group",
            h.steps, f.steps, f.steps / h.steps, "—", None, "steps"),
        Row(f"arithmetic, {shape.name}: a decoding request of L = {length:,} tokens (the per-group run's "
            f"mean per running request): per-group {formula(shape, block_size, length, 1)}, ratio "
            "all-full / per-group",
            predicted_hybrid / MIB, predicted_full / MIB, predicted_full / predicted_hybrid, "—", None,
            "MiB"),
    ]  # fmt: skip


def formula(shape: HybridShape, block_size: int, length: int, in_flight: int) -> str:
    """The arithmetic of :func:`request_blocks` for ``shape`` in words: ``(full blocks + sliding
    groups x their blocks) x tensors vs all-full blocks x layers``."""
    groups = shape.groups(block_size)
    full = sum(blocks_for_tokens(length, block_size) for g in groups if g.spec.sliding_window is None)
    sliding = [sliding_bound(g.spec, length, in_flight) for g in groups if g.spec.sliding_window is not None]
    terms = " + ".join(f"{count} x {b:,}" for b, count in sorted(Counter(sliding).items()))
    return (
        f"({full:,} + {terms} blocks) x {num_tensors(groups)} layers vs every layer full "
        f"{blocks_for_tokens(length, block_size):,} x {shape.num_layers}"
    )


def published_rows(
    shape: HybridShape, block_size: int, lengths: Sequence[int], prefill_budget: int
) -> list[Row]:
    """Section 2: one request's K/V bytes at each of ``lengths`` tokens, decoding and prefilling in
    chunks of ``prefill_budget``, per-group vs all-full."""
    hybrid, full = shape.groups(block_size), shape.all_full(block_size)
    hybrid_block, full_block = shape.block_bytes(hybrid, block_size), shape.block_bytes(full, block_size)
    rows = []
    for length in lengths:
        for in_flight, what in (
            (1, "decoding"),
            (prefill_budget, f"prefilling in chunks of {prefill_budget:,}"),
        ):
            hybrid_bytes = request_blocks(hybrid, length, in_flight) * hybrid_block
            full_bytes = request_blocks(full, length, in_flight) * full_block
            rows.append(
                Row(
                    f"{shape.describe(block_size)}: one request of {length:,} tokens, {what}: per-group "
                    f"{formula(shape, block_size, length, in_flight)}, ratio all-full / per-group",
                    hybrid_bytes / GIB,
                    full_bytes / GIB,
                    full_bytes / hybrid_bytes,
                    "—",
                    None,
                    "GiB",
                )
            )
    return rows


def coordinator_row(
    shape: HybridShape, block_size: int, num_prompt_tokens: int, chunk: int, num_decode: int
) -> Row:
    """Section 3: the blocks a coordinator of the model's groups holds against the arithmetic."""
    groups = shape.groups(block_size)
    held, predicted = check_coordinator(groups, num_prompt_tokens, chunk, num_decode)
    length = num_prompt_tokens + num_decode
    aligned = length > shape.sliding_window and (length - shape.sliding_window) % block_size == 0
    where = (
        "the window starts a block: the bound is 1 high per sliding group"
        if aligned
        else "no window starts a block"
    )
    return Row(
        f"check, {shape.name}'s groups on a KVCacheManager: a {num_prompt_tokens:,}-token prompt "
        f"prefilled in chunks of {chunk:,}, then {num_decode} tokens decoded (every call matched the "
        f"exact count): real blocks held vs the formula at L = {length:,} ({where}), decoding, "
        "ratio formula / held",
        held,
        predicted,
        predicted / held,
        "= 1.00x",
        held == predicted,
        "blocks",
    )


def run(
    num_requests: int = 200,
    num_layers: int = 12,
    full_every: int = 6,
    sliding_window: int = 256,
    num_kv_heads: int = 4,
    head_dim: int = 256,
    block_size: int = 16,
    full_pool_blocks: int = 768,
    budget: int = 2_048,
    prompt_range: tuple[int, int] = (1_024, 4_096),
    seed: int = 0,
    lengths: tuple[int, ...] = (32_768, 131_072),
    prefill_budget: int = 8_192,
    check_tokens: int = 4_096,
    check_chunk: int = 1_024,
    check_decode: int = 40,
) -> list[Row]:
    """The three sections; the served model is ``num_layers`` layers in Gemma 3's pattern with
    ``num_kv_heads`` K/V heads of ``head_dim`` (Gemma 3 4B's heads by default), the all-full pool
    ``full_pool_blocks`` blocks."""
    shape = HybridShape(
        "Gemma-3-shaped model", num_layers, full_every, sliding_window, num_kv_heads, head_dim
    )
    return [
        *served_rows(shape, block_size, full_pool_blocks, budget, num_requests, prompt_range, seed),
        *published_rows(GEMMA3_27B, block_size, lengths, prefill_budget),
        coordinator_row(GEMMA3_27B, block_size, check_tokens, check_chunk, check_decode),
    ]


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"num_requests": 12, "check_tokens": 1_100, "check_chunk": 256, "check_decode": 21}


if __name__ == "__main__":
    print(text_table(run()))

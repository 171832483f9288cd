"""The engine at a fixed KV budget: paged blocks against contiguous reservation, on the same requests.

A tiny :class:`~paged_kv.model.tiny_gpt.TinyGPT` serves ShareGPT-shaped requests: lengths drawn by
``sample_requests(SHAREGPT, ...)`` and divided by ``scale`` (8 by default) so that prompt plus output
fit the tiny model's ``max_len`` (ShareGPT's 2,048 becomes 256). Both modes get the same budget of
token slots; contiguous mode reserves ``max_model_len`` slots per sequence, paged mode takes blocks
as sequences grow. Both must generate identical tokens before anything is reported. The target is at
least 2 times the mean concurrent sequences; tokens per second are shown for information.

A second section runs out of blocks on purpose: a burst of long generations on a tight paged
budget, served once preempting by recompute (the baseline) and once by swap, which must generate
identical tokens. It reports the steps each needs and tokens per second, for information (here the
swap copies go from CPU to CPU; on a GPU they cross PCIe).

A third section serves requests that all start with the same system prompt, on the paged budget
of the first, with prefix caching on and off (the baseline), which must generate identical tokens:
the prompt tokens the prefills computed, the steps the run takes, and its wall time, for information.

    .venv/bin/python bench/bench_engine.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, text_table

from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest, min_num_blocks
from paged_kv.serving.engine_result import EngineResult
from paged_kv.simulation.workload import SHAREGPT, sample_requests
from paged_kv.timing import torch_threads

TARGET_CONCURRENCY = 2.0


def scaled_requests(num_requests: int, scale: int, max_len: int, seed: int = 0) -> list[EngineRequest]:
    """ShareGPT-shaped requests with lengths divided by ``scale``, random prompt bytes, all at step 0.

    Each prompt and output length is ``max(1, round(length / scale))``; the pair is then clipped so
    that prompt plus output fit ``max_len`` (with ``scale`` 8 and ``max_len`` 256 nothing is clipped).
    """
    rng = random.Random(seed)
    requests = []
    for r in sample_requests(SHAREGPT, num_requests, seed):
        prompt = min(max_len - 1, max(1, round(r.prompt_tokens / scale)))
        output = min(max_len - prompt, max(1, round(r.output_tokens / scale)))
        requests.append(EngineRequest(r.request_id, [rng.randrange(256) for _ in range(prompt)], output))
    return requests


def burst_requests(num_requests: int, max_len: int, seed: int = 0) -> list[EngineRequest]:
    """A burst at step 0 of short prompts (4 to ``max_len // 8`` tokens) asking for long outputs
    (``max_len // 4`` to ``3 * max_len // 4`` tokens): the sequences outgrow a tight budget."""
    rng = random.Random(seed)
    return [
        EngineRequest(
            f"burst-{i}",
            [rng.randrange(256) for _ in range(rng.randint(4, max(4, max_len // 8)))],
            rng.randint(max_len // 4, 3 * max_len // 4),
        )
        for i in range(num_requests)
    ]


def shared_prefix_requests(
    num_requests: int, system_tokens: int, scale: int, max_len: int, seed: int = 0
) -> list[EngineRequest]:
    """:func:`scaled_requests` fitted into ``max_len - system_tokens``, each prompt after one shared
    system prompt of ``system_tokens`` seeded random bytes."""
    rng = random.Random(seed + 1)  # not the user prompts' generator: the system prompt is new bytes
    system = [rng.randrange(256) for _ in range(system_tokens)]
    return [
        EngineRequest(r.request_id, system + r.prompt, r.max_tokens)
        for r in scaled_requests(num_requests, scale, max_len - system_tokens, seed)
    ]


def timed_runs(
    requests: list[EngineRequest], config: GPTConfig, settings: dict[str, dict]
) -> dict[str, tuple[EngineResult, float]]:
    """One engine per named ``settings`` (Engine keyword arguments) on the same model and requests:
    name -> (result, seconds); raises if any two generated different tokens."""
    model = TinyGPT(config, seed=0).eval()
    runs = {}
    for name, kwargs in settings.items():
        engine = Engine(model, **kwargs)
        start = time.perf_counter()
        result = engine.run(requests)
        runs[name] = (result, time.perf_counter() - start)
    first, *others = runs
    for name in others:
        if runs[name][0].tokens != runs[first][0].tokens:
            raise AssertionError(f"{first} and {name} generated different tokens")
    return runs


def serve(
    requests: list[EngineRequest], config: GPTConfig, num_blocks: int, block_size: int
) -> dict[str, tuple[EngineResult, float]]:
    """Both modes on ``requests``: mode -> (result, seconds); raises if their tokens differ."""
    budget = {"num_blocks": num_blocks, "block_size": block_size}
    return timed_runs(requests, config, {mode: {**budget, "mode": mode} for mode in ("paged", "contiguous")})


def preempt(
    requests: list[EngineRequest], config: GPTConfig, num_blocks: int, block_size: int
) -> dict[str, tuple[EngineResult, float]]:
    """The paged mode with each preemption on ``requests``: preemption -> (result, seconds);
    raises if their tokens differ."""
    budget = {"num_blocks": num_blocks, "block_size": block_size}
    return timed_runs(requests, config, {p: {**budget, "preemption": p} for p in ("recompute", "swap")})


def prefix_caching(
    requests: list[EngineRequest], config: GPTConfig, num_blocks: int, block_size: int
) -> dict[str, tuple[EngineResult, float]]:
    """The paged mode with and without prefix caching on ``requests``: ``"on"`` / ``"off"`` ->
    (result, seconds); raises if their tokens differ."""
    budget = {"num_blocks": num_blocks, "block_size": block_size}
    settings = {name: {**budget, "enable_prefix_caching": on} for name, on in (("on", True), ("off", False))}
    return timed_runs(requests, config, settings)


def run(
    num_requests: int = 160,
    slots_per_budget: int = 12,
    scale: int = 8,
    block_size: int = 16,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 16,
    max_len: int = 256,
    threads: int = 1,
    burst: int = 48,
    burst_blocks: int | None = None,
    system_tokens: int = 96,
) -> list[Row]:
    """Serve the same requests in both modes with a budget of ``slots_per_budget`` contiguous slots.

    The budget is ``slots_per_budget * max_len`` token slots, ``num_blocks = budget / block_size``.
    Then serve ``burst`` long generations on ``burst_blocks`` blocks (default: twice the smallest
    budget that can serve them) preempting by recompute and by swap. Then serve ``num_requests``
    requests sharing a system prompt of ``system_tokens`` on the first budget, with and without
    prefix caching.
    Runs with ``threads`` torch threads (1 by default: the tiny model's ops are too small to share).
    """
    with torch_threads(threads):
        config = GPTConfig(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, max_len=max_len)
        requests = scaled_requests(num_requests, scale, max_len)
        num_blocks = -(-slots_per_budget * max_len // block_size)
        runs = serve(requests, config, num_blocks, block_size)
        bursty = burst_requests(burst, max_len)
        burst_blocks = burst_blocks or 2 * min_num_blocks(bursty, block_size)
        preempted = preempt(bursty, config, burst_blocks, block_size)
        shared = shared_prefix_requests(num_requests, system_tokens, scale, max_len)
        cached = prefix_caching(shared, config, num_blocks, block_size)
    (paged, paged_s), (contiguous, contiguous_s) = runs["paged"], runs["contiguous"]
    generated = sum(r.max_tokens for r in requests)
    budget = num_blocks * block_size
    name = (
        f"engine, {num_requests} ShareGPT-shaped requests (lengths / {scale} to fit max_len {max_len}), "
        f"budget {budget:,} tokens, paged (block {block_size}) vs contiguous"
    )
    mean_ratio = paged.mean_running / contiguous.mean_running
    paged_speed, contiguous_speed = generated / paged_s, generated / contiguous_s
    thread_note = f"{threads} thread{'s' if threads != 1 else ''}"
    return [
        Row(f"{name}: mean concurrent sequences", paged.mean_running, contiguous.mean_running, mean_ratio,
            f">= {TARGET_CONCURRENCY:.0f}x", mean_ratio >= TARGET_CONCURRENCY, "seqs"),
        Row(f"{name}: peak concurrent sequences", paged.peak_running, contiguous.peak_running,
            paged.peak_running / contiguous.peak_running, "—", None, "seqs"),
        Row(f"{name}: generated tokens per second, CPU, {thread_note} ({paged.preemptions} preemptions)",
            paged_speed, contiguous_speed, paged_speed / contiguous_speed, "—", None, "tokens/s"),
        *preemption_rows(preempted, bursty, burst_blocks * block_size, thread_note),
        *prefix_caching_rows(cached, system_tokens, scale, budget, block_size, thread_note),
    ]  # fmt: skip


def preemption_rows(
    runs: dict[str, tuple[EngineResult, float]], requests: list[EngineRequest], budget: int, thread_note: str
) -> list[Row]:
    """Swap against recompute on the burst: steps to serve it all, and generated tokens per second."""
    (recompute, recompute_s), (swap, swap_s) = runs["recompute"], runs["swap"]
    outputs = [r.max_tokens for r in requests]
    name = (
        f"engine, a burst of {len(requests)} long generations ({min(outputs)} to {max(outputs)} tokens), "
        f"paged on {budget:,} tokens, swap vs recompute ({swap.preemptions} vs {recompute.preemptions} "
        f"preemptions, {swap.blocks_swapped_out} blocks swapped out vs {recompute.recomputed_tokens} "
        f"tokens recomputed)"
    )
    generated = sum(outputs)
    swap_speed, recompute_speed = generated / swap_s, generated / recompute_s
    return [
        Row(f"{name}: steps to serve every request", swap.steps, recompute.steps,
            recompute.steps / swap.steps, "—", None, "steps"),
        Row(f"{name}: generated tokens per second, CPU, {thread_note}", swap_speed, recompute_speed,
            swap_speed / recompute_speed, "—", None, "tokens/s"),
    ]  # fmt: skip


def prefix_caching_rows(
    runs: dict[str, tuple[EngineResult, float]],
    system_tokens: int,
    scale: int,
    budget: int,
    block_size: int,
    thread_note: str,
) -> list[Row]:
    """Prefix caching on against off: prefill tokens computed, steps, and the wall time of the run."""
    (on, on_s), (off, off_s) = runs["on"], runs["off"]
    name = (
        f"engine, {len(on.tokens)} requests sharing a {system_tokens}-token system prompt + a "
        f"ShareGPT-shaped user prompt (lengths / {scale}), paged (block {block_size}) on {budget:,} "
        f"tokens, prefix caching vs none (hit rate {on.hit_rate:.0%}, {on.preemptions} vs "
        f"{off.preemptions} preemptions)"
    )
    return [
        Row(f"{name}: prefill tokens computed", on.prefill_tokens_computed, off.prefill_tokens_computed,
            off.prefill_tokens_computed / on.prefill_tokens_computed, "—", None, "tokens"),
        Row(f"{name}: steps to serve every request (shared blocks leave room for more sequences)",
            on.steps, off.steps, off.steps / on.steps, "—", None, "steps"),
        Row(f"{name}: wall time of the run, CPU, {thread_note}", on_s, off_s, off_s / on_s, "—", None, "s"),
    ]  # fmt: skip


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {
    "num_requests": 6,
    "slots_per_budget": 2,
    "scale": 32,
    "block_size": 4,
    "max_len": 64,
    "head_dim": 8,
    "burst": 6,
    "system_tokens": 12,
}


if __name__ == "__main__":
    print(text_table(run()))

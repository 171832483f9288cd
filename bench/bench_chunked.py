"""Chunked prefill under a token budget (``Engine(..., max_num_batched_tokens=N)``, lesson 09).

1. A long-prompt workload: requests with short prompts arrive one every step, and every eighth
   brings a long prompt (most of ``max_len``). The tiny GPT serves them on a pool large enough
   never to preempt, with a budget of ``budget`` tokens per step against none. Reported: the
   largest step in tokens (what a step's forward must compute, and so what bounds the latency of
   every decode that rides in it) and the time to first token in steps, median and p99 (nearest
   rank). The tokens of both runs are compared and must be equal.
2. The burst of long generations that ``bench_engine`` preempts, on the same pool, three ways:
   recompute under the budget against recompute without one (either way a victim resumes by
   prefilling its prompt and the tokens it had generated, whole or in chunks), and swap against
   recompute under the budget: steps to serve every request.

Counts only, no timing: steps and tokens are exact, whatever the machine's load.

    .venv/bin/python bench/bench_chunked.py
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, text_table
from bench_engine import burst_requests

from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest, min_num_blocks
from paged_kv.serving.engine_result import EngineResult
from paged_kv.timing import torch_threads


def long_prompt_requests(
    num_requests: int, max_len: int, every: int = 8, seed: int = 0
) -> list[EngineRequest]:
    """One request per step: short prompts (4 to 16 tokens), and every ``every``-th a long one
    (``max_len / 2`` to ``3 max_len / 4`` tokens); 4 to 16 tokens to generate."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        length = rng.randint(max_len // 2, 3 * max_len // 4) if i % every == 0 else rng.randint(4, 16)
        prompt = [rng.randrange(256) for _ in range(length)]
        requests.append(EngineRequest(f"r{i}", prompt, rng.randint(4, 16), arrival_step=i))
    return requests


def percentile(values: list[int], share: float) -> int:
    """The nearest-rank percentile: the smallest value with ``share`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def serve(model: TinyGPT, requests: list[EngineRequest], **settings) -> EngineResult:
    return Engine(model, **settings).run(requests)


def run(
    num_requests: int = 96,
    budget: int = 64,
    block_size: int = 16,
    max_len: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 16,
    burst: int = 48,
    threads: int = 1,
) -> list[Row]:
    """Both comparisons of the module docstring; raises if a budget changes a token."""
    config = GPTConfig(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, max_len=max_len)
    with torch_threads(threads):
        model = TinyGPT(config, seed=0)
        requests = long_prompt_requests(num_requests, max_len)
        pool = {"num_blocks": 4 * min_num_blocks(requests, block_size), "block_size": block_size}
        whole = serve(model, requests, **pool)
        chunked = serve(model, requests, **pool, max_num_batched_tokens=budget)
        bursty = burst_requests(burst, max_len)
        tight = {"num_blocks": 2 * min_num_blocks(bursty, block_size), "block_size": block_size}
        unbudgeted = serve(model, bursty, **tight)
        v1 = serve(model, bursty, **tight, max_num_batched_tokens=budget)
        swap = serve(model, bursty, **tight, preemption="swap", max_num_batched_tokens=budget)
    if chunked.tokens != whole.tokens or not unbudgeted.tokens == v1.tokens == swap.tokens:
        raise AssertionError("a token budget changed the generated tokens")
    return budget_rows(whole, chunked, num_requests, budget, max_len) + recompute_rows(
        unbudgeted, v1, swap, burst, budget, tight["num_blocks"] * block_size
    )


def budget_rows(whole: EngineResult, chunked: EngineResult, n: int, budget: int, max_len: int) -> list[Row]:
    name = (
        f"engine, {n} requests arriving one a step, every 8th with a long prompt ({max_len // 2} to "
        f"{3 * max_len // 4} tokens), max_num_batched_tokens={budget} vs no budget"
    )
    largest = max(chunked.tokens_per_step), max(whole.tokens_per_step)
    ttft = list(chunked.time_to_first_token.values()), list(whole.time_to_first_token.values())
    medians = statistics.median(ttft[0]), statistics.median(ttft[1])
    p99 = percentile(ttft[0], 0.99), percentile(ttft[1], 0.99)
    steps = f"{chunked.steps} vs {whole.steps} steps in all"
    return [
        Row(
            f"{name}: the largest step ({steps})",
            largest[0],
            largest[1],
            largest[1] / largest[0],
            "—",
            None,
            "tokens",
        ),
        Row(
            f"{name}: time to first token, median",
            medians[0],
            medians[1],
            medians[0] / medians[1],
            "—",
            None,
            "steps",
        ),
        Row(f"{name}: time to first token, p99", p99[0], p99[1], p99[0] / p99[1], "—", None, "steps"),
    ]


def recompute_rows(
    unbudgeted: EngineResult, v1: EngineResult, swap: EngineResult, burst: int, budget: int, slots: int
) -> list[Row]:
    name = f"engine, a burst of {burst} long generations, paged on {slots:,} tokens"
    v1_note = (
        f"{v1.preemptions} vs {unbudgeted.preemptions} preemptions, {v1.prefill_tokens_computed:,} vs "
        f"{unbudgeted.prefill_tokens_computed:,} tokens prefilled"
    )
    return [
        Row(
            f"{name}: steps to serve every request, recompute with max_num_batched_tokens={budget} vs "
            f"without a budget (both resume by prefilling prompt and generated tokens; {v1_note})",
            v1.steps,
            unbudgeted.steps,
            unbudgeted.steps / v1.steps,
            "—",
            None,
            "steps",
        ),
        Row(
            f"{name}: steps to serve every request, swap vs v1 recompute, both "
            f"max_num_batched_tokens={budget} ({swap.preemptions} vs {v1.preemptions} preemptions)",
            swap.steps,
            v1.steps,
            v1.steps / swap.steps,
            "—",
            None,
            "steps",
        ),
    ]


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"num_requests": 9, "budget": 8, "block_size": 4, "max_len": 64, "head_dim": 8, "burst": 6}


if __name__ == "__main__":
    print(text_table(run()))

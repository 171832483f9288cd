"""The CPU offload tier on a multi-turn chat whose working set is several times the device pool.

A tiny :class:`~paged_kv.model.tiny_gpt.TinyGPT` serves ``num_chats`` conversations of
``num_turns`` turns under one shared system prompt (:func:`~paged_kv.serving.workloads.chat_requests`:
each turn's prompt is the previous prompt, its answer and a new message, every answer the model's own
greedy one). The device pool is ``pool`` times the blocks the largest turn needs at once, so the
blocks a conversation cached are evicted before it returns. The same requests run twice on the
offline :class:`~paged_kv.serving.engine.Engine` with prefix caching: without a host tier, and with
``kv_offloading_size`` GiB of host memory (vLLM's native offloading: full blocks stored to host
memory as they are computed, loaded back when a returning prompt hits past the device's hits).

Reported, from one run each (the counts are exact) and ``repeats`` interleaved timed rounds: the
prompt tokens computed, the mean time to first token, and the output tokens per second, with the
host tier against without; the external (host-tier) hits. Every request must give the tokens it
gives without the tier. What a host copy costs against a plain tensor copy of the same bytes is
``bench_offload_copy.py``'s.

    .venv/bin/python bench/bench_offload.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, spread_of, text_table

from paged_kv.core.block import blocks_for_tokens
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine
from paged_kv.serving.workloads import chat_requests
from paged_kv.timing import compare_times, torch_threads

COMPUTED_TARGET = 1.5  # the tier must spare at least a third of the prompt tokens computed


def run(
    num_chats: int = 12,
    num_turns: int = 4,
    system_tokens: int = 64,
    message: tuple[int, int] = (16, 48),
    answer: tuple[int, int] = (8, 24),
    block_size: int = 16,
    pool: float = 0.25,
    kv_offloading_size: float = 0.25,
    num_layers: int = 4,
    num_heads: int = 4,
    head_dim: int = 32,
    max_len: int = 512,
    repeats: int = 3,
    threads: int = 1,
) -> list[Row]:
    """The rows of the module docstring; raises if the tier changes a token."""
    config = GPTConfig(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, max_len=max_len)
    with torch_threads(threads):
        model = TinyGPT(config, seed=0).eval()
        requests, answers = chat_requests(model, num_chats, num_turns, system_tokens, message, answer)
        need = {r.request_id: blocks_for_tokens(len(r.prompt) + r.max_tokens, block_size) for r in requests}
        working_set = sum(need.values())
        largest_turn = max(sum(need[(chat, turn)] for chat in range(num_chats)) for turn in range(num_turns))
        num_blocks = max(max(need.values()) + 1, round(pool * largest_turn))
        settings = {"num_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": True}
        engines = {
            "without": Engine(model, **settings),
            "with the host tier": Engine(model, **settings, kv_offloading_size=kv_offloading_size),
        }
        runs = {name: engine.run(requests) for name, engine in engines.items()}
        for name, result in runs.items():
            if result.tokens != answers:
                raise AssertionError(f"{name}: a request's tokens differ from its answer alone")
        timings = compare_times(
            {name: partial(engine.run, requests) for name, engine in engines.items()},
            repeats=repeats,
            warmup=0,
            threads=threads,
        )
    base, tier = runs["without"], runs["with the host tier"]
    ttft = {name: mean(r.time_to_first_token_seconds.values()) for name, r in runs.items()}
    generated = sum(len(tokens) for tokens in answers.values())
    speed, spread = spread_of(
        b / t for b, t in zip(timings.samples["without"], timings.samples["with the host tier"], strict=True)
    )
    name = (
        f"{num_chats} chats x {num_turns} turns, a {system_tokens}-token system prompt, working set "
        f"{working_set} blocks of {block_size} on a device pool of {num_blocks} "
        f"({working_set / num_blocks:.1f}x), "
        f"{kv_offloading_size:g} GiB host tier, tiny GPT {num_layers} layers x {num_heads} heads x {head_dim}"
    )
    return [
        Row(f"{name}: prompt tokens computed, with the host tier vs without",
            tier.prefill_tokens_computed, base.prefill_tokens_computed,
            base.prefill_tokens_computed / tier.prefill_tokens_computed, f">= {COMPUTED_TARGET:g}x",
            base.prefill_tokens_computed / tier.prefill_tokens_computed >= COMPUTED_TARGET, "tokens"),
        Row(f"{name}: mean time to first token, with vs without (one run each)",
            ttft["with the host tier"] * 1e3, ttft["without"] * 1e3,
            ttft["without"] / ttft["with the host tier"], "—", None, "ms"),
        Row(f"{name}: output tokens per second, with vs without (the whole run, {repeats} rounds)",
            generated / timings.median("with the host tier"), generated / timings.median("without"),
            speed, "—", None, "tok/s", spread),
        Row(f"{name}: prompt tokens loaded from the host tier (external hits), of those looked up",
            _external(tier, "hits"), _external(tier, "queries"),
            _external(tier, "hits") / max(1, _external(tier, "queries")), "—", None, "tokens"),
    ]  # fmt: skip


def _external(result, counter: str) -> int:
    """A run's external prefix-cache ``"queries"`` or ``"hits"`` (the connector's lookups past the
    device's hits, in prompt tokens), summed over its steps."""
    return sum(
        getattr(stats.connector_prefix_cache_stats, counter)
        for stats in result.scheduler_stats
        if stats.connector_prefix_cache_stats is not None
    )


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"num_chats": 4, "num_turns": 3, "system_tokens": 32, "num_layers": 2, "head_dim": 16, "repeats": 1}


if __name__ == "__main__":
    print(text_table(run()))

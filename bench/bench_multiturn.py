"""Multi-turn chat: blocks filled during decode are cached too, so a follow-up turn reuses the answer.

A tiny :class:`~paged_kv.model.tiny_gpt.TinyGPT` serves ``num_chats`` conversations of ``num_turns``
turns under one shared system prompt. Each turn's prompt is the previous turn's prompt, its answer
and a new message (lengths drawn from ``message`` and ``answer``, seeded); turn ``k`` of every
conversation arrives at step ``k * gap``, after turn ``k - 1`` has finished, as a user who reads
the answer before writing again. The answers are what the model generates greedily for each prompt
alone, computed first, so that every prompt is known before the engine runs.

The engine runs with prefix caching twice on the same requests: as the package does, where the
scheduler passes a running request's token ids with every ``allocate_slots`` and every block that
fills is cached when its tokens are scheduled (vLLM v1), and with a memory that drops those ids for
running requests (:func:`prompt_blocks_only` on the :class:`~paged_kv.core.kv_cache_manager.KVCacheManager`,
:class:`PromptBlocksOnlyEngine`),
so that only the blocks of prompts admitted whole are cached (the package before issue 15).
Reported: prefill tokens computed, the hit rate in prompt tokens, the hit rate against the ideal
(every full block of the previous prompt and answer, computed from the chained hashes), on a pool
that holds every request at once and on a tight one where cached blocks are evicted; the tokens,
which must equal the answers of each prompt alone; and what the ids cost the decode step's
bookkeeping (``KVCacheManager.allocate_slots(request, 1, token_ids)`` per request against no ids).

    .venv/bin/python bench/bench_multiturn.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, text_table

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_coordinator import ComputedBlocks
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.workloads import chat_requests, ideal_hits
from paged_kv.timing import compare_times, torch_threads

IDEAL_TARGET = 0.99  # the share of the ideal hit rate decode-block caching must reach on the ample pool


def prompt_blocks_only(memory: KVCacheManager) -> None:
    """Make ``memory`` the baseline's: a running request's ``allocate_slots`` (its decode tokens, or a
    later prefill chunk) gets no token ids, so its hash chain ends there and only the blocks its
    admission filled, its prompt's, are cached."""
    allocate = memory.allocate_slots

    def allocate_slots(request, num_new_tokens, token_ids=None, **kwargs):
        if request.request_id in memory:
            token_ids = None
        return allocate(request, num_new_tokens, token_ids, **kwargs)

    memory.allocate_slots = allocate_slots


class PromptBlocksOnlyEngine(Engine):
    """The package's :class:`~paged_kv.serving.engine.Engine` whose memory caches prompt blocks only
    (:func:`prompt_blocks_only`): nothing else changes."""

    def new_llm_engine(self):
        llm = super().new_llm_engine()
        prompt_blocks_only(llm.engine_core.memory)
        return llm


ENGINES = {"decode": Engine, "prompts": PromptBlocksOnlyEngine}
"""The two engines: decode-block caching (the package) and prompt blocks only (the baseline)."""


def engines(model: TinyGPT, num_blocks: int, block_size: int) -> dict[str, Engine]:
    """Each of :data:`ENGINES` with prefix caching, by the same name."""
    settings = {"num_blocks": num_blocks, "block_size": block_size, "enable_prefix_caching": True}
    return {name: engine(model, **settings) for name, engine in ENGINES.items()}


def decode_steps_of(num_seqs: int, steps: int, block_size: int, with_ids: bool) -> Callable[[], None]:
    """A call that runs ``steps`` decode steps of ``num_seqs`` sequences (100-token prompts) on a new
    prefix-caching memory: per step and request, the token appended to its ids, then
    ``allocate_slots(request, 1, ids)`` as the scheduler calls it for a running request, or with no
    ids (its hash chain ends at the first)."""

    def decode() -> None:
        memory = KVCacheManager(num_seqs * blocks_for_tokens(100 + steps, block_size) + 1, block_size,
                                enable_caching=True)  # fmt: skip
        requests = [EngineCoreRequest(i, 100, steps + 1, tuple((i * 7 + t) % 256 for t in range(100)))
                    for i in range(num_seqs)]  # fmt: skip
        ids = {r.request_id: list(r.prompt_token_ids) for r in requests}
        for r in requests:
            memory.allocate_slots(r, 100, ids[r.request_id], new_computed_blocks=ComputedBlocks())
        for step in range(steps):
            for r in requests:
                tokens = ids[r.request_id]
                tokens.append((r.request_id + step) % 256)
                memory.allocate_slots(r, 1, tokens if with_ids else None)

    return decode


def run(
    num_chats: int = 16,
    num_turns: int = 4,
    system_tokens: int = 32,
    message: tuple[int, int] = (8, 32),
    answer: tuple[int, int] = (16, 48),
    block_size: int = 16,
    tight: float = 0.75,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 16,
    max_len: int = 384,
    threads: int = 1,
    decode_seqs: int = 256,
    decode_steps: int = 256,
    repeats: int = 3,
) -> list[Row]:
    """Serve the chats on an ample pool (every request at once) and on a tight one (``tight`` times
    the blocks of the largest turn at its longest), with decode blocks cached and with prompt blocks
    only; time the ample runs and the decode step's bookkeeping (``repeats`` interleaved rounds)."""
    config = GPTConfig(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, max_len=max_len)
    with torch_threads(threads):
        model = TinyGPT(config, seed=0).eval()
        requests, answers = chat_requests(model, num_chats, num_turns, system_tokens, message, answer)
        longest = {r.request_id: len(r.prompt) + r.max_tokens for r in requests}
        need = {request_id: blocks_for_tokens(n, block_size) for request_id, n in longest.items()}
        largest_turn = max(sum(need[(chat, turn)] for chat in range(num_chats)) for turn in range(num_turns))
        pools = {
            "ample": sum(need.values()),
            "tight": max(max(need.values()) + 1, round(tight * largest_turn)),
        }
        built = {pool: engines(model, blocks, block_size) for pool, blocks in pools.items()}
        runs = {pool: {name: e.run(requests) for name, e in pair.items()} for pool, pair in built.items()}
        wall = compare_times({name: partial(e.run, requests) for name, e in built["ample"].items()},
                             repeats=repeats, warmup=0)  # fmt: skip
    bookkeeping = compare_times(
        {
            ids: decode_steps_of(decode_seqs, decode_steps, block_size, ids == "with")
            for ids in ("with", "without")
        },
        repeats=repeats,
        warmup=1,
    )
    equal = sum(result.tokens == answers for pair in runs.values() for result in pair.values())
    ideal = ideal_hits(requests, answers, block_size)
    queries = sum(len(r.prompt) for r in requests)
    name = (
        f"multi-turn chat, {num_chats} conversations x {num_turns} turns ({len(requests)} prompts, "
        f"{queries:,} prompt tokens; messages {message[0]}-{message[1]}, answers {answer[0]}-{answer[1]} "
        f"tokens, a {system_tokens}-token system prompt), block {block_size}, tiny GPT"
    )
    rows = []
    for pool, blocks in pools.items():
        decode, prompt_only = runs[pool]["decode"], runs[pool]["prompts"]
        where = f"{name}, {pool} pool of {blocks:,} blocks"
        rows += [
            Row(f"{where}: prefill tokens computed, decode blocks cached vs prompt blocks only",
                decode.prefill_tokens_computed, prompt_only.prefill_tokens_computed,
                prompt_only.prefill_tokens_computed / decode.prefill_tokens_computed, "—", None, "tokens"),
            Row(f"{where}: hit rate in prompt tokens, decode blocks cached vs prompt blocks only "
                f"({decode.prefix_cache_hits:,} vs {prompt_only.prefix_cache_hits:,} prefill tokens saved)",
                100 * decode.hit_rate, 100 * prompt_only.hit_rate, decode.hit_rate / prompt_only.hit_rate,
                "—", None, "%"),
        ]  # fmt: skip
    ample = runs["ample"]["decode"]
    where = f"{name}, ample pool of {pools['ample']:,} blocks"
    ratio = ample.prefix_cache_hits / ideal
    runs_total = sum(len(pair) for pair in runs.values())
    rows += [
        Row(f"{where}: hit rate vs the ideal (every full block of the previous prompt and answer, from "
            f"the chained hashes)", 100 * ample.hit_rate, 100 * ideal / queries, ratio,
            f">= {IDEAL_TARGET}x", ratio >= IDEAL_TARGET, "%"),
        Row(f"{where}: wall time of a run, CPU, {threads} thread(s), decode blocks cached vs prompt blocks "
            f"only (time ratio, median of {repeats} interleaved rounds)", wall.median("decode"),
            wall.median("prompts"),
            wall.ratio("decode", "prompts"), "—", None, "s"),
        Row(f"{name}: runs whose tokens equal each prompt's answer alone (both pools, both cachings)",
            equal, runs_total, equal / runs_total, "all", equal == runs_total, "runs"),
        Row(f"{decode_steps} decode steps of {decode_seqs} seqs (100-token prompts, block {block_size}), "
            f"prefix caching: KVCacheManager.allocate_slots(request, 1) per request with its token ids vs "
            f"without (time ratio)",
            bookkeeping.median("with") * 1e3, bookkeeping.median("without") * 1e3,
            bookkeeping.ratio("with", "without"), "—", None, "ms"),
    ]  # fmt: skip
    return rows


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {
    "num_chats": 3,
    "num_turns": 2,
    "system_tokens": 4,
    "message": (2, 5),
    "answer": (3, 6),
    "block_size": 4,
    "max_len": 64,
    "head_dim": 8,
    "decode_seqs": 8,
    "decode_steps": 8,
    "repeats": 1,
}


if __name__ == "__main__":
    print(text_table(run()))

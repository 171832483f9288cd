"""Prompts that open with a shared system prompt, served through the paged cache: what prefix caching saves.

Chat applications send the same instructions (a *system prompt*) in front of every user's
message. :func:`system_prompt_requests` draws such a workload, seeded: each request opens with one
of ``num_system_prompts`` system prompts, then has a user prompt of its own, both random token ids
(so two user prompts share nothing but by chance). :func:`serve` runs the requests through a
:class:`~paged_kv.kv.cache.PagedKVCacheAllocator` of ``num_blocks`` blocks, with or without prefix
caching, and :class:`ServeResult` says how many prompt tokens the cache served.
:func:`ideal_cached_tokens` is what a cache that forgets nothing serves (user prompts that happen
to start alike aside): every request but the first with each system prompt finds that system
prompt's full blocks. Lesson 07 plots the hit rate against the pool size with them, and
``bench/bench_prefix_cache.py`` measures the hit rate against the ideal.

The scheduler of :func:`serve` is the simplest that shows the effect of memory: requests are
admitted in order, at most ``max_running`` at once; each takes its prompt's blocks and then
reserves its output tokens; when the window is full, or blocks run short, the oldest running
request finishes and frees its blocks. With prefix caching the freed blocks stay cached on the free
list until new data needs them, least recently freed first, so the more blocks the pool has, the
longer a system prompt nobody is using survives until its next request.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.simulation.workload import SHAREGPT, sample_requests
from paged_kv.validate import check_count

VOCAB_SIZE = 32_000
"""Token ids are drawn from ``0 .. VOCAB_SIZE - 1`` (a Llama-sized vocabulary)."""


class SharedPromptRequest(NamedTuple):
    """One request: its prompt's token ids (a system prompt, then the user's) and its output length."""

    token_ids: list[int]
    output_tokens: int
    system_prompt: int
    """Which system prompt the prompt opens with: ``0 .. num_system_prompts - 1``."""
    system_tokens: int
    """How many of the leading ``token_ids`` are that system prompt."""


def system_prompt_requests(
    num_requests: int, system_tokens: int, *, num_system_prompts: int = 1, seed: int = 0, scale: int = 1
) -> list[SharedPromptRequest]:
    """``num_requests`` requests, each a system prompt of ``system_tokens`` tokens and a user prompt.

    Each request picks one of the ``num_system_prompts`` system prompts uniformly at random. User
    prompt and output lengths are those of ``sample_requests(SHAREGPT, num_requests, seed)``, divided
    by ``scale`` (at least 1 token each). The same arguments always give the same requests.

    Raises:
        ValueError: naming the argument: a count below 0 (``num_requests``, ``system_tokens``) or
            below 1 (``num_system_prompts``, ``scale``), or a negative ``seed``.
    """
    num_requests = check_count("num_requests", num_requests)
    system_tokens = check_count("system_tokens", system_tokens)
    num_system_prompts = check_count("num_system_prompts", num_system_prompts, minimum=1)
    scale = check_count("scale", scale, minimum=1)
    seed = check_count("seed", seed)
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB_SIZE) for _ in range(system_tokens)] for _ in range(num_system_prompts)]
    requests = []
    for r in sample_requests(SHAREGPT, num_requests, seed):
        which = rng.randrange(num_system_prompts)
        user = [rng.randrange(VOCAB_SIZE) for _ in range(max(1, r.prompt_tokens // scale))]
        output = max(1, r.output_tokens // scale)
        requests.append(SharedPromptRequest(systems[which] + user, output, which, system_tokens))
    return requests


def ideal_cached_tokens(requests: Sequence[SharedPromptRequest], block_size: int) -> int:
    """The prompt tokens a prefix cache that forgets nothing would serve.

    Every request but the first with each system prompt finds that system prompt's *full* blocks,
    ``system_tokens // block_size`` of them; the block where the user prompt starts is never shared.
    (User prompts are random, so they share nothing beyond that but by chance.)
    """
    block_size = check_count("block_size", block_size, minimum=1)
    seen: set[int] = set()
    cached = 0
    for request in requests:
        if request.system_prompt in seen:
            cached += request.system_tokens // block_size * block_size
        seen.add(request.system_prompt)
    return cached


@dataclass(frozen=True)
class ServeResult:
    """What one run of :func:`serve` computed and found.

    Fields:
        prompt_tokens: the prompt tokens of every request.
        cached_tokens: the leading prompt tokens the prefix cache held (``num_cached_tokens``,
            summed); 0 without prefix caching.
        stats: the allocator's ``prefix_cache_stats`` at the end: with prefix caching,
            ``stats.queries == prompt_tokens`` and ``stats.hits == cached_tokens``; all 0 without.
    """

    prompt_tokens: int
    cached_tokens: int
    stats: PrefixCacheStats

    @property
    def computed_tokens(self) -> int:
        """Prefill tokens the model must compute: the prompts less what the cache held."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        """``cached_tokens / prompt_tokens``, the share of prompt tokens the cache served (0.0 for none)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def serve(
    requests: Sequence[SharedPromptRequest],
    num_blocks: int,
    block_size: int,
    max_running: int,
    caching: bool = True,
) -> ServeResult:
    """Admit the requests in order, at most ``max_running`` at once, the oldest finishing first.

    Each request allocates its prompt (with its token ids) and then reserves its output tokens with
    ``append_tokens``; when the window is full, or blocks run short, the oldest running request
    finishes and frees its blocks (which stay cached when ``caching`` is on).

    Raises:
        ValueError: naming the argument: ``num_blocks``, ``block_size`` or ``max_running`` below 1,
            or ``num_blocks`` too small for some request alone (its prompt and output tokens).
    """
    num_blocks = check_count("num_blocks", num_blocks, minimum=1)
    block_size = check_count("block_size", block_size, minimum=1)
    max_running = check_count("max_running", max_running, minimum=1)
    largest = max((len(r.token_ids) + r.output_tokens for r in requests), default=0)
    if blocks_for_tokens(largest, block_size) > num_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} cannot hold the longest request alone: its {largest} tokens "
            f"take {blocks_for_tokens(largest, block_size)} blocks of {block_size}"
        )
    cache = PagedKVCacheAllocator(num_blocks, block_size, 1, 1, enable_prefix_caching=caching)
    running: deque[int] = deque()
    cached = 0
    for seq_id, request in enumerate(requests):
        if len(running) == max_running:
            cache.free_sequence(running.popleft())
        prompt = request.token_ids
        _until_it_fits(cache, running, cache.allocate_for_sequence, seq_id, len(prompt), prompt)
        cached += cache.num_cached_tokens(seq_id)
        _until_it_fits(cache, running, cache.append_tokens, seq_id, request.output_tokens)
        running.append(seq_id)
    prompt_tokens = sum(len(request.token_ids) for request in requests)
    return ServeResult(prompt_tokens, cached, cache.prefix_cache_stats)


def _until_it_fits(
    cache: PagedKVCacheAllocator, running: deque[int], call: Callable[..., object], *args
) -> None:
    """``call(*args)``, finishing the oldest running request each time it runs out of blocks.

    ``serve`` checked that every request fits alone, so this ends at the latest when no other
    request runs.
    """
    while True:
        try:
            call(*args)
            return
        except OutOfBlocksError:
            cache.free_sequence(running.popleft())

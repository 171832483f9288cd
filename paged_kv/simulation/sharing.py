"""Prompts that open with a shared system prompt, served through the paged cache: what prefix caching saves.

Chat applications send the same instructions (a *system prompt*) in front of every user's
message. :func:`system_prompt_requests` draws such a workload, seeded: each request opens with one
of ``num_system_prompts`` system prompts, then has a user prompt of its own, both random token ids
(so two user prompts share nothing but by chance). :func:`serve` serves the requests with the
package's scheduler (:class:`~paged_kv.serving.scheduler.Scheduler`, the engine's, with a runner
that counts tokens instead of running a model) over ``num_blocks`` blocks, with or without prefix
caching, and :class:`ServeResult` says how many prompt tokens the cache served.
:func:`ideal_cached_tokens` is what a cache that forgets nothing serves (user prompts that happen
to start alike aside): every request but the first with each system prompt finds that system
prompt's full blocks. Lesson 08 plots the hit rate against the pool size with them, and
``bench/bench_prefix_cache.py`` measures the hit rate against the ideal.

:func:`serve` puts every request in the queue at step 0, in order, and lets the scheduler run at
most ``max_running`` at once: each admitted prompt takes its blocks (the cached prefix's blocks
where prefix caching finds them) and then grows one token per step until its output is done, when
it frees its blocks. With prefix caching the freed blocks stay cached on the free list until new
data needs them, least recently freed first, so the more blocks the pool has, the longer a system
prompt nobody is using survives until its next request.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler, run_steps
from paged_kv.simulation.workload import SHAREGPT, BlockBookkeeping, sample_requests
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
        prompt_tokens: the tokens every admission prefills (a request preempted by recompute is
            admitted, and looked up in the cache, again, with the tokens it had generated after its
            prompt).
        cached_tokens: the leading prompt tokens the prefix cache held (``num_cached_tokens``,
            summed over the admissions); 0 without prefix caching.
        stats: the cache's ``prefix_cache_stats`` at the end: with prefix caching,
            ``stats.queries + stats.preempted_queries == prompt_tokens`` and ``stats.hits +
            stats.preempted_hits == cached_tokens`` (a readmission's lookup counts apart, as
            vLLM's); all 0 without.
        steps: the scheduler's steps until every request finished.
        preemptions: the sequences preempted by recompute on the way.
    """

    prompt_tokens: int
    cached_tokens: int
    stats: PrefixCacheStats
    steps: int = 0
    preemptions: int = 0

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
    """Serve the requests, queued in order at step 0, at most ``max_running`` at once (lesson 08).

    The scheduler is the engine's (:class:`~paged_kv.serving.scheduler.Scheduler`, ``max_num_seqs
    = max_running``) over a :class:`~paged_kv.simulation.workload.BlockBookkeeping` of
    ``num_blocks`` blocks for the requests (and the pool's null block), with prefix caching when
    ``caching`` is on, and a runner that counts
    tokens: a request's prompt is looked up in the prefix cache and admitted by the engine's rule (its
    whole prompt's blocks, less the hits, are free), its output grows one token per step, and it
    frees its blocks (which stay cached) when done.

    Raises:
        ValueError: naming the argument: ``num_blocks``, ``block_size`` or ``max_running`` below 1,
            or ``num_blocks`` too small for some request alone (its prompt and output tokens).
    """
    num_blocks = check_count("num_blocks", num_blocks, minimum=1)
    block_size = check_count("block_size", block_size, minimum=1)
    max_running = check_count("max_running", max_running, minimum=1)
    memory = BlockBookkeeping(num_blocks + 1, block_size, enable_caching=caching)
    arrivals = [
        (0, EngineCoreRequest(seq_id, len(r.token_ids), r.output_tokens, tuple(r.token_ids)))
        for seq_id, r in enumerate(requests)
    ]
    for _, request in arrivals:
        if request.num_prompt_tokens + request.max_tokens - 1 > memory.max_tokens(request):
            raise ValueError(
                f"num_blocks={num_blocks} cannot hold request {request.request_id} alone: its "
                f"{request.num_prompt_tokens}-token prompt and {request.max_tokens} output "
                f"tokens, in blocks of {block_size}"
            )
    prompt_tokens = cached = steps = preemptions = 0
    scheduler = Scheduler(memory, max_num_seqs=max_running)
    for output, _ in run_steps(scheduler, CountingRunner(), arrivals):
        admitted = [new for new in output.scheduled_new_reqs]
        prompt_tokens += sum(len(new.token_ids) for new in admitted)
        cached += sum(new.num_computed_tokens for new in admitted)
        preemptions += len(output.preemptions)
        steps += 1
    return ServeResult(prompt_tokens, cached, memory.prefix_cache_stats, steps, preemptions)

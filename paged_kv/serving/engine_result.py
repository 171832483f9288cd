"""What an offline run produced and saw, step by step: :class:`EngineResult` (lessons 07-11, 14).

:meth:`Engine.run <paged_kv.serving.engine.Engine.run>` serves a list of requests to their end and
returns an :class:`EngineResult`: each request's tokens, per step the queues, the memory and the
tokens each request ran, per request the steps it was admitted, sampled its first token and
finished, the preemptions and the prefix cache's work, and vLLM's metrics by their names
(:meth:`EngineResult.metrics`). :class:`StepRecorder` fills it, one step at a time, from the online
engine's records of each step (its :class:`~paged_kv.serving.outputs.SchedulerOutput`,
:class:`~paged_kv.serving.scheduler.StepResult` and :class:`~paged_kv.serving.metrics.SchedulerStats`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.serving.metrics import LoggingStatLogger, RunMetrics, SchedulerStats
from paged_kv.serving.outputs import SchedulerOutput
from paged_kv.serving.scheduler import PREEMPTIONS, StepResult


@dataclass
class EngineResult:
    """What :meth:`Engine.run` produced and saw.

    ``tokens[request_id]`` is the request's generated token ids. The per-step lists are measured
    after the step's decode, before finished sequences leave: ``running`` sequences, ``waiting``
    requests (arrived, neither running nor swapped out), ``swapped`` sequences (their K/V in host
    memory), ``used_blocks`` (paged: blocks in use; contiguous: the blocks of the budget that the
    reserved slots cover, rounded up), ``held_tokens`` (tokens whose K/V the cache holds),
    ``reserved_tokens`` (paged: used blocks times ``block_size``; contiguous: running times
    ``max_model_len``) and ``utilization``, held / reserved (0.0 when nothing is reserved).
    ``admitted_step`` and ``finished_step`` give, per request, the step it was (last) admitted and
    the step it finished (a swapped-in sequence is not admitted again); ``first_token_step`` the
    step that sampled its first output token (the first time, if it was preempted and started
    over), and :attr:`time_to_first_token` the steps from its arrival to that one, counting both.
    ``scheduled_tokens`` holds one tuple per step of ``(request_id, tokens)`` pairs, what the step
    ran (:attr:`~paged_kv.serving.outputs.SchedulerOutput.num_scheduled_tokens`: the running
    requests in list order, then the new ones), and
    :attr:`tokens_per_step` their sums: with ``max_num_batched_tokens`` none is above it.

    ``preemptions_by_reason`` counts preemptions per way (``"recompute"``, ``"swap"``) and
    :attr:`preemptions` is their total. ``recomputed_tokens`` counts the tokens whose K/V a
    recompute preemption threw away, to be computed again; ``blocks_swapped_out`` and
    ``blocks_swapped_in`` count the blocks' worth of K/V copied to host memory and back.

    ``prefill_tokens_computed`` counts the tokens that prefills ran through the model (a request
    admitted again after a recompute preemption counts again; under a budget that includes the
    generated tokens it prefills when it resumes). With prefix caching,
    ``prefix_cache_queries`` counts the prompt tokens looked up in the cache (every admission's
    whole prompt), ``prefix_cache_hits`` those served from it, and :attr:`hit_rate` is their ratio;
    ``prefill_tokens_computed == prefix_cache_queries - prefix_cache_hits``. Without it, both are 0.
    With prefix caching, running sequences can share blocks, which count once among the
    ``used_blocks`` and ``reserved_tokens`` but once per sequence among the ``held_tokens``, so the
    ``utilization`` can exceed 1.0: the blocks serve more tokens than they hold.

    **vLLM's metrics** (:mod:`paged_kv.serving.metrics`). ``scheduler_stats`` holds one
    :class:`~paged_kv.serving.metrics.SchedulerStats` per step, measured after the step's finished
    requests freed their blocks, as vLLM measures it: ``num_running_reqs``, ``num_waiting_reqs``,
    ``kv_cache_usage`` (blocks in use over the pool, a fraction; a free block that still holds a
    cached prefix counts as free, and a hybrid model's null block is left out), the step's
    ``prefix_cache_stats`` (a resumed request's lookup apart), ``num_preempted_reqs``,
    ``num_generation_tokens``, ``num_prompt_tokens``. The run's totals by vLLM's names are
    :attr:`num_preemptions`, :attr:`prompt_tokens` (each prompt once, when its first token came),
    :attr:`generation_tokens` and :attr:`prefix_cache_stats`, whose ``queries`` and ``hits`` are first
    lookups only, vLLM's ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``, where
    ``prefix_cache_queries`` above counts every lookup: ``prefix_cache_queries ==
    prefix_cache_stats.queries + prefix_cache_stats.preempted_queries`` (and so for the hits).

    Each step is timed on the wall clock: ``step_start_seconds`` and ``step_end_seconds`` are the
    seconds from the run's start to the start and end of each step (its arrivals, schedule, forward
    and update). A request arrives at the start of its arrival step and gets a token at the end of
    the step that samples it, so :attr:`time_to_first_token_seconds` and
    :attr:`e2e_request_latency_seconds` are per request, and ``inter_token_latency_seconds`` holds,
    per token after a request's first, the seconds since the request's previous token
    (``inter_token_latency_steps`` the steps: 1 but after a preemption). :meth:`metrics` gathers
    them all as a :class:`~paged_kv.serving.metrics.RunMetrics` (its Prometheus text, its summary).
    """

    mode: str
    budget_tokens: int
    tokens: dict[Hashable, list[int]] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    held_tokens: list[int] = field(default_factory=list)
    reserved_tokens: list[int] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)
    admitted_step: dict[Hashable, int] = field(default_factory=dict)
    finished_step: dict[Hashable, int] = field(default_factory=dict)
    preemptions_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTIONS, 0))
    recomputed_tokens: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    scheduled_tokens: list[tuple[tuple[Hashable, int], ...]] = field(default_factory=list)
    first_token_step: dict[Hashable, int] = field(default_factory=dict)
    arrival_step: dict[Hashable, int] = field(default_factory=dict)
    scheduler_stats: list[SchedulerStats] = field(default_factory=list)
    step_start_seconds: list[float] = field(default_factory=list)
    step_end_seconds: list[float] = field(default_factory=list)
    inter_token_latency_seconds: list[float] = field(default_factory=list)
    inter_token_latency_steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> list[int]:
        """The tokens each step ran (its prefill chunks and decodes)."""
        return [sum(n for _, n in step) for step in self.scheduled_tokens]

    @property
    def time_to_first_token(self) -> dict[Hashable, int]:
        """Per request, in steps: ``first_token_step - arrival_step + 1`` (1 when the step it arrives
        in samples its first token), in request order."""
        return {r: self.first_token_step[r] - a + 1 for r, a in self.arrival_step.items()}

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hits per prompt token looked up, ``prefix_cache_hits / prefix_cache_queries``
        (0.0 when nothing was looked up)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def preemptions(self) -> int:
        """Preemptions of either way."""
        return sum(self.preemptions_by_reason.values())

    @property
    def steps(self) -> int:
        return len(self.running)

    @property
    def peak_running(self) -> int:
        return max(self.running, default=0)

    @property
    def mean_running(self) -> float:
        return sum(self.running) / self.steps if self.steps else 0.0

    @property
    def mean_utilization(self) -> float:
        """Utilization averaged over the steps that reserve something."""
        busy = [u for u, r in zip(self.utilization, self.reserved_tokens, strict=True) if r]
        return sum(busy) / len(busy) if busy else 0.0

    # ---------------------------------------------------------------- vLLM's metrics (lesson 15)

    @property
    def step_seconds(self) -> list[float]:
        """Each step's wall-clock seconds, from its start to its end."""
        return [
            end - start for start, end in zip(self.step_start_seconds, self.step_end_seconds, strict=True)
        ]

    @property
    def elapsed_seconds(self) -> float:
        """The run's wall-clock seconds, to the end of its last step."""
        return self.step_end_seconds[-1] if self.step_end_seconds else 0.0

    @property
    def time_to_first_token_seconds(self) -> dict[Hashable, float]:
        """Per request, in seconds: from the start of its arrival step to the end of the step that
        sampled its first token (vLLM's ``vllm:time_to_first_token_seconds``), in request order."""
        start, end = self.step_start_seconds, self.step_end_seconds
        return {r: end[self.first_token_step[r]] - start[a] for r, a in self.arrival_step.items()}

    @property
    def e2e_request_latency_seconds(self) -> dict[Hashable, float]:
        """Per request, in seconds: from the start of its arrival step to the end of the step it
        finished in (vLLM's ``vllm:e2e_request_latency_seconds``), in request order."""
        start, end = self.step_start_seconds, self.step_end_seconds
        return {r: end[self.finished_step[r]] - start[a] for r, a in self.arrival_step.items()}

    @property
    def kv_cache_usage(self) -> list[float]:
        """Each step's KV-cache usage, a fraction (vLLM's ``vllm:kv_cache_usage_perc``)."""
        return [stats.kv_cache_usage for stats in self.scheduler_stats]

    @property
    def num_preemptions(self) -> int:
        """Preemptions of either way (vLLM's ``vllm:num_preemptions``): :attr:`preemptions`."""
        return self.preemptions

    @property
    def prompt_tokens(self) -> int:
        """Each request's prompt tokens, counted once, when its first token came (vLLM's
        ``vllm:prompt_tokens``); recomputed tokens are not prompt tokens (:attr:`prefill_tokens_computed`)."""
        return sum(stats.num_prompt_tokens for stats in self.scheduler_stats)

    @property
    def generation_tokens(self) -> int:
        """Tokens sampled, first tokens included (vLLM's ``vllm:generation_tokens``)."""
        return sum(stats.num_generation_tokens for stats in self.scheduler_stats)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The run's prefix-cache lookups as vLLM counts them: ``queries`` and ``hits`` first lookups
        only, a resumed request's apart (``preempted_queries``, ``preempted_hits``)."""
        return sum((stats.prefix_cache_stats for stats in self.scheduler_stats), PrefixCacheStats())

    def metrics(self) -> RunMetrics:
        """The run's metrics by vLLM's names (:class:`~paged_kv.serving.metrics.RunMetrics`): the last
        step's gauges, the run's counters and every latency in seconds."""
        last = self.scheduler_stats[-1] if self.scheduler_stats else SchedulerStats()
        return RunMetrics(
            steps=self.steps,
            elapsed_seconds=self.elapsed_seconds,
            num_requests=len(self.finished_step),
            num_requests_running=last.num_running_reqs,
            num_requests_waiting=last.num_waiting_reqs,
            kv_cache_usage_perc=last.kv_cache_usage,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_stats=self.prefix_cache_stats,
            time_to_first_token_seconds=tuple(self.time_to_first_token_seconds.values()),
            inter_token_latency_seconds=tuple(self.inter_token_latency_seconds),
            e2e_request_latency_seconds=tuple(self.e2e_request_latency_seconds.values()),
            num_computed_prompt_tokens=sum(
                stats.num_computed_prompt_tokens for stats in self.scheduler_stats
            ),
            external_prefix_cache_stats=sum(
                (
                    s.connector_prefix_cache_stats
                    for s in self.scheduler_stats
                    if s.connector_prefix_cache_stats
                ),
                PrefixCacheStats(),
            ),
        )


class StepRecorder:
    """Fills an :class:`EngineResult` one step at a time (see the module).

    ``block_size`` turns tokens into blocks; ``count_prefix_cache`` says whether admissions count
    their lookups (the paged memory with prefix caching); ``stat_logger``, when given, hears every
    step's :class:`~paged_kv.serving.metrics.SchedulerStats` (vLLM's periodic log line). Between
    steps it keeps the tokens the last step sampled, and the step of the last token of each
    request that stopped sampling (preempted, or prefilling again) and will sample again.
    """

    def __init__(
        self,
        result: EngineResult,
        *,
        block_size: int,
        count_prefix_cache: bool,
        stat_logger: LoggingStatLogger | None = None,
    ) -> None:
        self.result, self.block_size, self.count_prefix_cache = result, block_size, count_prefix_cache
        self.stat_logger = stat_logger
        self.last_sampled: Mapping[Hashable, int] = {}
        self.last_finished: frozenset[Hashable] = frozenset()
        self.paused: dict[Hashable, int] = {}

    def record(self, output: SchedulerOutput, step: StepResult, stats: SchedulerStats) -> None:
        """Add one step's counts and its :class:`SchedulerStats` (the online engine's) to the result.
        Per step, the loops here run over the step's events (admissions, first tokens, preemptions,
        finished requests), never over every running request: the step's tokens are counted by
        ``len`` and set operations on its dicts."""
        result, block_size = self.result, self.block_size
        k = output.step
        result.prefill_tokens_computed += step.num_prefill_tokens
        for new in output.scheduled_new_reqs:
            if new.req_id in output.blocks_to_swap_in:
                continue
            result.admitted_step[new.req_id] = k
            if self.count_prefix_cache:
                result.prefix_cache_queries += len(new.token_ids)
                result.prefix_cache_hits += new.num_computed_tokens
        for request_id in step.first_tokens:
            result.first_token_step.setdefault(request_id, k)
        result.scheduled_tokens.append(tuple(output.num_scheduled_tokens.items()))
        for preemption in output.preemptions:
            result.preemptions_by_reason[preemption.way] += 1
            if preemption.way == "swap":
                result.blocks_swapped_out += blocks_for_tokens(preemption.num_tokens, block_size)
            else:
                result.recomputed_tokens += preemption.num_tokens
        result.blocks_swapped_in += sum(
            blocks_for_tokens(new.num_computed_tokens, block_size)
            for new in output.scheduled_new_reqs
            if new.req_id in output.blocks_to_swap_in
        )
        result.running.append(step.num_running)
        result.waiting.append(step.num_waiting)
        result.swapped.append(step.num_swapped)
        result.used_blocks.append(blocks_for_tokens(step.reserved_tokens, block_size))
        result.held_tokens.append(step.held_tokens)
        result.reserved_tokens.append(step.reserved_tokens)
        result.utilization.append(step.held_tokens / step.reserved_tokens if step.reserved_tokens else 0.0)
        for request_id, tokens in step.finished:
            result.tokens[request_id] = list(tokens)
            result.finished_step[request_id] = k
        self._inter_token_latencies(k, step)
        result.scheduler_stats.append(stats)
        if self.stat_logger is not None:
            self.stat_logger.record(stats, result.step_end_seconds[k])

    def _inter_token_latencies(self, k: int, step: StepResult) -> None:
        """Add the inter-token latencies of step ``k``'s tokens: a request that sampled in step ``k - 1``
        too waited one step (the seconds between the two steps' ends); one that comes back after a
        pause waited since its last token; a first token has none. Set operations on the steps'
        dicts, then a loop over the requests that came back."""
        result = self.result
        sampled, before = step.new_tokens, self.last_sampled
        ends = result.step_end_seconds
        for request_id in before.keys() - sampled.keys() - self.last_finished:
            self.paused[request_id] = k - 1
        came_back = sampled.keys() - before.keys()
        continuing = len(sampled) - len(came_back)
        if continuing:
            result.inter_token_latency_seconds.extend([ends[k] - ends[k - 1]] * continuing)
            result.inter_token_latency_steps.extend([1] * continuing)
        if len(came_back) > len(step.first_tokens):
            first = set(step.first_tokens)
            for request_id in came_back - first:
                last = self.paused.pop(request_id)
                result.inter_token_latency_seconds.append(ends[k] - ends[last])
                result.inter_token_latency_steps.append(k - last)
        self.last_sampled = sampled
        self.last_finished = frozenset(request_id for request_id, _ in step.finished)

"""The online engine: requests come and go while it steps (lesson 16; vLLM: ``LLMEngine``).

An :class:`~paged_kv.serving.engine.Engine` serves a list of requests known in advance. A server
does not know its requests in advance: they arrive at any moment, and a client may hang up. vLLM's
``LLMEngine`` (``vllm/v1/engine/llm_engine.py``) is the loop for that, built from the engine's config
(``LLMEngine.from_engine_args``, or from a ``VllmConfig``), and :class:`LLMEngine` has its shape,
three parts in a row:

* the **input processor** (:class:`~paged_kv.serving.input_processor.InputProcessor`) checks each
  request once and settles its ``max_tokens``; :meth:`LLMEngine.add_request` then queues it, or its
  ``n`` children, in the engine core; nothing runs yet;
* the **engine core** (:class:`~paged_kv.serving.engine_core.EngineCore`: the scheduler, the memory,
  the K/V storage and the model runner, built here from the config) runs one step per
  :meth:`LLMEngine.step`;
* the **output processor** (:class:`~paged_kv.serving.output_processor.OutputProcessor`) turns the
  step's new tokens into each request's :class:`~paged_kv.serving.output_processor.RequestOutput`; a
  stop string found there finishes its request in the core at once.

:meth:`LLMEngine.abort_request` finishes requests wherever they are: a running one's blocks go
back to the pool at once, before the next step; a waiting or preempted one just leaves. An id is
refused only while a request with it is live. :meth:`LLMEngine.reset_prefix_cache` is vLLM's
(refused while a request holds a block, unless the running ones are preempted first), and with
``kv_events_config`` on each step's KV-cache events go out on the config's publisher until
:meth:`LLMEngine.shutdown`. Each step leaves vLLM's two records of it:
:attr:`LLMEngine.last_stats`, the scheduler's :class:`~paged_kv.serving.metrics.SchedulerStats`, and
:attr:`LLMEngine.last_iteration`, an :class:`~paged_kv.serving.metrics.IterationStats` of the
wall-clock latencies the step completed (times to first token from each request's arrival,
inter-token latencies, finished requests), which the server's ``/metrics`` turns into histograms. A
preemption logs vLLM V0's warning (the first and every 50th), as the offline engine does. Every
per-request record leaves with its request, so a server's state stays bounded however long it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace

from paged_kv.distributed.kv_events import EventPublisher
from paged_kv.model.causal_lm import CausalLM, as_causal_lm
from paged_kv.serving.config import VllmConfig
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.engine_core import EngineCore
from paged_kv.serving.input_processor import InputProcessor
from paged_kv.serving.kv_cache_planning import KVCacheConfig
from paged_kv.serving.metrics import (
    ENGINE_LOGGER,
    PREEMPTION_MODES,
    PREEMPTION_WARNING,
    PREEMPTION_WARNING_EVERY,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
)
from paged_kv.serving.output_processor import Decode, OutputProcessor, RequestOutput, child_seed
from paged_kv.serving.outputs import SchedulerOutput
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.serving.scheduler import StepResult

_LOGGER = logging.getLogger(ENGINE_LOGGER)


class LLMEngine:
    """An online engine for ``model`` under ``vllm_config`` (see the module); ``kv_cache_config`` is a
    plan made already (``None``: planned now, vLLM's start-up sizing when the config asks for it).

    ``decode`` is the tokenizer's ``decode`` (token ids to text); without it the outputs have no
    text and stop strings are refused. The scheduler, the runner and the K/V storage are built once,
    here, and live as long as this object. ``clock`` gives the wall-clock seconds the latencies are
    measured on. ``kv_event_publisher`` publishes the KV-cache events instead of one made from the
    config's ``kv_events_config``, and outlives the engine.

    Invariant between steps: the engine core holds exactly the unfinished children of the requests
    the output processor tracks, and the pool holds blocks for the running ones only.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        model: CausalLM | object,
        *,
        decode: Decode | None = None,
        clock: Callable[[], float] = time.perf_counter,
        kv_cache_config: KVCacheConfig | None = None,
        kv_event_publisher: EventPublisher | None = None,
    ) -> None:
        self.model = model = as_causal_lm(model)
        self.engine_core = EngineCore(
            vllm_config, model, kv_cache_config, kv_event_publisher=kv_event_publisher
        )
        self.vllm_config = self.engine_core.vllm_config
        """The config, its block count settled."""
        memory = self.engine_core.memory
        self.input_processor = InputProcessor(
            self.vllm_config.model_config,
            memory.max_tokens,
            num_blocks=memory.num_blocks,
            eos_token_ids=model.eos_token_ids,
            can_detokenize=decode is not None,
            scheduling_policy=self.vllm_config.scheduler_config.policy,
        )
        self.output_processor = OutputProcessor(decode)
        self.clock = clock
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_step: tuple[SchedulerOutput, StepResult] | None = None
        """The last step's :class:`SchedulerOutput` and :class:`StepResult`."""
        self.last_stats = SchedulerStats()
        self.last_iteration = IterationStats()
        self._prompt_len: dict[Hashable, int] = {}  # core id -> prompt tokens, while it lives
        self._first_hits: dict[Hashable, int] = {}  # core id -> tokens its first admission hit
        self._arrival: dict[Hashable, float] = {}  # core id -> seconds it arrived
        self._last_token_at: dict[Hashable, float] = {}  # core id -> seconds of its last token

    @classmethod
    def from_engine_args(
        cls,
        model: CausalLM | object,
        engine_args: EngineArgs,
        *,
        decode: Decode | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> LLMEngine:
        """An engine built from ``engine_args`` (vLLM: ``LLMEngine.from_engine_args``).

        Raises:
            ValueError: a bad setting, named (:meth:`EngineArgs.create_engine_config
                <paged_kv.serving.engine_args.EngineArgs.create_engine_config>`).
        """
        model = as_causal_lm(model)
        return cls(engine_args.create_engine_config(model), model, decode=decode, clock=clock)

    # ------------------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: Hashable,
        prompt: Sequence[int] | EngineCoreRequest,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request (its ``n`` children) to be served from the next step.

        ``prompt`` is the prompt's token ids, checked here by the input processor with
        ``sampling_params`` (default ``SamplingParams()``), ``arrival_time`` (default: now, on
        :attr:`clock`), ``priority``, ``cache_salt`` and ``lora_name`` (see
        :class:`~paged_kv.serving.request.EngineCoreRequest`), or an ``EngineCoreRequest`` the input
        processor made already (vLLM's ``add_request`` takes either), then queued as it is.

        Raises:
            ValueError: the input processor refuses the request; or ``request_id``, or one of its
                children's core ids, names a live request. Nothing is queued.
        """
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
            if request.request_id != request_id:
                raise ValueError(
                    f"request_id {request_id!r} differs from its request's {request.request_id!r}"
                )
        else:
            arrived = self.clock() if arrival_time is None else arrival_time
            request = self.input_processor.process_inputs(
                request_id,
                prompt,
                sampling_params,
                arrived,
                priority=priority,
                cache_salt=cache_salt,
                lora_name=lora_name,
            )
        params = request.sampling_params
        if self.output_processor.in_use(request_id, params.n):
            raise ValueError(f"request_id {request_id!r} is in use")
        children = self.output_processor.add_request(
            request_id, request.prompt_token_ids, params, self.model.eos_token_ids
        )
        arrived = self.clock() if request.arrival_time is None else request.arrival_time
        for i, child in enumerate(children):
            child_params = params if params.n == 1 else replace(params, n=1, seed=child_seed(params.seed, i))
            self.engine_core.add_request(replace(request, request_id=child, sampling_params=child_params))
            self._prompt_len[child], self._arrival[child] = request.num_prompt_tokens, arrived

    def abort_request(self, request_ids: Hashable | Iterable[Hashable]) -> list[RequestOutput]:
        """Finish ``request_ids`` now (one id, or several): every block of their running children
        goes back to the pool before this returns; waiting or preempted children just leave. Unknown
        or finished ids are skipped. Returns the requests' last outputs, ``finish_reason`` ``"abort"``.

        An abort is recorded as a step is: :attr:`last_stats` is the pool as the abort left it (no
        tokens, no lookups), so a stat logger called now sees the blocks come back. It finishes no
        request in :attr:`last_iteration`: as vLLM's ``OutputProcessor.abort_requests``, which drops a
        request's state without recording finished stats, an abort from the front end (a client
        that hung up) is not counted in ``vllm:request_success``.
        """
        ids = [request_ids] if isinstance(request_ids, (str, int)) else list(request_ids)
        children = [child for request_id in ids for child in self.output_processor.children(request_id)]
        if not children:
            return []
        self.engine_core.abort_requests(children)
        outputs, _ = self.output_processor.process_outputs({}, aborted=children)
        self.last_stats = self._pool_stats()
        self.last_iteration = IterationStats()
        self._forget(children)
        return outputs

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix; whether it did (vLLM: ``LLMEngine.reset_prefix_cache``).

        Refused (``False``, nothing changes) while a request holds a block; with
        ``reset_running_requests`` the running requests are preempted first (by recompute: they
        resume in a later step with the same tokens) and it succeeds. Its ``AllBlocksCleared`` is
        published at once. ``reset_connector``: there is no connector, nothing more to reset.
        Call it between steps.
        """
        return self.engine_core.reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self) -> None:
        """End the engine (vLLM: ``LLMEngine``'s ``shutdown`` of its core): every request forgotten,
        the event publisher made from the config shut down. Idempotent."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        """Whether a request waits, runs or is swapped out."""
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """The requests (as the client sent them, not their children) not yet finished."""
        return len(self.output_processor)

    # ------------------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one step of the engine core; return the outputs of the requests it moved.

        A step with nothing to run schedules nothing and returns ``[]`` (the offline engine counts
        it: requests arrive at steps there).
        """
        output, step = self.engine_core.step()
        now = self.clock()
        self.num_steps += 1
        self.last_step = (output, step)
        finished = [request_id for request_id, _ in step.finished]
        self._note_admissions(output)  # before the outputs, which carry the prefix-cache hits
        outputs, stopped = self.output_processor.process_outputs(
            step.new_tokens, finished, logprobs=step.logprobs, prompt_logprobs=step.prompt_logprobs
        )
        if stopped:  # a stop string ended them: their blocks go now
            self.engine_core.abort_requests(stopped)
        self.last_stats = self._scheduler_stats(output, step)
        self.last_iteration = self._iteration_stats(step, now)
        self._forget(finished + stopped)
        return outputs

    # ------------------------------------------------------------------------------ the records

    def _note_admissions(self, output: SchedulerOutput) -> None:
        """Record the prefix-cache hit of each request the step admitted for the first time."""
        for new in output.scheduled_new_reqs:
            if new.req_id not in output.blocks_to_swap_in and new.req_id not in self._first_hits:
                self._first_hits[new.req_id] = new.num_computed_tokens  # its first admission only
                self.output_processor.note_cached_tokens(new.req_id, new.num_computed_tokens)

    def _scheduler_stats(self, output: SchedulerOutput, step: StepResult) -> SchedulerStats:
        """The step's :class:`SchedulerStats`, measured after its finished requests left."""
        prompt_tokens = sum(self._prompt_len[r] for r in step.first_tokens)
        cached_tokens = sum(self._first_hits.get(r, 0) for r in step.first_tokens)
        for preemption in output.preemptions:
            if self.num_preemptions % PREEMPTION_WARNING_EVERY == 0:  # V0's rule: the 1st, the 51st...
                _LOGGER.warning(
                    PREEMPTION_WARNING,
                    preemption.request_id,
                    PREEMPTION_MODES[preemption.way],
                    self.num_preemptions + 1,
                )
            self.num_preemptions += 1
        connector = self.engine_core.scheduler.connector
        external = None if connector is None else connector.make_connector_prefix_cache_stats()
        return self._pool_stats(
            prefix_cache_stats=self.engine_core.memory.make_prefix_cache_stats(),
            connector_prefix_cache_stats=external,
            num_preempted_reqs=len(output.preemptions),
            num_generation_tokens=len(step.new_tokens),
            num_prompt_tokens=prompt_tokens,
            num_cached_prompt_tokens=cached_tokens,
        )

    def _pool_stats(self, **counts: object) -> SchedulerStats:
        """:class:`SchedulerStats` of the queues and the pool as they are now, with ``counts``."""
        scheduler = self.engine_core.scheduler
        return SchedulerStats(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            kv_cache_usage=scheduler.memory.usage,
            num_swapped_reqs=len(scheduler.swapped),
            **counts,
        )

    def _iteration_stats(self, step: StepResult, now: float) -> IterationStats:
        """The latencies the step completed, in seconds on :attr:`clock`."""
        first = set(step.first_tokens)
        ttft, itl = [], []
        for request_id in step.new_tokens:
            if request_id in first:
                ttft.append(now - self._arrival[request_id])
            elif request_id in self._last_token_at:
                itl.append(now - self._last_token_at[request_id])
            self._last_token_at[request_id] = now
        done = self._finished_stats(now)
        return IterationStats(
            num_generation_tokens=len(step.new_tokens),
            num_prompt_tokens=self.last_stats.num_prompt_tokens,
            time_to_first_tokens_iter=tuple(ttft),
            inter_token_latencies_iter=tuple(itl),
            finished_requests=done,
        )

    def _finished_stats(self, now: float) -> tuple[FinishedRequestStats, ...]:
        """The children the output processor just finished, with their seconds since arrival."""
        return tuple(
            FinishedRequestStats(reason, now - self._arrival[child], num_tokens)
            for child, reason, num_tokens in self.output_processor.last_finished
            if child in self._arrival
        )

    def _forget(self, children: Iterable[Hashable]) -> None:
        """Drop the measuring state of children that left (a server runs for ever)."""
        for child in children:
            for record in (self._prompt_len, self._first_hits, self._arrival, self._last_token_at):
                record.pop(child, None)

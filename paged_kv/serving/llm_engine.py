"""The online engine: requests come and go while it steps (lesson 15; vLLM: ``LLMEngine``).

An :class:`~paged_kv.serving.engine.Engine` serves a list of requests known in advance. A server
does not know its requests in advance: they arrive at any moment, and a client may hang up. vLLM's
``LLMEngine`` (``vllm/v1/engine/llm_engine.py``) is the loop for that, and :class:`LLMEngine` has
its shape:

* :meth:`LLMEngine.add_request` checks a request as vLLM's input processor does (its token ids,
  its length against ``max_model_len``, in vLLM's words; whether the pool could hold it alone)
  and queues it, or its ``n`` children, in the scheduler; nothing runs yet;
* :meth:`LLMEngine.step` runs one step of the engine core (``scheduler.schedule()``,
  ``runner.execute_model(...)``, ``scheduler.update_from_output(...)``: exactly the step of
  :meth:`Engine.run <paged_kv.serving.engine.Engine.run>`, which runs on this class), then gives
  the new tokens to the :class:`~paged_kv.serving.output_processor.OutputProcessor` and returns
  each request's :class:`~paged_kv.serving.output_processor.RequestOutput`; a stop string found
  there finishes its request in the core at once;
* :meth:`LLMEngine.abort_request` finishes requests wherever they are: a running one's blocks go
  back to the pool at once, before the next step; a waiting or preempted one just leaves;
* :meth:`LLMEngine.has_unfinished_requests` says whether stepping has anything to do.

Each step leaves vLLM's two records of it: :attr:`LLMEngine.last_stats`, the scheduler's
:class:`~paged_kv.serving.metrics.SchedulerStats`, and :attr:`LLMEngine.last_iteration`, an
:class:`~paged_kv.serving.metrics.IterationStats` of the wall-clock latencies the step completed
(times to first token from each request's arrival, inter-token latencies, finished requests), which
the server's ``/metrics`` turns into histograms. A preemption logs vLLM V0's warning (the first and
every 50th), as the offline engine does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import replace

from paged_kv.model.generation import is_token
from paged_kv.serving.metrics import (
    ENGINE_LOGGER,
    PREEMPTION_MODES,
    PREEMPTION_WARNING,
    PREEMPTION_WARNING_EVERY,
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
)
from paged_kv.serving.output_processor import Decode, OutputProcessor, RequestOutput, child_request_ids
from paged_kv.serving.outputs import SchedulerOutput
from paged_kv.serving.request import SchedulerRequest
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.serving.scheduler import StepResult
from paged_kv.validate import check_hashable

_LOGGER = logging.getLogger(ENGINE_LOGGER)


class LLMEngine:
    """An online engine over ``engine``'s model, memory and settings (see the module): ``engine`` is
    an :class:`~paged_kv.serving.engine.Engine` (not imported here: the engine imports this module).

    ``decode`` is the tokenizer's ``decode`` (token ids to text); without it the outputs have no
    text and stop strings are refused. The scheduler, the runner and the K/V storage are built once,
    here, and live as long as this object. ``clock`` gives the wall-clock seconds the latencies are
    measured on.

    Invariant between steps: the scheduler holds exactly the unfinished children of the requests
    the output processor tracks, and the pool holds blocks for the running ones only.
    """

    def __init__(self, engine, *, decode: Decode | None = None, clock=time.perf_counter) -> None:
        self.engine = engine
        self.scheduler, self.runner = engine._new_step_loop()
        self.output_processor = OutputProcessor(decode)
        self.eos_token_ids = frozenset(getattr(engine.model, "eos_token_ids", ()))
        self.clock = clock
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_step: tuple[SchedulerOutput, StepResult] | None = None
        """The last step's :class:`SchedulerOutput` and :class:`StepResult`."""
        self.last_stats = SchedulerStats()
        self.last_iteration = IterationStats()
        memory = self.scheduler.memory
        self._prefix_stats = memory.make_prefix_cache_stats if engine.enable_prefix_caching else None  # type: ignore[attr-defined]
        self._prompt_len: dict[Hashable, int] = {}  # core id -> prompt tokens, while it lives
        self._first_hits: dict[Hashable, int] = {}  # core id -> tokens its first admission hit
        self._arrival: dict[Hashable, float] = {}  # core id -> seconds it arrived
        self._last_token_at: dict[Hashable, float] = {}  # core id -> seconds of its last token

    # ------------------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (its ``n`` children) to be served from the next step.

        ``sampling_params`` defaults to ``SamplingParams()`` (vLLM's defaults: 16 tokens,
        temperature 1.0). ``max_tokens`` is capped at ``max_model_len`` less the prompt, as vLLM
        caps it. ``arrival_time`` (default: now, on :attr:`clock`) starts its time to first token.

        Raises:
            ValueError: ``request_id`` (or a child's id) is in use, or was used, or is not
                hashable; the prompt is empty, holds something that is not a token id of the
                model, or leaves no room for one output token within ``max_model_len`` (vLLM's
                message); the memory could not hold the request alone; stop strings without
                ``decode``. Nothing is queued.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {params!r}")
        prompt = self.check_prompt(prompt_token_ids)
        check_hashable("request_id", request_id)
        self.check_request_id(request_id, params.n)
        max_tokens = min(params.max_tokens, self.engine.max_model_len - len(prompt))
        self.engine.check_request(request_id, prompt, max_tokens)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        children = self.output_processor.add_request(request_id, prompt, params, self.eos_token_ids)
        arrived = self.clock() if arrival_time is None else arrival_time
        for i, child in enumerate(children):
            child_params = params if params.n == 1 else replace(params, n=1, seed=_child_seed(params.seed, i))
            self.scheduler.add_request(
                SchedulerRequest(child, len(prompt), max_tokens, tuple(prompt), stop, child_params)
            )
            self._prompt_len[child], self._arrival[child] = len(prompt), arrived

    def check_request_id(self, request_id: Hashable, n: int = 1) -> None:
        """Whether ``request_id`` and its ``n`` children's core ids are free: the scheduler refuses
        an id it was ever given (a child ``f"{i}_{request_id}"`` may collide with another request).

        Raises:
            ValueError: one of them is in use or was used.
        """
        used = self.scheduler._ids  # every core id the scheduler was given
        if request_id in self.output_processor or not used.isdisjoint(child_request_ids(request_id, n)):
            raise ValueError(f"request_id {request_id!r} is in use")

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """``prompt_token_ids`` as a list, if the engine can serve it (vLLM's input processor).

        Raises:
            ValueError: empty, not token ids of the model, or too long for ``max_model_len``, in
                vLLM's words.
        """
        if (
            isinstance(prompt_token_ids, str)
            or not isinstance(prompt_token_ids, Sequence)
            or not prompt_token_ids
        ):
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.engine.model.config.vocab_size
        if not all(is_token(t, vocab) for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must hold token ids in [0, {vocab})")
        length, limit = len(prompt_token_ids), self.engine.max_model_len
        if length > limit:
            raise ValueError(
                f"The decoder prompt (length {length}) is longer than the maximum model length of "
                f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        if length == limit:
            raise ValueError(
                f"The decoder prompt (length {length}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                "output tokens)."
            )
        return [int(t) for t in prompt_token_ids]

    def abort_request(self, request_ids: Hashable | Iterable[Hashable]) -> list[RequestOutput]:
        """Finish ``request_ids`` now (one id, or several): every block of their running children
        goes back to the pool before this returns; waiting or preempted children just leave. Unknown
        or finished ids are skipped. Returns the requests' last outputs, ``finish_reason`` ``"abort"``.

        An abort is recorded as a step is: :attr:`last_stats` is the pool as the abort left it (no
        tokens, no lookups) and :attr:`last_iteration` holds the aborted requests as finished ones,
        so a stat logger called now sees the blocks come back and counts the aborts (vLLM counts
        them under ``finished_reason="abort"``).
        """
        ids = [request_ids] if isinstance(request_ids, (str, int)) else list(request_ids)
        children = [child for request_id in ids for child in self.output_processor.children(request_id)]
        if not children:
            return []
        self.scheduler.finish_requests(children)
        outputs, _ = self.output_processor.process_outputs({}, aborted=children)
        now = self.clock()
        self.last_stats = self._pool_stats()
        self.last_iteration = IterationStats(finished_requests=self._finished_stats(now))
        self._forget(children)
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Whether a request waits, runs or is swapped out."""
        return self.scheduler.has_unfinished_requests

    def get_num_unfinished_requests(self) -> int:
        """The requests (as the client sent them, not their children) not yet finished."""
        return len(self.output_processor)

    # ------------------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one step of the engine core; return the outputs of the requests it moved.

        A step with nothing to run schedules nothing and returns ``[]`` (the offline engine counts
        it: requests arrive at steps there).
        """
        scheduler = self.scheduler
        output = scheduler.schedule()
        step = scheduler.update_from_output(output, self.runner.execute_model(output))
        now = self.clock()
        self.num_steps += 1
        self.last_step = (output, step)
        finished = [request_id for request_id, _ in step.finished]
        self._note_admissions(output)  # before the outputs, which carry the prefix-cache hits
        outputs, stopped = self.output_processor.process_outputs(step.new_tokens, finished)
        if stopped:  # a stop string ended them: their blocks go now
            scheduler.finish_requests(stopped)
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
        return self._pool_stats(
            prefix_cache_stats=SchedulerStats().prefix_cache_stats
            if self._prefix_stats is None
            else self._prefix_stats(),
            num_preempted_reqs=len(output.preemptions),
            num_generation_tokens=len(step.new_tokens),
            num_prompt_tokens=prompt_tokens,
            num_cached_prompt_tokens=cached_tokens,
        )

    def _pool_stats(self, **counts: object) -> SchedulerStats:
        """:class:`SchedulerStats` of the queues and the pool as they are now, with ``counts``."""
        scheduler = self.scheduler
        return SchedulerStats(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            kv_cache_usage=scheduler.memory.usage,  # type: ignore[attr-defined]
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


def _child_seed(seed: int | None, index: int) -> int | None:
    """Child ``index``'s seed: ``seed + index``, as vLLM's ``ParentRequest`` gives it."""
    return None if seed is None else seed + index

"""The engine behind a server: asyncio in front, one background loop stepping (lesson 15; vLLM: ``AsyncLLM``).

A server handles many clients at once on one event loop, and a model step takes tens of
milliseconds of CPU or GPU: stepping on the event loop would stall every client. vLLM's
``AsyncLLM`` (``vllm/v1/engine/async_llm.py``) runs the engine core in another process and talks
to it through queues; :class:`AsyncLLM` keeps the same shape in one process:

* :meth:`AsyncLLM.generate` checks a request on the event loop (bad input fails there, before
  anything is queued), queues it for the engine, and yields its
  :class:`~paged_kv.serving.output_processor.RequestOutput` objects as they come, an async iterator
  ending with the finished one;
* one background task, :meth:`AsyncLLM.run_engine_loop`, hands each step to a worker thread
  (``asyncio.to_thread``): the thread applies the queued requests and aborts, steps the
  :class:`~paged_kv.serving.llm_engine.LLMEngine`, takes a snapshot of the pool, and the loop
  hands the outputs to each request's queue. Only that thread touches the engine;
* a client that stops iterating (it disconnected, or the task was cancelled) aborts its request:
  the abort is applied before the next step, so the request's blocks are back in the pool before
  anything else runs. :meth:`AsyncLLM.abort` does the same by request id.

:attr:`AsyncLLM.kv_view` is the pool as the last step left it (a :class:`KVCacheView`), for the
live page; :meth:`AsyncLLM.stat_loggers` get every step's stats (the Prometheus metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field

from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.metrics import IterationStats, SchedulerStats
from paged_kv.serving.output_processor import RequestOutput
from paged_kv.serving.sampling_params import SamplingParams

StatLogger = Callable[[SchedulerStats, IterationStats], None]
"""Called after every step with its two records (vLLM: ``StatLoggerBase.record``)."""


@dataclass(frozen=True)
class KVCacheView:
    """The pool as a step left it, for a picture: ``snapshot`` (None for a memory that has none), the
    step count, the usage (vLLM's ``kv_cache_usage_perc``, a fraction), the requests running and
    waiting, each running request's tokens, and the prefix cache's queries and hits so far."""

    snapshot: AllocatorSnapshot | None
    step: int = 0
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_tokens: dict[Hashable, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error: no request can be served (vLLM's name)."""


class AsyncLLM:
    """An :class:`~paged_kv.serving.llm_engine.LLMEngine` served to asyncio clients (see the module).

    Create it inside a running event loop (or call :meth:`start` from one); :meth:`shutdown` stops
    the loop and aborts what is left, leaving every block free.
    """

    def __init__(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self.stat_loggers: list[StatLogger] = []
        self._adds: list[tuple[Hashable, list[int], SamplingParams, float]] = []
        self._aborts: list[Hashable] = []
        self._lock = threading.Lock()  # guards the two lists above: the loop appends, the thread takes
        self._queues: dict[Hashable, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._queries = self._hits = 0
        self.kv_view = self._view()
        self.errored: BaseException | None = None

    # ------------------------------------------------------------------------------ the front

    def start(self) -> None:
        """Start the engine loop on the running event loop (generate starts it when needed)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self.run_engine_loop())

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: Hashable | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Serve one request; yield its outputs as the steps produce them, the last one finished.

        Raises:
            ValueError: the request is bad (see :meth:`LLMEngine.add_request
                <paged_kv.serving.llm_engine.LLMEngine.add_request>`), raised before anything is queued.
            EngineDeadError: the engine loop failed.
        """
        if self.errored is not None:
            raise EngineDeadError("the engine loop failed") from self.errored
        params = SamplingParams() if sampling_params is None else sampling_params
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        prompt = self.check(request_id, prompt_token_ids, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._adds.append((request_id, prompt, params, self.llm_engine.clock()))
        self.start()
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, ValueError):  # refused by the engine after all
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop failed") from item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the client went away, or the loop failed: let its blocks go
                self.abort(request_id)

    def check(
        self, request_id: Hashable, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> list[int]:
        """What :meth:`generate` checks before queueing, without touching the engine's state.

        Raises:
            ValueError: as :meth:`LLMEngine.add_request <paged_kv.serving.llm_engine.LLMEngine.add_request>`.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {params!r}")
        engine = self.llm_engine
        prompt = engine.check_prompt(prompt_token_ids)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is in use")
        if params.stop and engine.output_processor.decode is None:
            raise ValueError("stop strings need a tokenizer: give the engine a decode function")
        max_tokens = min(params.max_tokens, engine.engine.max_model_len - len(prompt))
        engine.engine.check_request(request_id, prompt, max_tokens)
        return prompt

    def abort(self, request_id: Hashable) -> None:
        """Abort ``request_id``: its blocks are freed before the next step (a no-op once it finished)."""
        with self._lock:
            self._aborts.append(request_id)
        if self._wake is not None:
            self._wake.set()

    @property
    def num_unfinished_requests(self) -> int:
        """Requests the clients are waiting on."""
        return len(self._queues)

    async def shutdown(self) -> None:
        """Stop the engine loop; abort every request left (their blocks freed)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a failure is kept in errored
                await self._task
            self._task = None
        with self._lock:
            self._adds.clear()
            self._aborts.clear()
        engine = self.llm_engine
        engine.abort_request(engine.output_processor.request_ids())
        self.kv_view = self._view()

    # ------------------------------------------------------------------------------ the loop

    async def run_engine_loop(self) -> None:
        """Step while there is work, in a worker thread; sleep until a request or an abort comes."""
        wake = self._wake
        try:
            while True:
                await wake.wait()
                wake.clear()
                while True:
                    outputs = await asyncio.to_thread(self._step)
                    for output in outputs:
                        queue = self._queues.get(output.request_id)
                        if queue is not None:
                            queue.put_nowait(output)
                    if not self.llm_engine.has_unfinished_requests() and not self._pending():
                        break
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the engine failed: every client hears of it
            self.errored = error
            for queue in self._queues.values():
                queue.put_nowait(error)
            raise

    def _pending(self) -> bool:
        with self._lock:
            return bool(self._adds or self._aborts)

    def _step(self) -> list[RequestOutput]:
        """In the worker thread: apply the queued aborts and requests, then step if there is work."""
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        engine = self.llm_engine
        outputs: list[RequestOutput] = []
        if aborts:
            engine.abort_request(aborts)  # their blocks go before the step
        for request_id, prompt, params, arrived in adds:
            if request_id in aborts:
                continue
            try:
                engine.add_request(request_id, prompt, params, arrival_time=arrived)
            except ValueError as error:  # checked on the loop already: only a race gets here
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(error)
        if engine.has_unfinished_requests():
            outputs = engine.step()
            stats = engine.last_stats.prefix_cache_stats
            self._queries, self._hits = self._queries + stats.queries, self._hits + stats.hits
            for logger in self.stat_loggers:
                logger(engine.last_stats, engine.last_iteration)
        self.kv_view = self._view()
        return outputs

    def _view(self) -> KVCacheView:
        engine = self.llm_engine
        scheduler = engine.scheduler
        memory = scheduler.memory
        manager = getattr(memory, "manager", None)
        snapshot = manager.snapshot() if manager is not None and hasattr(manager, "snapshot") else None
        return KVCacheView(
            snapshot,
            engine.num_steps,
            memory.usage,  # type: ignore[attr-defined]
            len(scheduler.running),
            len(scheduler.waiting),
            {r.request_id: r.num_tokens for r in scheduler.running},
            self._queries,
            self._hits,
        )

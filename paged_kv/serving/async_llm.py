"""The engine behind a server: asyncio in front, one background loop stepping (lesson 16; vLLM: ``AsyncLLM``).

A server handles many clients at once on one event loop, and a model step takes tens of
milliseconds of CPU or GPU: stepping on the event loop would stall every client. vLLM's
``AsyncLLM`` (``vllm/v1/engine/async_llm.py``) runs the engine core in another process and talks
to it through queues; :class:`AsyncLLM` keeps the same shape in one process:

* :meth:`AsyncLLM.generate` checks a request on the event loop, through the engine's input
  processor (bad input fails there, before anything is queued), queues it for the engine, and
  yields its
  :class:`~paged_kv.serving.output_processor.RequestOutput` objects as they come, an async iterator
  ending with the finished one;
* one background task, :meth:`AsyncLLM.run_engine_loop`, hands each step to a worker thread
  (``asyncio.to_thread``): the thread applies the queued requests and aborts, steps the
  :class:`~paged_kv.serving.llm_engine.LLMEngine`, takes a snapshot of the pool, and the loop
  hands the outputs to each request's queue. Only that thread touches the engine;
* a client that stops iterating (it disconnected, or the task was cancelled) aborts its request:
  the abort is applied before the next step, so the request's blocks are back in the pool before
  anything else runs. :meth:`AsyncLLM.abort` does the same by request id, and the request's
  iterator ends with its last output, ``finish_reason`` ``"abort"``, as vLLM's does.

:meth:`AsyncLLM.reset_prefix_cache` (vLLM's, behind the server's ``POST /reset_prefix_cache``) runs
in the worker thread between two steps, as every change to the engine does.

:attr:`AsyncLLM.kv_view` is the pool as the last step left it (a :class:`KVCacheView`), for the
live page; :meth:`AsyncLLM.stat_loggers` get every step's stats (the Prometheus metrics). A request's
id is refused only while its client listens; everything kept per request leaves with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field

from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.model.causal_lm import CausalLM
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.metrics import IterationStats, SchedulerStats
from paged_kv.serving.output_processor import Decode, RequestOutput
from paged_kv.serving.request import EngineCoreRequest
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


@dataclass(frozen=True)
class _Refused:
    """A request the engine refused when the loop applied it (its client raises ``error``), apart
    from an error of the engine itself, which kills the loop."""

    error: ValueError


_Queue = asyncio.Queue  # a client's queue: its outputs, a refusal, or the engine's failure


class AsyncLLM:
    """An :class:`~paged_kv.serving.llm_engine.LLMEngine` served to asyncio clients (see the module).

    Create it inside a running event loop (or call :meth:`start` from one); :meth:`shutdown` stops
    the loop and aborts what is left, leaving every block free.

    Requests and aborts reach the engine in the order the clients made them, each tied to its
    client's queue: an abort ends the request its own client started, never a later request that
    took the same id, and the engine's outputs go to the queue of the client whose request is live.
    """

    def __init__(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self.vllm_config = llm_engine.vllm_config
        self.stat_loggers: list[StatLogger] = []
        self._ops: list[tuple[EngineCoreRequest | Hashable, _Queue]] = []  # requests and aborts, in order
        self._lock = threading.Lock()  # guards the list above: the loop appends, the thread takes
        self._queues: dict[Hashable, _Queue] = {}  # the listening clients, by request id
        self._routes: dict[Hashable, _Queue] = {}  # the engine's live requests' clients (the thread's)
        self._engine_lock = threading.Lock()  # held by whoever touches the engine: a step, shutdown
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._in_flight: asyncio.Future | None = None  # the step the worker thread runs, until delivered
        self._ids = itertools.count()
        self._queries = self._hits = 0
        self.kv_view = self._view()
        self.errored: BaseException | None = None

    @classmethod
    def from_engine_args(
        cls, model: CausalLM | object, engine_args: EngineArgs, *, decode: Decode | None = None
    ) -> AsyncLLM:
        """An asyncio engine built from ``engine_args`` (vLLM: ``AsyncLLM.from_engine_args``)."""
        return cls(LLMEngine.from_engine_args(model, engine_args, decode=decode))

    # ------------------------------------------------------------------------------ the front

    def start(self) -> None:
        """Start the engine loop on the running event loop (generate starts it when needed)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self.run_engine_loop())

    async def generate(
        self,
        prompt: Sequence[int] | EngineCoreRequest,
        sampling_params: SamplingParams | None = None,
        request_id: Hashable | None = None,
        **options: object,
    ) -> AsyncIterator[RequestOutput]:
        """Serve one request; yield its outputs as the steps produce them, the last one finished.

        ``prompt`` is the prompt's token ids, checked here by the engine's input processor with
        ``sampling_params`` and ``request_id`` (``None``: a fresh one); or a request :meth:`check`
        made already, taken as it is (vLLM's ``AsyncLLM.add_request`` takes an
        ``EngineCoreRequest`` the same way), so that a server checks a request once. ``options``
        are :meth:`check`'s: ``priority``, ``cache_salt``, ``lora_name``.

        Raises:
            ValueError: the request is bad (see :meth:`LLMEngine.add_request
                <paged_kv.serving.llm_engine.LLMEngine.add_request>`), or a processed request comes
                with parameters or an id of its own; raised before anything is queued.
            EngineDeadError: the engine loop failed.
        """
        if self.errored is not None:
            raise EngineDeadError("the engine loop failed") from self.errored
        if isinstance(prompt, EngineCoreRequest):
            if sampling_params is not None or request_id is not None or options:
                raise ValueError("a processed request carries its own sampling_params and request_id")
            request, request_id = prompt, prompt.request_id
            if request_id in self._queues:
                raise ValueError(f"request_id {request_id!r} is in use")
        else:
            request_id = f"req-{next(self._ids)}" if request_id is None else request_id
            request = self.check(request_id, prompt, sampling_params, **options)
        queue: _Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(request, queue)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, _Refused):  # refused by the engine after all
                    raise item.error
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop failed") from item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the client went away, or the loop failed: let its blocks go
                self.abort(request_id)
            del self._queues[request_id]

    def check(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> EngineCoreRequest:
        """What :meth:`generate` checks before queueing, without touching the engine's state: the
        engine's input processor, and that no client is waiting on ``request_id``; the request as the
        engine core will take it.

        Raises:
            ValueError: as :meth:`InputProcessor.process_inputs
                <paged_kv.serving.input_processor.InputProcessor.process_inputs>`, or the id is in use.
        """
        engine = self.llm_engine
        request = engine.input_processor.process_inputs(
            request_id,
            prompt_token_ids,
            params,
            engine.clock(),
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is in use")
        return request

    def abort(self, request_id: Hashable) -> None:
        """Abort ``request_id``: its blocks are freed before the next step, and its client's iterator
        ends with the ``"abort"`` output (a no-op once it finished, or for an unknown id)."""
        queue = self._queues.get(request_id)
        if queue is not None:
            self._submit(request_id, queue)

    def _submit(self, op: EngineCoreRequest | Hashable, queue: _Queue) -> None:
        """Queue a request (an :class:`EngineCoreRequest`) or the abort of one (its id) for the engine
        thread, with the queue of the client it belongs to; wake the loop."""
        with self._lock:
            self._ops.append((op, queue))
        self.start()
        self._wake.set()

    @property
    def num_unfinished_requests(self) -> int:
        """Requests the clients are waiting on."""
        return len(self._queues)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached prefix, in the engine's thread between two steps; whether it did (vLLM:
        ``AsyncLLM.reset_prefix_cache``; see :meth:`LLMEngine.reset_prefix_cache
        <paged_kv.serving.llm_engine.LLMEngine.reset_prefix_cache>`). Requests it preempts go on
        in the next steps, their clients none the wiser but for the wait.

        Raises:
            EngineDeadError: the engine loop failed.
        """
        if self.errored is not None:
            raise EngineDeadError("the engine loop failed") from self.errored
        return await asyncio.to_thread(self._reset_prefix_cache, reset_running_requests, reset_connector)

    def _reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> bool:
        with self._engine_lock:
            reset = self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)
            self.kv_view = self._view()
        return reset

    async def shutdown(self) -> None:
        """Stop the engine loop; abort every request left (their blocks freed, their iterators ended
        with an ``"abort"`` output). After an engine failure the running requests' blocks are freed. The
        engine is shut down last (:meth:`LLMEngine.shutdown
        <paged_kv.serving.llm_engine.LLMEngine.shutdown>`: its event publisher closed)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a failure is kept in errored
                await self._task
            self._task = None
        if self._in_flight is not None:  # cancelling the loop does not stop its step: let it end
            try:
                self._deliver(await self._in_flight)
            except Exception as error:
                self.errored = self.errored or error
            self._in_flight = None
        with self._lock:
            self._ops.clear()
        self._deliver(await asyncio.to_thread(self._abort_all))
        await asyncio.to_thread(self.llm_engine.shutdown)  # a publisher's thread is joined: not on the loop

    def _abort_all(self) -> list[tuple[_Queue, RequestOutput]]:
        engine = self.llm_engine
        with self._engine_lock:
            if self.errored is not None:  # the step broke off: the scheduler may be mid-step
                engine.engine_core.free_all()
                outputs = []
            else:
                outputs = engine.abort_request(engine.output_processor.request_ids())
            self.kv_view = self._view()
            items = self._routed(outputs)
            self._routes.clear()
        return items

    def _deliver(self, items: Sequence[tuple[_Queue, RequestOutput | _Refused]]) -> None:
        """On the event loop: hand each item to its client's queue (a client that left reads none)."""
        for queue, item in items:
            queue.put_nowait(item)

    # ------------------------------------------------------------------------------ the loop

    async def run_engine_loop(self) -> None:
        """Step while there is work, in a worker thread; sleep until a request or an abort comes."""
        wake = self._wake
        try:
            while True:
                await wake.wait()
                wake.clear()
                while True:
                    self._in_flight = asyncio.ensure_future(asyncio.to_thread(self._step))
                    items = await asyncio.shield(self._in_flight)  # a cancel leaves it to shutdown
                    self._in_flight = None
                    self._deliver(items)
                    if not self.llm_engine.has_unfinished_requests() and not self._pending():
                        break
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the engine failed: every client hears of it
            self.errored, self._in_flight = error, None
            for queue in self._queues.values():
                queue.put_nowait(error)
            raise

    def _pending(self) -> bool:
        with self._lock:
            return bool(self._ops)

    def _step(self) -> list[tuple[_Queue, RequestOutput | _Refused]]:
        """In the worker thread: apply the queued requests and aborts in order, then step if there is
        work. Returns what each client's queue gets (the loop hands them over: a queue is the loop's)."""
        with self._lock:
            ops, self._ops = self._ops, []
        engine = self.llm_engine
        items: list[tuple[_Queue, RequestOutput | _Refused]] = []
        with self._engine_lock:
            aborted = False
            for op, queue in ops:
                if isinstance(op, EngineCoreRequest):
                    try:
                        engine.add_request(op.request_id, op)
                        self._routes[op.request_id] = queue
                    except ValueError as error:  # a child's id in use: only a race gets here
                        items.append((queue, _Refused(error)))
                elif self._routes.get(op) is queue:  # the abort of the request its own client started
                    items += self._routed(engine.abort_request([op]))  # its blocks go before the step
                    aborted = True
            if aborted:  # the loggers see the blocks back and the aborts counted
                self._record()
            if engine.has_unfinished_requests():
                items += self._routed(engine.step())
                stats = engine.last_stats.prefix_cache_stats
                self._queries, self._hits = self._queries + stats.queries, self._hits + stats.hits
                self._record()
            self.kv_view = self._view()
        return items

    def _routed(self, outputs: Sequence[RequestOutput]) -> list[tuple[_Queue, RequestOutput]]:
        """Each output with its client's queue; a finished request's route goes with it."""
        routed = [(self._routes[output.request_id], output) for output in outputs]
        for output in outputs:
            if output.finished:
                del self._routes[output.request_id]
        return routed

    def _record(self) -> None:
        engine = self.llm_engine
        for logger in self.stat_loggers:
            logger(engine.last_stats, engine.last_iteration)

    def _view(self) -> KVCacheView:
        engine = self.llm_engine
        scheduler = engine.engine_core.scheduler
        memory = scheduler.memory
        return KVCacheView(
            memory.snapshot(),
            engine.num_steps,
            memory.usage,
            len(scheduler.running),
            len(scheduler.waiting),
            {r.request_id: r.num_tokens for r in scheduler.running},
            self._queries,
            self._hits,
        )

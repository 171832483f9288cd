"""The scheduler: what runs at each step of continuous batching, and the blocks it takes (lessons 07, 09-11).

One scheduler serves the engine (:class:`~paged_kv.serving.engine.Engine`, a real model behind it),
lesson 07's simulator (:func:`~paged_kv.simulation.workload.simulate`) and lesson 08's shared-prompt
workload (:func:`~paged_kv.simulation.sharing.serve`), the last two with a runner that only counts
tokens. It is vLLM v1's scheduler (``Scheduler.schedule`` and ``Scheduler.update_from_output`` in
``vllm/v1/core/sched/scheduler.py``, vLLM 0.33.0), first come first served by default:

1. **the running requests, in list order** (admission order): each is given
   ``num_scheduled_tokens = min(tokens not yet computed, budget left)`` (one for a decode, the rest
   of its prompt for a partial prefill) and the memory's
   :meth:`~paged_kv.serving.protocols.KVMemory.allocate_slots` is asked for their slots **now**,
   before anything runs. When they do not fit, the newest running request is preempted
   (``self.running.pop()``), by recompute (its blocks freed, back to the front of the queue with
   its generated tokens, to prefill them after its prompt when it resumes) or by swap (its blocks'
   K/V copied to host memory by the runner, its blocks freed), and the slots are asked for again;
   when the request itself was the newest, it is preempted and the loop ends. Decodes come
   before the partial prefill only because a partly prefilled request is always the newest;
2. **swap-in**, when nobody was preempted in this step (only after a swap preemption, which vLLM
   v1 does not have: the course keeps the paper's second way, lesson 11, in vLLM V0's order):
   swapped-out requests come back, oldest first, while their blocks and their next token fit;
   each decodes this step;
3. **admission**, when nobody was preempted in this step and nothing is swapped out: waiting
   requests, oldest first, while ``max_num_seqs`` and the budget allow. The prefix cache is
   looked up (:meth:`~paged_kv.serving.protocols.KVMemory.get_computed_blocks`), and the request
   is admitted when the memory can take the slots of its first chunk *and* of its whole prompt
   (``scheduler_reserve_full_isl``) with the watermark kept free if anything runs; the first
   request that does not fit stops admission;
4. every scheduled request's ``num_computed_tokens`` advances by its scheduled tokens (vLLM's
   ``_update_after_schedule``), and the step is returned as a :class:`SchedulerOutput`, a value;
5. :meth:`Scheduler.update_from_output` appends each sampled token, and a request holding its
   ``max_tokens`` tokens (or ending with a stop token) finishes and frees its blocks at once.

A request with ``o`` output tokens that is never preempted runs ``o`` steps once its prompt is
prefilled: the last chunk of its prefill samples the first token, ``o - 1`` decodes the rest.
Between steps a running request has ``num_computed_tokens == num_tokens - 1`` once it decodes:
its last sampled token is the next step's input.

**Priority** (``policy="priority"``, vLLM's ``--scheduling-policy priority``): each request has
a ``priority``, lower first. The waiting queue (and the swapped one) is kept sorted by
``(priority, arrival_time)`` instead of arrival order (vLLM's ``PriorityRequestQueue``, a heap), so
admission takes the best ranked first and a preempted request waits in its rank, not at the
front; and the victim of step 1 is the running request with the largest ``(priority,
arrival_time)``, wherever it stands in the list: one scheduled earlier in this step gives back its
tokens to the budget and its blocks to the pool, and a request that preempts itself lets the
requests after it, all better ranked, try. Admission still never preempts: a better-ranked
arrival waits for blocks that running requests free. Ties (equal priority and arrival time, which
vLLM's wall-clock times make rare) go to the later added. The policy decides who waits; greedy
tokens are the same under either.

**The token budget** (``max_num_batched_tokens=N``, vLLM's setting of that name; lesson 10) caps
the tokens a step schedules; each admitted request takes at least one of them, so the running
requests never outnumber the budget and every decode gets its token. Without a budget (``None``,
the default) a step prefills every admitted prompt whole.

**KV-cache events** (vLLM's ``--kv-events-config``): the memory's events since the last step
(:class:`~paged_kv.distributed.kv_events.KVCacheEvents`, listening to its pool) are taken once at
the end of each step, in :meth:`Scheduler.update_from_output`, and published as one
``KVEventBatch`` (vLLM does the same there); a reset publishes its ``AllBlocksCleared`` at once.

**Reset** (:meth:`Scheduler.reset_prefix_cache`, vLLM's): the prefix cache forgets every hash
only when no request holds a block, unless the running requests are preempted first (by
recompute, whatever ``preemption`` says, as vLLM's ``_preempt_request``); the runner hears of
them in the next step's ``preemptions``.

**A KV connector** (``connector``, vLLM's ``Scheduler.connector``: the offloading connector of
``--kv-offloading-size``): at admission, after the prefix cache, the connector is asked how many
tokens past the device's hit it can supply (``get_num_new_matched_tokens``: the request's
``num_external_computed_tokens``). With some, the request's blocks are allocated for its computed
and external tokens (the external ones not cached yet: ``delay_cache_blocks``), the connector
plans their load (``update_state_after_alloc``), and the request waits out the step in
:attr:`Scheduler.waiting_for_remote_kvs` (vLLM's ``WAITING_FOR_REMOTE_KVS``), scheduling nothing,
while the runner loads them. When the runner reports the load done
(``ModelRunnerOutput.kv_connector_output``), its blocks are cached and it goes back to the front
of the queue with its computed tokens advanced, to be scheduled from there at the next step; a
load that failed (``invalid_block_ids``) frees its blocks and requeues it with no external hit
(recomputed: the same tokens). Each step's connector work is ``build_connector_meta``'s
metadata in the :class:`SchedulerOutput`; a finished request is told (``request_finished``); the
connector's events join the pool's batch; a reset with ``reset_connector`` resets its cache. With
no connector (the default), none of this runs.

**Recompute resumes by prefill**, as the PagedAttention paper (§4.5) and vLLM do: a request
preempted by recompute keeps the tokens it generated, its computed count goes back to 0, and when
it is admitted again it prefills its prompt *and* those tokens, then samples the next one. With
prefix caching its blocks are mostly still cached: freed blocks keep their hashes.
"""

from __future__ import annotations

import logging
import time
from bisect import insort
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from types import MappingProxyType

from paged_kv.core.kv_cache_coordinator import BlockIds, ComputedBlocks
from paged_kv.distributed.kv_events import EventPublisher, KVCacheEvents, KVEventBatch, NullEventPublisher
from paged_kv.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorOutput
from paged_kv.serving.logprobs import TokenLogprobs
from paged_kv.serving.metrics import ENGINE_LOGGER
from paged_kv.serving.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    Preemption,
    SchedulerOutput,
)
from paged_kv.serving.protocols import KVMemory, Runner
from paged_kv.serving.request import EngineCoreRequest, Request
from paged_kv.validate import check_count

_LOGGER = logging.getLogger(ENGINE_LOGGER)

PREEMPTIONS = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
"""vLLM's ``SchedulerPolicy``: first come first served, or by each request's ``priority``."""


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Scheduler.update_from_output` saw at the end of a step, before the finished leave.

    ``num_running`` counts the requests running after the step's scheduling (finishing ones
    included), ``num_waiting`` the requests added and neither running nor swapped out,
    ``num_swapped`` those in host memory; ``held_tokens`` the tokens whose K/V the memory holds for
    the running requests (their computed tokens, once per request even where requests share
    blocks) and ``reserved_tokens`` the slots the memory reserves. ``new_tokens`` maps each request
    that sampled to its token; ``first_tokens`` the requests whose first output token it was;
    ``finished`` lists the requests done in this step with their generated tokens, in running order.
    ``num_prefill_tokens`` counts the step's tokens that prefilled (the others decoded).
    ``logprobs`` and ``prompt_logprobs`` are the runner's (:class:`ModelRunnerOutput`), passed on.
    """

    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    held_tokens: int
    reserved_tokens: int
    new_tokens: Mapping[Hashable, int] = field(default_factory=dict)
    first_tokens: tuple[Hashable, ...] = ()
    finished: tuple[tuple[Hashable, tuple[int, ...]], ...] = ()
    num_prefill_tokens: int = 0
    logprobs: Mapping[Hashable, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: Mapping[Hashable, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


class Scheduler:
    """Continuous batching over ``memory``, a :class:`~paged_kv.serving.protocols.KVMemory` (see the module).

    ``preemption`` is ``"recompute"`` or ``"swap"``; ``max_num_seqs`` (None: no limit) caps the
    running requests and ``max_num_batched_tokens`` (None: no budget) the tokens a step schedules,
    as vLLM's settings of those names; ``reserve_full_prompt`` is vLLM's
    ``scheduler_reserve_full_isl`` (on by default: a request is admitted only when its whole prompt
    fits); ``policy`` is ``"fcfs"`` or ``"priority"`` (vLLM's ``SchedulerConfig.policy``).
    ``kv_cache_events`` are the memory's events, listening to its pool (``None``: none), published
    by ``kv_event_publisher`` (vLLM's attribute; ``None``: a
    :class:`~paged_kv.distributed.kv_events.NullEventPublisher`). ``connector`` is a KV connector's
    scheduler half (``None``: none; see the module), over a paged memory. Requests are
    added with :meth:`add_request` and wait, oldest first (best ranked first under ``"priority"``).

    Invariant between steps: every request in :attr:`requests` (the live ones, by id, as vLLM's
    ``Scheduler.requests``) is in exactly one of waiting, running, swapped or
    :attr:`waiting_for_remote_kvs`, and leaves :attr:`requests` when it finishes, so the scheduler's
    state is bounded by the live requests however long it serves; the memory holds exactly the
    blocks of the running requests, for their computed tokens, and of the requests whose external
    tokens a connector loads or has loaded (waiting, those, for their next scheduling); under a
    budget every step schedules at most ``max_num_batched_tokens`` tokens.

    Raises:
        ValueError: a bad ``preemption``, ``policy``, ``max_num_seqs`` or ``max_num_batched_tokens`` (a
            positive integer), named.
    """

    def __init__(
        self,
        memory: KVMemory,
        *,
        preemption: str = "recompute",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        reserve_full_prompt: bool = True,
        policy: str = "fcfs",
        kv_cache_events: KVCacheEvents | None = None,
        kv_event_publisher: EventPublisher | None = None,
        connector: KVConnectorBase_V1 | None = None,
    ) -> None:
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {preemption!r}")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.max_num_seqs = (
            None if max_num_seqs is None else check_count("max_num_seqs", max_num_seqs, minimum=1)
        )
        self.max_num_batched_tokens = check_budget(max_num_batched_tokens)
        self.memory = memory
        self.preemption = preemption
        self.reserve_full_prompt = bool(reserve_full_prompt)
        self.policy = policy
        # Under "priority" both queues are kept sorted by Request.priority_key, lower first.
        self.waiting: deque[Request] = deque()  # arrived or preempted by recompute, oldest first
        self.swapped: deque[Request] = deque()  # swapped out, in admission order
        self.running: list[Request] = []  # in admission order, the newest last
        self.requests: dict[Hashable, Request] = {}
        """The live requests by id: waiting, running or swapped out."""
        self._finished_ids: set[Hashable] = set()  # since the last schedule
        self._num_added = 0  # requests added so far: the last key of Request.priority_key
        self._step = 0
        self._output: SchedulerOutput | None = None  # the step scheduled and not yet updated
        self._scheduled: _Step | None = None  # what schedule() gathered for it
        self._reset_preemptions: list[Preemption] = []  # preempted by a reset, for the next step's output
        self.kv_cache_events = kv_cache_events
        self.kv_event_publisher: EventPublisher = (
            NullEventPublisher() if kv_event_publisher is None else kv_event_publisher
        )
        self.connector = connector
        self.waiting_for_remote_kvs: dict[Hashable, Request] = {}
        """The requests whose external tokens the connector loads this step (vLLM's
        ``WAITING_FOR_REMOTE_KVS``), by id."""
        self._num_external: dict[Hashable, int] = {}  # each loading request's external tokens
        self._loaded: set[Hashable] = set()  # waiting with their external tokens loaded: blocks held
        self._skip_external: set[Hashable] = set()  # a load failed: recompute, no external hit

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether a request waits, runs or is swapped out."""
        return bool(self.waiting or self.running or self.swapped or self.waiting_for_remote_kvs)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue ``request`` behind the waiting ones (vLLM: ``Scheduler.add_request``). Its content was
        checked once, by whoever made it (the engine's
        :class:`~paged_kv.serving.input_processor.InputProcessor`, or a simulator's workload).

        Raises:
            ValueError: a live request has its id (the scheduler keeps each request in one place);
                nothing is queued. A finished request's id may come again.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is live: it waits, runs or is swapped out")
        live = self.requests[request.request_id] = Request(request, self._num_added)
        self._num_added += 1
        self._enqueue(self.waiting, live, front=False)

    def schedule(self) -> SchedulerOutput:
        """Decide this step (see the module): the running requests' tokens and blocks, preemptions,
        swap-ins, admissions; then advance each scheduled request's computed tokens.

        Raises:
            RuntimeError: nothing is scheduled while requests wait (a memory whose answers
                are inconsistent), or the last output was not given to :meth:`update_from_output`.
        """
        if self._output is not None:
            raise RuntimeError(f"step {self._step} was scheduled already: call update_from_output first")
        step = _Step(self.max_num_batched_tokens)
        self._schedule_running(step)
        if self._loaded:  # even after a preemption: they hold blocks a preempted request may wait on
            self._admit_loaded(step)
        if not step.preemptions:
            self._swap_in(step)
            if not self.swapped:
                self._admit(step)
        if not step.num_scheduled and self._loaded and not self.running:
            # Loaded requests hold blocks that none of them can run on, and nothing runs to free
            # more: give their blocks back (their K/V stays cached on the free queue) and admit
            # again, from a pool with every block free.
            self._release_loaded()
            self._swap_in(step)
            if not self.swapped:
                self._admit(step)
        if not step.num_scheduled and self.has_unfinished_requests and not self.waiting_for_remote_kvs:
            raise RuntimeError(
                f"step {self._step}: nothing can run, yet requests wait; the memory has "
                f"{self.memory.describe_free()}"
            )
        self._update_after_schedule(step)
        output = SchedulerOutput(
            self._step,
            MappingProxyType(step.num_scheduled),  # the step's own dict: nothing else holds it
            sum(step.num_scheduled.values()),
            tuple(step.new_reqs),
            CachedRequestData(tuple(step.cached), tuple(step.cached_blocks), tuple(step.cached_computed)),
            (*self._reset_preemptions, *step.preemptions),
            MappingProxyType(dict(step.swap_out)),
            MappingProxyType(dict(step.swap_in)),
            frozenset(self._finished_ids),
        )
        if self.connector is not None:
            output = replace(output, kv_connector_metadata=self.connector.build_connector_meta(output))
        self._finished_ids.clear()
        self._reset_preemptions.clear()
        self._output, self._scheduled = output, step
        return output

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> StepResult:
        """Take the tokens the runner sampled for ``output``; finish the requests that are done.

        Raises:
            ValueError: ``output`` is not this step's, or ``result`` lacks a token for a request
                whose scheduled tokens reached its end; nothing changes.
        """
        if output is not self._output:
            raise ValueError(f"output must be the SchedulerOutput of step {self._step}, got {output!r}")
        sampling, sampled = self._scheduled.sampling, result.sampled_token_ids
        try:
            tokens = [sampled[r.request_id] for r in sampling]
        except KeyError:
            missing = [r.request_id for r in sampling if r.request_id not in sampled]
            raise ValueError(f"the runner's result has no sampled token for {missing!r}") from None
        if self.connector is not None and result.kv_connector_output is not None:
            self.connector.update_connector_output(result.kv_connector_output)
            self._update_waiting_for_remote_kv(result.kv_connector_output)
        first, new_tokens, done = [], {}, []
        for request, token in zip(sampling, tokens, strict=True):  # only a request that sampled can finish
            output_ids, request_id = request.output_token_ids, request.request_id
            if not output_ids:
                first.append(request_id)
            output_ids.append(token)
            request.num_tokens += 1
            if request.all_token_ids is not None:
                request.all_token_ids.append(token)
            if len(output_ids) == request.max_tokens or (
                token in request.stop_token_ids and len(output_ids) >= request.min_tokens
            ):
                done.append(request)  # all its max_tokens generated, or a stop token past min_tokens
            new_tokens[request_id] = token
        step = StepResult(
            self._step,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            held_tokens=sum(map(_computed_tokens, self.running)),
            reserved_tokens=self.memory.reserved_tokens,
            new_tokens=new_tokens,
            first_tokens=tuple(first),
            finished=self._finish(done),
            num_prefill_tokens=self._scheduled.num_prefill_tokens,
            logprobs=result.logprobs,
            prompt_logprobs=result.prompt_logprobs,
        )
        self._step += 1
        self._output = self._scheduled = None
        self.publish_kv_events()
        return step

    def _update_waiting_for_remote_kv(self, kv_output: KVConnectorOutput) -> None:
        """Move the requests whose load finished back to the front of the queue (vLLM:
        ``_update_waiting_for_remote_kv``): their external tokens cached and computed, or, when the
        load left an invalid block, their blocks freed, to be recomputed without an external hit."""
        done = [r for rid, r in self.waiting_for_remote_kvs.items() if rid in kv_output.finished_recving]
        for request in reversed(done):  # to the front, the oldest first
            request_id = request.request_id
            del self.waiting_for_remote_kvs[request_id]
            num_external = self._num_external.pop(request_id)
            if kv_output.invalid_block_ids.intersection(self.memory.get_block_ids(request_id)[0]):
                self.memory.free(request_id)
                request.num_computed_tokens = 0
                self._skip_external.add(request_id)
            else:
                start = request.num_computed_tokens
                self.memory.cache_blocks(request_id, request.all_token_ids[start : start + num_external])
                request.num_computed_tokens = start + num_external
                self._loaded.add(request_id)
            self._enqueue(self.waiting, request, front=True)

    def publish_kv_events(self) -> None:
        """Publish the memory's events since the last batch, then the connector's (the host tier's,
        medium ``"CPU"``), as one ``KVEventBatch`` stamped now, if there are any (vLLM: the end of
        ``update_from_output``)."""
        if self.kv_cache_events is None:
            return
        events = self.kv_cache_events.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix (vLLM: ``Scheduler.reset_prefix_cache``, after a weight update
        or between benchmark runs); return whether it did. Its ``AllBlocksCleared`` is published now.

        Refused (``False``, nothing changes) while a request holds a block, unless
        ``reset_running_requests``: then every running request is preempted first, newest first, by
        recompute (its computed tokens back to 0, to the front of the queue with the tokens it
        generated), so the reset succeeds and the requests go on with the same tokens, and the
        waiting requests whose external tokens were loaded give their blocks back too (to be
        admitted afresh). Swapped-out requests hold no block and stay swapped out.
        ``reset_connector`` resets the KV connector's cache too (the host tier forgets every block;
        vLLM's ``reset_connector_cache``), whether or not the pool's reset succeeded, and the answer
        is both's; without a connector it changes nothing (vLLM treats a missing connector as a
        success).

        Raises:
            RuntimeError: a step is scheduled and not yet updated (reset between steps); or the
                memory refused although nothing ran (vLLM's message).
        """
        if self._output is not None:
            raise RuntimeError(f"step {self._step} is scheduled: reset the prefix cache between steps")
        if reset_running_requests:
            while self.running:
                self._reset_preemptions.append(self._requeue(self.running.pop()))
            self._release_loaded()
        reset = self.memory.reset_prefix_cache()
        if reset_running_requests and not reset:
            raise RuntimeError(
                "Failed to reset KV cache even when all the running requests are preempted and moved "
                "to the waiting queue."
            )
        if reset:
            _LOGGER.info("Successfully reset prefix cache")
        else:
            _LOGGER.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.memory.reserved_tokens // self.memory.block_size,
            )
        if reset_connector and self.connector is not None:
            reset = self.connector.reset_cache() is not False and reset
        self.publish_kv_events()
        return reset

    def finish_requests(self, request_ids: Iterable[Hashable]) -> list[Hashable]:
        """Finish ``request_ids`` now, wherever they are (vLLM: ``Scheduler.finish_requests``, for an
        abort or a stop string): a running request's blocks are freed at once, a waiting or
        swapped-out one just leaves. The runner hears of them in the next step's
        ``finished_req_ids``. Ids that are unknown or finished already are skipped; the ones
        finished here are returned, in the order given.

        Raises:
            RuntimeError: a step is scheduled and not yet updated (finish between steps).
        """
        if self._output is not None:
            raise RuntimeError(f"step {self._step} is scheduled: finish requests between steps")
        wanted = list(dict.fromkeys(request_ids))
        asked = set(wanted)
        found = {
            r.request_id: r
            for queue in (self.running, self.waiting, self.swapped, self.waiting_for_remote_kvs.values())
            for r in queue
            if r.request_id in asked
        }
        if not found:
            return []
        holding = {r.request_id for r in self.running} | self._loaded | self.waiting_for_remote_kvs.keys()
        for request_id, request in found.items():
            if request_id in holding:
                self.memory.free(request_id)
            self._forget(request)
        gone = {id(request) for request in found.values()}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        self.swapped = deque(r for r in self.swapped if id(r) not in gone)
        for request_id in found:
            self.waiting_for_remote_kvs.pop(request_id, None)
        return [request_id for request_id in wanted if request_id in found]

    def free_all(self) -> None:
        """Free the memory of every running request and forget every request (after an error, or at
        the end of an offline run: a finished run holds nothing)."""
        for request in self.running:
            self.memory.free(request.request_id)
        for request_id in self._loaded | self.waiting_for_remote_kvs.keys():
            self.memory.free(request_id)
        if self.connector is not None:
            for request in self.requests.values():
                self.connector.request_finished(request, None)
        self.running = []
        self.waiting.clear()
        self.swapped.clear()
        self.requests.clear()
        self.waiting_for_remote_kvs.clear()
        self._num_external.clear()
        self._loaded.clear()
        self._skip_external.clear()
        self._reset_preemptions.clear()

    # ------------------------------------------------------------------------------ the phases

    def _has_room(self) -> bool:
        return self.max_num_seqs is None or len(self.running) < self.max_num_seqs

    def _swap_in(self, step: _Step) -> None:
        """Bring swapped-out requests back, oldest first, while their K/V and next token fit."""
        while self.swapped and self._has_room() and step.budget_left != 0:
            request = self.swapped[0]
            block_ids = self.memory.allocate_slots(
                request.request, request.num_computed_tokens + 1, has_scheduled_reqs=False
            )  # a running request in all but place: no watermark
            if block_ids is None:
                break
            self.swapped.popleft()
            self.running.append(request)
            step.swap_in[request.request_id] = block_ids
            step.new_reqs.append(
                NewRequestData(
                    request.request_id,
                    request.token_ids,
                    block_ids,
                    request.num_computed_tokens,
                    request.request.sampling_params,
                )
            )
            step.schedule(request, 1)

    def _schedule_running(self, step: _Step) -> None:
        """Give each running request its tokens and their slots; preempt the newest when they do not fit.

        The hot loop of a step: one pass, one call to the memory per request, the budget counted
        in a local (written back to ``step`` at the end) and everything it touches bound once. A
        scheduled request's computed tokens advance here, at once (vLLM's ``_update_after_schedule``
        for it): nothing later in the step reads them. Under ``"fcfs"`` a victim is never a request
        scheduled before it (victims are popped from the end, where the loop has not been); under
        ``"priority"`` it may be, and :meth:`_unschedule` takes its step back."""
        running, allocate = self.running, self.memory.allocate_slots
        cached, cached_blocks, cached_computed = step.cached, step.cached_blocks, step.cached_computed
        num_scheduled, sampling = step.num_scheduled, step.sampling
        by_priority = self.policy == "priority"
        budget = step.budget_left
        prefilled = index = 0
        while index < len(running) and budget != 0:
            request = running[index]
            computed, num_tokens = request.num_computed_tokens, request.num_tokens
            num_new = num_tokens - computed
            if budget is not None and num_new > budget:
                num_new = budget
            while (block_ids := allocate(request.request, num_new, request.all_token_ids)) is None:
                if by_priority:  # the lowest ranked, wherever it is (vLLM: max by (priority, arrival_time))
                    victim = max(running, key=_priority_key)
                    where = running.index(victim)
                    del running[where]
                    if where < index:  # scheduled earlier in this step: its tokens go back to the budget
                        index -= 1
                        tokens, prefill = self._unschedule(victim, step)
                        prefilled -= prefill
                        if budget is not None:
                            budget += tokens
                else:
                    victim = running.pop()
                self._preempt(victim, step)
                if victim is request:
                    break
            if block_ids is None:  # it preempted itself
                if by_priority:
                    continue  # the requests after it rank above it and may fit: vLLM goes on
                break
            request_id = request.request_id
            cached.append(request_id)
            cached_blocks.append(block_ids)
            cached_computed.append(computed)
            num_scheduled[request_id] = num_new
            request.num_computed_tokens = end = computed + num_new
            if end == num_tokens:
                sampling.append(request)
            if request.num_prefill_tokens > computed:  # positions below it prefill
                prefilled += min(num_new, request.num_prefill_tokens - computed)
            if budget is not None:
                budget -= num_new
            index += 1
        step.budget_left = budget
        step.num_prefill_tokens += prefilled

    def _admit(self, step: _Step) -> None:
        """Admit waiting requests in the queue's order, while they fit and the budget lasts."""
        connector = self.connector
        while self.waiting and self._has_room() and step.budget_left != 0:
            request = self.waiting[0]
            token_ids = request.token_ids
            if request.request_id in self._loaded:  # it did not fit in _admit_loaded
                break
            computed = self.memory.get_computed_blocks(request.request, token_ids)
            retry = request.request_id in self._skip_external  # its load failed: counted already
            if connector is not None and not retry:
                num_external, _ = connector.get_num_new_matched_tokens(request, computed.num_tokens)
                if num_external is None:  # the connector asks again at a later step
                    break
                if num_external:
                    if not self._admit_loading(request, computed, num_external):
                        break
                    continue
            num_new = step.clip(request.num_tokens - computed.num_tokens)
            block_ids = self.memory.allocate_slots(
                request.request,
                num_new,
                token_ids,
                new_computed_blocks=computed,
                num_tokens_to_fit=request.num_tokens if self.reserve_full_prompt else None,
                has_scheduled_reqs=bool(self.running),
                preempted=request.num_preemptions > 0 or retry,
            )
            if block_ids is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = request.num_cached_tokens = computed.num_tokens
            if retry:
                self._skip_external.discard(request.request_id)
            elif connector is not None:
                connector.update_state_after_alloc(request, block_ids, 0)
            request.num_prefill_tokens = request.num_tokens
            self.running.append(request)
            step.new_reqs.append(
                NewRequestData(
                    request.request_id,
                    token_ids,
                    block_ids,
                    computed.num_tokens,
                    request.request.sampling_params,
                )
            )
            step.schedule(request, num_new)

    def _admit_loading(self, request: Request, computed: ComputedBlocks, num_external: int) -> bool:
        """Allocate the blocks of ``request``'s computed and ``num_external`` external tokens (its
        whole prompt's reserved as for any admission) and have the connector load the external
        ones: the request waits in :attr:`waiting_for_remote_kvs`. False: they do not fit."""
        block_ids = self.memory.allocate_slots(
            request.request,
            num_external,
            request.token_ids,
            new_computed_blocks=computed,
            num_tokens_to_fit=request.num_tokens if self.reserve_full_prompt else None,
            has_scheduled_reqs=bool(self.running),
            preempted=request.num_preemptions > 0,
            delay_cache_blocks=True,
        )
        if block_ids is None:
            return False
        self.waiting.popleft()
        request_id = request.request_id
        request.num_computed_tokens = computed.num_tokens  # the device's hit; the load adds the rest
        request.num_cached_tokens = computed.num_tokens + num_external
        request.num_prefill_tokens = request.num_tokens
        self.waiting_for_remote_kvs[request_id] = request
        self._num_external[request_id] = num_external
        self.connector.update_state_after_alloc(request, self.memory.get_block_ids(request_id), num_external)
        return True

    def _release_loaded(self) -> None:
        """Free the blocks of every request whose external tokens were loaded: each waits in its
        place to be admitted again from nothing computed (its blocks cached, so a hit brings most
        of it back)."""
        for request_id in self._loaded:
            self.memory.free(request_id)
            self.requests[request_id].num_computed_tokens = 0
        self._loaded.clear()

    def _admit_loaded(self, step: _Step) -> None:
        """Schedule the requests whose external tokens were loaded (their blocks held), in the
        queue's order wherever they wait, from their computed tokens on, as new requests to the
        runner, while their next tokens' slots fit and the budget and ``max_num_seqs`` allow."""
        for request in [r for r in self.waiting if r.request_id in self._loaded]:
            if not (self._has_room() and step.budget_left != 0 and self._schedule_loaded(request, step)):
                break

    def _schedule_loaded(self, request: Request, step: _Step) -> bool:
        """:meth:`_admit_loaded` for one request; False: its slots do not fit."""
        request_id = request.request_id
        num_new = step.clip(request.num_tokens - request.num_computed_tokens)
        if self.memory.allocate_slots(request.request, num_new, request.token_ids) is None:
            return False
        self.waiting.remove(request)
        self._loaded.discard(request_id)
        self.running.append(request)
        step.new_reqs.append(
            NewRequestData(
                request_id,
                request.token_ids,
                self.memory.get_block_ids(request_id),
                request.num_computed_tokens,
                request.request.sampling_params,
            )
        )
        step.schedule(request, num_new)
        return True

    @staticmethod
    def _unschedule(request: Request, step: _Step) -> tuple[int, int]:
        """Take back a running request scheduled earlier in this step, a victim under ``"priority"``
        (vLLM pops its scheduled tokens and new blocks): its computed tokens go back to what they
        were; return its tokens and those of them that prefilled. Its blocks, the new ones
        included, are the preemption's to free."""
        at = step.cached.index(request.request_id)
        del step.cached[at], step.cached_blocks[at]
        computed = request.num_computed_tokens = step.cached_computed.pop(at)
        num_new = step.num_scheduled.pop(request.request_id)
        if request in step.sampling:
            step.sampling.remove(request)
        return num_new, max(0, min(num_new, request.num_prefill_tokens - computed))

    @staticmethod
    def _update_after_schedule(step: _Step) -> None:
        """Advance the computed tokens of each request admitted or swapped in (vLLM:
        ``_update_after_schedule``; the running ones advanced as they were scheduled); note those
        that reach their end, and so sample, and the tokens that prefill."""
        sampling, prefilled = step.sampling, 0
        for request, n in step.scheduled:
            computed = request.num_computed_tokens = request.num_computed_tokens + n
            if computed == request.num_tokens:
                sampling.append(request)
            if request.num_prefill_tokens > computed - n:  # positions below it prefill
                prefilled += min(n, request.num_prefill_tokens - (computed - n))
        step.num_prefill_tokens += prefilled

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Swap out or free ``victim``, the newest running request. A request still prefilling is
        always requeued (its K/V is not worth moving); a requeued one keeps its generated tokens."""
        request_id = victim.request_id
        prefilling = victim.num_computed_tokens < victim.num_tokens - 1 or not victim.output_token_ids
        if self.preemption == "swap" and not prefilling:
            victim.num_preemptions += 1
            step.swap_out[request_id] = self.memory.get_block_ids(request_id)
            self.memory.free(request_id)
            self._enqueue(self.swapped, victim, front=True)  # older victims come first
            step.preemptions.append(Preemption(request_id, "swap", victim.num_computed_tokens))
            return
        step.preemptions.append(self._requeue(victim))

    def _requeue(self, victim: Request) -> Preemption:
        """Preempt ``victim`` by recompute: its blocks freed, its computed tokens back to 0, to the
        front of the waiting queue (in its rank under ``"priority"``)."""
        victim.num_preemptions += 1
        self.memory.free(victim.request_id)
        preemption = Preemption(victim.request_id, "recompute", victim.num_computed_tokens)
        victim.num_computed_tokens = 0
        self._enqueue(self.waiting, victim, front=True)
        return preemption

    def _enqueue(self, queue: deque[Request], request: Request, *, front: bool) -> None:
        """Put ``request`` in ``queue``: under ``"fcfs"`` at its front (a victim) or back (an arrival),
        under ``"priority"`` in its place by :attr:`~paged_kv.serving.request.Request.priority_key`
        (vLLM's ``PriorityRequestQueue``, a heap, has no front either)."""
        if self.policy == "priority":
            insort(queue, request, key=_priority_key)
        elif front:
            queue.appendleft(request)
        else:
            queue.append(request)

    def _finish(self, done: list[Request]) -> tuple[tuple[Hashable, tuple[int, ...]], ...]:
        """Free the requests in ``done`` and drop them from the running ones."""
        if not done:
            return ()
        for request in done:
            self.memory.free(request.request_id)
            self._forget(request)
        gone = {id(request) for request in done}
        self.running = [request for request in self.running if id(request) not in gone]
        return tuple((r.request_id, tuple(r.output_token_ids)) for r in done)

    def _forget(self, request: Request) -> None:
        """A finished request leaves (its blocks freed already): the runner and the connector are told."""
        request_id = request.request_id
        self._finished_ids.add(request_id)
        del self.requests[request_id]
        if self.connector is not None:
            self.connector.request_finished(request, None)
            self._loaded.discard(request_id)
            self._skip_external.discard(request_id)
            self._num_external.pop(request_id, None)


@dataclass
class _Step:
    """What :meth:`Scheduler.schedule` gathers while it decides one step."""

    budget: int | None
    num_scheduled: dict[Hashable, int] = field(default_factory=dict)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """The requests admitted or swapped in, with their tokens, in the order of ``num_scheduled``."""
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached: list[Hashable] = field(default_factory=list)
    cached_blocks: list[BlockIds] = field(default_factory=list)
    cached_computed: list[int] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    swap_out: dict[Hashable, BlockIds] = field(default_factory=dict)
    swap_in: dict[Hashable, BlockIds] = field(default_factory=dict)
    budget_left: int | None = None
    """Tokens the step may still schedule (None: no budget)."""
    sampling: list[Request] = field(default_factory=list)
    """The scheduled requests whose tokens reach their end: each samples a token."""
    num_prefill_tokens: int = 0
    """The scheduled tokens below their request's prefill end (the others decode)."""

    def __post_init__(self) -> None:
        self.budget_left = self.budget

    def clip(self, num_tokens: int) -> int:
        left = self.budget_left
        return num_tokens if left is None else min(num_tokens, left)

    def schedule(self, request: Request, num_tokens: int) -> None:
        """Schedule a request admitted or swapped in (the running ones are the hot loop's)."""
        self.num_scheduled[request.request_id] = num_tokens
        self.scheduled.append((request, num_tokens))
        if self.budget_left is not None:
            self.budget_left -= num_tokens


_computed_tokens = attrgetter("num_computed_tokens")
_priority_key = attrgetter("priority_key")


def check_budget(max_num_batched_tokens: object) -> int | None:
    """``max_num_batched_tokens`` as an int of at least 1, or None (no budget); a ValueError naming it."""
    if max_num_batched_tokens is None:
        return None
    return check_count("max_num_batched_tokens", max_num_batched_tokens, minimum=1)


def run_steps(
    scheduler: Scheduler,
    runner: Runner,
    arrivals: Sequence[tuple[int, EngineCoreRequest]],
    max_steps: int | None = None,
) -> Iterator[tuple[SchedulerOutput, StepResult]]:
    """Drive ``scheduler`` and ``runner`` step by step; yield each step's output and result.

    ``arrivals`` are ``(arrival_step, request)`` pairs, added at their step (ties in their order).
    Stops when every request has finished, or after ``max_steps`` steps. Each step is
    ``output = scheduler.schedule(); result = runner.execute_model(output);
    scheduler.update_from_output(output, result)``. Whatever happens, the memory holds no request
    of this run afterwards.
    """
    pending = deque(sorted(arrivals, key=lambda pair: pair[0]))  # stable: ties keep their order
    step = 0
    try:
        while (pending or scheduler.has_unfinished_requests) and (max_steps is None or step < max_steps):
            while pending and pending[0][0] <= step:
                scheduler.add_request(pending.popleft()[1])
            output = scheduler.schedule()
            yield output, scheduler.update_from_output(output, runner.execute_model(output))
            step += 1
    finally:
        scheduler.free_all()

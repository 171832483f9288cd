"""The scheduler: what runs at each step of continuous batching (lessons 06, 08, 09).

One scheduler serves the engine (:class:`~paged_kv.serving.engine.Engine`, a real model behind it),
lesson 06's simulator (:func:`~paged_kv.simulation.workload.simulate`) and lesson 07's shared-prompt
workload (:func:`~paged_kv.simulation.sharing.serve`), the last two with a runner that only counts
tokens. It follows vLLM v1's split: :meth:`Scheduler.schedule` decides a step and returns it as a
value, a :class:`SchedulerOutput`; a runner computes it (:mod:`paged_kv.serving.model_runner`); and
:meth:`Scheduler.update` takes the tokens the runner sampled, advances the requests and finishes
those that are done. (In vLLM: ``Scheduler.schedule`` returning ``SchedulerOutput``,
``GPUModelRunner.execute_model``, ``Scheduler.update_from_output``.)

One step, in this order:

1. **swap-in** (only after a swap preemption): swapped-out sequences come back, oldest first,
   while the memory can take them with the headroom; they decode this step;
2. **admission**, when nothing is swapped out: requests are admitted first come first served
   while the memory's :meth:`~paged_kv.serving.memory.KVMemory.can_admit` says they fit
   (paged: :func:`~paged_kv.serving.memory.admits`), stopping at the first that does not. Each
   admitted prompt gets its room and is prefilled this step, and **its prefill samples its first
   output token**, as in vLLM;
3. **preemption**: while the decode step of the sequences that were running before this step's
   admissions (swapped-in ones included) needs more new blocks than are free, the newest running
   sequence is preempted, chosen by :func:`~paged_kv.serving.preemption.choose_victims` (newest
   first, never the oldest alone): by recompute (its memory is freed, its output dropped, and it
   goes back to the front of the queue) or by swap (its K/V goes to host memory and it waits in
   the swapped queue, ahead of every waiting request);
4. **decode**: those sequences each feed their last token and sample one more;
5. :meth:`Scheduler.update`: the sampled tokens are appended; a sequence holding
   ``max_new_tokens`` tokens finishes and frees its memory at once.

So a request with ``o`` output tokens that is never preempted runs ``o`` steps: one prefill, then
``o - 1`` decodes. A running sequence holds ``prompt + generated - 1`` tokens in the memory: its
last sampled token is the next step's input.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from paged_kv.serving.memory import KVMemory
from paged_kv.serving.preemption import choose_victims
from paged_kv.serving.request import SchedulerRequest
from paged_kv.validate import check_count

PREEMPTIONS = ("recompute", "swap")


class Prefill(NamedTuple):
    """A prompt to prefill this step, from its first uncached position on."""

    request: SchedulerRequest
    num_cached_tokens: int
    """The leading prompt tokens the prefix cache served (0 without prefix caching)."""

    @property
    def num_computed_tokens(self) -> int:
        """The prompt tokens the prefill runs through the model."""
        return self.request.num_prompt_tokens - self.num_cached_tokens


class Decode(NamedTuple):
    """A running sequence that feeds ``token`` (its last sampled one) this step."""

    request_id: Hashable
    token: int


class Preemption(NamedTuple):
    """A sequence preempted this step by ``way`` (``"recompute"`` or ``"swap"``), holding ``num_tokens``."""

    request_id: Hashable
    way: str
    num_tokens: int


class SwapIn(NamedTuple):
    """A swapped-out sequence of ``num_tokens`` tokens whose K/V came back this step."""

    request_id: Hashable
    num_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """What step ``step`` runs, as :meth:`Scheduler.schedule` decided it (vLLM: ``SchedulerOutput``).

    ``prefills`` are this step's admissions, in admission order; ``decodes`` the sequences that
    decode, in admission order (swapped-in ones last); ``preemptions`` the sequences preempted to
    make room, newest first; ``swapped_in`` the sequences that came back from host memory. The
    memory has already been changed accordingly: prompts have their room, victims lost theirs.
    """

    step: int
    prefills: tuple[Prefill, ...] = ()
    decodes: tuple[Decode, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    swapped_in: tuple[SwapIn, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the model runs this step: the prefills' uncached tokens and one per decode."""
        return sum(p.num_computed_tokens for p in self.prefills) + len(self.decodes)


@dataclass(frozen=True)
class RunnerOutput:
    """What a runner computed for a :class:`SchedulerOutput`: the token each prefill and decode sampled."""

    sampled: Mapping[Hashable, int]


class Runner(Protocol):
    """Computes a step: :class:`~paged_kv.serving.model_runner.ModelRunner` or a counting runner."""

    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Scheduler.update` saw at the end of a step, measured before the finished sequences leave.

    ``num_running`` counts the sequences in the step's forward pass (finishing ones included),
    ``num_waiting`` the requests added and not running nor swapped out, ``num_swapped`` those in
    host memory; ``held_tokens`` the tokens whose K/V the memory holds for the running sequences
    (once per sequence, even where sequences share blocks) and ``reserved_tokens`` the slots the
    memory reserves for them. ``finished`` lists the requests done in this step with their
    generated tokens, in admission order.
    """

    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    held_tokens: int
    reserved_tokens: int
    finished: tuple[tuple[Hashable, tuple[int, ...]], ...] = ()


@dataclass(eq=False)  # compared by identity
class _Running:
    request: SchedulerRequest
    generated: list[int] = field(default_factory=list)

    @property
    def held(self) -> int:
        """Tokens whose K/V the memory holds: the last sampled one is the next input, not yet held."""
        return self.request.num_prompt_tokens + len(self.generated) - 1

    @property
    def finished(self) -> bool:
        """All ``max_new_tokens`` generated, or the last one is a stop token."""
        request, generated = self.request, self.generated
        return len(generated) == request.max_new_tokens or (
            bool(generated) and generated[-1] in request.stop_token_ids
        )


class Scheduler:
    """Continuous batching over ``memory``, a :class:`~paged_kv.serving.memory.KVMemory` (see the module).

    ``preemption`` is ``"recompute"`` or ``"swap"`` (which needs ``memory.can_swap``);
    ``max_num_seqs`` (None: no limit) caps the running sequences, as vLLM's setting of that name.
    Requests are added with :meth:`add_request` and wait, oldest first.

    Invariant between steps: every added request is in exactly one of waiting, running, swapped
    or finished, and the memory holds exactly the running sequences.

    Raises:
        ValueError: a bad ``preemption`` or ``max_num_seqs``, named.
    """

    def __init__(
        self, memory: KVMemory, *, preemption: str = "recompute", max_num_seqs: int | None = None
    ) -> None:
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {preemption!r}")
        if preemption == "swap" and not memory.can_swap:
            raise ValueError(
                "preemption='swap' needs a cache with swap_out(seq_id) and swap_in(seq_id, saved), "
                "but this memory cannot swap; use preemption='recompute'"
            )
        self.memory = memory
        self.preemption = preemption
        self.max_num_seqs = (
            None if max_num_seqs is None else check_count("max_num_seqs", max_num_seqs, minimum=1)
        )
        self.waiting: deque[SchedulerRequest] = deque()  # arrived, not admitted, oldest first
        self.swapped: deque[tuple[_Running, object]] = deque()  # in admission order
        self.running: list[_Running] = []  # in admission order, the newest last
        self._ids: set[Hashable] = set()
        self._step = 0

    @property
    def has_unfinished(self) -> bool:
        """Whether a request waits, runs or is swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def add_request(self, request: SchedulerRequest) -> None:
        """Queue ``request`` behind the waiting ones.

        Raises:
            ValueError: it is not a :class:`SchedulerRequest`, its id was added before, or the
                memory could not serve it even alone (it would wait for ever). Nothing is queued.
        """
        if not isinstance(request, SchedulerRequest):
            raise ValueError(f"request must be a SchedulerRequest, got {request!r}")
        if request.request_id in self._ids:
            raise ValueError(f"request_id {request.request_id!r} was added before")
        if not self.memory.serves_alone(request):
            raise ValueError(f"the memory cannot serve request {request.request_id!r} even alone")
        self._ids.add(request.request_id)
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Decide this step: swap-ins, admissions with prefill, preemptions, decodes (see the module).

        Raises:
            RuntimeError: nothing runs while requests wait that do not fit (a memory whose free
                count is wrong); or the cache reports cached tokens outside ``0 .. n - 1``.
        """
        decoding = list(self.running)  # this step's admissions get their token from prefill
        swapped_in = self._swap_in(decoding)
        prefills = () if self.swapped else self._admit()
        if not self.running and (self.waiting or self.swapped):
            raise RuntimeError(
                f"step {self._step}: nothing runs, yet the next request does not fit in the "
                f"{self.memory.describe_free()}"
            )
        preemptions = self._make_room(decoding)
        running = {seq.request.request_id for seq in self.running}
        prefills = tuple(p for p in prefills if p.request.request_id in running)
        decodes = tuple(Decode(s.request.request_id, s.generated[-1]) for s in decoding if s in self.running)
        return SchedulerOutput(self._step, prefills, decodes, preemptions, swapped_in)

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> StepResult:
        """Take the tokens the runner sampled for ``output``; finish the sequences that are done.

        Raises:
            ValueError: ``output`` is not this step's, or ``result`` lacks a token for one of its
                prefills or decodes; nothing changes.
        """
        if not isinstance(output, SchedulerOutput) or output.step != self._step:
            raise ValueError(f"output must be the SchedulerOutput of step {self._step}, got {output!r}")
        ids = [p.request.request_id for p in output.prefills] + [d.request_id for d in output.decodes]
        missing = [i for i in ids if i not in result.sampled]
        if missing:
            raise ValueError(f"the runner's result has no sampled token for {missing!r}")
        for seq in self.running:
            if seq.request.request_id in result.sampled:
                seq.generated.append(int(result.sampled[seq.request.request_id]))
        step = StepResult(
            self._step,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            held_tokens=sum(seq.held for seq in self.running),
            reserved_tokens=self.memory.reserved_tokens,
            finished=self._finish(),
        )
        self._step += 1
        return step

    def free_all(self) -> None:
        """Free the memory of every running sequence (after an error: a finished run holds nothing)."""
        for seq in self.running:
            self.memory.free(seq.request.request_id)
        self.running = []

    # ------------------------------------------------------------------------------ the phases

    def _swap_in(self, decoding: list[_Running]) -> tuple[SwapIn, ...]:
        """Bring swapped-out sequences back, oldest first, while they fit; they decode this step."""
        back = []
        while self.swapped and self._has_room():
            seq, saved = self.swapped[0]
            if not self.memory.can_swap_in(seq.held, len(self.running)):
                break
            self.swapped.popleft()
            self.memory.swap_in(seq.request.request_id, saved)
            self.running.append(seq)
            decoding.append(seq)
            back.append(SwapIn(seq.request.request_id, seq.held))
        return tuple(back)

    def _admit(self) -> tuple[Prefill, ...]:
        """Admit waiting requests, first come first served, while they fit; each is prefilled this step."""
        admitted = []
        while self.waiting and self._has_room() and self.memory.can_admit(self.waiting[0], len(self.running)):
            request = self.waiting.popleft()
            cached = self.memory.add_sequence(request)
            self.running.append(_Running(request))
            admitted.append(Prefill(request, cached))
        return tuple(admitted)

    def _has_room(self) -> bool:
        return self.max_num_seqs is None or len(self.running) < self.max_num_seqs

    def _make_room(self, decoding: list[_Running]) -> tuple[Preemption, ...]:
        """Preempt the newest sequences until the decode step of ``decoding`` fits in the free blocks.

        :func:`~paged_kv.serving.preemption.choose_victims` names the victims; they are preempted
        one at a time and the rest counted again, because a victim that shares blocks (prefix
        caching) frees fewer than it holds.
        """
        preempted = []
        while True:
            decoding_ids = {s.request.request_id for s in decoding}
            candidates = [
                (
                    s.request.request_id,
                    self.memory.blocks_held(s.held),
                    s.request.request_id in decoding_ids
                    and self.memory.needs_new_block(s.request.request_id),
                )
                for s in self.running
            ]
            victims = choose_victims(candidates, self.memory.num_free_blocks)
            if not victims:
                return tuple(preempted)
            victim = self.running.pop()  # victims[0], the newest
            preempted.append(self._preempt(victim))

    def _preempt(self, victim: _Running) -> Preemption:
        """Swap out or free ``victim``; one admitted this step holds no K/V yet and is always requeued."""
        request_id, held = victim.request.request_id, victim.held
        if self.preemption == "swap" and victim.generated:
            self.swapped.appendleft((victim, self.memory.swap_out(request_id)))  # older victims come first
            return Preemption(request_id, "swap", held)
        self.memory.free(request_id)
        self.waiting.appendleft(victim.request)
        return Preemption(request_id, "recompute", held if victim.generated else 0)

    def _finish(self) -> tuple[tuple[Hashable, tuple[int, ...]], ...]:
        done = [seq for seq in self.running if seq.finished]
        for seq in done:
            self.memory.free(seq.request.request_id)
        self.running = [seq for seq in self.running if seq not in done]
        return tuple((seq.request.request_id, tuple(seq.generated)) for seq in done)


def run_steps(
    scheduler: Scheduler,
    runner: Runner,
    arrivals: Sequence[tuple[int, SchedulerRequest]],
    max_steps: int | None = None,
) -> Iterator[tuple[SchedulerOutput, StepResult]]:
    """Drive ``scheduler`` and ``runner`` step by step; yield each step's output and result.

    ``arrivals`` are ``(arrival_step, request)`` pairs, added at their step (ties in their order).
    Stops when every request has finished, or after ``max_steps`` steps. Each step is
    ``output = scheduler.schedule(); result = runner.execute(output); scheduler.update(output, result)``.
    Whatever happens, the memory holds no sequence of this run afterwards.
    """
    pending = deque(sorted(arrivals, key=lambda pair: pair[0]))  # stable: ties keep their order
    step = 0
    try:
        while (pending or scheduler.has_unfinished) and (max_steps is None or step < max_steps):
            while pending and pending[0][0] <= step:
                scheduler.add_request(pending.popleft()[1])
            output = scheduler.schedule()
            yield output, scheduler.update(output, runner.execute(output))
            step += 1
    finally:
        scheduler.free_all()

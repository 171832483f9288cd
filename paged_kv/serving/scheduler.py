"""The scheduler: what runs at each step of continuous batching (lessons 07, 09, 11).

One scheduler serves the engine (:class:`~paged_kv.serving.engine.Engine`, a real model behind it),
lesson 07's simulator (:func:`~paged_kv.simulation.workload.simulate`) and lesson 08's shared-prompt
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
   first, never the oldest alone): by recompute (its memory is freed, it keeps its generated
   tokens, and it goes back to the front of the queue, to prefill them after its prompt when it
   resumes) or by swap (its K/V goes to host memory and it waits in
   the swapped queue, ahead of every waiting request);
4. **decode**: those sequences each feed their last token and sample one more;
5. :meth:`Scheduler.update`: the sampled tokens are appended; a sequence holding
   ``max_new_tokens`` tokens finishes and frees its memory at once.

So a request with ``o`` output tokens that is never preempted runs ``o`` steps: one prefill, then
``o - 1`` decodes. A running sequence holds ``prompt + generated - 1`` tokens in the memory: its
last sampled token is the next step's input.

**A token budget** (``max_num_batched_tokens=N``, vLLM's setting of that name; lesson 09) makes it
vLLM v1's scheduler. Each request counts its ``num_computed_tokens``, the tokens whose K/V the
memory holds, and each step hands out at most ``N`` tokens so that the counts catch up with the
requests' tokens: first one token to each running decode, then what is left to prefill
**chunks**: the partly prefilled request first, then newly admitted ones, each taking
``min(tokens still to compute, budget left)``. Admission stops when the budget is spent, so every
admitted request takes at least one token of it: the running requests never outnumber the
budget, and a budget smaller than the decodes cannot arise (a decode always gets its token;
vLLM ensures the same by refusing a ``max_num_batched_tokens`` below ``max_num_seqs``).
A chunk that reaches the end of its prompt samples the first token; earlier chunks sample nothing.
The blocks of the whole prompt are still taken at admission, by the same admission rule; chunking
changes when the K/V is computed, not which blocks hold it. Invariant: at most one request is
partly prefilled between steps, and it is the newest running one (a chunk is cut short only when
it spends the last of the budget, so nobody is admitted after it), so "decodes first" is vLLM's
single pass over its running queue in order. Without a budget (``None``, the default) a step
prefills every admitted prompt whole.

**Recompute resumes by prefill**, with or without a budget, as the PagedAttention paper (§4.5) and
both vLLM engines do: a sequence preempted by recompute keeps the tokens it generated, its computed
count goes back to 0, and when it is admitted again it prefills its prompt *and* those tokens (in
chunks under a budget, whole without one), then samples the next token, instead of generating them
again one per step. With prefix caching its blocks are mostly still cached: freed blocks keep their
hashes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from paged_kv.serving.memory import KVMemory
from paged_kv.serving.preemption import choose_victims
from paged_kv.serving.request import SchedulerRequest
from paged_kv.validate import check_count

PREEMPTIONS = ("recompute", "swap")


class Prefill(NamedTuple):
    """A prefill chunk this step: positions ``start .. end - 1`` of a prompt (vLLM: a request's
    ``num_scheduled_tokens`` from its ``num_computed_tokens`` on).

    Without a budget a chunk is the whole uncached prompt: ``start == num_cached_tokens`` and
    ``end == num_tokens``. ``generated`` is empty except when a request preempted by recompute
    resumes: it prefills its prompt followed by the tokens it had generated.
    """

    request: SchedulerRequest
    num_cached_tokens: int
    """The leading tokens the prefix cache served when the request was admitted (0 without it)."""
    start: int
    end: int
    generated: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """The tokens this admission prefills: the prompt, and the resumed ``generated`` after it."""
        return self.request.num_prompt_tokens + len(self.generated)

    @property
    def num_new_tokens(self) -> int:
        """The tokens the chunk runs through the model, ``end - start``."""
        return self.end - self.start

    @property
    def is_first(self) -> bool:
        """Whether this is the admission's first chunk (it starts after the cached prefix)."""
        return self.start == self.num_cached_tokens

    @property
    def samples(self) -> bool:
        """Whether the chunk ends the prefill, so that its last logits sample the next token."""
        return self.end == self.num_tokens

    @property
    def token_ids(self) -> tuple[int, ...] | None:
        """The prefilled tokens' ids (prompt, then ``generated``); None when the prompt's are unknown."""
        prompt = self.request.prompt_token_ids
        return None if prompt is None else prompt + self.generated


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

    ``prefills`` are this step's prefill chunks, in admission order (the partly prefilled request
    first, then this step's admissions); ``decodes`` the sequences that decode, in admission order
    (swapped-in ones last); ``preemptions`` the sequences preempted to make room, newest first;
    ``swapped_in`` the sequences that came back from host memory. The memory has already been
    changed accordingly: prompts have their room, victims lost theirs.
    """

    step: int
    prefills: tuple[Prefill, ...] = ()
    decodes: tuple[Decode, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    swapped_in: tuple[SwapIn, ...] = ()

    @property
    def scheduled(self) -> tuple[tuple[Hashable, int], ...]:
        """``(request_id, tokens)`` for every request the step runs: decodes (1 each), then prefill
        chunks (vLLM: ``num_scheduled_tokens``)."""
        return tuple((d.request_id, 1) for d in self.decodes) + tuple(
            (p.request.request_id, p.num_new_tokens) for p in self.prefills
        )

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the model runs this step: the prefill chunks' and one per decode
        (vLLM: ``total_num_scheduled_tokens``)."""
        return sum(p.num_new_tokens for p in self.prefills) + len(self.decodes)


@dataclass(frozen=True)
class RunnerOutput:
    """What a runner computed for a :class:`SchedulerOutput`: the token each decode, and each prefill
    chunk that :attr:`~Prefill.samples`, sampled."""

    sampled: Mapping[Hashable, int]


class Runner(Protocol):
    """Computes a step: :class:`~paged_kv.serving.model_runner.ModelRunner` or a counting runner."""

    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Scheduler.update` saw at the end of a step, measured before the finished sequences leave.

    ``num_running`` counts the sequences in the step's forward pass (finishing ones included),
    ``num_waiting`` the requests added and not running nor swapped out, ``num_swapped`` those in
    host memory; ``held_tokens`` the tokens whose K/V the memory holds for the running sequences,
    their computed tokens (once per sequence, even where sequences share blocks) and
    ``reserved_tokens`` the slots the memory reserves for them.
    ``finished`` lists the requests done in this step with their generated tokens, in admission order.
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
    """A running request. Invariant: ``num_computed_tokens <= num_tokens``; while it prefills,
    ``num_computed_tokens < num_prefill_tokens`` and the memory holds room for ``num_prefill_tokens``;
    after, it decodes and ``num_computed_tokens == num_tokens - 1`` between steps."""

    request: SchedulerRequest
    generated: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    """The tokens this admission prefills: the prompt, plus the generated ones on a v1 resume."""
    num_computed_tokens: int = 0
    """Tokens whose K/V the memory holds (vLLM: ``Request.num_computed_tokens``), cached ones included."""
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens (vLLM: ``Request.num_tokens``)."""
        return self.request.num_prompt_tokens + len(self.generated)

    @property
    def prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def held(self) -> int:
        """Tokens the memory holds room for: the whole prefill while prefilling, then ``num_tokens - 1``
        (the last sampled token is the next input, not yet held)."""
        return max(self.num_prefill_tokens, self.num_tokens - 1)

    @property
    def finished(self) -> bool:
        """All ``max_new_tokens`` generated, or the last one is a stop token."""
        request, generated = self.request, self.generated
        return len(generated) == request.max_new_tokens or (
            bool(generated) and generated[-1] in request.stop_token_ids
        )

    def prefill(self, num_new: int) -> Prefill:
        """This request's next chunk of ``num_new`` tokens."""
        start = self.num_computed_tokens
        resumed = tuple(self.generated[: self.num_prefill_tokens - self.request.num_prompt_tokens])
        return Prefill(self.request, self.num_cached_tokens, start, start + num_new, resumed)


class Scheduler:
    """Continuous batching over ``memory``, a :class:`~paged_kv.serving.memory.KVMemory` (see the module).

    ``preemption`` is ``"recompute"`` or ``"swap"`` (which needs ``memory.can_swap``);
    ``max_num_seqs`` (None: no limit) caps the running sequences, and ``max_num_batched_tokens``
    (None: no budget) the tokens a step runs, as vLLM's settings of those names (see the module).
    Requests are added with :meth:`add_request` and wait, oldest first.

    Invariant between steps: every added request is in exactly one of waiting, running, swapped
    or finished, and the memory holds exactly the running sequences; under a budget, every step
    runs at most ``max_num_batched_tokens`` tokens, the running requests are at most that many
    (each one runs every step) and at most one of them is partly prefilled, the newest.

    Raises:
        ValueError: a bad ``preemption``, ``max_num_seqs`` or ``max_num_batched_tokens`` (a
            positive integer), named.
    """

    def __init__(
        self,
        memory: KVMemory,
        *,
        preemption: str = "recompute",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {preemption!r}")
        if preemption == "swap" and not memory.can_swap:
            raise ValueError(
                "preemption='swap' needs a cache with swap_out(seq_id) and swap_in(seq_id, saved), "
                "but this memory cannot swap; use preemption='recompute'"
            )
        self.max_num_seqs = (
            None if max_num_seqs is None else check_count("max_num_seqs", max_num_seqs, minimum=1)
        )
        self.max_num_batched_tokens = check_budget(max_num_batched_tokens)
        self.memory = memory
        self.preemption = preemption
        self.waiting: deque[SchedulerRequest] = deque()  # arrived, not admitted, oldest first
        self.swapped: deque[tuple[_Running, object]] = deque()  # in admission order
        self.running: list[_Running] = []  # in admission order, the newest last
        self._resumed: dict[Hashable, list[int]] = {}  # waiting v1 victims' generated tokens
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
        """Decide this step: swap-ins, decodes and prefill chunks under the budget, admissions,
        preemptions (see the module); then advance each scheduled request's computed tokens.

        Raises:
            RuntimeError: nothing runs while requests wait that do not fit (a memory whose free
                count is wrong); or the cache reports cached tokens outside ``0 .. n - 1``.
        """
        decoding = [s for s in self.running if not s.prefilling]  # this step's admissions prefill
        swapped_in = self._swap_in(decoding)
        budget = self.max_num_batched_tokens
        if budget is not None:  # never below 0: the running requests never outnumber the budget
            budget -= len(decoding)
        chunks: list[tuple[_Running, int]] = []
        for seq in self.running:  # the partly prefilled one (at most one, the newest)
            if seq.prefilling and budget != 0:
                budget = self._chunk(seq, budget, chunks)
        admitted = [] if self.swapped else self._admit(budget, chunks)
        if not self.running and (self.waiting or self.swapped):
            raise RuntimeError(
                f"step {self._step}: nothing runs, yet the next request does not fit in the "
                f"{self.memory.describe_free()}"
            )
        preemptions = self._make_room(decoding, admitted)
        chunks = [(seq, n) for seq, n in chunks if seq in self.running]
        decoding = [seq for seq in decoding if seq in self.running]
        prefills = tuple(seq.prefill(n) for seq, n in chunks)
        decodes = tuple(Decode(s.request.request_id, s.generated[-1]) for s in decoding)
        for seq, n in chunks:  # vLLM advances num_computed_tokens when it schedules (_update_after_schedule)
            seq.num_computed_tokens += n
        for seq in decoding:
            seq.num_computed_tokens += 1
        return SchedulerOutput(self._step, prefills, decodes, preemptions, swapped_in)

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> StepResult:
        """Take the tokens the runner sampled for ``output``; finish the sequences that are done.

        Only the decodes and the chunks that end their prefill sample (vLLM discards what a
        partial chunk's last position predicts).

        Raises:
            ValueError: ``output`` is not this step's, or ``result`` lacks a token for one of its
                decodes or sampling chunks; nothing changes.
        """
        if not isinstance(output, SchedulerOutput) or output.step != self._step:
            raise ValueError(f"output must be the SchedulerOutput of step {self._step}, got {output!r}")
        ids = {p.request.request_id for p in output.prefills if p.samples} | {
            d.request_id for d in output.decodes
        }
        missing = [i for i in ids if i not in result.sampled]
        if missing:
            raise ValueError(f"the runner's result has no sampled token for {missing!r}")
        for seq in self.running:
            if seq.request.request_id in ids:
                seq.generated.append(int(result.sampled[seq.request.request_id]))
        step = StepResult(
            self._step,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            held_tokens=sum(seq.num_computed_tokens for seq in self.running),
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

    def _admit(self, budget: int | None, chunks: list[tuple[_Running, int]]) -> list[_Running]:
        """Admit waiting requests, first come first served, while they fit and the budget lasts;
        each gets its first chunk this step (its whole prefill without a budget)."""
        admitted = []
        while self.waiting and budget != 0 and self._has_room():
            request = self.waiting[0]
            generated = self._resumed.get(request.request_id, [])
            view = _resuming(request, generated)
            if not self.memory.can_admit(view, len(self.running)):
                break
            self.waiting.popleft()
            self._resumed.pop(request.request_id, None)
            cached = self.memory.add_sequence(view)
            seq = _Running(request, generated, view.num_prompt_tokens, cached, cached)
            self.running.append(seq)
            admitted.append(seq)
            budget = self._chunk(seq, budget, chunks)
        return admitted

    @staticmethod
    def _chunk(seq: _Running, budget: int | None, chunks: list[tuple[_Running, int]]) -> int | None:
        """Give ``seq`` the next chunk the budget allows; return the budget left."""
        num_new = seq.num_prefill_tokens - seq.num_computed_tokens
        if budget is not None:
            num_new = min(num_new, budget)
            budget -= num_new
        chunks.append((seq, num_new))
        return budget

    def _has_room(self) -> bool:
        return self.max_num_seqs is None or len(self.running) < self.max_num_seqs

    def _make_room(self, decoding: list[_Running], admitted: list[_Running]) -> tuple[Preemption, ...]:
        """Preempt the newest sequences until the decode step of ``decoding`` fits in the free blocks.

        :func:`~paged_kv.serving.preemption.choose_victims` names the victims; they are preempted
        one at a time and the rest counted again, because a victim that shares blocks (prefix
        caching) frees fewer than it holds. Only the decodes take blocks: a prefill's blocks were
        taken at admission.
        """
        preempted = []
        decoding_ids = {s.request.request_id for s in decoding}
        while True:
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
            preempted.append(self._preempt(victim, fresh=victim in admitted))

    def _preempt(self, victim: _Running, fresh: bool) -> Preemption:
        """Swap out or free ``victim`` (one still prefilling is always requeued; ``fresh``: admitted
        this step, so it threw nothing away). A requeued one keeps its generated tokens, to prefill
        them when it resumes."""
        request_id = victim.request.request_id
        if self.preemption == "swap" and not victim.prefilling:
            self.swapped.appendleft((victim, self.memory.swap_out(request_id)))  # older victims come first
            return Preemption(request_id, "swap", victim.held)
        self.memory.free(request_id)
        self.waiting.appendleft(victim.request)
        if victim.generated:
            self._resumed[request_id] = victim.generated
        return Preemption(request_id, "recompute", 0 if fresh else victim.num_computed_tokens)

    def _finish(self) -> tuple[tuple[Hashable, tuple[int, ...]], ...]:
        done = [seq for seq in self.running if seq.finished]
        for seq in done:
            self.memory.free(seq.request.request_id)
        self.running = [seq for seq in self.running if seq not in done]
        return tuple((seq.request.request_id, tuple(seq.generated)) for seq in done)


def check_budget(max_num_batched_tokens: object) -> int | None:
    """``max_num_batched_tokens`` as an int of at least 1, or None (no budget); a ValueError naming it."""
    if max_num_batched_tokens is None:
        return None
    return check_count("max_num_batched_tokens", max_num_batched_tokens, minimum=1)


def _resuming(request: SchedulerRequest, generated: Sequence[int]) -> SchedulerRequest:
    """The request as the memory sees it when it resumes with ``generated`` tokens to prefill after
    its prompt: a prompt of both, and the tokens still to generate (itself when ``generated`` is empty)."""
    if not generated:
        return request
    prompt = request.prompt_token_ids
    return replace(
        request,
        num_prompt_tokens=request.num_prompt_tokens + len(generated),
        max_new_tokens=request.max_new_tokens - len(generated),
        prompt_token_ids=None if prompt is None else prompt + tuple(generated),
    )


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

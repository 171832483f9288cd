"""A concurrent serving workload: paged blocks against contiguous reservation, step by step (lesson 07).

Requests arrive, wait, are admitted, prefill, decode one token per step and finish; a finished
sequence releases its memory at once (continuous batching). :func:`simulate` serves a list of
requests with one memory policy and records, every step, how many sequences run and how much memory
they hold and reserve. It runs the package's one scheduler,
:class:`~paged_kv.serving.scheduler.Scheduler`, the engine's, with a runner that runs no model and
only counts tokens (:class:`~paged_kv.serving.model_runner.CountingRunner`), so it counts steps and
tokens exactly as lesson 09's engine does. The policies:

* :class:`PagedPolicy` (vLLM): blocks of ``block_size`` tokens, taken on demand from a
  :class:`BlockBookkeeping` (the engine's paged memory with no model behind it), admitted by the
  engine's rule (vLLM's: the whole prompt's blocks are free); when a decode step finds too few free
  blocks, the most recently admitted sequence is preempted by recompute.
* :class:`ContiguousPolicy` (the paper's Orca baselines): one contiguous range per sequence,
  reserved at admission, of the maximum model length (``"max"``, Orca (Max)), the prompt plus the
  next power of two of its output, at most twice the output (``"pow2"``, Orca (Pow2)), or exactly its
  final length (``"oracle"``, Orca (Oracle), which no real engine can know in advance);
  :func:`reserved_tokens` is that size.
  The ranges are laid out first fit in one linear address space
  (:mod:`paged_kv.simulation.contiguous`), so the free slots split into holes.

Every step, the simulation also splits the memory into token states, reservation, internal and
external fragmentation (:mod:`paged_kv.simulation.shares`); :attr:`SimulationResult.memory_shares`
sums them as the paper's Figure 2 does. :func:`sample_requests` draws seeded synthetic lengths
shaped like ShareGPT or Alpaca, and :func:`compare_policies` with :func:`format_table` puts the
four policies side by side.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_coordinator import BlockIds
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.core.trace import TraceFrame, allocate_caption, free_caption, start_caption, token_caption
from paged_kv.progress import progress_bar
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.outputs import ModelRunnerOutput, SchedulerOutput
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler, run_steps
from paged_kv.simulation.contiguous import FirstFitMemory
from paged_kv.simulation.shares import MemoryShares, SlotUse
from paged_kv.validate import check_count, check_hashable

# ------------------------------------------------------------------------------------ the requests


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class LengthDistribution:
    """Log-normal prompt and output lengths, rounded and clipped to ``[1, max_prompt]``/``[1, max_output]``.

    Clipping alone would pull the mean below its target (the long tail is cut off), so the
    log-normal's location is solved for so that the *clipped* mean is ``mean_prompt`` or
    ``mean_output``; rounding moves a sample's mean by a fraction of a token more. ``sigma`` is the
    spread of the log of a length. ``max_prompt + max_output`` is the model's maximum length.
    """

    name: str
    mean_prompt: float
    mean_output: float
    max_prompt: int
    max_output: int
    sigma: float = 1.0

    def __post_init__(self) -> None:
        for part in ("prompt", "output"):
            high = check_count(f"max_{part}", getattr(self, f"max_{part}"), minimum=2)
            mean = getattr(self, f"mean_{part}")
            if not _is_real(mean) or not 1 < mean < high:
                raise ValueError(
                    f"mean_{part} must lie strictly between 1 and max_{part} ({high}), got {mean!r}"
                )
        if not _is_real(self.sigma) or not self.sigma > 0:
            raise ValueError(f"sigma must be a positive number, got {self.sigma!r}")

    @property
    def max_model_len(self) -> int:
        """The longest sequence the workload can hold: ``max_prompt + max_output``."""
        return self.max_prompt + self.max_output


SHAREGPT = LengthDistribution("sharegpt", mean_prompt=161, mean_output=338, max_prompt=1024, max_output=1024)
ALPACA = LengthDistribution("alpaca", mean_prompt=19, mean_output=58, max_prompt=256, max_output=256)
WORKLOADS: dict[str, LengthDistribution] = {dist.name: dist for dist in (SHAREGPT, ALPACA)}


@dataclass(frozen=True)
class Request:
    """One request: it arrives at ``arrival_step`` with a prompt and will generate ``output_tokens``."""

    request_id: Hashable
    arrival_step: int
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        check_hashable("request_id", self.request_id)
        check_count("arrival_step", self.arrival_step)
        check_count("prompt_tokens", self.prompt_tokens, minimum=1)
        check_count("output_tokens", self.output_tokens, minimum=1)

    @property
    def total_tokens(self) -> int:
        """The final length of the sequence: prompt plus output."""
        return self.prompt_tokens + self.output_tokens


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """``E[min(max(X, low), high)]`` for ``X = exp(mu + sigma * Z)``, ``Z`` standard normal."""
    a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
    inside = math.exp(mu + sigma**2 / 2) * (_normal_cdf(b - sigma) - _normal_cdf(a - sigma))
    return low * _normal_cdf(a) + inside + high * (1.0 - _normal_cdf(b))


def _location_for_mean(mean: float, sigma: float, high: int) -> float:
    """The ``mu`` whose log-normal, clipped to ``[1, high]``, has mean ``mean`` (by bisection)."""
    lo, hi = -10.0 * sigma, math.log(high) + 10.0 * sigma
    for _ in range(100):  # the clipped mean grows with mu, from 1 to high
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _clipped_lognormal_mean(mid, sigma, 1, high) < mean else (lo, mid)
    return (lo + hi) / 2


def _workload(workload: LengthDistribution | str) -> LengthDistribution:
    if isinstance(workload, LengthDistribution):
        return workload
    if isinstance(workload, str) and workload in WORKLOADS:
        return WORKLOADS[workload]
    raise ValueError(f"workload must be a LengthDistribution or one of {sorted(WORKLOADS)}, got {workload!r}")


def sample_requests(
    workload: LengthDistribution | str, num_requests: int, seed: int = 0, arrival_rate: float | None = None
) -> list[Request]:
    """Draw ``num_requests`` requests, ids ``0 .. num_requests - 1``, seeded by ``seed``.

    Arrivals form a Poisson process of ``arrival_rate`` requests per step (exponential gaps; the
    arrival step is the time rounded down); with ``arrival_rate=None`` every request arrives at
    step 0. The same seed gives the same lengths whatever the arrival rate.
    """
    dist = _workload(workload)
    num_requests = check_count("num_requests", num_requests)
    seed = check_count("seed", seed)
    if arrival_rate is not None and not (_is_real(arrival_rate) and 0 < arrival_rate < math.inf):
        raise ValueError(
            f"arrival_rate must be a positive number of requests per step or None, got {arrival_rate!r}"
        )
    rng, arrival_rng = random.Random(seed), random.Random(f"arrivals {seed}")  # two independent streams
    mu_prompt = _location_for_mean(dist.mean_prompt, dist.sigma, dist.max_prompt)
    mu_output = _location_for_mean(dist.mean_output, dist.sigma, dist.max_output)
    requests, time = [], 0.0
    for request_id in range(num_requests):
        prompt = min(dist.max_prompt, max(1, round(rng.lognormvariate(mu_prompt, dist.sigma))))
        output = min(dist.max_output, max(1, round(rng.lognormvariate(mu_output, dist.sigma))))
        if arrival_rate is not None:
            time += arrival_rng.expovariate(arrival_rate)
        requests.append(Request(request_id, math.floor(time), prompt, output))
    return requests


# ------------------------------------------------------------------------------------ the policies


@dataclass(frozen=True)
class PagedPolicy:
    """Blocks of ``block_size`` tokens, taken when a sequence's last block is full.

    A request is admitted by the engine's rule (vLLM's): its whole prompt's blocks are free, with no
    block kept back for the running sequences' growth. Only the prompt's blocks are taken.
    """

    block_size: int = 16

    def __post_init__(self) -> None:
        check_count("block_size", self.block_size, minimum=1)

    @property
    def name(self) -> str:
        """``"vLLM (blocks of 16)"``: the paged policy, named after the paper's system."""
        return f"vLLM (blocks of {self.block_size})"

    def peak_tokens(self, request: Request) -> int:
        """The most slots the sequence ever reserves: its final length, rounded up to whole blocks."""
        return blocks_for_tokens(request.total_tokens, self.block_size) * self.block_size

    def capacity(self, budget_tokens: int) -> int:
        """The slots of the ``budget_tokens // block_size`` whole blocks the budget holds."""
        return budget_tokens // self.block_size * self.block_size

    def memory(self, budget_tokens: int, record: bool = False) -> BlockBookkeeping:
        """The ``budget_tokens // block_size`` blocks of the budget as the scheduler's memory, in a
        pool of one block more: its null block (block 0), which holds no request's tokens."""
        return BlockBookkeeping(budget_tokens // self.block_size + 1, self.block_size, record=record)


CONTIGUOUS_KINDS = ("max", "pow2", "oracle")
CONTIGUOUS_NAMES = {"max": "Max", "pow2": "Pow2", "oracle": "Oracle"}
"""How the paper names each kind: Orca (Max), Orca (Pow2), Orca (Oracle)."""


def next_power_of_two(n: int) -> int:
    """The smallest power of two that is at least ``n`` (``n >= 1``): 16 stays 16, 17 gives 32, 1 gives 1."""
    return 1 << (check_count("n", n, minimum=1) - 1).bit_length()


def _check_kind(kind: object) -> str:
    if kind not in CONTIGUOUS_KINDS:
        raise ValueError(f"kind must be one of {CONTIGUOUS_KINDS}, got {kind!r}")
    return kind  # type: ignore[return-value]


def reserved_tokens(
    kind: str, prompt_tokens: int, output_tokens: int, max_model_len: int | None = None
) -> int:
    """The slots a contiguous reservation of ``kind`` takes for a request, once, at admission.

    The slot cannot grow later, so it holds at least the final length ``prompt_tokens +
    output_tokens``: ``"max"`` reserves ``max_model_len`` whatever the request, ``"oracle"`` exactly
    the final length, and ``"pow2"``, as the vLLM paper's Orca (Pow2), the prompt plus the next power
    of two of the output, so the room for outputs is less than twice the output (no room for no
    output), and at most ``max_model_len`` when that is given. Each is at least the final length
    and, given ``max_model_len``, at most it.

    >>> [reserved_tokens(kind, 100, 200, 2048) for kind in ("max", "pow2", "oracle")]
    [2048, 356, 300]
    >>> reserved_tokens("pow2", 7, 25)  # the paper's example: 32 positions for a 25-token output
    39

    Raises:
        ValueError: ``kind`` is not one of :data:`CONTIGUOUS_KINDS`; a length is not an integer
            (``prompt_tokens`` at least 1, ``output_tokens`` at least 0); ``max_model_len`` is
            missing for ``"max"``; or the final length is over ``max_model_len``.
    """
    kind = _check_kind(kind)
    prompt_tokens = check_count("prompt_tokens", prompt_tokens, minimum=1)
    output_tokens = check_count("output_tokens", output_tokens)
    total = prompt_tokens + output_tokens
    if max_model_len is None:
        if kind == "max":
            raise ValueError("max_model_len is needed for kind 'max'")
    elif total > check_count("max_model_len", max_model_len, minimum=1):
        raise ValueError(f"{total} tokens (prompt + output) is more than max_model_len {max_model_len}")
    if kind == "oracle":
        return total
    if kind == "pow2":
        pow2 = prompt_tokens + (next_power_of_two(output_tokens) if output_tokens else 0)
        return pow2 if max_model_len is None else min(pow2, max_model_len)
    return max_model_len  # type: ignore[return-value]  # "max" has one: checked above


@dataclass(frozen=True)
class ContiguousPolicy:
    """One contiguous range per sequence, reserved whole at admission and held until it finishes.

    ``kind`` is ``"max"`` (``max_model_len`` slots for everyone), ``"pow2"`` (the prompt plus the
    next power of two of the output, at most ``max_model_len`` when that is given) or ``"oracle"``
    (exactly the final length): the paper's Orca (Max), Orca (Pow2) and Orca (Oracle). ``"max"`` needs
    ``max_model_len``. The ranges are laid out first fit in one address space
    (:class:`~paged_kv.simulation.contiguous.FirstFitMemory`), so a request waits when no hole
    holds its range; ``compact=True`` closes the holes instead, whenever that admits a request.
    """

    kind: str
    max_model_len: int | None = None
    compact: bool = False

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if self.max_model_len is not None:
            check_count("max_model_len", self.max_model_len, minimum=1)
        elif self.kind == "max":
            raise ValueError("max_model_len is needed for kind 'max'")
        if not isinstance(self.compact, bool):
            raise ValueError(f"compact must be True or False, got {self.compact!r}")

    @property
    def name(self) -> str:
        """The paper's name: ``"Orca (Max)"``, ``"Orca (Pow2)"``, ``"Orca (Oracle)"``, + ``", compacted"``."""
        name = f"Orca ({CONTIGUOUS_NAMES[self.kind]})"
        return f"{name}, compacted" if self.compact else name

    def reservation(self, request: Request) -> int:
        """The slots reserved for ``request`` at admission: :func:`reserved_tokens` of its lengths."""
        try:
            return reserved_tokens(
                self.kind, request.prompt_tokens, request.output_tokens, self.max_model_len
            )
        except ValueError as error:
            raise ValueError(f"request {request.request_id!r}: {error}") from None

    def peak_tokens(self, request: Request) -> int:
        """The most slots the sequence ever reserves: its reservation."""
        return self.reservation(request)

    def capacity(self, budget_tokens: int) -> int:
        """The slots a contiguous policy may reserve: the whole budget."""
        return budget_tokens

    def memory(self, budget_tokens: int, record: bool = False) -> FirstFitMemory:
        """One address space of ``budget_tokens`` slots, one :meth:`reservation` per sequence, first fit.

        ``record`` records nothing: only the paged memory has frames to animate.
        """
        return FirstFitMemory(budget_tokens, lambda r: self.reservation(_request(r)), compact=self.compact)


Policy = PagedPolicy | ContiguousPolicy


class BlockBookkeeping(KVCacheManager):
    """Paged blocks with no model and no tensor behind them: the memory the simulators' scheduler
    takes blocks from (lessons 07, 08).

    It is the engine's :class:`~paged_kv.core.kv_cache_manager.KVCacheManager`, ``num_blocks``
    blocks (its null block among them) of one group, so the blocks are taken, shared, cached and
    freed exactly as in the engine. ``record=True`` keeps a frame of the pool after each allocation
    and release for an animation (:attr:`trace`): a request's admission, each step's tokens (a
    frame names the block the step opened, or the last one it filled), each finished request.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = False,
        watermark: float = 0.0,
        record: bool = False,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching=enable_caching, watermark=watermark)
        self.record = record
        self._frames: list[TraceFrame] = []
        if record:
            self._frames.append(
                TraceFrame(self.snapshot(), start_caption(num_blocks, block_size), "start", None, ())
            )

    @property
    def trace(self) -> list[TraceFrame]:
        """The recorded frames (empty unless built with ``record=True``)."""
        return list(self._frames)

    def allocate_slots(
        self, request: EngineCoreRequest, num_new_tokens: int, *args, **kwargs
    ) -> BlockIds | None:
        new = request.request_id not in self
        gained = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        if self.record and gained is not None:
            self._record_allocation(request.request_id, new, gained[0])
        return gained

    def free(self, request_id: Hashable) -> None:
        held = self.get_block_ids(request_id)[0] if self.record and request_id in self else None
        super().free(request_id)
        if held is not None:
            freed = [b for b in held if self.block_pool.is_free(b)]
            frame = TraceFrame(
                self.snapshot(), free_caption(request_id, held, freed), "free", request_id, held
            )
            self._frames.append(frame)

    def sequences(self) -> dict[Hashable, tuple[int, int]]:
        """Each request's ``(tokens held, slots reserved)``: its length, and its blocks' slots."""
        size = self.block_size
        return {r: (self.num_tokens(r), len(self.get_block_ids(r)[0]) * size) for r in self.request_ids}

    def _record_allocation(self, request_id: Hashable, new: bool, gained: tuple[int, ...]) -> None:
        snapshot = self.snapshot()
        num_tokens = self.num_tokens(request_id)
        if new:
            caption, kind, highlight = allocate_caption(request_id, num_tokens, gained), "allocate", gained
        else:
            last = gained[-1] if gained else self.get_block_ids(request_id)[0][-1]
            caption = token_caption(request_id, num_tokens, last, bool(gained))
            kind, highlight = ("new_block" if gained else "append"), (last,)
        self._frames.append(TraceFrame(snapshot, caption, kind, request_id, tuple(highlight)))


def sequences_that_fit(requests: Sequence[Request], policy: Policy, budget_tokens: int) -> int:
    """How many of the first requests fit in ``budget_tokens`` at once, each at its final length."""
    capacity, used = policy.capacity(check_count("budget_tokens", budget_tokens)), 0
    for count, request in enumerate(requests):
        used += policy.peak_tokens(request)
        if used > capacity:
            return count
    return len(requests)


# ---------------------------------------------------------------------------------- the simulation


@dataclass
class SimulationResult:
    """What :func:`simulate` saw: totals, and one entry per step in each series.

    ``running``, ``held_tokens``, ``reserved_tokens`` and ``slot_use`` are measured during the
    step's forward pass (finishing sequences included); ``waiting`` counts requests that have
    arrived but do not run; ``finished`` counts requests done by the end of the step.
    ``slot_use[t]`` splits the ``budget_tokens`` slots of step ``t`` four ways
    (:class:`~paged_kv.simulation.shares.SlotUse`); ``blocked_by_holes`` counts the steps at which
    the request at the front of the queue waited although the free slots in all would have held
    its contiguous range (external fragmentation; always 0 for paged and compacted memories).
    Invariants: ``held_tokens[t] <= reserved_tokens[t] <= budget_tokens``, ``slot_use[t]`` sums
    to ``budget_tokens`` with ``slot_use[t].token_states == held_tokens[t]``, and ``finished``
    never decreases.
    """

    policy: str
    budget_tokens: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    preemptions: int = 0
    blocked_by_holes: int = 0
    trace: list[TraceFrame] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    held_tokens: list[int] = field(default_factory=list)
    reserved_tokens: list[int] = field(default_factory=list)
    slot_use: list[SlotUse] = field(default_factory=list)

    @property
    def memory_shares(self) -> MemoryShares:
        """Token states, reservation, internal and external fragmentation, in slot-steps, over the
        steps at which a request waited (:mod:`paged_kv.simulation.shares` defines them)."""
        waited = (use for use, waiting in zip(self.slot_use, self.waiting, strict=True) if waiting)
        return MemoryShares.measure(waited, self.budget_tokens)

    @property
    def steps(self) -> int:
        """Steps simulated: until the last request finished, or ``max_steps``."""
        return len(self.running)

    @property
    def all_finished(self) -> bool:
        return self.num_requests == (self.finished[-1] if self.finished else 0)

    @property
    def utilization(self) -> list[float]:
        """Held / reserved at each step, 0.0 when nothing is reserved."""
        return [h / r if r else 0.0 for h, r in zip(self.held_tokens, self.reserved_tokens, strict=True)]

    @property
    def mean_running(self) -> float:
        return sum(self.running) / self.steps if self.steps else 0.0

    @property
    def peak_running(self) -> int:
        return max(self.running, default=0)

    @property
    def mean_utilization(self) -> float:
        """Held / reserved averaged over the steps that reserve something."""
        busy = [u for u, r in zip(self.utilization, self.reserved_tokens, strict=True) if r]
        return sum(busy) / len(busy) if busy else 0.0

    @property
    def peak_reserved_tokens(self) -> int:
        return max(self.reserved_tokens, default=0)

    @property
    def throughput(self) -> float:
        """Output tokens per step (a preempted sequence's recomputed tokens are not counted twice)."""
        return self.output_tokens / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, object]:
        """The figures of :func:`format_table`'s row, ``blocked_by_holes`` and ``memory_shares``, for JSON."""
        return {
            "policy": self.policy,
            "steps": self.steps,
            "mean_running": self.mean_running,
            "peak_running": self.peak_running,
            "mean_utilization": self.mean_utilization,
            "tokens_per_step": self.throughput,
            "preemptions": self.preemptions,
            "blocked_by_holes": self.blocked_by_holes,
            "memory_shares": self.memory_shares.as_dict(),
        }


def _request(request: EngineCoreRequest) -> Request:
    """A scheduler's request back as a :class:`Request` (for a policy's reservation)."""
    return Request(request.request_id, 0, request.num_prompt_tokens, request.max_tokens)


def simulate(
    requests: Sequence[Request],
    policy: Policy,
    budget_tokens: int,
    *,
    max_steps: int = 1_000_000,
    progress: bool = False,
    record: bool = False,
) -> SimulationResult:
    """Serve ``requests`` with ``policy`` in ``budget_tokens`` token slots, one step at a time.

    Each step is one step of the engine's :class:`~paged_kv.serving.scheduler.Scheduler` over the
    policy's memory, with a runner that counts tokens instead of running a model:

    1. requests whose ``arrival_step`` has come join the back of the waiting queue;
    2. the sequences already running decode one token each, in admission order. Paged: a sequence
       whose last block is full takes a new one when its token is scheduled; when none is free,
       the most recently admitted sequences are preempted by recompute (their blocks are freed,
       they go back to the front of the queue and will prefill their prompt and the tokens they
       had generated when they resume), counted in ``preemptions``;
    3. if nobody was preempted, waiting requests are admitted first come first served while they
       fit, stopping at the first that does not (paged: the whole prompt's blocks are free;
       contiguous: a hole holds the reservation, first fit); an admitted request prefills, which
       samples its first output token;
    4. the step is recorded, with the split of the memory into token states, reservation, internal
       and external fragmentation (``result.slot_use``); then a sequence that holds all its
       output tokens finishes and frees its memory at once.

    A request with ``o`` output tokens thus runs for ``o`` steps if it is never preempted, as in
    the engine. Runs until every request has finished, or for ``max_steps`` steps.
    ``progress=True`` shows a tqdm bar of finished requests. ``record=True`` keeps the paged
    allocator's frames in ``result.trace``, one per allocation, token and release, for an
    animation (the contiguous policies record nothing).

    Raises:
        ValueError: a bad argument, or a request that could not be served in ``budget_tokens`` alone.
    """
    budget_tokens = check_count("budget_tokens", budget_tokens, minimum=1)
    max_steps = check_count("max_steps", max_steps)
    if not isinstance(policy, PagedPolicy | ContiguousPolicy):
        raise ValueError(f"policy must be a PagedPolicy or a ContiguousPolicy, got {policy!r}")
    requests = list(requests)
    if not all(isinstance(r, Request) for r in requests):
        raise ValueError("requests must all be Request objects")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("requests must have distinct request_id values")
    if policy.capacity(budget_tokens) == 0:
        culprit = f"request {requests[0].request_id!r}" if requests else "any request"
        raise ValueError(
            f"budget_tokens {budget_tokens} cannot hold {culprit} alone: {policy.name} needs one whole block"
        )
    memory = policy.memory(budget_tokens, record)
    arrivals = [
        (r.arrival_step, EngineCoreRequest(r.request_id, r.prompt_tokens, r.output_tokens)) for r in requests
    ]
    for request, (_, scheduled) in zip(requests, arrivals, strict=True):  # else it would wait for ever
        if request.total_tokens - 1 > memory.max_tokens(scheduled):
            raise ValueError(
                f"budget_tokens {budget_tokens} cannot hold request {request.request_id!r} alone "
                f"with {policy.name}: it holds {request.total_tokens - 1} tokens at its longest"
            )
    result = SimulationResult(
        policy=policy.name,
        budget_tokens=budget_tokens,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_tokens for r in requests),
        output_tokens=sum(r.output_tokens for r in requests),
    )
    bar = progress_bar(len(requests), policy.name) if progress else None
    try:
        _run(memory, arrivals, max_steps, result, bar)
    finally:
        if bar is not None:
            bar.close()
    if isinstance(memory, BlockBookkeeping):
        result.trace = memory.trace
    else:
        result.blocked_by_holes = memory.blocked_by_holes
    return result


class _MeasuringRunner(CountingRunner):
    """A counting runner that splits the memory's slots (:class:`SlotUse`) once the step's tokens are in."""

    def __init__(
        self, memory: BlockBookkeeping | FirstFitMemory, final_lengths: dict[Hashable, int], capacity: int
    ) -> None:
        self.memory, self.final_lengths, self.capacity = memory, final_lengths, capacity
        self.last: SlotUse | None = None

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        sampled = super().execute_model(output)
        self.last = SlotUse.measure(
            (
                (held, reserved, self.final_lengths[seq_id])
                for seq_id, (held, reserved) in self.memory.sequences().items()
            ),
            self.capacity,
        )
        return sampled


def _run(
    memory: BlockBookkeeping | FirstFitMemory, arrivals: list, max_steps: int, result: SimulationResult, bar
) -> None:
    """The scheduler's steps over ``memory`` with a measuring runner, recorded into ``result``."""
    finished = 0
    final_lengths = {r.request_id: r.num_prompt_tokens + r.max_tokens for _, r in arrivals}
    runner = _MeasuringRunner(memory, final_lengths, result.budget_tokens)
    for output, step in run_steps(Scheduler(memory), runner, arrivals, max_steps):
        result.slot_use.append(runner.last)
        result.preemptions += len(output.preemptions)
        result.running.append(step.num_running)
        result.waiting.append(step.num_waiting)
        result.held_tokens.append(step.held_tokens)
        result.reserved_tokens.append(step.reserved_tokens)
        finished += len(step.finished)
        result.finished.append(finished)
        if bar is not None:
            bar.update(len(step.finished))


# ---------------------------------------------------------------------------------- the comparison


def compare_policies(
    workload: LengthDistribution | str = "sharegpt",
    num_requests: int = 200,
    budget_tokens: int = 32768,
    seed: int = 0,
    arrival_rate: float | None = None,
    block_size: int = 16,
) -> list[SimulationResult]:
    """Run vLLM's paged blocks and the three Orca reservations on the same sampled requests, in that order."""
    dist = _workload(workload)
    requests = sample_requests(dist, num_requests, seed, arrival_rate)
    policies: list[Policy] = [PagedPolicy(block_size)]
    policies += [ContiguousPolicy(kind, dist.max_model_len) for kind in CONTIGUOUS_KINDS]
    return [simulate(requests, policy, budget_tokens) for policy in policies]


def format_table(results: Sequence[SimulationResult]) -> str:
    """The results as an aligned plain-text table, one policy per row."""
    header = ["policy", "mean running", "peak running", "mean util %", "steps", "tokens/step", "preemptions"]
    rows = [header] + [
        [
            r.policy,
            f"{r.mean_running:.1f}",
            str(r.peak_running),
            f"{100 * r.mean_utilization:.1f}",
            str(r.steps),
            f"{r.throughput:.1f}",
            str(r.preemptions),
        ]
        for r in results
    ]
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    rows.insert(1, ["-" * width for width in widths])
    justify = [str.ljust] + [str.rjust] * (len(header) - 1)  # the policy on the left, numbers right
    return "\n".join("  ".join(j(c, w) for j, c, w in zip(justify, row, widths, strict=True)) for row in rows)

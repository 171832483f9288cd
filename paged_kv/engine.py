"""A continuous-batching engine that runs :class:`~paged_kv.model.TinyGPT` over a stream of requests.

This is :class:`~paged_kv.workload.ContinuousBatcher`'s loop with a real model behind it: requests
arrive with a prompt and a maximum output length, wait, are admitted, prefill, decode one token
per step in one batched :meth:`~paged_kv.model.TinyGPT.decode_step`, and release their memory as
soon as they finish, so a waiting request can take their place at the next step.

The memory budget is ``num_blocks * block_size`` token slots, spent one of two ways (``mode``):

* ``"paged"``: a :class:`~paged_kv.model.PagedKVCache`. A request is admitted when its prompt's
  blocks, plus a headroom of one block per running sequence (the admitted one included), are free:
  that headroom is what the next decode step can need, at most one block per sequence. Blocks are
  taken on demand as sequences grow. When a decode step still finds too few free blocks, the most
  recently admitted sequence is *preempted by recompute*: its blocks are freed, its output so far
  is dropped and it goes back to the front of the queue, to start over when it fits again (greedy
  decoding is deterministic, so it regenerates the same tokens).
* ``"contiguous"``: a :class:`~paged_kv.model.ContiguousKVCache`, with one slot of ``max_model_len``
  tokens reserved per sequence at admission, out of the same budget; a request is admitted while
  one more slot fits. A sequence never outgrows its slot, so nothing is ever preempted.

The generated text does not depend on the mode or on the batch: every request gets exactly the
tokens :func:`~paged_kv.model.generate` gives its prompt alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from ._checks import check_count, check_hashable
from .block import blocks_for_tokens
from .model import ContiguousKVCache, GPTConfig, PagedKVCache, TinyGPT, is_token
from .progress import progress_bar

MODES = ("paged", "contiguous")

# Builds the paged mode's cache: (config, num_blocks, block_size, device, dtype) -> cache. Besides
# the KVCache methods, the cache has a ``num_free_blocks`` property and ``needs_new_block(seq_id)``.
CacheFactory = Callable[[GPTConfig, int, int, torch.device, torch.dtype], PagedKVCache]


@dataclass(frozen=True)
class EngineRequest:
    """A request: ``prompt`` token ids arriving at ``arrival_step``, to generate ``max_new_tokens``.

    Decoding is greedy with no end-of-sequence token, so a request generates exactly
    ``max_new_tokens`` tokens.
    """

    request_id: Hashable
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0

    def __post_init__(self) -> None:
        check_hashable("request_id", self.request_id)
        if isinstance(self.prompt, str) or not isinstance(self.prompt, Sequence) or not self.prompt:
            raise ValueError(f"prompt of request {self.request_id!r} must be a non-empty list of token ids")
        check_count("max_new_tokens", self.max_new_tokens, minimum=1)
        check_count("arrival_step", self.arrival_step)


@dataclass
class EngineResult:
    """What :meth:`Engine.run` produced and saw.

    ``tokens[request_id]`` is the request's generated token ids. The per-step lists are measured
    after the step's decode, before finished sequences leave: ``running`` sequences, ``waiting``
    requests (arrived, not running), ``used_blocks`` (paged: blocks in use; contiguous: the blocks
    of the budget that the reserved slots cover, rounded up), ``held_tokens`` (tokens whose K/V the
    cache holds), ``reserved_tokens`` (paged: used blocks times ``block_size``; contiguous: running
    times ``max_model_len``) and ``utilisation``, held / reserved (0.0 when nothing is reserved).
    ``admitted_step`` and ``finished_step`` give, per request, the step it was (last) admitted and
    the step it finished.
    """

    mode: str
    budget_tokens: int
    tokens: dict[Hashable, list[int]] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    used_blocks: list[int] = field(default_factory=list)
    held_tokens: list[int] = field(default_factory=list)
    reserved_tokens: list[int] = field(default_factory=list)
    utilisation: list[float] = field(default_factory=list)
    admitted_step: dict[Hashable, int] = field(default_factory=dict)
    finished_step: dict[Hashable, int] = field(default_factory=dict)
    preemptions: int = 0

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
    def mean_utilisation(self) -> float:
        """Utilisation averaged over the steps that reserve something."""
        busy = [u for u, r in zip(self.utilisation, self.reserved_tokens, strict=True) if r]
        return sum(busy) / len(busy) if busy else 0.0


@dataclass(eq=False)  # compared by identity
class _Running:
    request: EngineRequest
    generated: list[int]  # the last one is not in the cache yet: it is the next decode input

    @property
    def held(self) -> int:
        return len(self.request.prompt) + len(self.generated) - 1


class Engine:
    """Continuous batching of :class:`EngineRequest` objects on ``model``; see the module docstring.

    ``max_model_len`` (default: the model's ``max_len``) bounds prompt plus output of any request
    and is the slot size of the contiguous mode. ``device`` defaults to the model's and must be it.
    ``cache_factory`` builds the paged mode's cache (default :class:`~paged_kv.model.PagedKVCache`);
    lesson 09 plugs in a cache of the learner's own through it.

    Raises:
        ValueError: a bad argument, named in the message.
    """

    def __init__(
        self,
        model: TinyGPT,
        *,
        num_blocks: int,
        block_size: int = 16,
        mode: str = "paged",
        max_model_len: int | None = None,
        device: str | torch.device | None = None,
        cache_factory: CacheFactory | None = None,
    ) -> None:
        if not isinstance(model, TinyGPT):
            raise ValueError(f"model must be a TinyGPT, got {type(model).__name__}")
        self.model = model
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = check_count("block_size", block_size, minimum=1)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        if cache_factory is not None and not callable(cache_factory):
            raise ValueError(f"cache_factory must be callable, got {cache_factory!r}")
        if cache_factory is not None and mode != "paged":
            raise ValueError("cache_factory builds the paged mode's cache: use it with mode='paged'")
        self.cache_factory = PagedKVCache if cache_factory is None else cache_factory
        limit = model.config.max_len
        self.max_model_len = (
            limit if max_model_len is None else check_count("max_model_len", max_model_len, minimum=1)
        )
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_len {limit}")
        if mode == "contiguous" and self.max_model_len > self.budget_tokens:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit the budget of num_blocks * block_size "
                f"= {self.budget_tokens} token slots: contiguous mode could admit nothing"
            )
        model_device = next(model.parameters()).device
        self.device = model_device if device is None else torch.device(device)
        if self.device != model_device:
            raise ValueError(
                f"device {self.device} differs from the model's {model_device}; call model.to(device)"
            )

    @property
    def budget_tokens(self) -> int:
        """The memory budget in token slots, ``num_blocks * block_size``, in both modes."""
        return self.num_blocks * self.block_size

    def run(self, requests: Sequence[EngineRequest], progress: bool = False) -> EngineResult:
        """Serve ``requests`` until every one has finished; ``progress=True`` shows a tqdm bar.

        Each step: (1) arrivals join the back of the queue; (2) requests are admitted first come
        first served while they fit, stopping at the first that does not, and each admitted prompt
        is prefilled, its first token coming from the prefill logits; (3) the sequences running
        before this step's admissions decode one token each in one batched call (paged: preempting
        the newest sequence while the blocks they need are not free); (4) the step is recorded,
        and a sequence holding ``max_new_tokens`` generated tokens finishes and frees its memory.

        Raises:
            ValueError: a request that is not an :class:`EngineRequest`, a repeated ``request_id``,
                a bad token id, or a request too long for ``max_model_len`` or for the budget alone.
        """
        requests = self._check_requests(requests)
        if self.mode == "paged":
            cache = self.cache_factory(
                self.model.config, self.num_blocks, self.block_size, self.device, self.model.head.weight.dtype
            )
        else:
            cache = ContiguousKVCache(self.model.config, self.device)
        result = EngineResult(self.mode, self.budget_tokens)
        arrivals = deque(sorted(requests, key=lambda r: r.arrival_step))  # stable: ties keep their order
        waiting: deque[EngineRequest] = deque()
        running: list[_Running] = []  # in admission order
        bar = progress_bar(len(requests), f"engine ({self.mode})") if progress else None
        step = 0
        try:
            with torch.no_grad():
                while len(result.finished_step) < len(requests):
                    while arrivals and arrivals[0].arrival_step <= step:
                        waiting.append(arrivals.popleft())
                    decoding = list(running)  # this step's newcomers get their token from prefill
                    while waiting and self._fits(cache, waiting[0], len(running)):
                        request = waiting.popleft()
                        cache.add_sequence(request.request_id, len(request.prompt))
                        prompt = torch.tensor(request.prompt, device=self.device)
                        logits = self.model.prefill(prompt, request.request_id, cache)
                        running.append(_Running(request, [int(logits[-1].argmax())]))
                        result.admitted_step[request.request_id] = step
                    decoding = self._make_room(cache, decoding, running, waiting, result)
                    if decoding:
                        last = torch.tensor([seq.generated[-1] for seq in decoding], device=self.device)
                        ids = [seq.request.request_id for seq in decoding]
                        next_tokens = self.model.decode_step(last, ids, cache).argmax(dim=-1).tolist()
                        for seq, token in zip(decoding, next_tokens, strict=True):
                            seq.generated.append(token)
                    self._record(cache, running, len(waiting), result)
                    done = [seq for seq in running if len(seq.generated) == seq.request.max_new_tokens]
                    for seq in done:
                        cache.free(seq.request.request_id)
                        result.tokens[seq.request.request_id] = seq.generated
                        result.finished_step[seq.request.request_id] = step
                    running = [seq for seq in running if seq not in done]
                    if bar is not None:
                        bar.update(len(done))
                    step += 1
        finally:
            for seq in running:  # only after an error: a finished run holds nothing
                cache.free(seq.request.request_id)
            if bar is not None:
                bar.close()
        result.tokens = {r.request_id: result.tokens[r.request_id] for r in requests}  # request order
        return result

    # ------------------------------------------------------------------------------ the helpers

    def _check_requests(self, requests: Sequence[EngineRequest]) -> list[EngineRequest]:
        requests = list(requests)
        if not all(isinstance(r, EngineRequest) for r in requests):
            raise ValueError("requests must all be EngineRequest objects")
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("requests must have distinct request_id values")
        vocab = self.model.config.vocab_size
        for r in requests:
            if not all(is_token(t, vocab) for t in r.prompt):
                raise ValueError(f"prompt of request {r.request_id!r} must hold token ids in [0, {vocab})")
            total = len(r.prompt) + r.max_new_tokens
            if total > self.max_model_len:
                raise ValueError(
                    f"request {r.request_id!r}: prompt ({len(r.prompt)} tokens) + max_new_tokens "
                    f"({r.max_new_tokens}) exceeds max_model_len {self.max_model_len}"
                )
            # A paged sequence alone holds at most total - 1 tokens (its last token is never fed back)
            # and is admitted with one block of headroom.
            need = blocks_for_tokens(len(r.prompt), self.block_size) + 1
            if (
                self.mode == "paged"
                and max(need, blocks_for_tokens(total - 1, self.block_size)) > self.num_blocks
            ):
                raise ValueError(f"num_blocks {self.num_blocks} cannot hold request {r.request_id!r} alone")
        return requests

    def _fits(
        self, cache: PagedKVCache | ContiguousKVCache, request: EngineRequest, num_running: int
    ) -> bool:
        """Whether ``request`` can be admitted next to ``num_running`` sequences."""
        if self.mode == "contiguous":
            return (num_running + 1) * self.max_model_len <= self.budget_tokens
        headroom = num_running + 1  # one block per sequence for the next decode step
        free = cache.num_free_blocks
        return blocks_for_tokens(len(request.prompt), self.block_size) + headroom <= free

    def _make_room(self, cache, decoding, running, waiting, result) -> list[_Running]:
        """Paged: preempt the newest sequences until the decode step's new blocks are free.

        Returns the sequences that decode (a preempted one no longer does).
        """
        if self.mode == "contiguous":
            return decoding
        while sum(cache.needs_new_block(s.request.request_id) for s in decoding) > cache.num_free_blocks:
            victim = running.pop()  # never the oldest alone: _check_requests made sure it fits
            cache.free(victim.request.request_id)
            waiting.appendleft(victim.request)
            result.preemptions += 1
            decoding = [seq for seq in decoding if seq is not victim]
        return decoding

    def _record(self, cache, running: list[_Running], num_waiting: int, result: EngineResult) -> None:
        held = sum(seq.held for seq in running)
        if self.mode == "paged":
            used = self.num_blocks - cache.num_free_blocks
            reserved = used * self.block_size
        else:
            reserved = len(running) * self.max_model_len
            used = blocks_for_tokens(reserved, self.block_size)
        result.running.append(len(running))
        result.waiting.append(num_waiting)
        result.used_blocks.append(used)
        result.held_tokens.append(held)
        result.reserved_tokens.append(reserved)
        result.utilisation.append(held / reserved if reserved else 0.0)


def plot_metrics(result: EngineResult, ax=None):
    """Running and waiting sequences per step, with utilisation on a second axis; returns ``ax``."""
    import matplotlib.pyplot as plt  # only when a plot is asked for

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    steps = range(result.steps)
    ax.plot(steps, result.running, label="running", color="#0072B2")
    ax.plot(steps, result.waiting, label="waiting", color="#E69F00", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("sequences")
    ax.set_title(f"{result.mode}: {result.budget_tokens} token slots, {result.preemptions} preemptions")
    twin = ax.twinx()
    twin.plot(steps, result.utilisation, label="utilisation", color="#009E73", linestyle=":")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("utilisation (held / reserved)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    return ax

"""A continuous-batching engine that runs :class:`~paged_kv.model.tiny_gpt.TinyGPT` over a stream of requests.

This is :class:`~paged_kv.simulation.workload.ContinuousBatcher`'s loop with a real model behind it: requests
arrive with a prompt and a maximum output length, wait, are admitted, prefill, decode one token
per step in one batched :meth:`~paged_kv.model.tiny_gpt.TinyGPT.decode_step`, and release their memory as
soon as they finish, so a waiting request can take their place at the next step.

The memory budget is ``num_blocks * block_size`` token slots, spent one of two ways (``mode``):

* ``"paged"``: a :class:`~paged_kv.model.kv_cache.PagedKVCache`. A request is admitted when its prompt's
  blocks, plus a headroom of one block per running sequence (the admitted one included), plus the
  *watermark*, ``ceil(watermark * num_blocks)`` blocks kept free, are free: the headroom is what the
  next decode step can need, at most one block per sequence; the watermark keeps room for the steps
  after it. Blocks are taken on demand as sequences grow. When a decode step still finds too few
  free blocks, the most recently admitted sequence is *preempted*, one of two ways (``preemption``):

  - ``"recompute"``: its blocks are freed, its output so far is dropped and it goes back to the
    front of the queue, to start over when it fits again (greedy decoding is deterministic, so it
    regenerates the same tokens);
  - ``"swap"``: its K/V is copied to host memory (:mod:`paged_kv.kv.swap`) and its blocks are freed; it
    waits in a *swapped* queue that comes before the waiting requests: each step, swapped sequences
    come back first (fresh blocks, K/V copied in, generated tokens kept) while they fit with the
    headroom, and no new request is admitted while any is still swapped out.

  With ``enable_prefix_caching=True`` the paged cache keeps the blocks of prompt prefixes it has
  computed (:mod:`paged_kv.core.prefix_cache`). Admission passes the prompt's token ids; a prompt whose
  leading full blocks are cached (held by a running sequence, or freed by a finished or preempted
  one and not yet reused: freed blocks count as free and are evicted least recently freed first)
  reuses them, and its prefill computes only the uncached tail, ``c .. n - 1`` for ``c`` cached
  tokens out of ``n`` (``c`` is a multiple of ``block_size`` and at most ``n - 1``). Admission still
  counts every block of the prompt as needed, as if nothing were cached. Preemption is unchanged: a
  recomputed request queries the cache again when it is admitted again, and may find its own
  blocks; a swapped-in sequence gets fresh blocks and all its K/V back, sharing nothing.

* ``"contiguous"``: a :class:`~paged_kv.model.kv_cache.ContiguousKVCache`, with one slot of ``max_model_len``
  tokens reserved per sequence at admission, out of the same budget; a request is admitted while
  one more slot fits. A sequence never outgrows its slot, so nothing is ever preempted.

The generated text depends neither on the mode, nor on the batch, nor on preemption: every request
gets exactly the tokens :func:`~paged_kv.model.generate` gives its prompt alone.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from paged_kv.core.block import blocks_for_tokens
from paged_kv.model.generate import is_token
from paged_kv.model.kv_cache import ContiguousKVCache, PagedKVCache
from paged_kv.model.tiny_gpt import GPTConfig, TinyGPT
from paged_kv.progress import progress_bar
from paged_kv.validate import check_count, check_hashable

MODES = ("paged", "contiguous")
PREEMPTIONS = ("recompute", "swap")

# Builds the paged mode's cache: (config, num_blocks, block_size, device, dtype) -> cache. Besides
# the KVCache methods, the cache has a ``num_free_blocks`` property and ``needs_new_block(seq_id)``;
# ``preemption="swap"`` also needs ``swap_out(seq_id) -> saved`` and ``swap_in(seq_id, saved)``.
# ``enable_prefix_caching=True`` calls the factory with the keyword ``enable_prefix_caching=True``
# as well, and the cache needs ``add_sequence(seq_id, num_tokens, token_ids)``,
# ``num_cached_tokens(seq_id) -> int`` and ``attend_prefill`` (see :class:`~paged_kv.model.kv_cache.KVCache`).
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
    requests (arrived, neither running nor swapped out), ``swapped`` sequences (their K/V in host
    memory), ``used_blocks`` (paged: blocks in use; contiguous: the blocks of the budget that the
    reserved slots cover, rounded up), ``held_tokens`` (tokens whose K/V the cache holds),
    ``reserved_tokens`` (paged: used blocks times ``block_size``; contiguous: running times
    ``max_model_len``) and ``utilisation``, held / reserved (0.0 when nothing is reserved).
    ``admitted_step`` and ``finished_step`` give, per request, the step it was (last) admitted and
    the step it finished (a swapped-in sequence is not admitted again).

    ``preemptions_by_reason`` counts preemptions per way (``"recompute"``, ``"swap"``) and
    :attr:`preemptions` is their total. ``recomputed_tokens`` counts the tokens whose K/V a
    recompute preemption threw away, to be computed again; ``blocks_swapped_out`` and
    ``blocks_swapped_in`` count the blocks' worth of K/V copied to host memory and back.

    ``prefill_tokens_computed`` counts the prompt tokens that prefills ran through the model (a
    request admitted again after a recompute preemption counts again). With prefix caching,
    ``prefix_cache_queries`` counts the prompt tokens looked up in the cache (every admission's
    whole prompt), ``prefix_cache_hits`` those served from it, and :attr:`hit_rate` is their ratio;
    ``prefill_tokens_computed == prefix_cache_queries - prefix_cache_hits``. Without it, both are 0.
    With prefix caching, running sequences can share blocks, which count once among the
    ``used_blocks`` and ``reserved_tokens`` but once per sequence among the ``held_tokens``, so the
    ``utilisation`` can exceed 1.0: the blocks serve more tokens than they hold.
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
    utilisation: list[float] = field(default_factory=list)
    admitted_step: dict[Hashable, int] = field(default_factory=dict)
    finished_step: dict[Hashable, int] = field(default_factory=dict)
    preemptions_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTIONS, 0))
    recomputed_tokens: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

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


@dataclass
class _Queues:
    """Where the requests of a run are; each request is in exactly one place until it finishes."""

    arrivals: deque[EngineRequest]  # not arrived yet, by arrival step
    waiting: deque[EngineRequest] = field(default_factory=deque)  # arrived, not admitted, oldest first
    swapped: deque[tuple[_Running, object]] = field(default_factory=deque)  # in admission order
    running: list[_Running] = field(default_factory=list)  # in admission order (newest last)


class Engine:
    """Continuous batching of :class:`EngineRequest` objects on ``model``; see the module docstring.

    ``max_model_len`` (default: the model's ``max_len``) bounds prompt plus output of any request
    and is the slot size of the contiguous mode. ``device`` defaults to the model's and must be it.
    ``cache_factory`` builds the paged mode's cache (default :class:`~paged_kv.model.kv_cache.PagedKVCache`);
    lesson 09 plugs in a cache of the learner's own through it. ``preemption`` (``"recompute"`` or
    ``"swap"``) and ``watermark`` (a fraction in ``[0, 1)`` of the blocks that admission keeps free)
    are settings of the paged mode, and so is ``enable_prefix_caching`` (see the module docstring),
    which a ``cache_factory`` must accept as a keyword argument.

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
        preemption: str = "recompute",
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
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
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {preemption!r}")
        self.preemption = preemption
        self.watermark = _check_watermark(watermark)
        if mode != "paged" and (preemption != "recompute" or self.watermark):
            raise ValueError(
                "preemption and watermark are settings of the paged mode: the contiguous mode never preempts"
            )
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if enable_prefix_caching and mode != "paged":
            raise ValueError("enable_prefix_caching is a setting of the paged mode: use it with mode='paged'")
        if enable_prefix_caching and not _accepts_prefix_caching(self.cache_factory):
            raise ValueError(
                f"enable_prefix_caching=True calls cache_factory with the keyword argument "
                f"enable_prefix_caching=True, which {self.cache_factory!r} does not accept"
            )
        self.enable_prefix_caching = enable_prefix_caching
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

    @property
    def watermark_blocks(self) -> int:
        """The blocks admission keeps free, ``ceil(watermark * num_blocks)``."""
        return watermark_blocks(self.watermark, self.num_blocks)

    def run(self, requests: Sequence[EngineRequest], progress: bool = False) -> EngineResult:
        """Serve ``requests`` until every one has finished; ``progress=True`` shows a tqdm bar.

        Each step: (1) arrivals join the back of the queue; (2) paged with swap: swapped-out
        sequences come back, oldest first, while they fit with the headroom; (3) when none is left
        swapped out, requests are admitted first come first served while they fit, stopping at the
        first that does not, and each admitted prompt is prefilled, its first token coming from the
        prefill logits; (4) the sequences running before this step's admissions (swapped-in ones
        included) decode one token each in one batched call (paged: preempting the newest sequence
        while the blocks they need are not free); (5) the step is recorded, and a sequence holding
        ``max_new_tokens`` generated tokens finishes and frees its memory.

        Raises:
            ValueError: a request that is not an :class:`EngineRequest`, a repeated ``request_id``,
                a bad token id, a request too long for ``max_model_len`` or for the budget alone,
                or ``preemption="swap"`` with a cache that has no ``swap_out`` / ``swap_in``, or
                ``enable_prefix_caching=True`` with one that has no ``num_cached_tokens`` /
                ``attend_prefill``.
            RuntimeError: nothing runs while requests wait that do not fit: the cache reports fewer
                free blocks than it has (a plugged-in cache whose ``num_free_blocks`` is wrong); or
                the cache reports cached tokens outside ``0 .. len(prompt) - 1``.
        """
        requests = self._check_requests(requests)
        cache = self._new_cache()
        result = EngineResult(self.mode, self.budget_tokens)
        queues = _Queues(deque(sorted(requests, key=lambda r: r.arrival_step)))  # stable: ties keep order
        bar = progress_bar(len(requests), f"engine ({self.mode})") if progress else None
        step = 0
        try:
            with torch.no_grad():
                while len(result.finished_step) < len(requests):
                    done = self._step(step, cache, queues, result)
                    if bar is not None:
                        bar.update(done)
                    step += 1
        finally:
            for seq in queues.running:  # only after an error: a finished run holds nothing
                cache.free(seq.request.request_id)
            if bar is not None:
                bar.close()
        result.tokens = {r.request_id: result.tokens[r.request_id] for r in requests}  # request order
        return result

    # ------------------------------------------------------------------------------ the helpers

    def _new_cache(self) -> PagedKVCache | ContiguousKVCache:
        if self.mode == "contiguous":
            return ContiguousKVCache(self.model.config, self.device)
        dtype = self.model.head.weight.dtype
        args = (self.model.config, self.num_blocks, self.block_size, self.device, dtype)
        if self.enable_prefix_caching:
            cache = self.cache_factory(*args, enable_prefix_caching=True)
        else:
            cache = self.cache_factory(*args)
        if self.preemption == "swap" and not _has_methods(cache, "swap_out", "swap_in"):
            raise ValueError(
                f"preemption='swap' needs a cache with swap_out(seq_id) and swap_in(seq_id, saved), "
                f"but {type(cache).__name__} lacks them; use preemption='recompute'"
            )
        if self.enable_prefix_caching and not _has_methods(cache, "num_cached_tokens", "attend_prefill"):
            raise ValueError(
                f"enable_prefix_caching=True needs a cache with num_cached_tokens(seq_id) and "
                f"attend_prefill(...), but {type(cache).__name__} lacks them"
            )
        return cache

    def _step(self, step: int, cache, queues: _Queues, result: EngineResult) -> int:
        """Run step ``step``; return how many requests finished in it."""
        while queues.arrivals and queues.arrivals[0].arrival_step <= step:
            queues.waiting.append(queues.arrivals.popleft())
        decoding = list(queues.running)  # this step's newcomers get their token from prefill
        self._swap_in(cache, queues, decoding, result)
        if not queues.swapped:  # swapped-out sequences come before new requests
            self._admit(step, cache, queues, result)
        if not queues.running and (queues.waiting or queues.swapped):
            raise RuntimeError(
                f"step {step}: nothing runs, yet the next request does not fit in the "
                f"{cache.num_free_blocks} free blocks the cache reports out of {self.num_blocks}; "
                f"check the cache's num_free_blocks"
            )
        decoding = self._make_room(cache, decoding, queues, result)
        if decoding:
            last = torch.tensor([seq.generated[-1] for seq in decoding], device=self.device)
            ids = [seq.request.request_id for seq in decoding]
            next_tokens = self.model.decode_step(last, ids, cache).argmax(dim=-1).tolist()
            for seq, token in zip(decoding, next_tokens, strict=True):
                seq.generated.append(token)
        self._record(cache, queues, result)
        done = [seq for seq in queues.running if len(seq.generated) == seq.request.max_new_tokens]
        for seq in done:
            cache.free(seq.request.request_id)
            result.tokens[seq.request.request_id] = seq.generated
            result.finished_step[seq.request.request_id] = step
        queues.running = [seq for seq in queues.running if seq not in done]
        return len(done)

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
            if self.mode == "paged" and not _serves_alone(
                r, self.num_blocks, self.block_size, self.watermark
            ):
                admit, peak = _blocks_alone(r, self.block_size)
                raise ValueError(
                    f"num_blocks {self.num_blocks} cannot hold request {r.request_id!r} alone: it needs "
                    f"{admit} blocks to be admitted (prompt and one of headroom) plus the "
                    f"{self.watermark_blocks} that watermark {self.watermark} keeps free, and {peak} "
                    f"at its longest; see min_num_blocks"
                )
        return requests

    def _swap_in(self, cache, queues: _Queues, decoding: list[_Running], result: EngineResult) -> None:
        """Bring swapped-out sequences back, oldest first, while they fit; they decode this step."""
        while queues.swapped:
            seq, saved = queues.swapped[0]
            blocks = blocks_for_tokens(seq.held, self.block_size)
            if not _fits(cache, blocks, len(queues.running)):
                return
            queues.swapped.popleft()
            cache.swap_in(seq.request.request_id, saved)
            queues.running.append(seq)
            decoding.append(seq)
            result.blocks_swapped_in += blocks

    def _admit(self, step: int, cache, queues: _Queues, result: EngineResult) -> None:
        """Admit and prefill waiting requests, first come first served, while they fit."""
        while queues.waiting:
            request = queues.waiting[0]
            if self.mode == "contiguous":
                fits = (len(queues.running) + 1) * self.max_model_len <= self.budget_tokens
            else:
                blocks = blocks_for_tokens(len(request.prompt), self.block_size)
                fits = _fits(cache, blocks, len(queues.running), self.watermark_blocks)
            if not fits:
                return
            queues.waiting.popleft()
            cached = self._add_sequence(cache, request, result)
            prompt = torch.tensor(request.prompt, device=self.device)
            logits = self.model.prefill(prompt, request.request_id, cache, start=cached)
            result.prefill_tokens_computed += len(logits)  # one row per position the prefill ran
            queues.running.append(_Running(request, [int(logits[-1].argmax())]))
            result.admitted_step[request.request_id] = step

    def _add_sequence(self, cache, request: EngineRequest, result: EngineResult) -> int:
        """Give a request's prompt its blocks; return how many leading tokens the prefix cache served."""
        if not self.enable_prefix_caching:
            cache.add_sequence(request.request_id, len(request.prompt))
            return 0
        cache.add_sequence(request.request_id, len(request.prompt), token_ids=request.prompt)
        cached = cache.num_cached_tokens(request.request_id)
        if not 0 <= cached < len(request.prompt):
            raise RuntimeError(
                f"the cache reports {cached} cached tokens for request {request.request_id!r}, whose "
                f"prompt has {len(request.prompt)}: expected 0 .. {len(request.prompt) - 1}"
            )
        result.prefix_cache_queries += len(request.prompt)
        result.prefix_cache_hits += cached
        return cached

    def _make_room(
        self, cache, decoding: list[_Running], queues: _Queues, result: EngineResult
    ) -> list[_Running]:
        """Paged: preempt the newest sequences until the decode step's new blocks are free.

        Returns the sequences that decode (a preempted one no longer does).
        """
        if self.mode == "contiguous":
            return decoding
        while sum(cache.needs_new_block(s.request.request_id) for s in decoding) > cache.num_free_blocks:
            victim = queues.running.pop()  # never the oldest alone: _check_requests made sure it fits
            request_id = victim.request.request_id
            if self.preemption == "swap":
                queues.swapped.appendleft((victim, cache.swap_out(request_id)))  # older victims come first
                result.blocks_swapped_out += blocks_for_tokens(victim.held, self.block_size)
            else:
                cache.free(request_id)
                queues.waiting.appendleft(victim.request)
                result.recomputed_tokens += victim.held
            result.preemptions_by_reason[self.preemption] += 1
            decoding = [seq for seq in decoding if seq is not victim]
        return decoding

    def _record(self, cache, queues: _Queues, result: EngineResult) -> None:
        running = queues.running
        held = sum(seq.held for seq in running)
        if self.mode == "paged":
            used = self.num_blocks - cache.num_free_blocks
            reserved = used * self.block_size
        else:
            reserved = len(running) * self.max_model_len
            used = blocks_for_tokens(reserved, self.block_size)
        result.running.append(len(running))
        result.waiting.append(len(queues.waiting))
        result.swapped.append(len(queues.swapped))
        result.used_blocks.append(used)
        result.held_tokens.append(held)
        result.reserved_tokens.append(reserved)
        result.utilisation.append(held / reserved if reserved else 0.0)


# ------------------------------------------------------------------------- budgets, for lesson 08


def min_num_blocks(requests: Sequence[EngineRequest], block_size: int = 16, watermark: float = 0.0) -> int:
    """The smallest ``num_blocks`` on which the paged engine can serve every one of ``requests``.

    Each request must be admissible alone (its prompt's blocks, one block of headroom and the
    watermark's ``ceil(watermark * num_blocks)`` blocks) and must fit at its longest, holding
    ``len(prompt) + max_new_tokens - 1`` tokens (its last token is never fed back).

    Raises:
        ValueError: ``requests`` is empty or holds something else than :class:`EngineRequest`, or a
            bad ``block_size`` or ``watermark``.
    """
    block_size = check_count("block_size", block_size, minimum=1)
    watermark = _check_watermark(watermark)
    requests = list(requests)
    if not requests or not all(isinstance(r, EngineRequest) for r in requests):
        raise ValueError("requests must be a non-empty list of EngineRequest objects")
    num_blocks = max(max(_blocks_alone(r, block_size)) for r in requests)
    while not all(_serves_alone(r, num_blocks, block_size, watermark) for r in requests):
        num_blocks += 1  # ends: num_blocks - ceil(watermark * num_blocks) grows without bound
    return num_blocks


def sweep_budgets(
    model: TinyGPT,
    requests: Sequence[EngineRequest],
    num_blocks_list: Sequence[int],
    block_size: int = 16,
    preemption: str = "recompute",
    watermark: float = 0.0,
    progress: bool = False,
) -> list[dict[str, int | float]]:
    """Serve the same ``requests`` in the paged mode once per budget in ``num_blocks_list``.

    Returns one row per budget, in order, ready for a table or a plot: ``num_blocks``,
    ``budget_tokens``, ``steps``, ``preemptions``, ``recomputed_tokens``, ``blocks_swapped_out``,
    ``peak_running``, ``mean_running`` and ``mean_utilisation``. :func:`min_num_blocks` gives the
    smallest budget that can serve ``requests``.

    Raises:
        ValueError: a bad argument, as :class:`Engine` and :meth:`Engine.run` raise it.
    """
    if isinstance(num_blocks_list, str | bytes) or not isinstance(num_blocks_list, Sequence):
        raise ValueError(f"num_blocks_list must be a list of block counts, got {num_blocks_list!r}")
    engines = [
        Engine(model, num_blocks=n, block_size=block_size, preemption=preemption, watermark=watermark)
        for n in num_blocks_list
    ]
    bar = progress_bar(len(engines), f"sweep ({preemption})", unit="budget") if progress else None
    rows = []
    try:
        for engine in engines:
            result = engine.run(requests)
            rows.append(
                {
                    "num_blocks": engine.num_blocks,
                    "budget_tokens": engine.budget_tokens,
                    "steps": result.steps,
                    "preemptions": result.preemptions,
                    "recomputed_tokens": result.recomputed_tokens,
                    "blocks_swapped_out": result.blocks_swapped_out,
                    "peak_running": result.peak_running,
                    "mean_running": result.mean_running,
                    "mean_utilisation": result.mean_utilisation,
                }
            )
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def admits(num_free_blocks: int, blocks: int, num_running: int, keep_free: int = 0) -> bool:
    """The paged admission rule: can a sequence taking ``blocks`` blocks now join ``num_running`` others?

    Yes when its blocks, one block of headroom per running sequence (itself included: the most the
    next decode step can take) and ``keep_free`` blocks (the watermark) are all free.
    """
    headroom = num_running + 1
    return blocks + headroom + keep_free <= num_free_blocks


def _fits(cache, blocks: int, num_running: int, keep_free: int = 0) -> bool:
    """:func:`admits` on the cache's free blocks."""
    return admits(cache.num_free_blocks, blocks, num_running, keep_free)


def _has_methods(cache: object, *names: str) -> bool:
    return all(callable(getattr(cache, name, None)) for name in names)


def _accepts_prefix_caching(factory: Callable) -> bool:
    """Whether ``factory(config, num_blocks, block_size, device, dtype, enable_prefix_caching=True)``
    binds to its signature (a factory whose signature cannot be read gets the benefit of the doubt)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(None, 1, 1, None, None, enable_prefix_caching=True)
    except TypeError:
        return False
    return True


def _check_watermark(watermark: object) -> float:
    if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark!r}")
    return float(watermark)


def watermark_blocks(watermark: float, num_blocks: int) -> int:
    """The blocks an admission ``watermark`` (a fraction of the pool) keeps free: rounded up.

    Rounding up means any watermark above 0 keeps at least one block free (vLLM V0 rounded down).
    """
    return math.ceil(_check_watermark(watermark) * check_count("num_blocks", num_blocks, minimum=1))


def _blocks_alone(request: EngineRequest, block_size: int) -> tuple[int, int]:
    """The blocks a request needs alone: to be admitted (prompt plus one of headroom), and at its longest."""
    admit = blocks_for_tokens(len(request.prompt), block_size) + 1
    peak = blocks_for_tokens(len(request.prompt) + request.max_new_tokens - 1, block_size)
    return admit, peak


def _serves_alone(request: EngineRequest, num_blocks: int, block_size: int, watermark: float) -> bool:
    """Whether ``num_blocks`` can admit ``request`` alone, watermark kept, and hold it at its longest."""
    admit, peak = _blocks_alone(request, block_size)
    return admit + watermark_blocks(watermark, num_blocks) <= num_blocks and peak <= num_blocks


def plot_metrics(result: EngineResult, ax=None):
    """Running and waiting (and swapped, if any) sequences per step, with utilisation on a second
    axis; returns ``ax``."""
    import matplotlib.pyplot as plt  # only when a plot is asked for

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    steps = range(result.steps)
    ax.plot(steps, result.running, label="running", color="#0072B2")
    ax.plot(steps, result.waiting, label="waiting", color="#E69F00", linestyle="--")
    if any(result.swapped):
        ax.plot(steps, result.swapped, label="swapped", color="#CC79A7", linestyle="-.")
    ax.set_xlabel("step")
    ax.set_ylabel("sequences")
    reasons = ", ".join(f"{n} by {reason}" for reason, n in result.preemptions_by_reason.items() if n)
    ax.set_title(
        f"{result.mode}: {result.budget_tokens} token slots, {result.preemptions} preemptions"
        + (f" ({reasons})" if reasons else "")
    )
    twin = ax.twinx()
    twin.plot(steps, result.utilisation, label="utilisation", color="#009E73", linestyle=":")
    twin.set_ylim(0, 1.05 * max([1.0, *result.utilisation]))  # above 1 only when blocks are shared
    twin.set_ylabel("utilisation (held / reserved)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    return ax

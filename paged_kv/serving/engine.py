"""The offline engine: a list of requests served to their end with continuous batching (lessons 09-11;
vLLM: ``LLM``).

Requests arrive with a prompt and a maximum output length, wait, are admitted, prefill (the step
that computes a prompt's last token samples its first output token), decode one token per step,
and release their memory as soon as they finish, so a waiting request can take their place at the
next step. vLLM's offline ``LLM`` (``vllm/entrypoints/llm.py``) is a thin layer on its online
``LLMEngine``, and so is :class:`Engine`: its keywords are the engine's arguments
(:class:`~paged_kv.serving.engine_args.EngineArgs`, vLLM's names, ``num_blocks`` for vLLM's
``num_gpu_blocks_override``), checked once; its cache is planned once
(:func:`~paged_kv.serving.kv_cache_planning.get_kv_cache_config`); and each :meth:`Engine.run` builds
a fresh :class:`~paged_kv.serving.llm_engine.LLMEngine` on that plan, adds each request at its
arrival step and steps until every one has finished, so that two runs of the same requests give the
same result (vLLM's ``LLM`` keeps one engine, and its prefix cache, across calls). Each step of that
engine is vLLM v1's:

1. ``scheduler.schedule()``: :class:`~paged_kv.serving.scheduler.Scheduler` gives each request its
   tokens for the step and takes their blocks now (``allocate_slots`` of the
   :class:`~paged_kv.core.kv_cache_manager.KVCacheManager`, one block stack for every model),
   preempting the newest running request when they do not fit (under
   ``scheduling_policy="priority"``, the lowest ranked: the largest ``(priority, arrival)``);
2. ``model_runner.execute_model(output)``: :class:`~paged_kv.serving.model_runner.ModelRunner` applies
   the step to its persistent block table, prepares its inputs once and runs one forward of the
   model over the flattened batch, prefill chunks and decodes together;
3. ``scheduler.update_from_output(output, result)``: the sampled tokens are appended, and the
   finished requests free their blocks.

The memory budget is ``num_blocks * block_size`` token slots, spent one of two ways (``mode``):

* ``"paged"``: blocks taken as tokens are scheduled, from a pool whose block 0 is the null block. A
  request is admitted when its whole prompt's blocks are free (``scheduler_reserve_full_isl``,
  vLLM's default), plus the *watermark*, ``ceil(watermark * num_blocks)`` blocks, while another
  request runs; no block is kept back for the running requests' growth. When a running request's
  next tokens find too few free blocks, the newest running request is *preempted*, one of two ways
  (``preemption``):

  - ``"recompute"`` (vLLM v1's only way): its blocks are freed and it goes back to the front of
    the queue. It keeps its output and, admitted again, prefills its prompt and that output (in
    chunks under a token budget), then samples its next token;
  - ``"swap"`` (the paper's other way, and vLLM V0's): its K/V is copied to host memory by the
    runner (:mod:`paged_kv.kv.swap`) and its blocks are freed; it waits in a *swapped* queue that
    comes before the waiting requests. A victim still prefilling is requeued instead, as recompute.

  With ``enable_prefix_caching=True`` the pool keeps the blocks of prefixes it has computed
  (:mod:`paged_kv.core.prefix_cache`): a new request's tokens are looked up, a prefix of cached full
  blocks (held by a running request, or freed and not yet reused) is reused, and the prefill
  computes only the rest. Every block the scheduled tokens fill is cached when they are scheduled.

* ``"contiguous"``: one seat of ``max_model_len`` tokens reserved per request at admission, out of
  the same budget (:class:`~paged_kv.serving.contiguous_memory.ContiguousMemory`); nothing is ever
  preempted. The runner reads a seat through the same block table as paged blocks.

The course's engine gives every request exactly the tokens :func:`~paged_kv.model.generate` gives
its prompt alone, whatever the mode, the batch, the preemptions or the token budget (vLLM promises
that only with ``VLLM_BATCH_INVARIANT``; it is off by default). **Metrics, by vLLM's names**
(:mod:`paged_kv.serving.metrics`, lesson 15): every step is timed on the wall clock and leaves a
:class:`~paged_kv.serving.metrics.SchedulerStats`; :meth:`EngineResult.metrics
<paged_kv.serving.engine_result.EngineResult.metrics>` gathers a run's as vLLM's ``/metrics`` would
show them. With ``log_stats_interval`` the engine logs vLLM's periodic line (logger
``paged_kv.engine``, INFO), and preemptions log vLLM V0's WARNING there, the first and every 50th.
**KV-cache events** (``kv_events_config``, vLLM's ``--kv-events-config``): the engine's publisher is
made once, with the engine (its socket bound then, so a subscriber can connect before the first
run), and shared by its runs; each run's pool is new, so each run ends with an
``AllBlocksCleared``. :meth:`Engine.shutdown` (or leaving a ``with Engine(...)`` block) closes it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from paged_kv.core.kv_cache_groups import KVCacheGroupSpec
from paged_kv.core.kv_cache_manager import blocks_alone, watermark_blocks
from paged_kv.distributed.config import KVEventsConfig
from paged_kv.distributed.kv_events import EventPublisherFactory
from paged_kv.kv.sizing import KVCacheSpec
from paged_kv.kv.startup import KVCacheReport
from paged_kv.model.causal_lm import CausalLM, as_causal_lm
from paged_kv.progress import progress_bar
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.engine_core import check_kv_offloading
from paged_kv.serving.engine_result import EngineResult, StepRecorder
from paged_kv.serving.kv_cache_planning import get_kv_cache_config, sized
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.metrics import LoggingStatLogger, check_interval, kv_cache_device
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.validate import check_count, check_hashable


@dataclass(frozen=True)
class EngineRequest:
    """A request: ``prompt`` token ids arriving at ``arrival_step``, to generate ``max_tokens`` (vLLM's
    ``SamplingParams.max_tokens``), of ``priority`` (vLLM's request field: lower first, under an
    engine of ``scheduling_policy="priority"``; an ``"fcfs"`` engine takes only 0, the default).

    Decoding is greedy. A request generates ``max_tokens`` tokens, or fewer: when the model names
    end-of-sequence tokens (a Hugging Face model's ``generation_config.eos_token_id``) and it
    generates one, which it keeps, unless the engine has ``ignore_eos=True`` (the tiny GPT has none);
    and when its prompt and output would pass ``max_model_len``, where it stops (its ``max_tokens``
    capped, as vLLM caps it).
    """

    request_id: Hashable
    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    priority: int = 0

    def __post_init__(self) -> None:
        check_hashable("request_id", self.request_id)
        if isinstance(self.prompt, str) or not isinstance(self.prompt, Sequence) or not self.prompt:
            raise ValueError(f"prompt of request {self.request_id!r} must be a non-empty list of token ids")
        check_count("max_tokens", self.max_tokens, minimum=1)
        check_count("arrival_step", self.arrival_step)


class Engine:
    """Continuous batching of :class:`EngineRequest` objects on ``model``; see the module docstring.

    ``model`` is a :class:`~paged_kv.model.tiny_gpt.TinyGPT`, a Hugging Face causal LM of a supported
    architecture or any :class:`~paged_kv.model.causal_lm.CausalLM`
    (:func:`~paged_kv.model.causal_lm.as_causal_lm`); :attr:`model` is that ``CausalLM``. Every other
    keyword is the engine's argument of that name (:class:`~paged_kv.serving.engine_args.EngineArgs`,
    kept as :attr:`engine_args`), but ``num_blocks``, vLLM's ``num_gpu_blocks_override``, and the two
    of the offline loop itself: ``ignore_eos`` (vLLM's sampling parameter: every request runs to
    ``max_tokens``) and ``log_stats_interval``. The settings are gathered in :attr:`vllm_config`
    and read there; the cache's plan, made once, is :attr:`kv_cache_config`.

    The memory is given one of three ways, exactly one of them: ``num_blocks`` (the pool's blocks,
    its null block among them); or ``kv_cache_memory_bytes``, the bytes the K/V may take; or
    ``gpu_memory_utilization``, the fraction of the device's memory (a GPU's, or the machine's RAM
    for the CPU) the engine may use, the model's weights included, as in vLLM: vLLM's start-up
    sizing whole (:func:`~paged_kv.kv.startup.kv_cache_report`, kept as :attr:`kv_cache_report`),
    its two start-up lines logged (logger ``paged_kv.engine``, INFO), and vLLM's error raised when
    one request of ``max_model_len`` does not fit.

    ``log_stats_interval`` logs vLLM's periodic line (:class:`~paged_kv.serving.metrics.LoggingStatLogger`)
    to the logger ``paged_kv.engine`` at INFO, every that many steps (an int) or seconds of the
    engine's wall clock (a float; vLLM's ``VLLM_LOG_STATS_INTERVAL``, 10.0 by default), and once
    more at the end of a run; None (the default) logs none.

    ``kv_events_config`` (a :class:`~paged_kv.distributed.config.KVEventsConfig`, a dict or its JSON
    text) publishes the pool's KV-cache events (see the module); the publisher starts here, last,
    once every argument passed, and stops at :meth:`shutdown`. ``kv_offloading_size`` (GiB; ``None``:
    off) keeps blocks in a host tier for the run (each run's engine core makes its own), through the
    offloading connector (``kv_offloading_backend="native"``).

    Raises:
        ValueError: a bad argument, named in the message.
    """

    def __init__(
        self,
        model: CausalLM | object,
        *,
        num_blocks: int | None = None,
        block_size: int = 16,
        mode: str = "paged",
        max_model_len: int | None = None,
        device: str | torch.device | None = None,
        preemption: str = "recompute",
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        ignore_eos: bool = False,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        attention_backend: str | None = None,
        log_stats_interval: int | float | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        scheduling_policy: str = "fcfs",
        kv_events_config: KVEventsConfig | dict | str | None = None,
        kv_offloading_size: float | None = None,
        kv_offloading_backend: str = "native",
    ) -> None:
        self.model = as_causal_lm(model)
        self.log_stats_interval = check_interval(log_stats_interval)
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        self.ignore_eos = ignore_eos
        self.engine_args = EngineArgs(
            block_size=block_size,
            num_gpu_blocks_override=num_blocks,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            watermark=watermark,
            preemption=preemption,
            mode=mode,
            attention_backend=attention_backend,
            device=device,
            scheduling_policy=scheduling_policy,
            kv_events_config=kv_events_config,
            kv_offloading_size=kv_offloading_size,
            kv_offloading_backend=kv_offloading_backend,
        )
        vllm_config = self.engine_args.create_engine_config(self.model)
        self.kv_cache_config = get_kv_cache_config(vllm_config, self.model)
        """The cache's plan, made once: its groups, its block count, vLLM's start-up report."""
        self.vllm_config = sized(vllm_config, self.kv_cache_config)
        check_kv_offloading(self.vllm_config, self.kv_cache_config)  # a tier too small fails now
        self.kv_event_publisher = EventPublisherFactory.create(self.vllm_config.kv_events_config)
        """The runs' KV-cache event publisher (a ``NullEventPublisher`` with events off)."""

    def shutdown(self) -> None:
        """Stop the event publisher (its thread ended, its sockets closed); idempotent. A run after
        it publishes nothing more (it fails: the publisher is closed)."""
        self.kv_event_publisher.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # The settings, read from the one configuration and the one plan.
    mode = property(lambda self: self.vllm_config.cache_config.mode)
    block_size = property(lambda self: self.vllm_config.cache_config.block_size)
    num_blocks = property(lambda self: self.vllm_config.cache_config.num_gpu_blocks)
    enable_prefix_caching = property(lambda self: self.vllm_config.cache_config.enable_prefix_caching)
    max_model_len = property(lambda self: self.vllm_config.model_config.max_model_len)
    max_num_batched_tokens = property(lambda self: self.vllm_config.scheduler_config.max_num_batched_tokens)
    preemption = property(lambda self: self.vllm_config.scheduler_config.preemption)
    scheduling_policy = property(lambda self: self.vllm_config.scheduler_config.policy)
    watermark = property(lambda self: self.vllm_config.scheduler_config.watermark)
    device = property(lambda self: self.vllm_config.device_config.device)

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The KV-cache groups the pool's blocks serve (one, unless a paged hybrid model: lesson 13)."""
        return self.kv_cache_config.kv_cache_groups

    @property
    def is_hybrid(self) -> bool:
        """Whether the cache is managed in several KV-cache groups (a paged hybrid model, lesson 13)."""
        return self.kv_cache_config.is_hybrid

    @property
    def kv_spec(self) -> KVCacheSpec:
        """What one token costs in the pool's tensors."""
        return self.kv_cache_config.kv_cache_spec

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype the K/V tensors hold: the model's for ``"auto"``, torch's fp8 for ``"fp8"``."""
        return self.kv_cache_config.kv_cache_dtype

    @property
    def kv_cache_report(self) -> KVCacheReport | None:
        """vLLM's start-up sizing when the memory was given as ``gpu_memory_utilization``, else None."""
        return self.kv_cache_config.report

    @property
    def bytes_per_block(self) -> int:
        """The bytes of K and V one block takes over all the model's layers (a hybrid model's over
        its largest group's: the layers of different groups share tensors)."""
        return self.kv_spec.bytes_per_block(self.block_size)

    @property
    def budget_tokens(self) -> int:
        """The memory budget in token slots, ``num_blocks * block_size``, in both modes."""
        return self.num_blocks * self.block_size

    @property
    def watermark_blocks(self) -> int:
        """The blocks admission keeps free while others run, ``ceil(watermark * num_blocks)``."""
        return watermark_blocks(self.watermark, self.num_blocks)

    def new_llm_engine(self) -> LLMEngine:
        """A fresh online engine on this engine's config and plan: what each :meth:`run` steps."""
        return LLMEngine(
            self.vllm_config,
            self.model,
            kv_cache_config=self.kv_cache_config,
            kv_event_publisher=self.kv_event_publisher,
        )

    def run(self, requests: Sequence[EngineRequest], progress: bool = False) -> EngineResult:
        """Serve ``requests`` until every one has finished; ``progress=True`` shows a tqdm bar.

        Every request is checked first, by the engine's input processor (a bad one fails before
        anything runs); then each is added at its arrival step, and each step is
        :meth:`LLMEngine.step <paged_kv.serving.llm_engine.LLMEngine.step>`, recorded.

        Raises:
            ValueError: a request that is not an :class:`EngineRequest`, a repeated ``request_id``, a
                bad token id, a prompt too long for ``max_model_len``, or a request the memory
                cannot hold alone.
        """
        requests = list(requests)
        if not all(isinstance(r, EngineRequest) for r in requests):
            raise ValueError("requests must all be EngineRequest objects")
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("requests must have distinct request_id values")
        llm = self.new_llm_engine()
        checked = {r.request_id: self._process(llm, r) for r in requests}
        result = EngineResult(self.mode, self.budget_tokens)
        result.arrival_step = {r.request_id: r.arrival_step for r in requests}
        stat_logger = None
        if self.log_stats_interval is not None:
            stat_logger = LoggingStatLogger(
                self.log_stats_interval, kv_cache_device=kv_cache_device(self.device)
            )
        recorder = StepRecorder(
            result,
            block_size=self.block_size,
            count_prefix_cache=self.enable_prefix_caching,
            stat_logger=stat_logger,
        )
        pending = deque(sorted(requests, key=lambda r: r.arrival_step))  # stable: ties keep their order
        bar = progress_bar(len(requests), f"engine ({self.mode})") if progress else None
        clock = time.perf_counter
        try:
            start = clock()
            began = 0.0
            while pending or llm.has_unfinished_requests():  # each step timed around it, arrivals included
                while pending and pending[0].arrival_step <= llm.num_steps:
                    request_id = pending.popleft().request_id
                    llm.add_request(request_id, checked[request_id])
                llm.step()
                result.step_start_seconds.append(began)
                result.step_end_seconds.append(clock() - start)
                recorder.record(*llm.last_step, llm.last_stats)
                if bar is not None:
                    bar.update(len(llm.last_step[1].finished))
                began = clock() - start
            if stat_logger is not None:
                stat_logger.flush(result.elapsed_seconds)
        finally:
            llm.shutdown()  # every request forgotten; with events, the run's pool cleared on the wire
            if bar is not None:
                bar.close()
        result.tokens = {r.request_id: result.tokens[r.request_id] for r in requests}  # request order
        return result

    def _process(self, llm: LLMEngine, request: EngineRequest):
        """An offline request through the one check: greedy, ``max_tokens``, the engine's ``ignore_eos``,
        its ``priority``."""
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=self.ignore_eos)
        return llm.input_processor.process_inputs(
            request.request_id, request.prompt, params, priority=request.priority
        )


def min_num_blocks(requests: Sequence[EngineRequest], block_size: int = 16) -> int:
    """The smallest ``num_blocks`` on which the paged engine can serve every one of ``requests``.

    Alone, a request needs the blocks of its longest: ``len(prompt) + max_tokens - 1`` tokens
    (its last token is never fed back), and the pool one block more, its null block. Neither
    headroom nor the watermark counts alone: vLLM's scheduler keeps its watermark only while
    another request is scheduled.

    Raises:
        ValueError: ``requests`` is empty or holds something else than :class:`EngineRequest`, or a
            bad ``block_size``.
    """
    block_size = check_count("block_size", block_size, minimum=1)
    requests = list(requests)
    if not requests or not all(isinstance(r, EngineRequest) for r in requests):
        raise ValueError("requests must be a non-empty list of EngineRequest objects")
    return 1 + max(blocks_alone(len(r.prompt), r.max_tokens, block_size)[1] for r in requests)


def sweep_budgets(
    model: CausalLM | object,
    requests: Sequence[EngineRequest],
    num_blocks_list: Sequence[int],
    block_size: int = 16,
    preemption: str = "recompute",
    watermark: float = 0.0,
    progress: bool = False,
    max_num_batched_tokens: int | None = None,
) -> list[dict[str, int | float]]:
    """Serve the same ``requests`` in the paged mode once per budget in ``num_blocks_list``.

    Returns one row per budget, in order, ready for a table or a plot: ``num_blocks``,
    ``budget_tokens``, ``steps``, ``preemptions``, ``recomputed_tokens``, ``blocks_swapped_out``,
    ``peak_running``, ``mean_running`` and ``mean_utilization``. :func:`min_num_blocks` gives the
    smallest budget that can serve ``requests``. ``max_num_batched_tokens`` is the engines' token
    budget (None: none; with one, recompute resumes by prefilling, see :class:`Engine`).

    Raises:
        ValueError: a bad argument, as :class:`Engine` and :meth:`Engine.run` raise it.
    """
    if isinstance(num_blocks_list, str | bytes) or not isinstance(num_blocks_list, Sequence):
        raise ValueError(f"num_blocks_list must be a list of block counts, got {num_blocks_list!r}")
    engines = [
        Engine(
            model,
            num_blocks=n,
            block_size=block_size,
            preemption=preemption,
            watermark=watermark,
            max_num_batched_tokens=max_num_batched_tokens,
        )
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
                    "mean_utilization": result.mean_utilization,
                }
            )
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows

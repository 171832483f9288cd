"""A continuous-batching engine that serves a stream of requests with a model on the paged cache.

Requests arrive with a prompt and a maximum output length, wait, are admitted, prefill (the step
that computes a prompt's last token samples its first output token), decode one token per step,
and release their memory as soon as they finish, so a waiting request can take their place at the
next step (lessons 09-11). The engine is the loop of a serving engine, split as vLLM v1 splits it:

1. ``output = scheduler.schedule()``: :class:`~paged_kv.serving.scheduler.Scheduler` gives each
   request its tokens for the step and takes their blocks now
   (:meth:`~paged_kv.serving.memory.KVCacheManager.allocate_slots`), preempting the newest
   running request when they do not fit; the step is a frozen
   :class:`~paged_kv.serving.outputs.SchedulerOutput`;
2. ``result = runner.execute_model(output)``: :class:`~paged_kv.serving.model_runner.ModelRunner`
   applies it to its persistent block table, prepares the step's inputs once and runs one forward
   of the model (the tiny GPT, or a Hugging Face Llama, Qwen2 or Mistral model) over the
   flattened batch, prefill chunks and decodes together;
3. ``scheduler.update_from_output(output, result)``: the sampled tokens are appended, and the
   finished requests free their blocks.

Lesson 07's simulator runs the same scheduler with no model. The memory budget is ``num_blocks *
block_size`` token slots, spent one of two ways (``mode``):

* ``"paged"``: a :class:`~paged_kv.serving.memory.KVCacheManager` over a
  :class:`~paged_kv.core.block_manager.BlockManager`. A request is admitted when its whole
  prompt's blocks are free (``scheduler_reserve_full_isl``, vLLM's default), plus the *watermark*,
  ``ceil(watermark * num_blocks)`` blocks, while another request runs; no block is kept back for
  the running requests' growth. Blocks are taken as tokens are scheduled. When a running request's
  next tokens find too few free blocks, the newest running request is *preempted*, one of two
  ways (``preemption``):

  - ``"recompute"`` (vLLM v1's only way): its blocks are freed and it goes back to the front of
    the queue. It keeps its output and, admitted again, prefills its prompt and that output (in
    chunks under a token budget), then samples its next token;
  - ``"swap"`` (the paper's other way, and vLLM V0's): its K/V is copied to host memory by the
    runner (:mod:`paged_kv.kv.swap`) and its blocks are freed; it waits in a *swapped* queue that
    comes before the waiting requests: in a step that preempts nobody, swapped requests come back
    (fresh blocks, K/V copied in) while they fit, and no new request is admitted while any is
    still swapped out. A victim still prefilling is requeued instead, as recompute.

  With ``enable_prefix_caching=True`` the manager keeps the blocks of prefixes it has computed
  (:mod:`paged_kv.core.prefix_cache`): a new request's tokens are looked up, a prefix of cached full
  blocks (held by a running request, or freed and not yet reused: freed blocks count as free and
  are evicted least recently freed first) is reused, and the prefill computes only the rest,
  ``c .. n - 1`` for ``c`` cached tokens out of ``n`` (``c`` a multiple of ``block_size``, at most
  ``n - 1``). A hit on a block nobody holds takes it off the free list, so it counts at admission.
  Every block the scheduled tokens fill is cached when they are scheduled, prompt or decode.

* ``"contiguous"``: a :class:`~paged_kv.serving.memory.ContiguousMemory`, one seat of
  ``max_model_len`` tokens reserved per request at admission, out of the same budget; a request is
  admitted while one more seat fits. A request never outgrows its seat, so nothing is ever
  preempted. The runner reads a seat through the same block table as paged blocks.

The generated text depends neither on the mode, nor on the batch, nor on preemption, nor on the
token budget: every request gets exactly the tokens :func:`~paged_kv.model.generate` gives its
prompt alone.

**Metrics, by vLLM's names** (:mod:`paged_kv.serving.metrics`, lesson 14): every step is timed on
the wall clock and leaves a :class:`~paged_kv.serving.metrics.SchedulerStats` (requests running and
waiting, the KV-cache usage, the prefix cache's lookups, the step's preemptions and tokens), so a run
gives times to first token, inter-token and end-to-end latencies in seconds as well as in steps,
and :meth:`EngineResult.metrics` gathers them as vLLM's ``/metrics`` would show them. With
``log_stats_interval`` the engine logs vLLM's periodic line (logger ``paged_kv.engine``, INFO), and
preemptions log vLLM V0's WARNING there, the first and every 50th (see
:func:`~paged_kv.serving.metrics.enable_engine_log`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from paged_kv.attention.paged import STRATEGIES
from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_manager import BlockManager
from paged_kv.core.kv_cache_coordinator import KVCacheCoordinator, peak_blocks
from paged_kv.core.kv_cache_groups import kv_cache_groups, layer_tensors, num_tensors
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.device import resolve_device
from paged_kv.kv.fp8 import kv_cache_dtype_str_to_dtype
from paged_kv.kv.sizing import KVCacheSpec, device_memory, format_bytes
from paged_kv.kv.startup import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KVCacheReport,
    kv_cache_report,
    measure_activation_peak,
)
from paged_kv.kv.storage import KVStorage
from paged_kv.model.causal_lm import CausalLM, as_causal_lm
from paged_kv.model.generation import is_token
from paged_kv.progress import progress_bar
from paged_kv.serving.config import CacheConfig, EngineConfig, SchedulerConfig
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.memory import (
    ContiguousMemory,
    HybridKVCacheManager,
    KVCacheManager,
    blocks_alone,
    check_watermark,
    serves_alone,
    watermark_blocks,
)
from paged_kv.serving.metrics import (
    ENGINE_LOGGER,
    LoggingStatLogger,
    RunMetrics,
    SchedulerStats,
    check_interval,
    kv_cache_device,
)
from paged_kv.serving.model_runner import ModelRunner
from paged_kv.serving.outputs import SchedulerOutput
from paged_kv.serving.protocols import KVMemory
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.serving.scheduler import PREEMPTIONS, Scheduler, StepResult, check_budget
from paged_kv.validate import check_count, check_hashable

MODES = ("paged", "contiguous")

_LOGGER = logging.getLogger(ENGINE_LOGGER)


@dataclass(frozen=True)
class EngineRequest:
    """A request: ``prompt`` token ids arriving at ``arrival_step``, to generate ``max_new_tokens``.

    Decoding is greedy. A request generates ``max_new_tokens`` tokens, or fewer when the model names
    end-of-sequence tokens (a Hugging Face model's ``generation_config.eos_token_id``) and it
    generates one, which it keeps, unless the engine has ``ignore_eos=True``. The tiny GPT has none.
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
    ``max_model_len``) and ``utilization``, held / reserved (0.0 when nothing is reserved).
    ``admitted_step`` and ``finished_step`` give, per request, the step it was (last) admitted and
    the step it finished (a swapped-in sequence is not admitted again); ``first_token_step`` the
    step that sampled its first output token (the first time, if it was preempted and started
    over), and :attr:`time_to_first_token` the steps from its arrival to that one, counting both.
    ``scheduled_tokens`` holds one tuple per step of ``(request_id, tokens)`` pairs, what the step
    ran (:attr:`~paged_kv.serving.outputs.SchedulerOutput.num_scheduled_tokens`: the running
    requests in list order, then the new ones), and
    :attr:`tokens_per_step` their sums: with ``max_num_batched_tokens`` none is above it.

    ``preemptions_by_reason`` counts preemptions per way (``"recompute"``, ``"swap"``) and
    :attr:`preemptions` is their total. ``recomputed_tokens`` counts the tokens whose K/V a
    recompute preemption threw away, to be computed again; ``blocks_swapped_out`` and
    ``blocks_swapped_in`` count the blocks' worth of K/V copied to host memory and back.

    ``prefill_tokens_computed`` counts the tokens that prefills ran through the model (a request
    admitted again after a recompute preemption counts again; under a budget that includes the
    generated tokens it prefills when it resumes). With prefix caching,
    ``prefix_cache_queries`` counts the prompt tokens looked up in the cache (every admission's
    whole prompt), ``prefix_cache_hits`` those served from it, and :attr:`hit_rate` is their ratio;
    ``prefill_tokens_computed == prefix_cache_queries - prefix_cache_hits``. Without it, both are 0.
    With prefix caching, running sequences can share blocks, which count once among the
    ``used_blocks`` and ``reserved_tokens`` but once per sequence among the ``held_tokens``, so the
    ``utilization`` can exceed 1.0: the blocks serve more tokens than they hold.

    **vLLM's metrics** (:mod:`paged_kv.serving.metrics`). ``scheduler_stats`` holds one
    :class:`~paged_kv.serving.metrics.SchedulerStats` per step, measured after the step's finished
    requests freed their blocks, as vLLM measures it: ``num_running_reqs``, ``num_waiting_reqs``,
    ``kv_cache_usage`` (blocks in use over the pool, a fraction; a free block that still holds a
    cached prefix counts as free, and a hybrid model's null block is left out), the step's
    ``prefix_cache_stats`` (a resumed request's lookup apart), ``num_preempted_reqs``,
    ``num_generation_tokens``, ``num_prompt_tokens``. The run's totals by vLLM's names are
    :attr:`num_preemptions`, :attr:`prompt_tokens` (each prompt once, when its first token came),
    :attr:`generation_tokens` and :attr:`prefix_cache_stats`, whose ``queries`` and ``hits`` are first
    lookups only, vLLM's ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``, where
    ``prefix_cache_queries`` above counts every lookup: ``prefix_cache_queries ==
    prefix_cache_stats.queries + prefix_cache_stats.preempted_queries`` (and so for the hits).

    Each step is timed on the wall clock: ``step_start_seconds`` and ``step_end_seconds`` are the
    seconds from the run's start to the start and end of each step (its arrivals, schedule, forward
    and update). A request arrives at the start of its arrival step and gets a token at the end of
    the step that samples it, so :attr:`time_to_first_token_seconds` and
    :attr:`e2e_request_latency_seconds` are per request, and ``inter_token_latency_seconds`` holds,
    per token after a request's first, the seconds since the request's previous token
    (``inter_token_latency_steps`` the steps: 1 but after a preemption). :meth:`metrics` gathers
    them all as a :class:`~paged_kv.serving.metrics.RunMetrics` (its Prometheus text, its summary).
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
    utilization: list[float] = field(default_factory=list)
    admitted_step: dict[Hashable, int] = field(default_factory=dict)
    finished_step: dict[Hashable, int] = field(default_factory=dict)
    preemptions_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTIONS, 0))
    recomputed_tokens: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    prefill_tokens_computed: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    scheduled_tokens: list[tuple[tuple[Hashable, int], ...]] = field(default_factory=list)
    first_token_step: dict[Hashable, int] = field(default_factory=dict)
    arrival_step: dict[Hashable, int] = field(default_factory=dict)
    scheduler_stats: list[SchedulerStats] = field(default_factory=list)
    step_start_seconds: list[float] = field(default_factory=list)
    step_end_seconds: list[float] = field(default_factory=list)
    inter_token_latency_seconds: list[float] = field(default_factory=list)
    inter_token_latency_steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> list[int]:
        """The tokens each step ran (its prefill chunks and decodes)."""
        return [sum(n for _, n in step) for step in self.scheduled_tokens]

    @property
    def time_to_first_token(self) -> dict[Hashable, int]:
        """Per request, in steps: ``first_token_step - arrival_step + 1`` (1 when the step it arrives
        in samples its first token), in request order."""
        return {r: self.first_token_step[r] - a + 1 for r, a in self.arrival_step.items()}

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
    def mean_utilization(self) -> float:
        """Utilization averaged over the steps that reserve something."""
        busy = [u for u, r in zip(self.utilization, self.reserved_tokens, strict=True) if r]
        return sum(busy) / len(busy) if busy else 0.0

    # ---------------------------------------------------------------- vLLM's metrics (lesson 14)

    @property
    def step_seconds(self) -> list[float]:
        """Each step's wall-clock seconds, from its start to its end."""
        return [
            end - start for start, end in zip(self.step_start_seconds, self.step_end_seconds, strict=True)
        ]

    @property
    def elapsed_seconds(self) -> float:
        """The run's wall-clock seconds, to the end of its last step."""
        return self.step_end_seconds[-1] if self.step_end_seconds else 0.0

    @property
    def time_to_first_token_seconds(self) -> dict[Hashable, float]:
        """Per request, in seconds: from the start of its arrival step to the end of the step that
        sampled its first token (vLLM's ``vllm:time_to_first_token_seconds``), in request order."""
        start, end = self.step_start_seconds, self.step_end_seconds
        return {r: end[self.first_token_step[r]] - start[a] for r, a in self.arrival_step.items()}

    @property
    def e2e_request_latency_seconds(self) -> dict[Hashable, float]:
        """Per request, in seconds: from the start of its arrival step to the end of the step it
        finished in (vLLM's ``vllm:e2e_request_latency_seconds``), in request order."""
        start, end = self.step_start_seconds, self.step_end_seconds
        return {r: end[self.finished_step[r]] - start[a] for r, a in self.arrival_step.items()}

    @property
    def kv_cache_usage(self) -> list[float]:
        """Each step's KV-cache usage, a fraction (vLLM's ``vllm:kv_cache_usage_perc``)."""
        return [stats.kv_cache_usage for stats in self.scheduler_stats]

    @property
    def num_preemptions(self) -> int:
        """Preemptions of either way (vLLM's ``vllm:num_preemptions``): :attr:`preemptions`."""
        return self.preemptions

    @property
    def prompt_tokens(self) -> int:
        """Each request's prompt tokens, counted once, when its first token came (vLLM's
        ``vllm:prompt_tokens``); recomputed tokens are not prompt tokens (:attr:`prefill_tokens_computed`)."""
        return sum(stats.num_prompt_tokens for stats in self.scheduler_stats)

    @property
    def generation_tokens(self) -> int:
        """Tokens sampled, first tokens included (vLLM's ``vllm:generation_tokens``)."""
        return sum(stats.num_generation_tokens for stats in self.scheduler_stats)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The run's prefix-cache lookups as vLLM counts them: ``queries`` and ``hits`` first lookups
        only, a resumed request's apart (``preempted_queries``, ``preempted_hits``)."""
        return sum((stats.prefix_cache_stats for stats in self.scheduler_stats), PrefixCacheStats())

    def metrics(self) -> RunMetrics:
        """The run's metrics by vLLM's names (:class:`~paged_kv.serving.metrics.RunMetrics`): the last
        step's gauges, the run's counters and every latency in seconds."""
        last = self.scheduler_stats[-1] if self.scheduler_stats else SchedulerStats()
        return RunMetrics(
            steps=self.steps,
            elapsed_seconds=self.elapsed_seconds,
            num_requests=len(self.finished_step),
            num_requests_running=last.num_running_reqs,
            num_requests_waiting=last.num_waiting_reqs,
            kv_cache_usage_perc=last.kv_cache_usage,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_cache_stats=self.prefix_cache_stats,
            time_to_first_token_seconds=tuple(self.time_to_first_token_seconds.values()),
            inter_token_latency_seconds=tuple(self.inter_token_latency_seconds),
            e2e_request_latency_seconds=tuple(self.e2e_request_latency_seconds.values()),
            num_computed_prompt_tokens=sum(
                stats.num_computed_prompt_tokens for stats in self.scheduler_stats
            ),
        )


class Engine:
    """Continuous batching of :class:`EngineRequest` objects on ``model``; see the module docstring.

    ``model`` is a :class:`~paged_kv.model.tiny_gpt.TinyGPT`, a Hugging Face causal LM of a supported
    architecture or any :class:`~paged_kv.model.causal_lm.CausalLM`
    (:func:`~paged_kv.model.causal_lm.as_causal_lm`); :attr:`model` is that ``CausalLM``. The
    settings are gathered in :attr:`config`, an :class:`~paged_kv.serving.config.EngineConfig`
    (vLLM's ``CacheConfig`` and ``SchedulerConfig``), and read there.

    The memory is given one of three ways, exactly one of them: ``num_blocks`` (vLLM's
    ``num_gpu_blocks_override``); or ``kv_cache_memory_bytes``, the bytes the K/V may take; or
    ``gpu_memory_utilization``, the fraction of the device's memory (a GPU's, or the machine's RAM
    for the CPU) the engine may use, the model's weights included, as in vLLM:
    ``num_blocks = budget // bytes_per_block`` where ``bytes_per_block`` is K and V of
    ``block_size`` tokens over all layers (:class:`~paged_kv.kv.sizing.KVCacheSpec`). The last is
    vLLM's start-up sizing whole (:func:`~paged_kv.kv.startup.kv_cache_report`, kept as
    :attr:`kv_cache_report`): the budget is the device's share less the weights and the activation
    peak of a dummy step (measured on CUDA, estimated elsewhere), vLLM's two start-up lines are
    logged (logger ``paged_kv.engine``, INFO), and vLLM's error is raised when one request of
    ``max_model_len`` does not fit.

    A request ends at the model's end-of-sequence tokens, as in vLLM, unless ``ignore_eos=True``
    (vLLM's sampling parameter of that name): see :class:`EngineRequest`.

    ``max_model_len`` (default: the model's ``max_len``) bounds prompt plus output of any request
    and is the reservation of the contiguous mode. ``device`` defaults to the model's and must be
    it. ``preemption`` (``"recompute"`` or ``"swap"``), ``watermark`` (a fraction in ``[0, 1)`` of
    the blocks that an admission keeps free while others run) and ``enable_prefix_caching`` are
    settings of the paged mode. ``max_num_seqs`` caps the running requests and
    ``max_num_batched_tokens`` the tokens a step schedules (None: no limit), as vLLM's settings:
    under a budget prompts are prefilled in chunks, and a request preempted by recompute resumes
    by prefilling its prompt and the tokens it had generated (see
    :mod:`~paged_kv.serving.scheduler`). The tokens do not change. ``attention_strategy`` is the
    paged attention's (:func:`~paged_kv.attention.paged.paged_prefill_attention`).

    ``kv_cache_dtype`` is the K/V's format by vLLM's name: ``"auto"`` (the model's dtype), ``"fp8"``
    (``"fp8_e4m3"``) or ``"fp8_e5m2"``, one byte a number, so a block takes half the bytes of 16-bit
    and the same memory holds twice the blocks (:mod:`~paged_kv.kv.fp8`, lesson 10); each layer's
    scales are 1.0, or with ``calculate_kv_scales`` measured from its first write in each run.

    ``log_stats_interval`` logs vLLM's periodic line (:class:`~paged_kv.serving.metrics.LoggingStatLogger`)
    to the logger ``paged_kv.engine`` at INFO, every that many steps (an int) or seconds of the
    engine's wall clock (a float; vLLM's ``VLLM_LOG_STATS_INTERVAL``, 10.0 by default), and once
    more at the end of a run; None (the default) logs none. The KV cache's pool is named as vLLM
    names it, ``GPU`` on CUDA and else the device's type (``CPU``).

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
        attention_strategy: str = "auto",
        log_stats_interval: int | float | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
    ) -> None:
        self.model = model = as_causal_lm(model)
        self.log_stats_interval = check_interval(log_stats_interval)
        if not isinstance(kv_cache_dtype, str):
            raise ValueError(f"kv_cache_dtype must be one of vLLM's names, a str, got {kv_cache_dtype!r}")
        self.kv_cache_torch_dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, model.dtype)
        """The dtype the K/V tensors hold: the model's for ``"auto"``, torch's fp8 for ``"fp8"``."""
        if not isinstance(calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be True or False, got {calculate_kv_scales!r}")
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        block_size = check_count("block_size", block_size, minimum=1)
        config = model.config
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        # A hybrid model's paged cache is managed in KV-cache groups (lesson 13); otherwise, and in
        # the contiguous mode, every layer keeps all its tokens and the window is the attention's.
        hybrid = mode == "paged" and config.is_hybrid
        windows = config.sliding_windows if hybrid else (None,) * config.num_layers
        self.kv_cache_groups = kv_cache_groups(windows, block_size)
        self.kv_spec = KVCacheSpec(
            num_tensors(self.kv_cache_groups), config.num_kv_heads, config.head_dim, self.kv_cache_torch_dtype
        )
        model_device = resolve_device(model.device)
        self.device = model_device if device is None else resolve_device(device)
        if self.device != model_device:
            raise ValueError(
                f"device {self.device} differs from the model's {model_device}; call model.to(device)"
            )
        limit = config.max_len
        max_model_len = (
            limit if max_model_len is None else check_count("max_model_len", max_model_len, minimum=1)
        )
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_len {limit}")
        if max_num_seqs is not None:
            max_num_seqs = check_count("max_num_seqs", max_num_seqs, minimum=1)
        max_num_batched_tokens = check_budget(max_num_batched_tokens)
        self.kv_cache_report: KVCacheReport | None = None
        """vLLM's start-up sizing (:func:`~paged_kv.kv.startup.kv_cache_report`) when the memory was
        given as ``gpu_memory_utilization``, else None."""
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {preemption!r}")
        watermark = check_watermark(watermark)
        if mode != "paged" and (preemption != "recompute" or watermark):
            raise ValueError(
                "preemption and watermark are settings of the paged mode: the contiguous mode never preempts"
            )
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if enable_prefix_caching and mode != "paged":
            raise ValueError("enable_prefix_caching is a setting of the paged mode: use it with mode='paged'")
        if attention_strategy not in STRATEGIES:
            raise ValueError(f"attention_strategy must be one of {STRATEGIES}, got {attention_strategy!r}")
        blocks = self._size_cache(
            block_size,
            num_blocks,
            kv_cache_memory_bytes,
            gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_dtype=kv_cache_dtype,
        )
        if hybrid and blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 for a hybrid model (block 0 is the null block), got {blocks}"
            )
        if mode == "contiguous" and max_model_len > blocks * block_size:
            raise ValueError(
                f"max_model_len {max_model_len} does not fit the budget of num_blocks * block_size "
                f"= {blocks * block_size} token slots: contiguous mode could admit nothing"
            )
        self.config = EngineConfig(
            CacheConfig(
                block_size=block_size,
                num_blocks=blocks,
                num_gpu_blocks_override=num_blocks,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,
                calculate_kv_scales=calculate_kv_scales,
            ),
            SchedulerConfig(
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                watermark=watermark,
                preemption=preemption,
            ),
            mode=mode,
            ignore_eos=ignore_eos,
            attention_strategy=attention_strategy,
        )

    # The settings, read from the one configuration object.
    mode = property(lambda self: self.config.mode)
    block_size = property(lambda self: self.config.cache.block_size)
    num_blocks = property(lambda self: self.config.cache.num_blocks)
    enable_prefix_caching = property(lambda self: self.config.cache.enable_prefix_caching)
    max_model_len = property(lambda self: self.config.scheduler.max_model_len)
    max_num_batched_tokens = property(lambda self: self.config.scheduler.max_num_batched_tokens)
    preemption = property(lambda self: self.config.scheduler.preemption)
    watermark = property(lambda self: self.config.scheduler.watermark)
    ignore_eos = property(lambda self: self.config.ignore_eos)

    @property
    def is_hybrid(self) -> bool:
        """Whether the cache is managed in several KV-cache groups (a paged hybrid model, lesson 13)."""
        return len(self.kv_cache_groups) > 1 or self.kv_cache_groups[0].spec.sliding_window is not None

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

    def run(self, requests: Sequence[EngineRequest], progress: bool = False) -> EngineResult:
        """Serve ``requests`` until every one has finished; ``progress=True`` shows a tqdm bar.

        Each step is ``output = scheduler.schedule()`` (the tokens of every request and their
        blocks, preemptions, admissions: see :mod:`~paged_kv.serving.scheduler`), ``result =
        runner.execute_model(output)`` (a :class:`~paged_kv.serving.model_runner.ModelRunner`: the
        step's inputs prepared once, one forward, greedy sampling), ``scheduler.update_from_output(
        output, result)`` (tokens appended, finished requests freed); then the step is recorded.

        Raises:
            ValueError: a request that is not an :class:`EngineRequest`, a repeated ``request_id``,
                a bad token id, or a request too long for ``max_model_len`` or for the budget alone.
        """
        requests = self._check_requests(requests)
        llm = LLMEngine(self)
        result = EngineResult(self.mode, self.budget_tokens)
        result.arrival_step = {r.request_id: r.arrival_step for r in requests}
        pending = deque(sorted(requests, key=lambda r: r.arrival_step))  # stable: ties keep their order
        run = _RunState(
            {r.request_id: len(r.prompt) for r in requests},
            None
            if self.log_stats_interval is None
            else LoggingStatLogger(self.log_stats_interval, kv_cache_device=kv_cache_device(self.device)),
        )
        bar = progress_bar(len(requests), f"engine ({self.mode})") if progress else None
        clock = time.perf_counter
        try:
            start = clock()
            began = 0.0
            while pending or llm.has_unfinished_requests():  # each step timed around it, arrivals included
                while pending and pending[0].arrival_step <= llm.num_steps:
                    r = pending.popleft()
                    llm.add_request(r.request_id, r.prompt, self._sampling_params(r.max_new_tokens))
                llm.step()
                result.step_start_seconds.append(began)
                result.step_end_seconds.append(clock() - start)
                self._record(*llm.last_step, llm.last_stats, result, run)
                if bar is not None:
                    bar.update(len(llm.last_step[1].finished))
                began = clock() - start
            if run.stat_logger is not None:
                run.stat_logger.flush(result.elapsed_seconds)
        finally:
            llm.scheduler.free_all()
            if bar is not None:
                bar.close()
        result.tokens = {r.request_id: result.tokens[r.request_id] for r in requests}  # request order
        return result

    def _sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """An offline request's parameters: greedy, ``max_new_tokens``, the engine's ``ignore_eos``."""
        return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=self.ignore_eos)

    # ------------------------------------------------------------------------------ the helpers

    def _size_cache(
        self,
        block_size: int,
        num_blocks: int | None,
        kv_cache_memory_bytes: int | None,
        gpu_memory_utilization: float | None,
        *,
        max_model_len: int,
        max_num_seqs: int | None,
        max_num_batched_tokens: int | None,
        kv_cache_dtype: str,
    ) -> int:
        """The block count: given, or as many blocks as the budget in bytes holds (see the class).

        From ``gpu_memory_utilization`` the budget is vLLM's start-up sizing whole
        (:func:`~paged_kv.kv.startup.kv_cache_report`, kept as :attr:`kv_cache_report` and its two
        lines logged): the device's memory at that share, less the weights and the activation peak
        of a dummy step of the largest batch the engine schedules (its ``max_num_batched_tokens``;
        without one, vLLM's rule when nothing is chunked: ``max(max_model_len, 2048)``), measured on
        CUDA and estimated elsewhere; and it raises vLLM's error when one request of
        ``max_model_len`` does not fit."""
        given = {
            "num_blocks": num_blocks,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        named = [name for name, value in given.items() if value is not None]
        if len(named) != 1:
            raise ValueError(
                "give the cache's size one way: num_blocks, kv_cache_memory_bytes or "
                f"gpu_memory_utilization, got {', '.join(named) or 'none of them'}"
            )
        if num_blocks is not None:
            return check_count("num_blocks", num_blocks, minimum=1)
        if kv_cache_memory_bytes is not None:
            budget = check_count("kv_cache_memory_bytes", kv_cache_memory_bytes, minimum=0)
            blocks = self.kv_spec.num_blocks(budget, block_size)
            if blocks < 1:
                raise ValueError(
                    f"a budget of {format_bytes(budget)} holds no block: one takes "
                    f"{format_bytes(self.kv_spec.bytes_per_block(block_size))} (block_size {block_size})"
                )
            return blocks
        config = self.model.config
        if not self.is_hybrid:  # every layer keeps all its tokens: one group
            config = replace(config, sliding_windows=None)
        profile_tokens = max_num_batched_tokens or max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
        module = _profiled_module(self.model)
        report = self.kv_cache_report = kv_cache_report(
            config,
            gpu_memory_bytes=device_memory(self.device),
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_batched_tokens=profile_tokens,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            dtype=self.model.dtype,
            weight_bytes=self.model.weight_bytes,
            activation_peak_bytes=None
            if self.device.type != "cuda" or module is None
            else measure_activation_peak(module, profile_tokens),
        )
        for line in report.lines:
            _LOGGER.info(line.replace("GPU", kv_cache_device(self.device), 1))
        return report.num_gpu_blocks

    def _new_step_loop(self) -> tuple[Scheduler, ModelRunner]:
        """The scheduler over this run's memory, and the runner over its K/V storage."""
        cache, scheduler_config = self.config.cache, self.config.scheduler
        if self.mode == "contiguous":
            memory: KVMemory = ContiguousMemory(
                self.budget_tokens,
                lambda _: self.max_model_len,
                seat_tokens=self.max_model_len,
                block_size=self.block_size,
            )
        elif self.is_hybrid:
            coordinator = KVCacheCoordinator(
                self.kv_cache_groups,
                self.num_blocks,
                enable_prefix_caching=cache.enable_prefix_caching,
                max_tokens_in_flight=scheduler_config.max_num_batched_tokens,
            )
            memory = HybridKVCacheManager(coordinator, watermark=scheduler_config.watermark)
        else:
            manager = BlockManager(
                self.num_blocks, self.block_size, enable_prefix_caching=cache.enable_prefix_caching
            )
            memory = KVCacheManager(manager, watermark=scheduler_config.watermark)
        config = self.model.config
        storage = KVStorage(
            config.num_layers,
            memory.num_blocks,
            self.block_size,
            config.num_kv_heads,
            config.head_dim,
            self.kv_cache_torch_dtype,
            self.device,
            layer_tensors=[layer_tensors(self.kv_cache_groups)[layer] for layer in range(config.num_layers)],
            calculate_kv_scales=cache.calculate_kv_scales,
        )
        scheduler = Scheduler(
            memory,
            preemption=scheduler_config.preemption,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            reserve_full_prompt=scheduler_config.scheduler_reserve_full_isl,
        )
        max_blocks_per_req = blocks_for_tokens(self.max_model_len, self.block_size)
        runner = ModelRunner(
            self.model,
            storage,
            # A running request holds a block at least: the rows the table starts with (it grows).
            max_num_reqs=scheduler_config.max_num_seqs or memory.num_blocks,
            max_blocks_per_req=max_blocks_per_req,
            strategy=self.config.attention_strategy,
            kv_cache_groups=self.kv_cache_groups,
        )
        return scheduler, runner

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
            self.check_request(r.request_id, r.prompt, r.max_new_tokens)
        return requests

    def check_request(self, request_id: Hashable, prompt: Sequence[int], max_new_tokens: int) -> None:
        """Whether the memory could hold the request alone at its longest (else it would wait for ever).

        Raises:
            ValueError: it could not, with the blocks it needs.
        """
        if self.is_hybrid:
            longest = len(prompt) + max_new_tokens - 1
            needed = peak_blocks(self.kv_cache_groups, longest, self.max_num_batched_tokens) + 1
            if needed > self.num_blocks:
                raise ValueError(
                    f"num_blocks {self.num_blocks} cannot hold request {request_id!r} alone: at its "
                    f"longest its KV-cache groups hold {needed - 1} blocks, and block 0 is the null block"
                )
        elif self.mode == "paged" and not serves_alone(
            len(prompt), max_new_tokens, self.num_blocks, self.block_size
        ):
            admit, peak = blocks_alone(len(prompt), max_new_tokens, self.block_size)
            raise ValueError(
                f"num_blocks {self.num_blocks} cannot hold request {request_id!r} alone: it needs "
                f"{admit} blocks for its prompt and {peak} at its longest; see min_num_blocks"
            )

    def _record(
        self,
        output: SchedulerOutput,
        step: StepResult,
        stats: SchedulerStats,
        result: EngineResult,
        run: _RunState,
    ) -> None:
        """Add one step's counts and its :class:`SchedulerStats` (the online engine's) to ``result``.
        Per step, the loops here run over the step's events (admissions, first tokens, preemptions,
        finished requests), never over every running request: the step's tokens are counted by
        ``len`` and set operations on its dicts."""
        k = output.step
        result.prefill_tokens_computed += step.num_prefill_tokens
        for new in output.scheduled_new_reqs:
            if new.req_id in output.blocks_to_swap_in:
                continue
            result.admitted_step[new.req_id] = k
            if self.enable_prefix_caching:
                result.prefix_cache_queries += len(new.token_ids)
                result.prefix_cache_hits += new.num_computed_tokens
        for request_id in step.first_tokens:
            result.first_token_step.setdefault(request_id, k)
        result.scheduled_tokens.append(tuple(output.num_scheduled_tokens.items()))
        for preemption in output.preemptions:
            result.preemptions_by_reason[preemption.way] += 1
            if preemption.way == "swap":
                result.blocks_swapped_out += blocks_for_tokens(preemption.num_tokens, self.block_size)
            else:
                result.recomputed_tokens += preemption.num_tokens
        result.blocks_swapped_in += sum(
            blocks_for_tokens(new.num_computed_tokens, self.block_size)
            for new in output.scheduled_new_reqs
            if new.req_id in output.blocks_to_swap_in
        )
        result.running.append(step.num_running)
        result.waiting.append(step.num_waiting)
        result.swapped.append(step.num_swapped)
        result.used_blocks.append(blocks_for_tokens(step.reserved_tokens, self.block_size))
        result.held_tokens.append(step.held_tokens)
        result.reserved_tokens.append(step.reserved_tokens)
        result.utilization.append(step.held_tokens / step.reserved_tokens if step.reserved_tokens else 0.0)
        for request_id, tokens in step.finished:
            result.tokens[request_id] = list(tokens)
            result.finished_step[request_id] = k
        run.inter_token_latencies(k, step, result)
        result.scheduler_stats.append(stats)
        if run.stat_logger is not None:
            run.stat_logger.record(stats, result.step_end_seconds[k])


@dataclass
class _RunState:
    """What :meth:`Engine.run` keeps between steps to measure them, beside the result.

    ``prompt_tokens`` gives each request's prompt length; ``last_sampled`` the tokens the last step
    sampled, and ``paused`` the step of the last token of each request that stopped sampling
    (preempted, or prefilling again) and will sample again.
    """

    prompt_tokens: dict[Hashable, int]
    stat_logger: LoggingStatLogger | None
    last_sampled: Mapping[Hashable, int] = field(default_factory=dict)
    last_finished: frozenset[Hashable] = frozenset()
    paused: dict[Hashable, int] = field(default_factory=dict)

    def inter_token_latencies(self, k: int, step: StepResult, result: EngineResult) -> None:
        """Add the inter-token latencies of step ``k``'s tokens to ``result``: a request that sampled in
        step ``k - 1`` too waited one step (the seconds between the two steps' ends); one that comes
        back after a pause waited since its last token; a first token has none. Set operations on
        the steps' dicts, then a loop over the requests that came back."""
        sampled, before = step.new_tokens, self.last_sampled
        ends = result.step_end_seconds
        for request_id in before.keys() - sampled.keys() - self.last_finished:
            self.paused[request_id] = k - 1
        came_back = sampled.keys() - before.keys()
        continuing = len(sampled) - len(came_back)
        if continuing:
            result.inter_token_latency_seconds.extend([ends[k] - ends[k - 1]] * continuing)
            result.inter_token_latency_steps.extend([1] * continuing)
        if len(came_back) > len(step.first_tokens):
            first = set(step.first_tokens)
            for request_id in came_back - first:
                last = self.paused.pop(request_id)
                result.inter_token_latency_seconds.append(ends[k] - ends[last])
                result.inter_token_latency_steps.append(k - last)
        self.last_sampled = sampled
        self.last_finished = frozenset(request_id for request_id, _ in step.finished)


def _profiled_module(model: CausalLM) -> torch.nn.Module | None:
    """The module a dummy forward of token ids runs on (the tiny GPT, or a Hugging Face model's), or None."""
    module = getattr(model, "model", model)  # HFCausalLM keeps the transformers model as .model
    return module if isinstance(module, torch.nn.Module) else None


def min_num_blocks(requests: Sequence[EngineRequest], block_size: int = 16) -> int:
    """The smallest ``num_blocks`` on which the paged engine can serve every one of ``requests``.

    Alone, a request needs the blocks of its longest: ``len(prompt) + max_new_tokens - 1`` tokens
    (its last token is never fed back). Neither headroom nor the watermark counts alone: vLLM's
    scheduler keeps its watermark only while another request is scheduled.

    Raises:
        ValueError: ``requests`` is empty or holds something else than :class:`EngineRequest`, or a
            bad ``block_size``.
    """
    block_size = check_count("block_size", block_size, minimum=1)
    requests = list(requests)
    if not requests or not all(isinstance(r, EngineRequest) for r in requests):
        raise ValueError("requests must be a non-empty list of EngineRequest objects")
    return max(blocks_alone(len(r.prompt), r.max_new_tokens, block_size)[1] for r in requests)


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

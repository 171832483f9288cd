"""The engine's settings in one object, split as vLLM splits them (lessons 09-11, 14, 15).

vLLM builds every engine from one ``VllmConfig`` (``vllm/config/vllm.py``), a section per concern:
``ModelConfig`` (``vllm/config/model.py``: ``max_model_len``), ``CacheConfig``
(``vllm/config/cache.py``: ``block_size``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
``num_gpu_blocks_override``, ``enable_prefix_caching``, ``cache_dtype``, ``calculate_kv_scales``),
``SchedulerConfig`` (``vllm/config/scheduler.py``: ``max_num_seqs``, ``max_num_batched_tokens``,
``scheduler_reserve_full_isl``, ``watermark``), ``ParallelConfig`` (``tensor_parallel_size``),
``DeviceConfig``, ``AttentionConfig`` (``backend``) and ``KVEventsConfig``
(``vllm/config/kv_events.py``: the KV-cache events a router reads). :class:`VllmConfig` here has the
same sections with the same names, and every later section (speculative decoding, KV transfer) is
one more field beside them. Users rarely build one by hand: the offline
:class:`~paged_kv.serving.engine.Engine`'s keywords and ``paged-kv serve``'s flags are
:class:`~paged_kv.serving.engine_args.EngineArgs`, which checks them and makes the config. The course
adds the settings of its own comparisons: the contiguous baseline (``CacheConfig.mode``) and
preemption by swapping (``SchedulerConfig.preemption``), which vLLM v1 does not have.

Every section is frozen: a config, once made, describes one engine for its whole life.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged_kv.distributed.config import KVEventsConfig


@dataclass(frozen=True)
class ModelConfig:
    """What the engine knows of its model (vLLM: ``ModelConfig``): ``max_model_len``, the longest
    prompt plus output a request may have, and the model's vocabulary and dtype."""

    max_model_len: int
    vocab_size: int
    dtype: torch.dtype = torch.float32
    max_logprobs: int = 20
    """The most log-probabilities a request may ask for per token (vLLM's ``--max-logprobs``, 20;
    -1: the whole vocabulary)."""


@dataclass(frozen=True)
class CacheConfig:
    """How big the KV cache is and how its blocks are used (vLLM: ``CacheConfig``).

    The size is given one of three ways: ``num_gpu_blocks_override``, ``kv_cache_memory_bytes`` or
    ``gpu_memory_utilization``; ``num_gpu_blocks`` is what the engine settled on once it sized the
    cache (vLLM sets ``cache_config.num_gpu_blocks`` after its profile run), ``None`` before.
    ``cache_dtype`` is the K/V's format by vLLM's name (``"auto"``, the model's dtype, or ``"fp8"``,
    ``"fp8_e4m3"``, ``"fp8_e5m2"``), and ``calculate_kv_scales`` whether an fp8 cache measures each
    layer's scales from its first write (else 1.0). ``mode`` is the course's: ``"paged"`` blocks,
    or the ``"contiguous"`` baseline of one reservation of ``max_model_len`` per request.
    ``kv_offloading_size`` (GiB, vLLM's name; ``None``: off) is the host tier's size, through the
    offloading connector of ``kv_offloading_backend`` (``"native"``, the only one here).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = False
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    mode: str = "paged"
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may run in a step, and how it makes room (vLLM: ``SchedulerConfig``).

    ``max_num_seqs`` and ``max_num_batched_tokens`` are ``None`` for no limit (vLLM always has
    both); ``watermark`` is the share of the blocks an admission keeps free;
    ``scheduler_reserve_full_isl`` admits a request only when its whole prompt fits; ``preemption``
    is ``"recompute"`` (vLLM v1's only way) or ``"swap"`` (the paper's other way, and vLLM V0's
    ``preemption_mode``).
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    preemption: str = "recompute"
    policy: str = "fcfs"
    """``"fcfs"``, first come first served, or ``"priority"``: waiting requests by (priority,
    arrival time), the victim the running one with the largest (vLLM's ``--scheduling-policy``)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices (vLLM: ``ParallelConfig``): ``tensor_parallel_size`` ranks
    each holding ``1 / tensor_parallel_size`` of the attention heads. The course's engine runs one
    rank; lesson 14 sizes a cache for several."""

    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model, the K/V storage and the step's tensors live (vLLM: ``DeviceConfig``)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention backend reads the paged cache (vLLM: ``AttentionConfig.backend``, the
    ``--attention-backend`` flag): a registry name, or ``None`` for the platform's choice."""

    backend: str | None = None


@dataclass(frozen=True)
class VllmConfig:
    """Every setting of one engine, a section per concern (vLLM: ``VllmConfig``; see the module)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = ParallelConfig()
    device_config: DeviceConfig = DeviceConfig()
    attention_config: AttentionConfig = AttentionConfig()
    kv_events_config: KVEventsConfig | None = None
    """``None`` or a disabled config: no events (vLLM's default)."""

    @property
    def max_in_flight_tokens(self) -> int | None:
        """The most tokens scheduled and not yet settled (vLLM's property of that name): one batch of
        ``max_num_batched_tokens``, the course's engine running one step at a time; ``None`` without a
        budget. A sliding-window group holds its window and these at once."""
        return self.scheduler_config.max_num_batched_tokens

"""The engine's settings in one place, split as vLLM splits them (lessons 09-11).

vLLM gathers its settings in ``VllmConfig``; the two parts that decide the KV cache are
``CacheConfig`` (``vllm/config/cache.py``: ``block_size``, ``gpu_memory_utilization``,
``kv_cache_memory_bytes``, ``num_gpu_blocks_override``, ``enable_prefix_caching``, ``cache_dtype``) and
``SchedulerConfig`` (``vllm/config/scheduler.py``: ``max_num_seqs``, ``max_num_batched_tokens``,
``max_model_len``, ``scheduler_reserve_full_isl``, ``watermark``). :class:`EngineConfig` holds one
of each, as the :class:`~paged_kv.serving.engine.Engine` was built; the engine reads its settings
there and nowhere else. The course adds the settings of its own comparisons: the contiguous
baseline (``mode``) and preemption by swapping (``preemption``), which vLLM v1 does not have.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """How big the KV cache is and how its blocks are used.

    ``num_blocks`` is the block count the engine settled on, whichever way it was given
    (``num_gpu_blocks_override``, ``kv_cache_memory_bytes`` or ``gpu_memory_utilization``).
    ``cache_dtype`` is the K/V's format by vLLM's name (``"auto"``, the model's dtype, or ``"fp8"``,
    ``"fp8_e4m3"``, ``"fp8_e5m2"``...: the engine's ``kv_cache_dtype``), and ``calculate_kv_scales``
    whether an fp8 cache measures each layer's scales from its first write (else 1.0).
    """

    block_size: int = 16
    num_blocks: int = 0
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = False
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may run in a step, and how it makes room.

    ``max_num_seqs`` and ``max_num_batched_tokens`` are ``None`` for no limit (vLLM always has
    both); ``watermark`` is the share of the blocks an admission keeps free (vLLM's
    ``SchedulerConfig.watermark``); ``preemption`` is ``"recompute"`` (vLLM v1's only way) or
    ``"swap"`` (the paper's other way, and vLLM V0's).
    """

    max_model_len: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    preemption: str = "recompute"


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of an :class:`~paged_kv.serving.engine.Engine`: vLLM's two parts, the memory
    ``mode`` (``"paged"`` or the ``"contiguous"`` baseline), ``ignore_eos`` (vLLM's sampling
    parameter) and the paged attention's ``attention_strategy``."""

    cache: CacheConfig
    scheduler: SchedulerConfig
    mode: str = "paged"
    ignore_eos: bool = False
    attention_strategy: str = "auto"

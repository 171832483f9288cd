"""Start-up planning: which KV-cache groups a model's layers form, and how many blocks the cache gets
(lessons 00, 10, 13, 14).

vLLM plans its cache once, when the engine core starts (``vllm/v1/core/kv_cache_planning.py``,
``get_kv_cache_configs``): the layers' specs make the KV-cache groups, the memory left after a
profile run makes the block count, and the answer is a ``KVCacheConfig``
(``vllm/v1/kv_cache_interface.py``: ``num_blocks``, ``kv_cache_groups``) that the scheduler's
memory and the workers' tensors are both built from. :func:`get_kv_cache_config` is that step for
the course's engine, and :class:`KVCacheConfig` its answer:

* **the groups**: a paged hybrid model's layers grouped by window (lesson 13,
  :func:`~paged_kv.core.kv_cache_groups.kv_cache_groups`); every other model, and the contiguous
  mode, one group of every layer attending fully (the window is then the attention's alone);
* **the block count**: the one given (``num_gpu_blocks_override``), or as many blocks as
  ``kv_cache_memory_bytes`` holds, or vLLM's start-up sizing whole from ``gpu_memory_utilization``
  (:func:`~paged_kv.kv.startup.kv_cache_report`: the share of the device rounded up, less the
  weights and the activation peak of a dummy step of ``max_num_batched_tokens`` tokens, measured on
  CUDA and estimated elsewhere), whose two start-up lines are logged, and whose error is raised when
  one request of ``max_model_len`` does not fit beside the null block.

Bytes become blocks through :class:`~paged_kv.kv.sizing.KVCacheSpec`: a block costs K and V of
``block_size`` tokens in each of the pool's tensors (as many as the largest group has layers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from paged_kv.core.kv_cache_groups import KVCacheGroupSpec, kv_cache_groups, layer_tensors, num_tensors
from paged_kv.kv.fp8 import kv_cache_dtype_str_to_dtype
from paged_kv.kv.sizing import KVCacheSpec, device_memory, format_bytes
from paged_kv.kv.startup import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KVCacheReport,
    kv_cache_report,
    measure_activation_peak,
)
from paged_kv.model.causal_lm import CausalLM
from paged_kv.serving.config import VllmConfig
from paged_kv.serving.metrics import ENGINE_LOGGER, kv_cache_device

_LOGGER = logging.getLogger(ENGINE_LOGGER)


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache an engine runs on, as start-up planning settled it (vLLM: ``KVCacheConfig``).

    ``num_blocks`` blocks (the null block among them, in a paged pool) of the
    :class:`~paged_kv.serving.config.CacheConfig`'s ``block_size``; ``kv_cache_groups`` the groups
    sharing them; ``kv_cache_spec`` what one token costs in the pool's tensors; ``kv_cache_dtype`` the
    dtype the K/V tensors hold; ``report`` vLLM's start-up sizing when the cache was sized from
    ``gpu_memory_utilization``, else ``None``.
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    kv_cache_spec: KVCacheSpec
    kv_cache_dtype: torch.dtype
    report: KVCacheReport | None = None

    @property
    def is_hybrid(self) -> bool:
        """Whether the cache is managed in several KV-cache groups, or one of sliding windows (lesson 13)."""
        return len(self.kv_cache_groups) > 1 or self.kv_cache_groups[0].spec.sliding_window is not None

    def layer_tensors(self, num_layers: int) -> list[int]:
        """The pool tensor each of the model's layers reads and writes (a hybrid model's layers share
        them, one layer of every group on each)."""
        tensors = layer_tensors(self.kv_cache_groups)
        return [tensors[layer] for layer in range(num_layers)]


def get_kv_cache_config(vllm_config: VllmConfig, model: CausalLM) -> KVCacheConfig:
    """The groups and the block count of ``model``'s cache under ``vllm_config`` (see the module).

    Raises:
        ValueError: a byte budget that holds no block; a paged pool of fewer than 2 blocks (block 0
            is the null block); a contiguous budget that holds no reservation of ``max_model_len``;
            or vLLM's start-up errors, from ``gpu_memory_utilization``.
    """
    cache = vllm_config.cache_config
    config = model.config
    hybrid = cache.mode == "paged" and config.is_hybrid
    windows = config.sliding_windows if hybrid else (None,) * config.num_layers
    groups = kv_cache_groups(windows, cache.block_size)
    kv_dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model.dtype)
    spec = KVCacheSpec(num_tensors(groups), config.num_kv_heads, config.head_dim, kv_dtype)
    report = None
    if cache.num_gpu_blocks is not None:
        num_blocks = cache.num_gpu_blocks
    elif cache.kv_cache_memory_bytes is not None:
        num_blocks = spec.num_blocks(cache.kv_cache_memory_bytes, cache.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"a budget of {format_bytes(cache.kv_cache_memory_bytes)} holds no block: one takes "
                f"{format_bytes(spec.bytes_per_block(cache.block_size))} (block_size {cache.block_size})"
            )
    else:
        report = _startup_sizing(vllm_config, model, hybrid)
        num_blocks = report.num_gpu_blocks
    max_model_len = vllm_config.model_config.max_model_len
    if cache.mode == "paged" and num_blocks < 2:
        raise ValueError(
            f"num_blocks must be at least 2: block 0 of the pool is the null block, got {num_blocks}"
        )
    if cache.mode == "contiguous" and max_model_len > num_blocks * cache.block_size:
        raise ValueError(
            f"max_model_len {max_model_len} does not fit the budget of num_blocks * block_size "
            f"= {num_blocks * cache.block_size} token slots: contiguous mode could admit nothing"
        )
    return KVCacheConfig(num_blocks, groups, spec, kv_dtype, report)


def sized(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmConfig:
    """``vllm_config`` with the block count planning settled (vLLM sets ``cache_config.num_gpu_blocks``
    after its profile run)."""
    return replace(
        vllm_config, cache_config=replace(vllm_config.cache_config, num_gpu_blocks=kv_cache_config.num_blocks)
    )


def _startup_sizing(vllm_config: VllmConfig, model: CausalLM, hybrid: bool) -> KVCacheReport:
    """vLLM's start-up sizing from ``gpu_memory_utilization``: the report, its lines logged."""
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    max_model_len = vllm_config.model_config.max_model_len
    device = vllm_config.device_config.device
    config = model.config if hybrid else replace(model.config, sliding_windows=None)
    # Without a budget, vLLM's rule when nothing is chunked: the dummy batch holds max(max_model_len, 2048).
    profile_tokens = scheduler.max_num_batched_tokens or max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    module = _profiled_module(model)
    report = kv_cache_report(
        config,
        gpu_memory_bytes=device_memory(device),
        gpu_memory_utilization=cache.gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_batched_tokens=profile_tokens,
        max_num_seqs=scheduler.max_num_seqs,
        block_size=cache.block_size,
        kv_cache_dtype=cache.cache_dtype,
        dtype=model.dtype,
        weight_bytes=model.weight_bytes,
        activation_peak_bytes=None
        if device.type != "cuda" or module is None
        else measure_activation_peak(module, profile_tokens),
    )
    for line in report.lines:
        _LOGGER.info(line.replace("GPU", kv_cache_device(device), 1))
    return report


def _profiled_module(model: CausalLM) -> torch.nn.Module | None:
    """The module a dummy forward of token ids runs on (the tiny GPT, or a Hugging Face model's), or None."""
    module = getattr(model, "model", model)  # HFCausalLM keeps the transformers model as .model
    return module if isinstance(module, torch.nn.Module) else None

"""The engine's arguments, checked once and turned into its config (lessons 09-11, 14, 15).

vLLM's ``EngineArgs`` (``vllm/engine/arg_utils.py``) holds every setting a user gives, as
``LLM(**kwargs)`` keywords or ``vllm serve`` flags, and ``create_engine_config`` checks them and makes
the ``VllmConfig`` the engine is built from. :class:`EngineArgs` is the same, with vLLM's names and
the course's two additions (``mode``, ``preemption``): the offline
:class:`~paged_kv.serving.engine.Engine` and ``paged-kv serve`` both fill one, and
:meth:`EngineArgs.create_engine_config` is the one place a setting is checked. Every bad setting is a
``ValueError`` that names it; nothing is built before all of them pass.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from paged_kv.attention.registry import check_backend_name
from paged_kv.core.kv_cache_manager import check_watermark
from paged_kv.device import resolve_device
from paged_kv.distributed.config import KVEventsConfig
from paged_kv.kv.fp8 import kv_cache_dtype_str_to_dtype
from paged_kv.kv_offload.cpu.spec import cpu_bytes_to_use
from paged_kv.model.causal_lm import CausalLM
from paged_kv.serving.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from paged_kv.serving.metrics import ENGINE_LOGGER
from paged_kv.serving.scheduler import PREEMPTIONS, SCHEDULING_POLICIES, check_budget
from paged_kv.validate import check_count

_LOGGER = logging.getLogger(ENGINE_LOGGER)

KV_OFFLOADING_BACKENDS = ("native",)
"""The host tier's backends (vLLM's ``KVOffloadingBackend`` has ``"lmcache"`` too)."""
MODES = ("paged", "contiguous")
"""The course's two memories: paged blocks, or one contiguous reservation per request."""


@dataclass(frozen=True)
class EngineArgs:
    """Every setting of an engine, by vLLM's names (see the module); ``None`` means the default.

    The cache's size is given exactly one way: ``num_gpu_blocks_override`` (the offline engine's
    ``num_blocks``), ``kv_cache_memory_bytes``, or ``gpu_memory_utilization``, a share of the
    device's memory from which the weights and the activation peak are taken, as vLLM sizes it.
    ``max_model_len`` defaults to the model's longest. ``attention_backend`` is a backend's name or
    ``None`` (the platform picks); ``device`` must be the model's (``None``: the model's).
    ``kv_events_config`` is a :class:`~paged_kv.distributed.config.KVEventsConfig`, a dict of its fields
    or their JSON text (vLLM's ``--kv-events-config``), or ``None``: no events.
    ``kv_offloading_size`` (GiB, vLLM's ``--kv-offloading-size``; ``None``: off) keeps blocks in a host
    tier through the offloading connector of ``kv_offloading_backend`` (``"native"``; paged mode).
    """

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    preemption: str = "recompute"
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    mode: str = "paged"
    tensor_parallel_size: int = 1
    attention_backend: str | None = None
    device: str | torch.device | None = None
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"

    def create_engine_config(self, model: CausalLM) -> VllmConfig:
        """The :class:`~paged_kv.serving.config.VllmConfig` of an engine serving ``model`` with these
        settings (vLLM: ``EngineArgs.create_engine_config``); the cache's block count is known after
        sizing (:func:`~paged_kv.serving.kv_cache_planning.get_kv_cache_config`), unless given.

        Raises:
            ValueError: a bad setting, named in the message; a size given other than exactly one way.
        """
        for name in ("enable_prefix_caching", "calculate_kv_scales", "scheduler_reserve_full_isl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.kv_cache_dtype, str):
            raise ValueError(
                f"kv_cache_dtype must be one of vLLM's names, a str, got {self.kv_cache_dtype!r}"
            )
        kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, model.dtype)  # a name it does not know raises
        block_size = check_count("block_size", self.block_size, minimum=1)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        check_count("max_logprobs", self.max_logprobs, minimum=-1)
        if self.preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {PREEMPTIONS}, got {self.preemption!r}")
        watermark = check_watermark(self.watermark)
        if self.mode != "paged" and (self.preemption != "recompute" or watermark):
            raise ValueError(
                "preemption and watermark are settings of the paged mode: the contiguous mode never preempts"
            )
        if self.enable_prefix_caching and self.mode != "paged":
            raise ValueError("enable_prefix_caching is a setting of the paged mode: use it with mode='paged'")
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(
                f"kv_offloading_backend must be one of {KV_OFFLOADING_BACKENDS}, "
                f"got {self.kv_offloading_backend!r}"
            )
        if self.kv_offloading_size is not None:
            cpu_bytes_to_use(self.kv_offloading_size)  # a ValueError naming it
            if self.mode != "paged":
                raise ValueError(
                    "kv_offloading_size is a setting of the paged mode: use it with mode='paged'"
                )
        check_backend_name(self.attention_backend, "attention_backend")
        if check_count("tensor_parallel_size", self.tensor_parallel_size, minimum=1) != 1:
            raise ValueError(
                f"tensor_parallel_size must be 1: this engine runs on one device (lesson 14 sizes a "
                f"cache split over {self.tensor_parallel_size}), got {self.tensor_parallel_size}"
            )
        return VllmConfig(
            model_config=self._model_config(model),
            cache_config=self._cache_config(block_size),
            scheduler_config=SchedulerConfig(
                max_num_seqs=None
                if self.max_num_seqs is None
                else check_count("max_num_seqs", self.max_num_seqs, minimum=1),
                max_num_batched_tokens=check_budget(self.max_num_batched_tokens),
                scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                watermark=watermark,
                preemption=self.preemption,
                policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(self.tensor_parallel_size),
            device_config=DeviceConfig(self._device(model)),
            attention_config=AttentionConfig(self.attention_backend),
            kv_events_config=self._kv_events_config(),
        )

    def _kv_events_config(self) -> KVEventsConfig | None:
        """``kv_events_config`` as a :class:`KVEventsConfig`, with vLLM's two warnings: events on
        without prefix caching (nothing is ever stored), and a publisher with events off."""
        config = kv_events_config(self.kv_events_config)
        if config is not None and config.enable_kv_cache_events and not self.enable_prefix_caching:
            _LOGGER.warning(
                "KV cache events are on, but prefix caching is not enabled. Use --enable-prefix-caching "
                "to enable."
            )
        if config is not None and config.publisher != "null" and not config.enable_kv_cache_events:
            _LOGGER.warning(
                "KV cache events are disabled, but the scheduler is configured to publish them. Modify "
                "KVEventsConfig.enable_kv_cache_events to True to enable."
            )
        return config

    def _model_config(self, model: CausalLM) -> ModelConfig:
        limit = model.config.max_len
        if self.max_model_len is None:
            return ModelConfig(limit, model.config.vocab_size, model.dtype, self.max_logprobs)
        max_model_len = check_count("max_model_len", self.max_model_len, minimum=1)
        if max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_len {limit}")
        return ModelConfig(max_model_len, model.config.vocab_size, model.dtype, self.max_logprobs)

    def _cache_config(self, block_size: int) -> CacheConfig:
        given = {
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        named = [name for name, value in given.items() if value is not None]
        if len(named) != 1:
            raise ValueError(
                "give the cache's size one way: num_blocks (num_gpu_blocks_override), kv_cache_memory_bytes "
                f"or gpu_memory_utilization, got {', '.join(named) or 'none of them'}"
            )
        override = self.num_gpu_blocks_override
        if override is not None:
            override = check_count("num_blocks", override, minimum=1)
        if self.kv_cache_memory_bytes is not None:
            check_count("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=0)
        return CacheConfig(
            block_size=block_size,
            num_gpu_blocks=override,
            num_gpu_blocks_override=override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,  # checked where it is used: sizing
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
            mode=self.mode,
            kv_offloading_size=self.kv_offloading_size,
            kv_offloading_backend=self.kv_offloading_backend,
        )

    def _device(self, model: CausalLM) -> torch.device:
        model_device = resolve_device(model.device)
        device = model_device if self.device is None else resolve_device(self.device)
        if device != model_device:
            raise ValueError(
                f"device {device} differs from the model's {model_device}; call model.to(device)"
            )
        return device


_KV_EVENTS_FIELDS = tuple(f.name for f in fields(KVEventsConfig))


def kv_events_config(value: object) -> KVEventsConfig | None:
    """``value`` as a :class:`~paged_kv.distributed.config.KVEventsConfig`: one already, a dict of its
    fields, or that dict's JSON text (``--kv-events-config '{"enable_kv_cache_events": true}'``);
    ``None`` stays ``None``.

    Raises:
        ValueError: text that is not a JSON object, an unknown field or a bad value, naming
            ``kv_events_config`` and the field.
    """
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv_events_config must be a JSON object, got {value!r}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_events_config must be a KVEventsConfig, a dict or its JSON text, got {value!r}")
    unknown = sorted(set(value) - set(_KV_EVENTS_FIELDS))
    if unknown:
        raise ValueError(
            f"kv_events_config has no field {', '.join(map(repr, unknown))}: its fields are "
            f"{', '.join(_KV_EVENTS_FIELDS)}"
        )
    try:
        return KVEventsConfig(**value)
    except ValueError as error:
        raise ValueError(f"kv_events_config: {error}") from None

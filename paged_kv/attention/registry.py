"""The attention backends by name, and the platform's default (lessons 05, 06, 12).

vLLM 0.33.0 names its backends in ``AttentionBackendEnum`` (``vllm/v1/attention/backends/registry.py``)
and each platform picks one when none is asked for (``--attention-backend``, ``None`` by default):
the CPU platform always ``CPU_ATTN`` (``CpuPlatform.get_attn_backend_cls``, ``vllm/platforms/cpu.py``);
CUDA the first of ``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``, ``FLEX_ATTENTION`` that supports
the model's dtype, head size and cache (``_get_backend_priorities``, ``vllm/platforms/cuda.py``).

The course has five, one module each in :mod:`paged_kv.attention.backends`. Three carry vLLM's
names for vLLM's concepts: ``CPU_ATTN`` (a compiled CPU kernel, the course's own in C),
``TRITON_ATTN`` (the Triton kernel of lesson 12) and ``FLEX_ATTENTION`` (PyTorch's FlexAttention
over the pool). Two are the course's own, with no vLLM counterpart: ``GATHER``, the reference of
lesson 05 (copy the blocks, then masked attention), and ``IN_PLACE``, lesson 06's block-by-block
batched products. All five compute the same attention; tests hold each to the reference.

:func:`default_backend` is the course's platform rule, vLLM's with the backends it has:

* **CPU**: ``CPU_ATTN`` when its kernel can be built here (a C compiler) and reads the dtypes
  (float32, float16 and bfloat16 queries over caches of those or fp8), as vLLM's CPU platform
  always picks its ``CPU_ATTN``; otherwise ``GATHER``, which runs everywhere (float64 included).
* **CUDA**: ``TRITON_ATTN`` when triton is installed and reads the cache (vLLM's first choice
  among the backends the course has: it lacks FlashAttention and FlashInfer); otherwise
  ``GATHER``. ``FLEX_ATTENTION`` is never the default: compiled per batch shape, it pays its
  compilation again for every new mix of a step's lengths.
* any other device: ``GATHER``.
"""

from __future__ import annotations

import torch

from paged_kv.attention.backend import AttentionImpl
from paged_kv.attention.backends.cpu_attn import CPUAttentionImpl
from paged_kv.attention.backends.flex_attention import FlexAttentionImpl
from paged_kv.attention.backends.gather import GatherImpl
from paged_kv.attention.backends.in_place import InPlaceImpl
from paged_kv.attention.backends.triton_attn import TritonAttentionImpl

BACKENDS: dict[str, type[AttentionImpl]] = {
    impl.name: impl
    for impl in (CPUAttentionImpl, TritonAttentionImpl, FlexAttentionImpl, GatherImpl, InPlaceImpl)
}
#: The valid backend names (an engine's ``attention_backend`` is one of them, or ``None``: vLLM's
#: ``--attention-backend``, whose default lets the platform choose).
ATTENTION_BACKENDS = tuple(BACKENDS)


def check_backend_name(name: object, argument: str = "backend") -> str | None:
    """``name``, a registry name or ``None`` (the platform's default), checked.

    Raises:
        ValueError: naming ``argument`` and listing the valid names.
    """
    if name is None or (isinstance(name, str) and name in BACKENDS):
        return name
    raise ValueError(
        f"{argument} must be one of {', '.join(ATTENTION_BACKENDS)}, or None for the platform's default, "
        f"got {name!r}"
    )


def default_backend(
    device: torch.device | str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> str:
    """The platform's backend for a ``dtype`` query over a ``cache_dtype`` cache (default: ``dtype``)
    on ``device`` (see the module)."""
    device = torch.device(device)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    preferred = {"cpu": CPUAttentionImpl, "cuda": TritonAttentionImpl}.get(device.type)
    if preferred is not None and not preferred.unavailable(device, dtype, cache_dtype):
        return preferred.name
    return GatherImpl.name


def attention_backend(
    name: object, device: torch.device | str, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> type[AttentionImpl]:
    """The implementation class of backend ``name``, the platform's default for ``None``
    (:func:`default_backend` of the device and dtypes).

    Raises:
        ValueError: an unknown name (:func:`check_backend_name`).
    """
    name = check_backend_name(name)
    return BACKENDS[default_backend(device, dtype, cache_dtype) if name is None else name]

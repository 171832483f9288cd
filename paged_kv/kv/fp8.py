"""An fp8 KV cache (lesson 10): vLLM's ``kv_cache_dtype`` names, and the per-tensor scales of K/V.

An fp8 cache holds each K and V number in one byte, half of 16-bit and a quarter of float32, so the
same memory holds twice (four times) the blocks. vLLM names the formats by strings (``CacheConfig.
cache_dtype``, ``CacheDType`` in ``vllm/config/cache.py``): ``"auto"`` is the model's dtype,
``"fp8"`` is ``"fp8_e4m3"`` (4 exponent bits, 3 of mantissa: finite to 448, about two significant
decimal digits) and ``"fp8_e5m2"`` has range instead of precision (to 57,344, about one digit).
:func:`kv_cache_dtype_str_to_dtype` maps them to torch's ``torch.float8_e4m3fn`` and
``torch.float8_e5m2`` (vLLM's function of that name, in ``vllm/utils/torch_utils.py``, maps them to
``torch.uint8`` bytes that its kernels view as fp8; here the tensors have the fp8 dtype itself).

Each layer scales its K and V by one number each, ``k_scale`` and ``v_scale`` (per tensor; vLLM's
``layer._k_scale`` and ``layer._v_scale``, 1.0 unless the checkpoint brings them:
``BaseKVCacheMethod.process_weights_after_loading`` in
``vllm/model_executor/layers/quantization/kv_cache.py``). The rules, as vLLM's ``reshape_and_cache``
kernels and its attention kernels apply them:

* **store** (:func:`quantize`): ``value / scale`` in float32, clamped to the format's finite range
  (vLLM's CUDA conversion saturates, a plain cast would give inf or NaN past it), cast to fp8;
* **read** (:func:`dequantize`): ``stored * scale`` in float32, cast to the compute dtype, the
  query's (``_cast_kv_tile`` in ``vllm/v1/attention/ops/triton_unified_attention.py``);
* a scale measured from the data (:func:`calculate_scale`): the largest ``|value|`` over the
  format's largest finite number, so the data fills the format's range (a scale of 1.0 when the
  data is all zeros). Earlier vLLM versions measured them so, once, on the first forward, when
  ``calculate_kv_scales`` was set, but divided by constants, 200 for K and 100 for V by default,
  which leaves headroom under e4m3's 448 for larger values later; vLLM 0.33.0 has dropped the
  option. Here a later value past the range is clamped to it.

Invariant: for a finite ``x`` with ``|x| / s`` within the format's range, ``dequantize(quantize(x,
s, d), s, torch.float32)`` differs from ``x`` by at most ``max(2**-4 * |x|, 2**-10 * s)`` for e4m3
and ``max(2**-3 * |x|, 2**-17 * s)`` for e5m2 (half a step of the format: relative in its normal
range, half its smallest subnormal below it), plus float32's rounding of ``x / s``; past the range,
``quantize`` gives the largest finite number of the sign of ``x``.
"""

from __future__ import annotations

import math
import numbers

import torch

#: vLLM's ``kv_cache_dtype`` strings that name an fp8 format, and their torch dtype's name.
FP8_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: The 16-bit strings vLLM's ``CacheDType`` also names, each of which must be the model's dtype.
FLOAT_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: Every string :func:`kv_cache_dtype_str_to_dtype` takes.
KV_CACHE_DTYPES = ("auto", *FP8_NAMES, *FLOAT_NAMES)


def fp8_dtypes() -> tuple[torch.dtype, ...]:
    """The fp8 dtypes this torch has: ``float8_e4m3fn`` and ``float8_e5m2`` (torch 2.1 and later), or none."""
    names = dict.fromkeys(FP8_NAMES.values())
    return tuple(getattr(torch, name) for name in names if hasattr(torch, name))


_FP8_DTYPES = frozenset(fp8_dtypes())


def is_fp8(dtype: object) -> bool:
    """Whether ``dtype`` is one of the fp8 dtypes a cache may hold (:func:`fp8_dtypes`, at import)."""
    return isinstance(dtype, torch.dtype) and dtype in _FP8_DTYPES


def kv_cache_dtype_str_to_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` holds, for a model computing in ``model_dtype``.

    ``"auto"`` is ``model_dtype``; ``"fp8"`` and ``"fp8_e4m3"`` are ``torch.float8_e4m3fn``,
    ``"fp8_e5m2"`` is ``torch.float8_e5m2``; ``"float16"`` and ``"bfloat16"`` must be the
    model's dtype (vLLM: "An explicit float16 or bfloat16 must match the model data type").
    A floating point ``torch.dtype`` is returned as it is.

    Raises:
        ValueError: another string or type (the message lists the strings), a 16-bit string that is
            not the model's dtype, or an fp8 string on a torch without float8 dtypes.
    """
    if isinstance(kv_cache_dtype, torch.dtype) and kv_cache_dtype.is_floating_point:
        return kv_cache_dtype
    unknown = ValueError(
        f"kv_cache_dtype must be one of {', '.join(repr(s) for s in KV_CACHE_DTYPES)} or a floating point "
        f"torch.dtype, got {kv_cache_dtype!r}"
    )
    if not isinstance(kv_cache_dtype, str):
        raise unknown
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FP8_NAMES:
        name = FP8_NAMES[kv_cache_dtype]
        if not hasattr(torch, name):
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} needs torch.{name}, which torch {torch.__version__} "
                "does not have (torch 2.1 or later has it)"
            )
        return getattr(torch, name)
    if kv_cache_dtype in FLOAT_NAMES:
        dtype = FLOAT_NAMES[kv_cache_dtype]
        if dtype != model_dtype:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} must be the model's dtype, {model_dtype}: use 'auto' "
                "for it, or 'fp8' for a smaller cache"
            )
        return dtype
    raise unknown


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite number of an fp8 ``dtype``: 448 for e4m3, 57,344 for e5m2."""
    return float(torch.finfo(dtype).max)


def check_scale(name: str, value: object) -> float:
    """``value`` as a positive finite ``float``; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, clamped to the finite range of the fp8 ``dtype``, cast to it."""
    limit = fp8_max(dtype)
    y = x.to(torch.float32)
    if scale != 1.0:
        y = y / scale
    return y.clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, cast to ``dtype``: what an fp8 ``x`` stored with ``scale`` stands for."""
    y = x.to(torch.float32)
    if scale != 1.0:
        y = y * scale
    return y.to(dtype)


def calculate_scale(x: torch.Tensor, dtype: torch.dtype) -> float:
    """The scale that maps the largest ``|x|`` to the largest finite number of the fp8 ``dtype``
    (1.0 when ``x`` is empty, all zeros or not finite): one read back from the device."""
    if not x.numel():
        return 1.0
    largest = float(x.detach().abs().max())
    if not 0 < largest < math.inf:
        return 1.0
    return largest / fp8_max(dtype)

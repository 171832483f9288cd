"""Sizing the KV cache from a memory budget, the way vLLM does: how many blocks fit.

Lesson 00 works the arithmetic for real models on real GPUs; lesson 09's engine can take a budget in
bytes instead of a block count.

The formulas, and where vLLM keeps them (vLLM v1, read in ``vllm-project/vllm``):

* **Bytes per block of one layer**: ``2 * block_size * num_kv_heads * head_size * dtype size``, the 2
  for K and V. This is ``AttentionSpec.real_page_size_bytes``, which ``page_size_bytes`` returns, in
  ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec`` spells it ``head_size + head_size_v`` so
  that K and V may differ in size). The cache holds the *KV* heads: with grouped-query attention many
  query heads share one KV head, and only the KV heads cost memory.
* **Bytes per block of the model**: that page size times the number of layers, because every layer
  keeps its own K/V for the same block id (one block table for all layers).
* **Blocks**: ``available_memory // page_size // num_layers``, never below 0; ``get_num_blocks`` in
  ``vllm/v1/core/kv_cache_utils.py``, called from ``get_kv_cache_config_from_groups``.
  ``num_gpu_blocks_override`` (``CacheConfig``, ``vllm/config/cache.py``) replaces the result.
* **Available memory**: ``Worker.determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``
  takes ``requested_memory = total_memory * gpu_memory_utilization`` (computed in ``init_device``)
  minus the ``non_kv_cache_memory`` that a profiling run measured: the weights, the peak activations
  and the memory outside torch. Setting ``CacheConfig.kv_cache_memory_bytes`` skips that and uses
  the bytes given, ignoring ``gpu_memory_utilization``.

Here the model's non-KV memory is a number the caller gives (the weights, say); nothing is profiled.
:func:`~paged_kv.kv.startup.kv_cache_report` does vLLM's start-up whole: the activation peak, the
CUDA graphs, tensor parallelism, hybrid models' groups, the null block and the line vLLM logs.

Invariants: ``spec.num_blocks(budget, b) * spec.bytes_per_block(b) <= budget <
(spec.num_blocks(budget, b) + 1) * spec.bytes_per_block(b)``; every byte count is exact integer
arithmetic, linear in the layers, the KV heads, the head size and the block size.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import torch

from paged_kv.validate import check_count

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs in the K/V cache of a model: its layers, KV heads, head size and dtype.

    ``num_kv_heads`` is the number of key/value heads (``num_key_value_heads`` in a Hugging Face
    config), not the number of query heads. All fields are checked: positive integers and a floating
    point ``torch.dtype``; a bad one is a ``ValueError`` naming it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, check_count(name, getattr(self, name), minimum=1))
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point torch.dtype, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``2 * num_layers * num_kv_heads * head_dim * dtype size``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_block(self, block_size: int) -> int:
        """The bytes one block of ``block_size`` tokens takes in every layer: what one allocation reserves."""
        return check_count("block_size", block_size, minimum=1) * self.bytes_per_token

    def num_blocks(self, budget_bytes: int, block_size: int) -> int:
        """How many whole blocks of ``block_size`` tokens fit in ``budget_bytes``: 0 when not even one does.

        ``budget_bytes`` must be a non-negative integer (a ``ValueError`` otherwise).
        """
        budget = check_count("budget_bytes", budget_bytes, minimum=0)
        return budget // self.bytes_per_block(block_size)


def device_memory(device: str | torch.device) -> int:
    """The total memory of ``device`` in bytes: a CUDA device's ``total_memory``, or the CPU's RAM.

    On the CPU it is the machine's physical memory, ``os.sysconf`` pages times page size, as Linux
    reports it; where that cannot be read (Windows has no ``os.sysconf``) the ``OSError`` says to
    give the budget in bytes instead. A CUDA device that is not there, or another kind of device,
    is a ``ValueError``.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device must be a torch.device or a device string such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} is not available: no CUDA GPU is visible")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(
                f"device {str(device)!r} does not exist: {torch.cuda.device_count()} CUDA GPU(s)"
            )
        return torch.cuda.get_device_properties(index).total_memory
    if device.type == "cpu":
        try:
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError) as error:
            raise OSError(
                f"cannot read this machine's physical memory ({error}); give the KV cache budget in bytes"
            ) from None
        if pages <= 0 or page_size <= 0:
            raise OSError("this machine reports no physical memory; give the KV cache budget in bytes")
        return pages * page_size
    raise ValueError(
        f"device_memory reads CUDA and CPU memory, not {device.type!r}; give the KV cache budget in bytes"
    )


def kv_cache_budget(total_memory: int, gpu_memory_utilization: float, non_kv_memory: int) -> int:
    """vLLM's KV cache budget: ``int(total_memory * gpu_memory_utilization) - non_kv_memory`` bytes.

    (vLLM's ``request_memory`` rounds the product up, ``math.ceil``, one byte more at most:
    :func:`~paged_kv.kv.startup.kv_cache_report` does, this keeps the floor its callers were built on.)

    ``gpu_memory_utilization`` is the fraction of the device the engine may use, in ``(0, 1]``;
    ``non_kv_memory`` is what the model takes of it besides the cache (weights, activations). When
    nothing is left, the ``ValueError`` says how much is missing.
    """
    total = check_count("total_memory", total_memory, minimum=1)
    non_kv = check_count("non_kv_memory", non_kv_memory, minimum=0)
    utilization = gpu_memory_utilization
    if isinstance(utilization, bool) or not isinstance(utilization, numbers.Real):
        raise ValueError(f"gpu_memory_utilization must be a number, got {type(utilization).__name__}")
    if not 0 < utilization <= 1:  # also refuses nan
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    allowed = int(total * utilization)
    budget = allowed - non_kv
    if budget <= 0:
        over = "which leaves nothing" if budget == 0 else f"{format_bytes(-budget)} more than that"
        raise ValueError(
            f"no memory is left for the KV cache: the model takes {format_bytes(non_kv)} of the "
            f"{format_bytes(allowed)} that gpu_memory_utilization={utilization} allows "
            f"(of {format_bytes(total)}), {over}"
        )
    return budget


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers (a tied weight counts once): its non-KV memory
    before any activation."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def format_bytes(num_bytes: int) -> str:
    """A byte count in binary units: ``'22.5 KiB'``, ``'128 KiB'``, ``'5.4 GiB'``, ``'640 B'``.

    The largest unit that keeps the number at least 1; a whole number prints with no decimals, any
    other with one.
    """
    value = float(check_count("num_bytes", num_bytes, minimum=0))
    unit = 0
    while unit < len(_UNITS) - 1 and round(value, 1) >= 1024:
        value /= 1024
        unit += 1
    return f"{value:.0f} {_UNITS[unit]}" if value == int(value) else f"{value:.1f} {_UNITS[unit]}"

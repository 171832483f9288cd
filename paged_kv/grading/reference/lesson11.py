"""Exercise 11 graded on the package: ``admit_with_watermark`` is the engine's admission rule,
:func:`paged_kv.serving.memory.admits`, with the watermark's ``ceil(watermark * num_blocks)`` blocks kept
free; ``choose_victims`` is :func:`paged_kv.serving.preemption.choose_victims`, and ``requeue`` puts the
victims back at the front of the queue the way the engine does (``appendleft``, newest first);
``swap_out`` and ``swap_in`` are :mod:`paged_kv.kv.swap` on one allocator, with the saved K/V as a
``(k, v)`` pair instead of a :class:`~paged_kv.kv.swap.SwappedKV`.
"""

from collections import deque as _deque
from collections.abc import Hashable as _Hashable

import torch as _torch

from paged_kv.kv import swap as _swap
from paged_kv.kv.cache import PagedKVCacheAllocator as _PagedKVCacheAllocator
from paged_kv.serving.memory import admits as _admits
from paged_kv.serving.memory import watermark_blocks
from paged_kv.serving.preemption import choose_victims

__all__ = ["admit_with_watermark", "choose_victims", "requeue", "swap_in", "swap_out"]


def admit_with_watermark(
    num_free_blocks: int, prompt_blocks: int, num_running: int, num_blocks: int, watermark: float
) -> bool:
    """The prompt blocks, one of headroom per running sequence (itself included), the watermark: all free."""
    return _admits(num_free_blocks, prompt_blocks, num_running, watermark_blocks(watermark, num_blocks))


def requeue(waiting: _deque, victims: list) -> None:
    """Put ``victims`` (newest first) at the front of ``waiting``, the oldest victim first."""
    waiting.extendleft(victims)


def swap_out(allocator: _PagedKVCacheAllocator, seq_id: _Hashable) -> tuple[_torch.Tensor, _torch.Tensor]:
    """The sequence's K and V copied to host memory; its blocks freed."""
    saved = _swap.swap_out(allocator.manager, allocator.storage, seq_id)
    return saved.k[0], saved.v[0]


def swap_in(
    allocator: _PagedKVCacheAllocator, seq_id: _Hashable, saved: tuple[_torch.Tensor, _torch.Tensor]
) -> None:
    """Fresh blocks for the saved tokens, the K and V copied back; all or nothing."""
    k, v = saved
    _swap.swap_in(allocator.manager, allocator.storage, seq_id, _swap.SwappedKV(k.shape[0], (k,), (v,)))

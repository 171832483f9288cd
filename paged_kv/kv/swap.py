"""Swapping a sequence's K/V out to host memory and back: preemption without recomputation (lesson 08).

When the device runs out of blocks, an engine can lend a sequence's blocks to others without
throwing its work away: copy the K and V it holds, every layer, to CPU tensors, free its blocks,
and later, when blocks are free again, allocate fresh blocks and copy the K/V back. The physical
block ids change (the sequence gets whatever blocks are free); the logical content does not, so
the sequence continues exactly where it stopped.

The functions work on the per-layer allocators of :class:`~paged_kv.model.kv_cache.PagedKVCache` (one
:class:`~paged_kv.kv.cache.PagedKVCacheAllocator` per layer, all with identical block tables); the
cache's ``swap_out`` / ``swap_in`` methods call them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from paged_kv.core.block import blocks_for_tokens
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.validate import check_hashable


@dataclass(frozen=True, eq=False)
class SwappedKV:
    """The K/V of one sequence, all layers, held in host memory while its blocks serve others.

    Invariant: ``k[layer]`` and ``v[layer]`` are CPU tensors of shape
    ``(num_tokens, num_heads, head_dim)``, one pair per layer, row ``p`` holding token ``p``.
    """

    num_tokens: int
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Host memory the saved K and V take, in bytes."""
        return sum(t.nbytes for t in (*self.k, *self.v))


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``; in pinned (page-locked) memory when it comes from CUDA.

    Pinned memory is what lets the later copy back to the GPU run at full PCIe bandwidth.
    """
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)


def swap_out(allocators: Sequence[PagedKVCacheAllocator], seq_id: Hashable) -> SwappedKV:
    """Copy the sequence's K/V from every layer to host memory, then free its blocks everywhere.

    Raises:
        UnknownSequenceError: ``seq_id`` is not allocated (nothing is copied or freed).
    """
    num_tokens = allocators[0].sequence_length(seq_id)
    saved = [allocator.read_kv(seq_id) for allocator in allocators]
    swapped = SwappedKV(num_tokens, tuple(to_host(k) for k, _ in saved), tuple(to_host(v) for _, v in saved))
    for allocator in allocators:
        allocator.free_sequence(seq_id)
    return swapped


def swap_in(allocators: Sequence[PagedKVCacheAllocator], seq_id: Hashable, saved: SwappedKV) -> None:
    """Give ``seq_id`` fresh blocks for ``saved.num_tokens`` tokens in every layer and copy its K/V back.

    Raises:
        ValueError: ``saved`` is not a :class:`SwappedKV` with one K/V pair per layer, or
            ``seq_id`` is already allocated.
        OutOfBlocksError: too few blocks are free.

        A call that raises changes nothing.
    """
    if not isinstance(saved, SwappedKV):
        raise ValueError(f"saved must be a SwappedKV from swap_out, got {type(saved).__name__}")
    if len(saved.k) != len(allocators) or len(saved.v) != len(allocators):
        raise ValueError(
            f"saved holds K/V for {len(saved.k)} layers but the cache has {len(allocators)} layers"
        )
    first = allocators[0]
    if check_hashable("seq_id", seq_id) in first:
        raise ValueError(f"seq_id {seq_id!r} is already allocated; it cannot be swapped in twice")
    expected = (saved.num_tokens, first.num_heads, first.head_dim)
    for name, tensors in (("k", saved.k), ("v", saved.v)):
        for layer, tensor in enumerate(tensors):
            if tuple(tensor.shape) != expected or tensor.dtype != first.dtype:
                raise ValueError(
                    f"saved.{name}[{layer}] is {tuple(tensor.shape)} {tensor.dtype}, but the cache "
                    f"holds {expected} {first.dtype}: it was swapped out of a different cache"
                )
    needed = blocks_for_tokens(saved.num_tokens, first.block_size)
    if needed > first.num_free_blocks:
        raise OutOfBlocksError(needed, first.num_free_blocks, f"swapping in sequence {seq_id!r}")
    for allocator, k, v in zip(allocators, saved.k, saved.v, strict=True):
        allocator.allocate_for_sequence(seq_id, saved.num_tokens)
        allocator.write_kv(seq_id, k.to(allocator.device), v.to(allocator.device))

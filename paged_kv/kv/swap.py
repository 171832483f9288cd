"""Swapping a sequence's K/V out to host memory and back: preemption without recomputation (lesson 11).

When the device runs out of blocks, an engine can lend a sequence's blocks to others without
throwing its work away: copy the K and V it holds, every layer, to CPU tensors, free its blocks,
and later, when blocks are free again, allocate fresh blocks and copy the K/V back. The physical
block ids change (the sequence gets whatever blocks are free); the logical content does not, so
the sequence continues exactly where it stopped.

The functions work on a :class:`~paged_kv.core.block_manager.BlockManager` and the
:class:`~paged_kv.kv.storage.KVStorage` its block ids index, one layer or many: the blocks are freed
and allocated once, and every layer's K/V is copied. The model cache's ``swap_out`` / ``swap_in``
(:class:`~paged_kv.model.kv_cache.PagedKVCache`) call them. The engine splits the two halves as
vLLM V0 did: its scheduler frees and allocates the blocks, and its runner copies the K/V
(:func:`copy_out` and :func:`copy_in`) before the step's forward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_manager import BlockManager
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.storage import KVStorage
from paged_kv.validate import check_hashable


@dataclass(frozen=True, eq=False)
class SwappedKV:
    """The K/V of one sequence, all layers, held in host memory while its blocks serve others.

    Invariant: ``k[layer]`` and ``v[layer]`` are CPU tensors of shape
    ``(num_tokens, num_kv_heads, head_dim)``, one pair per layer, row ``p`` holding token ``p``.
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


def copy_out(
    storage: KVStorage,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    layer_group: Sequence[int] | None = None,
) -> SwappedKV:
    """The first ``num_tokens`` tokens' K/V, every layer, copied to host memory: layer ``l`` read
    through ``block_ids[layer_group[l]]``, its KV-cache group's blocks (``layer_group``: every
    layer in group 0). A sliding-window group's null entries read the null block: positions no
    window needs again, copied and never read.

    The engine's runner calls it for each request the scheduler swapped out, before the step's
    forward writes into the freed blocks (vLLM V0's ``blocks_to_swap_out``).
    """
    groups = _layer_groups(storage, layer_group)
    index = [storage.block_index(ids) for ids in block_ids]
    saved = [storage.read(layer, index[groups[layer]], num_tokens) for layer in range(storage.num_layers)]
    return SwappedKV(num_tokens, tuple(to_host(k) for k, _ in saved), tuple(to_host(v) for _, v in saved))


def copy_in(
    storage: KVStorage,
    saved: SwappedKV,
    block_ids: Sequence[Sequence[int]],
    layer_group: Sequence[int] | None = None,
) -> None:
    """Write ``saved`` back, every layer into its group's ``block_ids`` (the runner's
    ``blocks_to_swap_in``; ``layer_group`` as for :func:`copy_out`).

    Raises:
        ValueError: ``saved`` is not a :class:`SwappedKV` of this storage's layers, shape and dtype,
            or a group's blocks hold fewer slots than its tokens; nothing is written.
    """
    check_saved(storage, saved)
    groups = _layer_groups(storage, layer_group)
    for ids in block_ids:
        if len(ids) * storage.block_size < saved.num_tokens:
            raise ValueError(f"{len(ids)} blocks cannot hold the {saved.num_tokens} swapped tokens")
    index = [storage.block_index(ids) for ids in block_ids]
    for layer, (k, v) in enumerate(zip(saved.k, saved.v, strict=True)):
        storage.write(layer, index[groups[layer]], k.to(storage.device), v.to(storage.device))


def _layer_groups(storage: KVStorage, layer_group: Sequence[int] | None) -> Sequence[int]:
    return [0] * storage.num_layers if layer_group is None else layer_group


def check_saved(storage: KVStorage, saved: object) -> None:
    """A ValueError unless ``saved`` is a :class:`SwappedKV` of ``storage``'s layers, shape and dtype."""
    if not isinstance(saved, SwappedKV):
        raise ValueError(f"saved must be a SwappedKV from swap_out, got {type(saved).__name__}")
    if len(saved.k) != storage.num_layers or len(saved.v) != storage.num_layers:
        raise ValueError(
            f"saved holds K/V for {len(saved.k)} layers but the cache has {storage.num_layers} layers"
        )
    expected = (saved.num_tokens, storage.num_kv_heads, storage.head_dim)
    for name, tensors in (("k", saved.k), ("v", saved.v)):
        for layer, tensor in enumerate(tensors):
            if tuple(tensor.shape) != expected or tensor.dtype != storage.dtype:
                raise ValueError(
                    f"saved.{name}[{layer}] is {tuple(tensor.shape)} {tensor.dtype}, but the cache "
                    f"holds {expected} {storage.dtype}: it was swapped out of a different cache"
                )


def swap_out(manager: BlockManager, storage: KVStorage, seq_id: Hashable) -> SwappedKV:
    """Copy the sequence's K/V from every layer to host memory, then free its blocks.

    Raises:
        UnknownSequenceError: ``seq_id`` is not allocated (nothing is copied or freed).
    """
    table = manager.table(seq_id)
    swapped = copy_out(storage, (table.block_ids,), table.num_tokens)
    manager.free(seq_id)
    return swapped


def swap_in(manager: BlockManager, storage: KVStorage, seq_id: Hashable, saved: SwappedKV) -> None:
    """Give ``seq_id`` fresh blocks for ``saved.num_tokens`` tokens and copy its K/V back into every layer.

    Raises:
        ValueError: ``saved`` is not a :class:`SwappedKV` with one K/V pair per layer of the
            storage's shape and dtype, or ``seq_id`` is already allocated.
        OutOfBlocksError: too few blocks are free.

        A call that raises changes nothing.
    """
    check_saved(storage, saved)
    if check_hashable("seq_id", seq_id) in manager:
        raise ValueError(f"seq_id {seq_id!r} is already allocated; it cannot be swapped in twice")
    needed = blocks_for_tokens(saved.num_tokens, manager.block_size)
    if needed > manager.num_free_blocks:
        raise OutOfBlocksError(needed, manager.num_free_blocks, f"swapping in sequence {seq_id!r}")
    table = manager.allocate(seq_id, saved.num_tokens)
    manager.prepare_write(seq_id, 0, saved.num_tokens)
    copy_in(storage, saved, (table.block_ids,))

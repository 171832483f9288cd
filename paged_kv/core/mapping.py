"""The arithmetic of a block table, on lists and tensors: where a token lives, and when to grow.

Lesson 03 builds the translation, lesson 04 the boundary rule.

Token ``p`` of a sequence lives in logical block ``p // block_size`` at offset ``p % block_size``;
the block table turns the logical block into a physical one, ``block_table[p // block_size]``.
The KV caches have shape ``(num_blocks, num_heads, block_size, head_dim)``, so token ``p``'s K is
``k_cache[block_table[p // block_size], :, p % block_size, :]``. A sequence holding ``num_tokens``
tokens in ``num_blocks_held`` blocks needs a new block before its next token exactly when those
blocks are full.

These functions hold no state and know no sequence ids. The one-layer cache
(:class:`~paged_kv.kv.cache.PagedKVCacheAllocator`) and the storage (:class:`~paged_kv.kv.storage.KVStorage`)
check their arguments and then delegate to them, and the block manager asks :func:`needs_new_block`
(its decode hot path inlines the same comparison), so the translation lives here and only here. The
tensor functions work on whole tensors of positions at once, with no Python loop over tokens.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from paged_kv.validate import check_count


def needs_new_block(num_tokens: int, num_blocks_held: int, block_size: int) -> bool:
    """Whether a sequence's next token needs a new block: the blocks it holds are full.

    That is ``num_tokens == num_blocks_held * block_size``. It covers an empty sequence (0 tokens in
    0 blocks: its first token needs a block) and a block reserved ahead (4 tokens in 2 blocks of 4:
    the next token fits). The popular ``(num_tokens + 1) % block_size == 0`` is off by one.

    >>> [needs_new_block(n, 1, 4) for n in (1, 3, 4)], needs_new_block(0, 0, 4), needs_new_block(4, 2, 4)
    ([False, False, True], True, False)
    """
    return num_tokens == num_blocks_held * block_size


def physical_location(block_table: Sequence[int], position: int, block_size: int) -> tuple[int, int]:
    """``(physical_block_id, offset)`` of one logical position, as two ints.

    >>> physical_location([5, 2, 7], 6, 4)
    (2, 2)

    Raises:
        ValueError: ``position`` is not an integer in ``[0, len(block_table) * block_size)`` (a
            negative one would silently read the last block through ``block_table[-1]``), or
            ``block_size`` is not a positive integer.
    """
    block_size = check_count("block_size", block_size, minimum=1)
    if isinstance(position, bool) or not isinstance(position, numbers.Integral):
        raise ValueError(f"position must be an integer, got {type(position).__name__} {position!r}")
    capacity = len(block_table) * block_size
    if not 0 <= position < capacity:
        raise ValueError(
            f"position {position} is outside the block table: {len(block_table)} blocks of {block_size} "
            f"hold positions 0 to {capacity - 1}"
        )
    logical_block, offset = divmod(int(position), block_size)
    return int(block_table[logical_block]), offset


def physical_locations(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The physical block ids and offsets of many positions at once: two tensors shaped like ``positions``.

    ``block_table`` is a 1-D integer tensor and ``positions`` an integer tensor on the same device.
    Positions are not range-checked (that would wait for the device): each must lie in
    ``[0, len(block_table) * block_size)``.
    """
    return block_table[positions // block_size], positions % block_size


def slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat slot ``physical_block_id * block_size + offset`` of every position, as a LongTensor.

    The slot indexes the cache viewed as ``num_blocks * block_size`` token slots. With a long
    ``positions`` tensor the result is long, even for an int32 ``block_table`` (what
    :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.block_tables_tensor` gives). Positions are not
    range-checked, as in :func:`physical_locations`.

    >>> slot_mapping(torch.tensor([5, 2, 7]), torch.arange(6), 4).tolist()
    [20, 21, 22, 23, 8, 9]
    """
    # The slots of the whole table in logical order, then one gather: the same numbers as
    # block_table[p // block_size] * block_size + p % block_size, without an integer division and
    # a modulo per position (about twice as fast on a CPU; bench/bench_slot_mapping.py).
    offsets = torch.arange(block_size, device=block_table.device)
    slots = (block_table.long()[:, None] * block_size + offsets).reshape(-1)
    return slots[positions]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_position: int = 0,
) -> None:
    """Scatter ``k`` and ``v`` into the caches, in place: token ``i`` goes to position ``start_position + i``.

    ``k`` and ``v`` have shape ``(num_tokens, num_heads, head_dim)``; the caches
    ``(num_blocks, num_heads, block_size, head_dim)``; ``block_table`` is a 1-D integer tensor on
    the caches' device. Shapes, dtypes and ranges are not checked here (the cache's
    :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.write_kv` does that).
    """
    positions = torch.arange(start_position, start_position + k.shape[0], device=k_cache.device)
    block_ids, offsets = physical_locations(block_table, positions, k_cache.shape[2])
    # Advanced indices on axes 0 and 2 pair block_ids[i] with offsets[i]; ":" keeps the heads.
    k_cache[block_ids, :, offsets] = k
    v_cache[block_ids, :, offsets] = v


def read_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather positions ``0 .. num_tokens - 1`` back into contiguous ``(num_tokens, num_heads, head_dim)``.

    Row ``p`` of each result is token ``p``, whatever order its blocks lie in physically.
    """
    positions = torch.arange(num_tokens, device=k_cache.device)
    block_ids, offsets = physical_locations(block_table, positions, k_cache.shape[2])
    return k_cache[block_ids, :, offsets], v_cache[block_ids, :, offsets]

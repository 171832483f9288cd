"""Slots on tensors: where many tokens' K/V go in the pool, and the scatter and gather through a table.

Lesson 03 builds the translation one position at a time (:mod:`paged_kv.core.mapping`, plain ints);
these are the same rule on whole tensors of positions, with no Python loop over tokens. Token ``p``
of a sequence whose block table is ``block_table`` lives at offset ``p % block_size`` of physical
block ``block_table[p // block_size]``: flat **slot** ``block_table[p // block_size] * block_size +
p % block_size`` of the pool viewed as ``num_blocks * block_size`` token slots. vLLM's model runner
computes the same numbers for every token of a step (its ``slot_mapping``; in vLLM 0.33.0's Model
Runner V2, ``BlockTables.compute_slot_mappings`` in ``vllm/v1/worker/gpu/block_table.py``).

:func:`slot_mapping` is the one place the package turns positions into slots: the one-layer cache
of lessons 02-08, the step inputs of the engine (:mod:`paged_kv.model.step`) and the grader's
references all call it. Positions are not range-checked here (that would wait for the device):
each must fall in a block its row holds.
"""

from __future__ import annotations

import torch


def physical_locations(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The physical block ids and offsets of many positions of one sequence: two tensors like ``positions``.

    ``block_table`` is a 1-D integer tensor and ``positions`` an integer tensor on its device.
    """
    return block_table[positions // block_size], positions % block_size


def slot_mapping(
    block_table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The flat slot ``physical_block_id * block_size + offset`` of every position, as a LongTensor.

    With a 1-D ``block_table`` (one sequence) the positions are that sequence's. With a 2-D
    ``block_table`` (one row per sequence of a batch, padded) ``rows`` gives the row of each
    position: token ``t`` is position ``positions[t]`` of the sequence in row ``rows[t]``, as a
    step's flattened batch has it. The result is long even for an int32 table.

    >>> slot_mapping(torch.tensor([5, 2, 7]), torch.arange(6), 4).tolist()
    [20, 21, 22, 23, 8, 9]
    >>> table, rows = torch.tensor([[5, 2], [7, -1]]), torch.tensor([0, 1, 1])
    >>> slot_mapping(table, torch.tensor([5, 0, 1]), 4, rows=rows).tolist()
    [9, 28, 29]
    """
    if rows is not None:
        blocks = block_table[rows, positions // block_size].long()
        return blocks * block_size + positions % block_size
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

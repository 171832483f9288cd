"""Lesson 00's names over the package: ``blocks_for_tokens`` is :func:`paged_kv.core.block.blocks_for_tokens`
itself; ``paged_usage`` reads four fields of :func:`paged_kv.simulation.fragmentation.paged_usage` (a
:class:`~paged_kv.core.usage.BlockUsage`) into the exercise's dict; ``contiguous_usage`` is
:func:`paged_kv.simulation.fragmentation.contiguous_baseline` (a
:class:`~paged_kv.simulation.fragmentation.ContiguousUsage`)
as a dict.
"""

from dataclasses import asdict as _asdict

from paged_kv.core.block import blocks_for_tokens
from paged_kv.simulation import fragmentation as _fragmentation

__all__ = ["blocks_for_tokens", "contiguous_usage", "paged_usage"]


def paged_usage(request_tokens: list[int], block_size: int) -> dict:
    """Blocks, slots and waste when every request holds whole blocks."""
    usage = _fragmentation.paged_usage(request_tokens, block_size)
    return {
        "used_blocks": usage.used_blocks,
        "reserved_tokens": usage.reserved_tokens,
        "internal_fragmentation_tokens": usage.internal_fragmentation_tokens,
        "block_utilization": usage.block_utilization,
    }


def contiguous_usage(request_tokens: list[int], slot_tokens: int | None = None) -> dict:
    """Slots and waste when every request reserves one contiguous slot."""
    return _asdict(_fragmentation.contiguous_baseline(request_tokens, slot_tokens))

"""The fragmentation benchmark: paged blocks against one contiguous fixed slot per request.

A contiguous engine must reserve, for every request, a slot as long as the longest request it may
serve. Paging reserves whole blocks, so it wastes at most ``block_size - 1`` slots per request.
:func:`fragmentation_report` puts both side by side for a list of request lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ._checks import check_count
from .cache import PagedKVCacheAllocator


@dataclass(frozen=True)
class ContiguousUsage:
    """Reserving one fixed slot of ``slot_tokens`` for every request.

    Fields:
        reserved_tokens: ``len(requests) * slot_tokens``.
        internal_fragmentation_tokens: reserved slots that hold no token.
        utilization: tokens held / tokens reserved (0.0 when nothing is reserved).
    """

    reserved_tokens: int
    internal_fragmentation_tokens: int
    utilization: float


def contiguous_baseline(request_tokens: Sequence[int], slot_tokens: int | None = None) -> ContiguousUsage:
    """What reserving ``slot_tokens`` (default: the longest request) per request costs."""
    tokens = [check_count("request_tokens", n) for n in request_tokens]
    slot = max(tokens, default=0) if slot_tokens is None else check_count("slot_tokens", slot_tokens)
    if tokens and slot < max(tokens):
        raise ValueError(f"slot_tokens must hold the longest request ({max(tokens)}), got {slot}")
    reserved = slot * len(tokens)
    held = sum(tokens)
    return ContiguousUsage(
        reserved_tokens=reserved,
        internal_fragmentation_tokens=reserved - held,
        utilization=held / reserved if reserved else 0.0,
    )


def fragmentation_report(
    request_tokens: Sequence[int], block_size: int = 16, total_blocks: int = 64
) -> dict[str, object]:
    """Allocate every request in a real paged cache and compare it with the contiguous baseline.

    The cache has one head of dimension one: the bookkeeping is what is measured, not the data.

    Raises:
        ValueError: a count is negative or not an integer.
        OutOfBlocksError: the requests need more than ``total_blocks`` blocks.
    """
    tokens = [check_count("request_tokens", n) for n in request_tokens]
    cache = PagedKVCacheAllocator(total_blocks, block_size, num_heads=1, head_dim=1)
    for seq_id, num_tokens in enumerate(tokens):
        cache.allocate_for_sequence(seq_id, num_tokens)
    paged = cache.usage()
    contiguous = contiguous_baseline(tokens)
    return {
        "block_size": cache.block_size,
        "block_usage": paged.as_dict(),
        "contiguous_fixed_slot_baseline": asdict(contiguous),
        "fragmentation_tokens_saved_vs_contiguous": contiguous.internal_fragmentation_tokens
        - paged.internal_fragmentation_tokens,
        "request_tokens": tokens,
    }

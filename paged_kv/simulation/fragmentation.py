"""The fragmentation benchmark: paged blocks against one contiguous fixed slot per request (lesson 00).

A contiguous engine must reserve, for every request, a slot as long as the longest request it may
serve. Paging reserves whole blocks, so it wastes at most ``block_size - 1`` slots per request.
:func:`paged_usage` and :func:`contiguous_baseline` are the arithmetic of each layout;
:func:`fragmentation_report` allocates the requests in a real paged cache and puts both side by side.

Each request's count is its final length: it is done growing. So every reserved slot that holds no
token is **internal fragmentation** (reserved beyond the final length, never used), and none is
**reservation** (slots kept for tokens still to come), the other waste of the vLLM paper's Figure 2,
which only a request still generating has; :mod:`paged_kv.simulation.shares` measures both over time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.usage import BlockUsage
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.validate import check_count


@dataclass(frozen=True)
class ContiguousUsage:
    """Reserving one fixed slot of ``slot_tokens`` for every request.

    Fields:
        reserved_tokens: ``len(requests) * slot_tokens``.
        internal_fragmentation_tokens: reserved slots that hold no token (beyond the final
            lengths: internal fragmentation).
        utilization: tokens held / tokens reserved (0.0 when nothing is reserved).
    """

    reserved_tokens: int
    internal_fragmentation_tokens: int
    utilization: float


def paged_usage(
    request_tokens: Sequence[int], block_size: int = 16, total_blocks: int | None = None
) -> BlockUsage:
    """What paging reserves for the requests: each holds ``blocks_for_tokens(tokens, block_size)`` blocks.

    The arithmetic of what a :class:`~paged_kv.kv.cache.PagedKVCacheAllocator` of ``total_blocks``
    blocks measures (its :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.usage`) once every request is
    allocated, without building one. Blocks are rounded up per request, never for the total: a
    block holds the tokens of one sequence only. ``total_blocks`` defaults to exactly the blocks
    the requests use, so that no block is free.

    >>> paged_usage([9, 17, 33, 5, 41, 12], block_size=16).internal_fragmentation_tokens
    59

    Raises:
        ValueError: a count is negative or not an integer.
        OutOfBlocksError: the requests need more than ``total_blocks`` blocks.
    """
    tokens = [check_count("request_tokens", n) for n in request_tokens]
    block_size = check_count("block_size", block_size, minimum=1)
    used = sum(blocks_for_tokens(n, block_size) for n in tokens)
    total = used if total_blocks is None else check_count("total_blocks", total_blocks, minimum=1)
    if used > total:
        raise OutOfBlocksError(used, total, f"{len(tokens)} requests of {sum(tokens)} tokens")
    return BlockUsage.measure(
        used_blocks=used, free_blocks=total - used, allocated_tokens=sum(tokens), block_size=block_size
    )


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

"""The arithmetic of a block table, on plain ints: where a token lives, and when to grow.

Lesson 03 builds the translation, lesson 04 the boundary rule.

Token ``p`` of a sequence lives in logical block ``p // block_size`` at offset ``p % block_size``;
the block table turns the logical block into a physical one, ``block_table[p // block_size]``.
The KV caches have shape ``(num_blocks, num_heads, block_size, head_dim)``, so token ``p``'s K is
``k_cache[block_table[p // block_size], :, p % block_size, :]``. A sequence holding ``num_tokens``
tokens in ``num_blocks_held`` blocks needs a new block before its next token exactly when those
blocks are full.

These functions hold no state, know no sequence ids and import no torch: the block manager asks
:func:`needs_new_block` (its hot path inlines the same comparison), and the one-layer cache
(:class:`~paged_kv.kv.cache.PagedKVCacheAllocator`) asks :func:`physical_location`. The same
arithmetic on whole tensors of positions, for the slots a step writes, is
:mod:`paged_kv.kv.slots`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

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

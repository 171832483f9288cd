"""The two data structures of paging: a physical :class:`Block` and a sequence's :class:`BlockTable`.

Lesson 01 builds them.

A KV cache is cut into ``num_blocks`` fixed-size blocks of ``block_size`` token slots each. A
sequence does not own a contiguous region; it owns a *block table*, an ordered list of physical
block ids, exactly like a process's page table: logical block ``i`` of the sequence lives in
physical block ``block_ids[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from paged_kv.core import mapping
from paged_kv.validate import check_count


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``.

    >>> [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 33)]
    [0, 1, 1, 2, 3]
    """
    return -(-num_tokens // block_size)


@dataclass
class Block:
    """A handle to one physical block of the KV cache.

    ``block_id`` is the block's index along dimension 0 of ``k_cache`` and ``v_cache``.
    ``ref_count`` is the number of block tables that hold the block: 0 means the block is free,
    more than 1 means sequences share it (a forked sequence or a cached prefix).
    """

    block_id: int
    ref_count: int = 0


@dataclass
class BlockTable:
    """A sequence's page table: logical block ``i`` lives in physical block ``block_ids[i]``.

    Invariant kept by the allocator: ``num_tokens <= len(block_ids) * block_size``, so every token
    of the sequence has a slot. The last block may be partly empty; that tail is the only place
    paging wastes memory (internal fragmentation, less than one block per sequence).
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def append_block(self, block_id: int) -> None:
        """Add a physical block at the end of the table (the next logical block)."""
        self.block_ids.append(block_id)

    @property
    def num_blocks(self) -> int:
        """How many blocks the table holds."""
        return len(self.block_ids)

    def capacity(self, block_size: int) -> int:
        """How many tokens fit in the blocks the table holds."""
        return len(self.block_ids) * block_size

    def physical_block(self, position: int, block_size: int) -> int:
        """The physical block that holds token ``position``: ``block_ids[position // block_size]``.

        The table holds positions ``0 .. num_tokens - 1``; the look-up itself is
        :func:`paged_kv.core.mapping.physical_location`'s.

        >>> BlockTable([7, 2, 5], num_tokens=40).physical_block(16, 16)
        2

        Raises:
            ValueError: ``position`` is not an integer in ``0 .. num_tokens - 1`` (a negative
                position is refused, not read from the end of the table), the table has no block
                for it, or ``block_size`` is not a positive integer.
        """
        position = check_count("position", position)
        if position >= self.num_tokens:
            raise ValueError(
                f"position {position} is out of range: the table holds {self.num_tokens} tokens, "
                f"so positions run from 0 to {self.num_tokens - 1}"
            )
        block_id, _offset = mapping.physical_location(self.block_ids, position, block_size)
        return block_id

    def copy(self) -> BlockTable:
        """An independent copy, of the same class: changing it never changes this table."""
        return replace(self, block_ids=list(self.block_ids))

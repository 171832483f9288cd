"""Lesson 01's names over the package: ``Block`` and ``BlockTable`` are :class:`paged_kv.core.block.Block`
and :class:`paged_kv.core.block.BlockTable` themselves, and ``physical_block(table, position, block_size)``
calls :meth:`paged_kv.core.block.BlockTable.physical_block` on the table.
"""

from paged_kv.core.block import Block, BlockTable

__all__ = ["Block", "BlockTable", "physical_block"]


def physical_block(table: BlockTable, position: int, block_size: int) -> int:
    """The physical block that holds token ``position`` of the sequence ``table`` describes."""
    return table.physical_block(position, block_size)

"""Exercise 04 graded on the package: ``needs_new_block`` is the boundary rule of :mod:`paged_kv.kv.mapping`
(the one ``PagedKVCacheAllocator.needs_new_block`` applies to a sequence); ``BlockManager`` is lesson
02's ``SequenceAllocator``, so :class:`paged_kv.kv.cache.PagedKVCacheAllocator`, whose
``append_block_to_sequence`` is the one graded, seen through the seed lesson's names
(``blocks``, ``free_blocks``, ``sequence_block_tables``, read only); and ``decode_step`` and
``finish_and_admit`` are the scheduler steps of :mod:`paged_kv.serving.scheduling`, which work on the
package's cache.
"""

from collections import deque as _deque
from collections.abc import Hashable as _Hashable

from paged_kv.core.block import Block as _Block
from paged_kv.core.block import BlockTable as _BlockTable
from paged_kv.grading.reference.lesson02 import SequenceAllocator as _SequenceAllocator
from paged_kv.kv.mapping import needs_new_block
from paged_kv.serving.scheduling import decode_step, finish_and_admit

__all__ = ["BlockManager", "decode_step", "finish_and_admit", "needs_new_block"]


class BlockManager(_SequenceAllocator):
    """The package's cache (with tensors too small to matter, block ids back) under the exercise's names."""

    @property
    def blocks(self) -> list[_Block]:
        """A handle per block with its ref count (a snapshot)."""
        return [_Block(block_id, self.ref_count(block_id)) for block_id in range(self.num_blocks)]

    @property
    def free_blocks(self) -> _deque[int]:
        """The free list, head first (a snapshot)."""
        return _deque(self.manager.allocator.free_block_ids)

    @property
    def sequence_block_tables(self) -> dict[_Hashable, _BlockTable]:
        """The live block tables, by sequence id."""
        return self.manager.tables

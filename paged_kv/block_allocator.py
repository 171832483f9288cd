"""The block pool's bookkeeping: a free list and a ref count per block, and no tensors.

:class:`BlockAllocator` answers one question, "which physical block can I use next?", in O(1).
It knows nothing about sequences or K/V data; :class:`~paged_kv.cache.PagedKVCacheAllocator`
builds on it.
"""

from __future__ import annotations

from collections import deque

from ._checks import check_count
from .block import Block
from .errors import OutOfBlocksError


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks with a FIFO free list and ref counts.

    Invariants, true after every call (and unchanged by a call that raises):

    * a block is free exactly when its ref count is 0, and then it is on the free list once;
    * ``num_free_blocks + num_used_blocks == num_blocks``;
    * a block returns to the free list only when its ref count drops to 0.

    ``allocate`` takes the block at the head of the free list and ``free`` puts a released block
    at its tail, so both are O(1) whatever the pool size.
    """

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self._blocks = [Block(block_id) for block_id in range(self._num_blocks)]
        self._free: deque[int] = deque(range(self._num_blocks))

    def __repr__(self) -> str:
        return f"BlockAllocator(free={self.num_free_blocks}/{self._num_blocks})"

    @property
    def num_blocks(self) -> int:
        """The size of the pool."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """How many blocks have a ref count above 0."""
        return self._num_blocks - len(self._free)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free list in order: the first id is the next one ``allocate`` returns."""
        return tuple(self._free)

    def can_allocate(self, num_blocks: int = 1) -> bool:
        """Whether ``num_blocks`` blocks are free right now."""
        return check_count("num_blocks", num_blocks) <= len(self._free)

    def allocate(self) -> int:
        """Take the next free block, set its ref count to 1 and return its id.

        Raises:
            OutOfBlocksError: no block is free.
        """
        if not self._free:
            raise OutOfBlocksError(needed=1, free=0)
        block_id = self._free.popleft()
        self._blocks[block_id].ref_count = 1
        return block_id

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks at once, or none: all or nothing.

        Raises:
            OutOfBlocksError: fewer than ``num_blocks`` blocks are free (nothing is taken).
        """
        num_blocks = check_count("num_blocks", num_blocks)
        if num_blocks > len(self._free):
            raise OutOfBlocksError(needed=num_blocks, free=len(self._free))
        return [self.allocate() for _ in range(num_blocks)]

    def add_ref(self, block_id: int) -> int:
        """Record one more holder of a used block (sharing) and return its new ref count."""
        block = self._used_block(block_id)
        block.ref_count += 1
        return block.ref_count

    def free(self, block_id: int) -> bool:
        """Drop one reference to a used block.

        Returns:
            ``True`` when the ref count reached 0 and the block went back to the free list,
            ``False`` when other holders keep it in use.

        Raises:
            ValueError: ``block_id`` is out of range or the block is already free (a double free).
        """
        block = self._used_block(block_id)
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free.append(block.block_id)
            return True
        return False

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has; 0 when it is free."""
        return self._block(block_id).ref_count

    def is_free(self, block_id: int) -> bool:
        """Whether the block is on the free list."""
        return self._block(block_id).ref_count == 0

    def _block(self, block_id: int) -> Block:
        block_id = check_count("block_id", block_id)
        if block_id >= self._num_blocks:
            raise ValueError(f"block_id must be below num_blocks={self._num_blocks}, got {block_id}")
        return self._blocks[block_id]

    def _used_block(self, block_id: int) -> Block:
        block = self._block(block_id)
        if block.ref_count == 0:
            raise ValueError(f"block_id {block.block_id} is already free (a double free)")
        return block

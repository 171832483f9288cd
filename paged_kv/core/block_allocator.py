"""The block pool's bookkeeping: a free list and a ref count per block, and no tensors (lesson 02).

:class:`BlockAllocator` answers one question, "which physical block can I use next?", in O(1).
It knows nothing about sequences or K/V data; :class:`~paged_kv.kv.cache.PagedKVCacheAllocator`
builds on it.

The free list is a :class:`FreeKVCacheBlockQueue`, a doubly linked list threaded through two arrays
indexed by block id (as vLLM v1's ``FreeKVCacheBlockQueue``): besides taking the head and adding at
the tail, it can take one particular block out of the middle in O(1), which prefix caching needs
when a request reuses a cached block that sits on the free list.
"""

from __future__ import annotations

from collections.abc import Iterator

from paged_kv.core.block import Block
from paged_kv.errors import OutOfBlocksError
from paged_kv.validate import check_count

DETACHED = -1
"""The ``prev``/``next`` link of a block that is not on a :class:`FreeKVCacheBlockQueue`."""


class FreeKVCacheBlockQueue:
    """A FIFO queue of block ids ``0 .. num_blocks - 1``, each at most once, with O(1) removal anywhere.

    The list is a ring through a sentinel node, index ``num_blocks``: ``next[sentinel]`` is the
    head, ``prev[sentinel]`` the tail, and an empty queue is the sentinel linked to itself. A block
    id is its own node, so finding a block costs nothing.

    Invariants, true after every call (and unchanged by a call that raises):

    * walking ``next`` from the sentinel visits every queued block once and comes back to the
      sentinel after ``len(queue)`` steps; walking ``prev`` visits the same blocks in reverse;
    * for every queued block ``b``: ``next[prev[b]] == b`` and ``prev[next[b]] == b``;
    * a block that is not queued has both links equal to :data:`DETACHED`.
    """

    def __init__(self, num_blocks: int) -> None:
        """A queue of all ``num_blocks`` blocks, in id order: block 0 is the head."""
        num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self._sentinel = num_blocks
        # Node i links to i - 1 and i + 1; the sentinel closes the ring at both ends.
        self._next = [*range(1, num_blocks + 1), 0]
        self._prev = [num_blocks, *range(num_blocks)]
        self.num_free_blocks = num_blocks
        """How many blocks are queued (vLLM's name): kept as a count, so that reading it costs no call."""

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[int]:
        """The queued blocks from head to tail."""
        node = self._next[self._sentinel]
        while node != self._sentinel:
            yield node
            node = self._next[node]

    def __reversed__(self) -> Iterator[int]:
        """The queued blocks from tail to head (walking the ``prev`` links)."""
        node = self._prev[self._sentinel]
        while node != self._sentinel:
            yield node
            node = self._prev[node]

    def __contains__(self, block_id: object) -> bool:
        return (
            isinstance(block_id, int)
            and not isinstance(block_id, bool)
            and 0 <= block_id < self._sentinel
            and self._next[block_id] != DETACHED
        )

    def __repr__(self) -> str:
        return f"FreeKVCacheBlockQueue({list(self)})"

    def append(self, block_id: int) -> None:
        """Put a block that is not queued at the tail.

        Raises:
            ValueError: ``block_id`` is not a block id of the queue, or the block is already queued
                (nothing changes).
        """
        self._link(self._detached(block_id), self._prev[self._sentinel])

    def appendleft(self, block_id: int) -> None:
        """Put a block that is not queued at the head: the next ``popleft`` returns it.

        Raises:
            ValueError: as :meth:`append` (nothing changes).
        """
        self._link(self._detached(block_id), self._sentinel)

    def popleft(self) -> int:
        """Take the head off the queue and return it.

        Raises:
            IndexError: the queue is empty.
        """
        nxt, prev, sentinel = self._next, self._prev, self._sentinel
        head = nxt[sentinel]
        if head == sentinel:
            raise IndexError("pop from an empty FreeKVCacheBlockQueue")
        after = nxt[head]  # _unlink(head), inlined: every allocation comes here
        nxt[sentinel], prev[after] = after, sentinel
        prev[head] = nxt[head] = DETACHED
        self.num_free_blocks -= 1
        return head

    def remove(self, block_id: int) -> None:
        """Take one queued block out, wherever it is: O(1), its neighbours are linked together.

        Raises:
            ValueError: ``block_id`` is not a block id of the queue, or the block is not queued
                (nothing changes).
        """
        block_id = self._block_id(block_id)
        if self._next[block_id] == DETACHED:
            raise ValueError(f"block_id {block_id} is not on the free list")
        self._unlink(block_id)

    def _block_id(self, block_id: object) -> int:
        """``block_id`` as an int in ``0 .. num_blocks - 1``, else a ``ValueError`` naming it."""
        block_id = check_count("block_id", block_id)
        if block_id >= self._sentinel:
            raise ValueError(f"block_id must be below num_blocks={self._sentinel}, got {block_id}")
        return block_id

    def _detached(self, block_id: object) -> int:
        """``block_id`` checked, and not queued, else a ``ValueError``."""
        block_id = self._block_id(block_id)
        if self._next[block_id] != DETACHED:
            raise ValueError(f"block_id {block_id} is already on the free list")
        return block_id

    def _link(self, block_id: int, before: int) -> None:
        """Queue ``block_id`` right after node ``before`` (the sentinel: at the head)."""
        after = self._next[before]
        self._next[before] = block_id
        self._prev[block_id] = before
        self._next[block_id] = after
        self._prev[after] = block_id
        self.num_free_blocks += 1

    def _unlink(self, block_id: int) -> None:
        before, after = self._prev[block_id], self._next[block_id]
        self._next[before] = after
        self._prev[after] = before
        self._prev[block_id] = self._next[block_id] = DETACHED
        self.num_free_blocks -= 1


class BlockAllocator:
    """A pool of ``num_blocks`` physical blocks with a FIFO free list and ref counts.

    Invariants, true after every call (and unchanged by a call that raises):

    * a block is free exactly when its ref count is 0, and then it is on the free list once;
    * ``num_free_blocks + num_used_blocks == num_blocks``;
    * a block returns to the free list only when its ref count drops to 0.

    ``allocate`` takes the block at the head of the free list and ``free`` puts a released block
    at its tail; ``take`` removes one particular free block from wherever it sits. All three are
    O(1) whatever the pool size. Every block that ``allocate_blocks`` hands out goes through
    ``allocate``, and every released block through ``_release``, so a subclass can watch both ends
    of the free list by overriding those two methods (prefix caching evicts at the head and puts
    the blocks that hold nothing cached back there).
    """

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self._blocks = [Block(block_id) for block_id in range(self._num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self._num_blocks)
        """The free list (vLLM's name; read it: the allocator changes it)."""
        self.num_shared_blocks = 0
        """How many blocks have more than one holder (kept up to date in O(1); read it)."""

    def __repr__(self) -> str:
        return f"BlockAllocator(free={self.num_free_blocks}/{self._num_blocks})"

    @property
    def num_blocks(self) -> int:
        """The size of the pool."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are on the free list."""
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        """How many blocks have a ref count above 0."""
        return self._num_blocks - len(self.free_block_queue)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        """The free list in order: the first id is the next one ``allocate`` returns."""
        return tuple(self.free_block_queue)

    def can_allocate(self, num_blocks: int = 1) -> bool:
        """Whether ``num_blocks`` blocks are free right now."""
        return check_count("num_blocks", num_blocks) <= len(self.free_block_queue)

    def allocate(self) -> int:
        """Take the next free block, set its ref count to 1 and return its id.

        Raises:
            OutOfBlocksError: no block is free.
        """
        try:
            block_id = self.free_block_queue.popleft()
        except IndexError:
            raise OutOfBlocksError(needed=1, free=0) from None
        self._blocks[block_id].ref_count = 1
        return block_id

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks at once, or none: all or nothing.

        Raises:
            OutOfBlocksError: fewer than ``num_blocks`` blocks are free (nothing is taken).
        """
        num_blocks = check_count("num_blocks", num_blocks)
        if num_blocks > len(self.free_block_queue):
            raise OutOfBlocksError(needed=num_blocks, free=len(self.free_block_queue))
        return [self.allocate() for _ in range(num_blocks)]

    def take(self, block_id: int) -> None:
        """Take one particular free block off the free list, wherever it sits, with ref count 1.

        This is how a prefix-cache hit revives a cached block that no sequence holds: O(1), the
        rest of the free list keeps its order.

        Raises:
            ValueError: ``block_id`` is out of range or the block is in use (nothing changes).
        """
        block = self._block(block_id)
        if block.ref_count:
            raise ValueError(
                f"block_id {block.block_id} is in use (ref count {block.ref_count}), not on the free "
                "list; use add_ref to share a used block"
            )
        self.free_block_queue.remove(block.block_id)
        block.ref_count = 1

    def add_ref(self, block_id: int) -> int:
        """Record one more holder of a used block (sharing) and return its new ref count."""
        block = self._used_block(block_id)
        block.ref_count += 1
        if block.ref_count == 2:
            self.num_shared_blocks += 1
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
        if block.ref_count == 1:
            self.num_shared_blocks -= 1
        if block.ref_count == 0:
            self._release(block.block_id)
            return True
        return False

    def _release(self, block_id: int) -> None:
        """Put a block whose ref count reached 0 on the free list: at the tail (FIFO)."""
        self.free_block_queue.append(block_id)

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

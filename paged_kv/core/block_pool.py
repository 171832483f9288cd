"""The block pool: every block of the KV cache, its free list, its ref counts and the prefix cache's
map over them, and the one place a cached block is stored or evicted (lessons 02, 08, 13).

vLLM 0.33.0 keeps one ``BlockPool`` (``vllm/v1/core/block_pool.py``) under every model's memory: its
single-type managers take blocks from it (``get_new_blocks``), hand hits back to it (``touch``) and
free into it (``free_blocks``), and it alone stores and evicts cached hashes. :class:`BlockPool` is
that pool, built on lesson 02's :class:`~paged_kv.core.block_allocator.BlockAllocator` (the free
list and the ref counts) with lesson 08's :class:`~paged_kv.core.prefix_cache.PrefixCache` (the
maps from hash to block):

* **The null block.** Block :data:`NULL_BLOCK` (0) is taken when the pool is built and never given
  back: it is the entry a sliding-window layer's table holds where a block left its window (lesson
  13), and a pool of ``num_blocks`` blocks has ``num_blocks - 1`` to give out, as in vLLM for every
  model. The lessons' facade (:class:`~paged_kv.core.block_manager.BlockManager`, lessons 02-08)
  builds its pool with ``null_block=False``: its block 0 is an ordinary block.
* **One eviction point.** A cached block that nobody holds sits on the free list with its hash; it
  loses the hash (is *evicted*) exactly when :meth:`allocate` hands it out for new data, or when
  :meth:`evict` is told its K/V changed. A released block that holds no hash goes to the head of
  the free list, a cached one to the tail, so new data takes every block with nothing worth keeping
  before it evicts a cached prefix, and evicts the least recently freed first (vLLM's
  ``free_blocks`` does the same). Without caching, a released block goes to the tail: the free
  list is lesson 02's FIFO.
* **One store point.** :meth:`cache_block` caches a full block under its chained hash, and
  :meth:`cache_full_blocks` every block a request's new tokens fill, following its
  :class:`~paged_kv.core.prefix_cache.HashChain`: the lessons' facade and every group's manager
  cache through it.
* **No K/V changes under a hash.** :meth:`record_write` notes the slots written in each block since
  it was handed out, and evicts a cached block written again below them (the lessons' caches can
  write any position; the engine only ever writes a block's next slots).
* **The hook.** Every store, eviction and reset is told to the pool's listeners
  (:class:`BlockPoolListener`): which block, under which hash and group, with which tokens and
  parent. vLLM turns the same moments into its KV-cache events (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``, queued in its pool until ``take_events``); so does the listener
  :class:`~paged_kv.distributed.kv_events.KVCacheEvents`, which the engine adds when its events
  are on: one eviction is one ``BlockRemoved``, a reset one ``AllBlocksCleared`` (no removal per
  block).

Invariants, on top of :class:`~paged_kv.core.block_allocator.BlockAllocator`'s, true after every
call and unchanged by a call that raises: a block holds at most one hash, and only while caching is
on; a block on the free list that holds a hash is at or behind every free block that holds none
once released; the null block, when there is one, has ref count 1 for ever and holds no hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from paged_kv.core.block_allocator import BlockAllocator
from paged_kv.core.prefix_cache import CachedBlock, ExtraKeys, HashChain, PrefixCache, TokenIds
from paged_kv.errors import OutOfBlocksError

NULL_BLOCK = 0
"""The null block of a pool that has one (vLLM: ``BlockPool.null_block``): the entry of a block that
left a sliding window."""


class BlockPoolListener(Protocol):
    """What a :class:`BlockPool` tells about its prefix cache, after the change is made (vLLM's
    KV-cache events hang at the same three moments)."""

    def block_stored(self, entry: CachedBlock) -> None:
        """``entry.block_id`` now holds ``entry.block_hash`` (of group ``entry.group``)."""

    def block_removed(self, entry: CachedBlock) -> None:
        """``entry.block_id`` no longer holds ``entry.block_hash``: evicted."""

    def all_blocks_cleared(self) -> None:
        """Every hash was forgotten at once (a reset)."""


class BlockPool(BlockAllocator):
    """``num_blocks`` blocks with a free list, ref counts and, with ``enable_caching``, a prefix cache.

    ``null_block`` (default ``True``) takes block :data:`NULL_BLOCK` for good (see the module).

    Raises:
        ValueError: ``num_blocks`` below 1 (below 2 with a null block), or ``enable_caching`` not a
            bool.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = False, null_block: bool = True) -> None:
        super().__init__(num_blocks)
        if not isinstance(enable_caching, bool):
            raise ValueError(f"enable_caching must be True or False, got {enable_caching!r}")
        if null_block and self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 with a null block (block 0) and one to give out, "
                f"got {self.num_blocks}"
            )
        self.enable_caching = enable_caching
        self.prefix_cache = PrefixCache()
        """The hash maps and the counters (read them; the pool changes them)."""
        self.listeners: list[BlockPoolListener] = []
        self.null_block: int | None = None
        """:data:`NULL_BLOCK` when the pool has one, else ``None``."""
        self._written = [0] * self.num_blocks  # per block: leading slots written since it was handed out
        if null_block:
            self.null_block = BlockAllocator.allocate(self)  # the head of a fresh free list: block 0

    def __repr__(self) -> str:
        return f"BlockPool(free={self.num_free_blocks}/{self.num_blocks}, cached={len(self.prefix_cache)})"

    @property
    def num_usable_blocks(self) -> int:
        """The blocks the pool gives out: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    def get_usage(self) -> float:
        """The share of the usable blocks in use (vLLM: ``BlockPool.get_usage``): a free block that
        still holds a cached prefix counts as free."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def add_listener(self, listener: BlockPoolListener) -> None:
        """Tell ``listener`` every store, eviction and reset from now on."""
        if not all(callable(getattr(listener, name, None)) for name in _LISTENER_METHODS):
            raise ValueError(
                f"listener must have the methods {', '.join(_LISTENER_METHODS)}, got {listener!r}"
            )
        self.listeners.append(listener)

    # ------------------------------------------------------------------ taking and releasing

    def allocate(self) -> int:
        """Take the head of the free list for new data, evicting the hash it held (the one place a
        block is handed out)."""
        block_id = super().allocate()
        if self.enable_caching:
            self._written[block_id] = 0
            self.evict(block_id)
        return block_id

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free list, all or none (vLLM's name: the
        engine's call, which has counted them; :meth:`allocate_blocks` checks its argument first).
        None for a count of 0 or less.

        Raises:
            OutOfBlocksError: fewer than ``num_blocks`` are free (nothing is taken).
        """
        if num_blocks > len(self.free_block_queue):
            raise OutOfBlocksError(needed=num_blocks, free=len(self.free_block_queue))
        if num_blocks == 1:  # a decode's block: the common case
            return [self.allocate()]
        allocate = self.allocate
        return [allocate() for _ in range(num_blocks)]

    def touch(self, block_ids: Sequence[int]) -> None:
        """One more holder for each block of a prefix-cache hit: off the free list when nobody held it
        (vLLM: ``touch``). The null block is skipped."""
        for block_id in block_ids:
            if block_id == self.null_block:
                continue
            if self.is_free(block_id):
                self.take(block_id)
            else:
                self.add_ref(block_id)

    def num_revived(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` (a hit) sit on the free list: touching them costs free blocks."""
        return sum(self.is_free(b) for b in block_ids if b != self.null_block)

    def free_blocks(self, ordered_block_ids: Sequence[int]) -> list[int]:
        """Drop one reference to each block, in order (the first to be evicted first among those
        that reach 0 and are cached); return the blocks that went back to the free list. The null
        block is skipped (vLLM: ``free_blocks``)."""
        return [b for b in ordered_block_ids if b != self.null_block and self.free(b)]

    def _release(self, block_id: int) -> None:
        """With caching, a cached block goes to the tail of the free list, to stay cached longest, and
        any other to the head, to be reused first; without, every block to the tail, lesson 02's FIFO
        (vLLM puts an uncached block at the head either way)."""
        if self.enable_caching and self.prefix_cache.entry(block_id) is None:
            self.free_block_queue.appendleft(block_id)
        else:
            self.free_block_queue.append(block_id)

    # ---------------------------------------------------------------------- the prefix cache

    def cache_block(
        self,
        parent: CachedBlock | None,
        tokens: TokenIds,
        block_id: int,
        block_hash: int | None = None,
        group: int = 0,
        evicted_parent: bool = False,
        extra_keys: ExtraKeys = None,
    ) -> CachedBlock | None:
        """Cache the full block ``block_id`` after ``parent``, its hash taking its ``extra_keys``, by
        :meth:`PrefixCache.extend <paged_kv.core.prefix_cache.PrefixCache.extend>`'s rule, and tell
        the listeners when it stored a new entry. Returns the entry the request's next full block
        follows, ``None`` when its chain ends. The caller must write the block's K/V before any
        other request reads it."""
        entry = self.prefix_cache.extend(
            parent, tokens, block_id, block_hash, group, evicted_parent, extra_keys
        )
        if entry is not None and entry.block_id == block_id and self.listeners:
            for listener in self.listeners:
                listener.block_stored(entry)
        return entry

    def cache_full_blocks(
        self,
        chain: HashChain,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        block_size: int,
        group: int = 0,
        evicted_parent: bool = False,
    ) -> bool:
        """A request grew by ``token_ids``: cache each of its blocks they fill (vLLM:
        ``cache_full_blocks``). ``block_ids`` is its table after the growth; the block that fills is
        hashed after ``chain.last`` with the tokens ``chain.tail`` and ``token_ids`` put in it and
        the extra keys of its place (``chain.extra_keys``: a salt on block 0, a LoRA name on every
        block, as a prompt block of that place), and cached by :meth:`cache_block`; ``chain``
        moves past it. ``evicted_parent`` lets a sliding
        window's chain go on after its earlier blocks left the pool. Nothing is taken or freed.

        Returns:
            Whether the chain goes on (``False``: it ended, and the caller drops it).
        """
        tail, keys = chain.tail, chain.extra_keys
        tail.extend(token_ids)
        while len(tail) >= block_size:
            tokens = tuple(tail[:block_size])
            del tail[:block_size]
            chain.last = self.cache_block(
                chain.last,
                tokens,
                block_ids[chain.num_blocks],
                group=group,
                evicted_parent=evicted_parent,
                extra_keys=keys.rest if chain.num_blocks else keys.first,
            )
            chain.num_blocks += 1
            if chain.last is None:
                return False
        return True

    def record_write(self, block_id: int, first: int, end: int) -> bool:
        """Note a write into slots ``first .. end - 1`` of a used block; return whether it overwrote.

        A write that starts below the slots already written overwrites K/V: if the block is cached,
        its hash is evicted first, since the new K/V may not be those of its tokens. Writes are
        assumed to fill a block in order (prefill, then decode); a write out of order is taken for
        an overwrite, which costs a cache entry and never correctness.
        """
        overwrites = first < self._written[block_id]
        self._written[block_id] = max(self._written[block_id], end)
        if overwrites:
            self.evict(block_id)
        return overwrites

    def copy_written(self, source: int, copy: int) -> None:
        """A used block ``copy`` now holds ``source``'s K/V (copy-on-write): it has its written slots,
        so that a later write below them counts as an overwrite, as it would in ``source``."""
        self._written[copy] = self._written[source]

    def evict(self, block_id: int) -> bool:
        """Forget the hash ``block_id`` holds, if any (its K/V are about to change); tell the
        listeners. Returns whether it held one."""
        entry = self.prefix_cache.evict(block_id)
        if entry is None:
            return False
        for listener in self.listeners:
            listener.block_removed(entry)
        return True

    def clear_prefix_cache(self) -> int:
        """Forget every hash at once, held blocks' too, and zero the counters; return how many blocks
        held one. Live requests keep their blocks; the free list keeps its order."""
        dropped = self.prefix_cache.reset()
        self._tell_cleared()
        return dropped

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (``BlockPool.reset_prefix_cache``): forget every hash, only when no request
        holds a block; return whether it did. The counters go on: they count every lookup since the
        pool was built (vLLM's ``vllm:prefix_cache_queries`` is a counter, which never goes back),
        so a reader of their differences (``make_prefix_cache_stats``) never sees one below 0."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block_id in list(self.prefix_cache.cached_blocks()):
            self.prefix_cache.evict(block_id)
        self._tell_cleared()
        return True

    def _tell_cleared(self) -> None:
        for listener in self.listeners:
            listener.all_blocks_cleared()


_LISTENER_METHODS = ("block_stored", "block_removed", "all_blocks_cleared")

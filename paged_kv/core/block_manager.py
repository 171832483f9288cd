"""The lessons' block manager: sequences' block tables, with fork and copy-on-write, over a block pool,
and no tensors (lessons 02, 04, 08).

Lessons 02, 04 and 08 build its parts; this is where they meet, behind the lessons' facade
(:class:`~paged_kv.kv.cache.PagedKVCacheAllocator`, ``generate``'s
:class:`~paged_kv.model.kv_cache.PagedKVCache`). It keeps one table per sequence over a
:class:`~paged_kv.core.block_pool.BlockPool`, the very pool the engine's coordinator holds (built
here without a null block, so that the lessons' block 0 is an ordinary block): the pool hands out,
caches and evicts, and a prompt's cached prefix is found by the same
:meth:`~paged_kv.core.prefix_cache.PrefixCache.match` the engine's full-attention groups use. What
the manager adds is vLLM V0's: a prompt allocated at once (``BlockSpaceManager.allocate``), appends
token by token, and :meth:`fork` with copy-on-write (parallel sampling, beam search), which vLLM v1's
engine no longer has. The tensors live in :class:`~paged_kv.kv.storage.KVStorage`; what must happen
to them is what the manager returns: the ``(source, copy)`` block pairs of a copy-on-write, which the
caller copies in every layer before writing.

Invariants, true after every call (and unchanged by a call that raises):

* every sequence has ``num_tokens <= len(block_ids) * block_size``;
* a block's ref count equals the number of block tables that hold it, and a block is on the free
  list exactly when that count is 0; used blocks + free blocks == ``num_blocks``;
* no sequence writes into a block another sequence holds: the appends and :meth:`prepare_write`
  first give the writer its own copy of such a block (returned as a ``(source, copy)`` pair), so
  every holder of a shared block holds the same tokens in it;
* with prefix caching, a cached block's K/V never change under its hash: a write below the slots
  already written in a cached block makes the pool forget the hash first (:meth:`prepare_write`);
  and a cached block's hash is the chained hash of exactly the tokens it holds, from its sequence's
  first block on, whether it filled in prefill or in decode (a sequence whose appends give their
  ``token_ids`` keeps a :class:`~paged_kv.core.prefix_cache.HashChain`).

Every successful change is announced to the observers as a :class:`~paged_kv.core.changes.BlockChange`;
the recorder of the widgets' traces is one (:class:`~paged_kv.core.trace.Recorder`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from paged_kv.core import mapping
from paged_kv.core.block import BlockTable, blocks_for_tokens
from paged_kv.core.block_pool import BlockPool
from paged_kv.core.changes import BlockChange, Observer
from paged_kv.core.prefix_cache import (
    CachedBlock,
    HashChain,
    PrefixCacheStats,
    chain_hashes,
    check_token_ids,
    full_blocks,
)
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.core.usage import BlockUsage
from paged_kv.errors import OutOfBlocksError, UnknownSequenceError
from paged_kv.validate import check_count, check_hashable

Copies = list[tuple[int, int]]
"""``(shared block, its copy)`` pairs: the block copies the caller makes in the K/V storage."""


class BlockManager:
    """Block tables for many sequences over one pool of ``num_blocks`` blocks of ``block_size`` slots.

    Sequence ids can be any hashable value. With ``enable_prefix_caching=True`` a prompt allocated
    with its ``token_ids`` reuses the blocks of its longest cached prefix (full blocks only, see
    :mod:`paged_kv.core.prefix_cache`), and its full blocks are cached; while every append gives its
    ``token_ids`` too, each block that fills during decode is cached the same way.

    Raises:
        ValueError: a bad ``num_blocks`` or ``block_size``, or ``enable_prefix_caching`` not a bool.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        self.block_size = check_count("block_size", block_size, minimum=1)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        self.allocator = BlockPool(num_blocks, enable_caching=enable_prefix_caching, null_block=False)
        """The pool: free list, ref counts and prefix cache (read it; the manager changes it)."""
        self.num_blocks = self.allocator.num_blocks
        self._observers: list[Observer] = []
        self._tables: dict[Hashable, BlockTable] = {}
        self._cached_tokens: dict[Hashable, int] = {}
        # Per sequence whose tokens are known, its place in the chain of block hashes.
        self._chains: dict[Hashable, HashChain] = {}

    def __repr__(self) -> str:
        return (
            f"BlockManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, sequences={len(self._tables)})"
        )

    # ----------------------------------------------------------------------------- the pool

    @property
    def tables(self) -> dict[Hashable, BlockTable]:
        """The live block tables by sequence id, in allocation order: the manager's own dict, not a copy.

        Read it; the manager's methods keep the invariants, and code that writes here (the
        grader's checks build shared tables by hand) must keep them itself.
        """
        return self._tables

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are free."""
        return self.allocator.num_free_blocks

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """The live sequences, in the order they were allocated."""
        return tuple(self._tables)

    def __contains__(self, seq_id: object) -> bool:
        try:
            return seq_id in self._tables
        except TypeError:  # not hashable
            return False

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self.allocator.ref_count(block_id)

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether prompts given with ``token_ids`` reuse cached blocks (set when the manager is built)."""
        return self.allocator.enable_caching

    # ----------------------------------------------------------------------------- observers

    def subscribe(self, observer: Observer) -> None:
        """Call ``observer(change)`` after each successful change from now on
        (:mod:`paged_kv.core.changes`)."""
        if not callable(observer):
            raise ValueError(f"observer must be callable with a BlockChange, got {observer!r}")
        if not self._observers:  # the pool's evictions become "evict" changes
            self.allocator.add_listener(_Evictions(self._emit))
        self._observers.append(observer)

    def _emit(self, change: BlockChange) -> None:
        for observer in self._observers:
            observer(change)

    # ------------------------------------------------------------------- the life of a sequence

    def allocate(
        self, seq_id: Hashable, num_prompt_tokens: int, token_ids: Sequence[int] | None = None
    ) -> BlockTable:
        """Give a new sequence the blocks for its whole prompt: ``ceil(num_prompt_tokens / block_size)``.

        The lessons' call (vLLM V0's ``BlockSpaceManager.allocate``). With prefix caching and the
        prompt's ``token_ids``, the leading full blocks of the longest cached prefix are reused (at
        most ``num_prompt_tokens - 1`` tokens: the last prompt token is always computed, for the
        logits that sample the next token) and :meth:`num_cached_tokens` says how many tokens they
        cover; the hits are taken first (off the free list, or one more reference), then the fresh
        blocks from the head of the free list, which evicts whatever they held, and the prompt's
        fresh full blocks are cached for later prompts: the caller must write their K/V before
        another prompt reuses them. Without prefix caching ``token_ids`` are checked and otherwise
        ignored.

        Returns:
            A copy of the new block table.

        Raises:
            ValueError: ``seq_id`` is already allocated or not hashable, ``num_prompt_tokens`` is
                negative, or ``token_ids`` is not ``num_prompt_tokens`` non-negative integers.
            OutOfBlocksError: too few blocks are free (cached blocks on the free list count among
                those the prompt takes). Nothing changes, nothing is counted.
        """
        self._check_new_id("seq_id", seq_id)
        num_tokens = check_count("num_prompt_tokens", num_prompt_tokens)
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, num_tokens)
        pool, size = self.allocator, self.block_size
        caching = pool.enable_caching and token_ids is not None
        hits: list[CachedBlock] = []
        if caching:
            blocks = full_blocks(token_ids, size)
            hits = pool.prefix_cache.match(blocks, chain_hashes(blocks), max(0, (num_tokens - 1) // size))
        hit_ids = [entry.block_id for entry in hits]
        num_fresh = blocks_for_tokens(num_tokens, size) - len(hits)
        needed = num_fresh + pool.num_revived(hit_ids)
        if needed > pool.num_free_blocks:
            raise OutOfBlocksError(needed, pool.num_free_blocks, f"sequence {seq_id!r} ({num_tokens} tokens)")
        pool.touch(hit_ids)
        cached = len(hits) * size
        table = self._tables[seq_id] = BlockTable(hit_ids, num_tokens)
        if cached:
            self._cached_tokens[seq_id] = cached
            if self._observers:
                self._emit(BlockChange("cache_hit", seq_id, tuple(hit_ids), tokens=(1, cached)))
        table.block_ids += pool.get_new_blocks(num_fresh)
        if caching:
            pool.prefix_cache.record(num_tokens, cached)
            self._chains[seq_id] = HashChain(hits[-1] if hits else None, len(hits))
            self._advance_chain(seq_id, table, token_ids[cached:])
        if self._observers:
            self._emit(BlockChange("allocate", seq_id, tuple(table.block_ids), tokens=(1, num_tokens)))
        return table.copy()

    def append_tokens(
        self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None
    ) -> tuple[list[int], Copies]:
        """Grow a sequence by ``n`` tokens, taking blocks only where a token finds no room of its own.

        Token ``t + 1`` of a sequence holding ``t`` tokens needs a new block when ``t`` is a multiple
        of ``block_size`` and the table has no block for it; it needs a copy when the block it lands
        in is shared (after :meth:`fork`): the sequence takes a fresh block in the shared block's
        place, and the shared block loses one holder (lazy copy-on-write, as in vLLM). Full shared
        blocks take no token and stay shared. The tokens are placed block by block, so the work is
        O(blocks the tokens touch), one for a decode step; with nothing shared and no observer,
        the blocks are taken at once, with the same outcome.

        ``token_ids`` are the ids of the ``n`` new tokens. With prefix caching, and a sequence
        whose tokens the manager knows (allocated with ``token_ids``, every append since with
        its ids), each block the tokens fill is cached under its chained hash, as a prompt's full
        block would be: a later prompt that starts with this sequence's tokens reuses it. An append
        without ids ends that: the manager no longer knows the sequence's tokens, so none of its
        later blocks is cached. Without prefix caching ``token_ids`` are checked and ignored.

        Returns:
            The blocks taken, in table order, and the ``(shared block, copy)`` pairs whose K/V the
            caller must copy before writing the new tokens.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: ``n`` is negative, or ``token_ids`` is not ``n`` non-negative integers.
            OutOfBlocksError: too few blocks are free for the copies and new blocks together (the
                sequence does not grow at all).
        """
        try:
            table = self._tables[seq_id]
        except (KeyError, TypeError):
            table = self._table(seq_id)  # raises the package's own error
        if type(n) is not int or n < 0:
            n = check_count("n", n)
        if token_ids is None and not self._observers and not self.allocator.num_shared_blocks:
            end = table.num_tokens + n
            if end <= len(table.block_ids) * self.block_size:  # the common case: it fits its last block
                table.num_tokens = end
                if self._chains and n:
                    self._advance_chain(seq_id, table, None)
                return [], []
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, n, "n", "appended token")
        size, end = self.block_size, table.num_tokens + n
        shared = self._shared_blocks(table, table.num_tokens, end) if self.allocator.num_shared_blocks else ()
        missing = max(0, -(-end // size) - len(table.block_ids))
        if len(shared) + missing > self.allocator.num_free_blocks:
            self._check_free(len(shared) + missing, f"appending {n} tokens to sequence {seq_id!r}")
        if not shared and not self._observers:  # the common case, with the same outcome as the loop
            taken = [self.allocator.allocate() for _ in range(missing)] if missing else []
            table.block_ids += taken
            table.num_tokens = end
            if self._chains and n:
                self._advance_chain(seq_id, table, token_ids)
            return taken, []
        taken: list[int] = []
        copies: Copies = []
        while table.num_tokens < end:  # one pass per block the new tokens land in
            logical, first = divmod(table.num_tokens, size)
            stop = min(end, table.num_tokens - first + size)
            kind = "append"
            if logical == len(table.block_ids):
                table.block_ids.append(self.allocator.allocate())
                taken.append(table.block_ids[-1])
                kind = "new_block"
            elif logical in shared:
                copies += self._copy_on_write(table, (logical,))
                taken.append(copies[-1][1])
                kind = "copy_on_write"
            tokens = (table.num_tokens + 1, stop)
            table.num_tokens = stop
            if self._observers:
                pair = tuple(copies[-1:]) if kind == "copy_on_write" else ()
                self._emit(BlockChange(kind, seq_id, (table.block_ids[logical],), tokens, copies=pair))
        if self._chains and n:
            self._advance_chain(seq_id, table, token_ids)
        return taken, copies

    def append_batch(self, seq_ids: Iterable[Hashable], token_ids: Sequence[int] | None = None) -> Copies:
        """One token for every sequence of a decode step, all or none: the engine's hot path.

        The same as ``append_tokens(seq_id, 1, [token_ids[i]])`` for each sequence in order (the
        same blocks, in the same order, the same events, the same blocks cached), checked first for
        the whole batch, so a batch that does not fit changes nothing. ``token_ids`` holds the id
        of each sequence's new token (the step's input tokens), or is ``None``. Without shared
        blocks or observers it takes a shortcut with the same outcome: a block for each sequence
        whose blocks are full, then one more token each.

        Returns:
            The ``(shared block, copy)`` pairs to copy before the step writes its K/V.

        Raises:
            UnknownSequenceError: a sequence is not allocated.
            ValueError: a sequence appears twice, or ``token_ids`` is not one non-negative integer
                per sequence.
            OutOfBlocksError: the batch needs more blocks than are free (``needed`` and ``free``
                count the whole batch).
        """
        seq_ids = seq_ids if isinstance(seq_ids, list | tuple) else list(seq_ids)
        tables = [self._table(seq_id) for seq_id in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            repeated = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise ValueError(f"seq_ids must be distinct, but {repeated!r} appears more than once")
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, len(seq_ids), "len(seq_ids)", "sequence")
        size = self.block_size  # the boundary rule of mapping.needs_new_block, inlined: the hot path
        full = [table for table in tables if table.num_tokens == len(table.block_ids) * size]
        if not self.allocator.num_shared_blocks and not self._observers:
            if len(full) > self.allocator.num_free_blocks:
                self._check_free(len(full), f"a decode step of {len(tables)} sequences")
            allocate = self.allocator.allocate
            for table in full:
                table.block_ids.append(allocate())
            for table in tables:
                table.num_tokens += 1
            if self._chains:
                self._advance_chains(seq_ids, tables, token_ids)
            return []
        shared = sum(bool(self._shared_blocks(t, t.num_tokens, t.num_tokens + 1)) for t in tables)
        self._check_free(len(full) + shared, f"a decode step of {len(tables)} sequences")
        copies: Copies = []
        for i, seq_id in enumerate(seq_ids):
            copies += self.append_tokens(seq_id, 1, None if token_ids is None else token_ids[i : i + 1])[1]
        return copies

    def append_block(self, seq_id: Hashable) -> int:
        """Append one free block to a sequence's table ahead of its tokens (the low-level step).

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            OutOfBlocksError: no block is free.
        """
        table = self._table(seq_id)
        (block_id,) = self._take(1, f"a new block for sequence {seq_id!r}")
        table.append_block(block_id)
        if self._observers:
            self._emit(BlockChange("new_block", seq_id, (block_id,)))
        return block_id

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token takes a free block: exactly when ``append_tokens(seq_id)`` would.

        That is when its blocks are all full, or when the block the token lands in is shared.
        """
        table = self._table(seq_id)
        if mapping.needs_new_block(table.num_tokens, len(table.block_ids), self.block_size):
            return True
        return bool(self._shared_blocks(table, table.num_tokens, table.num_tokens + 1))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> BlockTable:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all of its blocks (one more holder each).

        Nothing is copied: O(the parent's blocks). The first append or write into a shared block
        copies it for the writer alone.

        Returns:
            A copy of the child's new block table.

        Raises:
            UnknownSequenceError: ``parent_id`` is not allocated.
            ValueError: ``child_id`` is already allocated (``parent_id`` included), or an id is not
                hashable. Nothing changes.
        """
        parent = self._table(check_hashable("parent_id", parent_id))
        if check_hashable("child_id", child_id) in self._tables:
            raise ValueError(f"child_id {child_id!r} is already allocated; fork into a new id")
        for block_id in parent.block_ids:
            self.allocator.add_ref(block_id)
        child = parent.copy()
        self._tables[child_id] = child
        if parent_id in self._chains:  # the same tokens: the child goes on from the parent's place
            self._chains[child_id] = self._chains[parent_id].copy()
        if self._observers:
            self._emit(BlockChange("fork", child_id, tuple(child.block_ids), parent=parent_id))
        return child.copy()

    def free(self, seq_id: Hashable) -> list[int]:
        """Drop a sequence and its references to its blocks; an unknown id is a no-op returning ``[]``.

        With prefix caching, blocks that hold a prompt's hash stay cached on the free list until
        new data takes them.

        Returns:
            The blocks that went back to the free list, in the order they went: table order, or,
            with prefix caching, reverse table order, so that a cached prefix loses its last block
            before its first (a cached block is only found after its whole prefix).
        """
        table = self._tables.pop(check_hashable("seq_id", seq_id), None)
        if table is None:
            return []
        self._cached_tokens.pop(seq_id, None)
        self._chains.pop(seq_id, None)
        order = reversed(table.block_ids) if self.enable_prefix_caching else table.block_ids
        freed = [block_id for block_id in order if self.allocator.free(block_id)]
        if self._observers:
            self._emit(BlockChange("free", seq_id, tuple(table.block_ids), freed=tuple(freed)))
        return freed

    def prepare_write(self, seq_id: Hashable, start: int, end: int) -> Copies:
        """Make positions ``start .. end - 1`` of a sequence safe to write; return the copies to make first.

        A block the positions fall in that another sequence also holds is replaced by a fresh
        copy in the writer's table (copy-on-write). With prefix caching, a cached block that only
        this sequence holds and whose written slots are written again loses its hash, since its
        K/V may no longer be those of its tokens, and the sequence loses its hash chain: none of
        its later blocks is cached.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: ``start`` or ``end`` is not a count, or the range runs past the sequence's
                tokens (nothing changes).
            OutOfBlocksError: too few blocks are free for the copies (nothing changes).
        """
        table = self._table(seq_id)
        start = check_count("start", start)
        end = check_count("end", end, minimum=start)
        if end > table.num_tokens:
            raise ValueError(
                f"positions {start} .. {end - 1} run past the {table.num_tokens} tokens of sequence "
                f"{seq_id!r}; append the tokens first"
            )
        shared = self._shared_blocks(table, start, end)
        self._check_free(len(shared), f"copying the shared blocks sequence {seq_id!r} writes into")
        copies = self._copy_on_write(table, shared)
        if copies and self._observers:
            self._emit(BlockChange("copy_on_write", seq_id, _flat(copies), copies=tuple(copies)))
        if self.allocator.enable_caching and end > start:
            size = self.block_size
            for logical in range(start // size, (end - 1) // size + 1):
                base = logical * size
                first, last = max(start, base) - base, min(end, base + size) - base
                if self.allocator.record_write(table.block_ids[logical], first, last):
                    self._chains.pop(seq_id, None)
        return copies

    # ------------------------------------------------------------------------------ look-ups

    def table(self, seq_id: Hashable) -> BlockTable:
        """The sequence's live block table, for reading: only the manager's methods change it.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
        """
        return self._table(seq_id)

    def get_block_table(self, seq_id: Hashable) -> BlockTable:
        """A copy of the sequence's block table."""
        return self._table(seq_id).copy()

    def sequence_length(self, seq_id: Hashable) -> int:
        """How many tokens the sequence holds."""
        return self._table(seq_id).num_tokens

    def block_rows(self, seq_ids: Iterable[Hashable], pad: int = -1) -> list[list[int]]:
        """The block tables of a batch as rows of one length, padded on the right with ``pad`` (new lists)."""
        tables = [self._table(seq_id) for seq_id in seq_ids]
        width = max((len(t.block_ids) for t in tables), default=0)
        return [t.block_ids + [pad] * (width - len(t.block_ids)) for t in tables]

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """How many leading prompt tokens of the sequence the prefix cache held (whole blocks).

        0 without prefix caching, without ``token_ids``, or for a fork.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
        """
        self._table(seq_id)
        return self._cached_tokens.get(seq_id, 0)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompts, prompt tokens looked up and prompt tokens found; all 0 without prefix caching."""
        return self.allocator.prefix_cache.stats

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Each block that holds a prompt's hash (used or free), with the token ids it holds."""
        return self.allocator.prefix_cache.cached_blocks()

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash and zero the counters; return how many blocks held one (0 if not caching).

        Live sequences keep their blocks; the free list keeps its order.
        """
        return self.allocator.clear_prefix_cache()

    def usage(self) -> BlockUsage:
        """Blocks used, free and shared; tokens held and reserved; waste; utilization (shared ones once)."""
        return BlockUsage.of_tables(
            self._tables.values(),
            num_blocks=self.num_blocks,
            free_blocks=self.allocator.num_free_blocks,
            block_size=self.block_size,
        )

    def snapshot(self) -> AllocatorSnapshot:
        """A frozen copy of the bookkeeping: free list, ref counts and tables."""
        return AllocatorSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_block_ids=self.allocator.free_block_ids,
            ref_counts=tuple(self.allocator.ref_count(b) for b in range(self.num_blocks)),
            tables={seq_id: table.copy() for seq_id, table in self._tables.items()},
        )

    # ------------------------------------------------------------------------------- helpers

    def _table(self, seq_id: Hashable) -> BlockTable:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None
        except TypeError:  # not hashable: the same message as everywhere else
            check_hashable("seq_id", seq_id)
            raise

    def _check_new_id(self, name: str, seq_id: Hashable) -> None:
        if check_hashable(name, seq_id) in self._tables:
            raise ValueError(f"{name} {seq_id!r} is already allocated; free it first or pick a new id")

    def _take(self, count: int, what: str) -> list[int]:
        self._check_free(count, what)
        return self.allocator.allocate_blocks(count)

    def _check_free(self, count: int, what: str) -> None:
        if count > self.allocator.num_free_blocks:
            raise OutOfBlocksError(count, self.allocator.num_free_blocks, what)

    def _advance_chain(self, seq_id: Hashable, table: BlockTable, token_ids: Sequence[int] | None) -> None:
        """After an append: cache the blocks the new tokens filled, or drop the sequence's chain when
        their ids are unknown (``None``) or the chain ended."""
        chain = self._chains.get(seq_id)
        if chain is None:
            return
        if token_ids is None or not self.allocator.cache_full_blocks(
            chain, token_ids, table.block_ids, self.block_size
        ):
            del self._chains[seq_id]

    def _advance_chains(
        self, seq_ids: Sequence[Hashable], tables: Sequence[BlockTable], token_ids: Sequence[int] | None
    ) -> None:
        """:meth:`_advance_chain` for a decode step, one token per sequence, inlined where the token
        fills no block (the common case: a list append)."""
        chains, size = self._chains, self.block_size
        for i, seq_id in enumerate(seq_ids):
            chain = chains.get(seq_id)
            if chain is None:
                continue
            if token_ids is not None and len(chain.tail) < size - 1:
                chain.tail.append(token_ids[i])
            else:
                self._advance_chain(seq_id, tables[i], None if token_ids is None else token_ids[i : i + 1])

    def _shared_blocks(self, table: BlockTable, start: int, end: int) -> list[int]:
        """The logical blocks holding positions ``start .. end - 1`` that another table also holds.

        The one place a write into a shared block is caught. Positions past the table's blocks
        (blocks yet to append) are not shared.
        """
        if end <= start or not self.allocator.num_shared_blocks:
            return []
        first = start // self.block_size
        last = min(len(table.block_ids), blocks_for_tokens(end, self.block_size))
        if last - first == 1:  # one block, as for every decode token: one look-up
            return [first] if self.allocator.ref_count(table.block_ids[first]) > 1 else []
        return [i for i in range(first, last) if self.allocator.ref_count(table.block_ids[i]) > 1]

    def _copy_on_write(self, table: BlockTable, logical_blocks: Sequence[int]) -> Copies:
        """Put a fresh block in place of each shared block of ``logical_blocks``; return the pairs.

        The caller has checked that enough blocks are free. The shared block loses one holder and
        stays in use with the others.
        """
        copies: Copies = []
        for logical in logical_blocks:
            source = table.block_ids[logical]
            copy = self.allocator.allocate()
            table.block_ids[logical] = copy
            self.allocator.copy_written(source, copy)
            self.allocator.free(source)  # shared, so it keeps at least one holder
            copies.append((source, copy))
        return copies


def _flat(copies: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The blocks of ``(shared, copy)`` pairs, each shared block followed by its copy."""
    return tuple(block_id for pair in copies for block_id in pair)


def _new_ids(token_ids: Sequence[int] | None, start: int, end: int) -> Sequence[int] | None:
    """The ids of positions ``start .. end - 1`` of a sequence's ``token_ids`` (``None`` when unknown)."""
    return None if token_ids is None else token_ids[start:end]


class _Evictions:
    """A pool listener that turns the pool's evictions into the manager's ``"evict"`` changes."""

    def __init__(self, emit: Observer) -> None:
        self._emit = emit

    def block_stored(self, entry: CachedBlock) -> None:
        """Nothing: a stored block is shown by the change that filled it."""

    def block_removed(self, entry: CachedBlock) -> None:
        self._emit(BlockChange("evict", blocks=(entry.block_id,)))

    def all_blocks_cleared(self) -> None:
        """Nothing: the lessons' pictures show no reset."""

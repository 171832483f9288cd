"""The block manager: the block tables, ref counts, free list and prefix cache of a pool, and no tensors.

Lessons 02, 04 and 08 build its parts; this is where they meet. vLLM keeps one such manager
(``KVCacheManager`` over a ``BlockPool``) for all the layers of a model: a block id names the same
slot range in every layer's K/V tensors, so the bookkeeping is done once per block, whatever the
number of layers. The tensors live in :class:`~paged_kv.kv.storage.KVStorage`; what must happen to
them is what the manager returns: the ``(source, copy)`` block pairs of a copy-on-write, which the
caller copies in every layer before writing.

Invariants, true after every call (and unchanged by a call that raises):

* every sequence has ``num_tokens <= len(block_ids) * block_size``;
* a block's ref count equals the number of block tables that hold it, and a block is on the free
  list exactly when that count is 0; used blocks + free blocks == ``num_blocks``;
* no sequence writes into a block another sequence holds: the appends and :meth:`prepare_write`
  first give the writer its own copy of such a block (returned as a ``(source, copy)`` pair), so
  every holder of a shared block holds the same tokens in it;
* with prefix caching, a cached block's K/V never change under its hash (see
  :class:`~paged_kv.core.prefix_cache.CachingBlockAllocator`), and its hash is the chained hash of
  exactly the tokens it holds, from its sequence's first block on, whether it filled in prefill or
  in decode (a sequence whose appends give their ``token_ids`` keeps a
  :class:`~paged_kv.core.prefix_cache.HashChain`).

Every successful change is announced to the observers as a :class:`~paged_kv.core.events.BlockEvent`;
the recorder of the widgets' traces is one (:class:`~paged_kv.core.trace.Recorder`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from paged_kv.core import mapping
from paged_kv.core.block import BlockTable, blocks_for_tokens
from paged_kv.core.block_allocator import BlockAllocator
from paged_kv.core.events import BlockEvent, Observer
from paged_kv.core.prefix_cache import (
    CachedBlock,
    CachingBlockAllocator,
    HashChain,
    PrefixCacheStats,
    check_token_ids,
)
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.core.usage import BlockUsage
from paged_kv.errors import OutOfBlocksError, UnknownSequenceError
from paged_kv.validate import check_count, check_hashable

Copies = list[tuple[int, int]]
"""``(shared block, its copy)`` pairs: the block copies the caller makes in the K/V storage."""


@dataclass(frozen=True)
class ComputedBlocks:
    """The cached prefix a new sequence can start with (vLLM: the ``KVCacheBlocks`` of
    ``get_computed_blocks``): its block ids in table order and the tokens they hold, whole blocks."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    entries: tuple[CachedBlock, ...] = field(default=(), repr=False)


class BlockManager:
    """Block tables for many sequences over one pool of ``num_blocks`` blocks of ``block_size`` slots.

    Sequence ids can be any hashable value. With ``enable_prefix_caching=True`` a prompt allocated
    with its ``token_ids`` reuses the blocks of its longest cached prefix (full blocks only, see
    :mod:`paged_kv.core.prefix_cache`), and its full blocks are cached; while every append gives its
    ``token_ids`` too, each block that fills during decode is cached the same way.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = check_count("block_size", block_size, minimum=1)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        self._observers: list[Observer] = []
        if enable_prefix_caching:
            self._allocator: BlockAllocator = CachingBlockAllocator(self.num_blocks, on_evict=self._evicted)
        else:
            self._allocator = BlockAllocator(self.num_blocks)
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
    def allocator(self) -> BlockAllocator:
        """The pool: free list and ref counts (read it; the manager changes it)."""
        return self._allocator

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
        return self._allocator.num_free_blocks

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
        return self._allocator.ref_count(block_id)

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether prompts given with ``token_ids`` reuse cached blocks (set when the manager is built)."""
        return isinstance(self._allocator, CachingBlockAllocator)

    # ----------------------------------------------------------------------------- observers

    def subscribe(self, observer: Observer) -> None:
        """Call ``observer(event)`` after each successful change from now on (:mod:`paged_kv.core.events`)."""
        if not callable(observer):
            raise ValueError(f"observer must be callable with a BlockEvent, got {observer!r}")
        self._observers.append(observer)

    def _emit(self, event: BlockEvent) -> None:
        for observer in self._observers:
            observer(event)

    def _evicted(self, block_id: int) -> None:
        if self._observers:
            self._emit(BlockEvent("evict", blocks=(block_id,)))

    # ------------------------------------------------------------------- the life of a sequence

    def get_computed_blocks(self, token_ids: Sequence[int]) -> ComputedBlocks:
        """The longest cached prefix a new sequence of ``token_ids`` can reuse (vLLM:
        ``KVCacheManager.get_computed_blocks``): whole blocks, at most ``len(token_ids) - 1``
        tokens, since the last token is always computed. Nothing changes; without prefix caching
        it finds nothing.

        Raises:
            ValueError: ``token_ids`` is not a list of non-negative integers.
        """
        token_ids = check_token_ids(token_ids, None)
        if not isinstance(self._allocator, CachingBlockAllocator):
            return ComputedBlocks()
        hits = self._allocator.find_longest_cache_hit(token_ids, self.block_size)
        block_ids = tuple(entry.block_id for entry in hits)
        return ComputedBlocks(block_ids, len(hits) * self.block_size, tuple(hits))

    def allocate_slots(
        self,
        seq_id: Hashable,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        computed: ComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        keep_free: int = 0,
        preempted: bool = False,
    ) -> list[int] | None:
        """Take the blocks for ``num_new_tokens`` more tokens of a sequence, all or none (vLLM:
        ``KVCacheManager.allocate_slots``): the scheduler's one call, for a decode token and for a
        prefill chunk alike.

        A sequence the manager does not hold is new: it starts with the ``computed`` blocks (what
        :meth:`get_computed_blocks` found, whose tokens it need not compute) and grows by
        ``num_new_tokens`` after them. A held one grows from its tokens. The new tokens need a
        block each time they cross a block boundary; they never land in a block another sequence
        holds (a fork's copy-on-write is :meth:`append_tokens`'s, the lessons' API).

        ``token_ids`` are the sequence's tokens from its first on, at least through the new ones
        (``None``: unknown). With prefix caching, each block the new tokens fill is cached under its
        chained hash now, when they are scheduled, as vLLM does: they are computed in this step's
        forward, before any later step can read them. ``num_tokens_to_fit`` (vLLM's
        ``full_sequence_must_fit``, the default of ``scheduler_reserve_full_isl``) asks that the
        blocks of that many tokens be free as well, so that a prompt admitted for its first chunk
        can also take the rest; ``keep_free`` blocks (the watermark) must stay free after either.
        A new sequence's lookup is counted in :attr:`prefix_cache_stats` (with ``token_ids`` and
        prefix caching), apart when ``preempted`` says it resumes after a preemption (vLLM counts a
        request with ``num_preemptions > 0`` apart); ``preempted`` means nothing for a held one.

        Returns:
            The block ids the sequence's table gained, in table order (for a new sequence, all of
            them, hits first: vLLM's ``NewRequestData.block_ids``); ``None`` when too few blocks
            are free, and then nothing changed.

        Raises:
            ValueError: a bad count; ``computed`` given for a held sequence, or no longer cached;
                ``token_ids`` shorter than the tokens it must cover; or the new tokens would land in
                a shared block. Nothing changes.
        """
        if type(num_new_tokens) is not int or num_new_tokens < 0:  # the hot path's cheap test first
            num_new_tokens = check_count("num_new_tokens", num_new_tokens)
        size, allocator = self.block_size, self._allocator
        table = self._tables.get(seq_id) if computed is None else None
        if table is not None and num_tokens_to_fit is None and not self._observers:
            # The hot path of a decode step: nothing to look up, nobody watching.
            start = table.num_tokens
            end = start + num_new_tokens
            if not allocator._num_shared and end <= len(table.block_ids) * size:  # fits its last block
                table.num_tokens = end
                if self._chains and num_new_tokens:
                    self._advance_chain(seq_id, table, _new_ids(token_ids, start, end))
                return []
            if allocator.num_shared_blocks and self._shared_blocks(table, start, end):
                self._refuse_shared(seq_id)
            missing = -(-end // size) - len(table.block_ids)
            taken: list[int] = []
            if missing > 0:
                if missing + keep_free > allocator.num_free_blocks:
                    return None
                taken = [allocator.allocate() for _ in range(missing)]
                table.block_ids += taken
            table.num_tokens = end
            if self._chains and num_new_tokens:
                self._advance_chain(seq_id, table, _new_ids(token_ids, start, end))
            return taken
        return self._allocate_slots(
            seq_id, num_new_tokens, token_ids, computed, num_tokens_to_fit, keep_free, preempted
        )

    def allocate(
        self, seq_id: Hashable, num_prompt_tokens: int, token_ids: Sequence[int] | None = None
    ) -> BlockTable:
        """Give a new sequence the blocks for its whole prompt: ``ceil(num_prompt_tokens / block_size)``.

        The lessons' call (vLLM V0's ``BlockSpaceManager.allocate``): :meth:`get_computed_blocks`
        and :meth:`allocate_slots` for every prompt token at once. With prefix caching and the
        prompt's ``token_ids``, the leading full blocks of the longest cached prefix are reused
        (at most ``num_prompt_tokens - 1`` tokens) and :meth:`num_cached_tokens` says how many
        tokens they cover; the prompt's fresh full blocks are cached for later prompts. Without
        prefix caching ``token_ids`` are checked and otherwise ignored.

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
        computed = self.get_computed_blocks(token_ids) if token_ids is not None else ComputedBlocks()
        blocks = self.allocate_slots(seq_id, num_tokens - computed.num_tokens, token_ids, computed=computed)
        if blocks is None:
            needed = self._blocks_needed(len(computed.block_ids), computed.block_ids, num_tokens)
            raise OutOfBlocksError(needed, self.num_free_blocks, f"sequence {seq_id!r} ({num_tokens} tokens)")
        return self._tables[seq_id].copy()

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
        if token_ids is None and not self._observers and not self._allocator._num_shared:
            end = table.num_tokens + n
            if end <= len(table.block_ids) * self.block_size:  # the common case: it fits its last block
                table.num_tokens = end
                if self._chains and n:
                    self._advance_chain(seq_id, table, None)
                return [], []
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, n, "n", "appended token")
        size, end = self.block_size, table.num_tokens + n
        shared = (
            self._shared_blocks(table, table.num_tokens, end) if self._allocator.num_shared_blocks else ()
        )
        missing = max(0, -(-end // size) - len(table.block_ids))
        if len(shared) + missing > self._allocator.num_free_blocks:
            self._check_free(len(shared) + missing, f"appending {n} tokens to sequence {seq_id!r}")
        if not shared and not self._observers:  # the common case, with the same outcome as the loop
            taken = [self._allocator.allocate() for _ in range(missing)] if missing else []
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
                table.block_ids.append(self._allocator.allocate())
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
                self._emit(BlockEvent(kind, seq_id, (table.block_ids[logical],), tokens, copies=pair))
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
        if not self._allocator.num_shared_blocks and not self._observers:
            if len(full) > self._allocator.num_free_blocks:
                self._check_free(len(full), f"a decode step of {len(tables)} sequences")
            allocate = self._allocator.allocate
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
            self._emit(BlockEvent("new_block", seq_id, (block_id,)))
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
            self._allocator.add_ref(block_id)
        child = parent.copy()
        self._tables[child_id] = child
        if parent_id in self._chains:  # the same tokens: the child goes on from the parent's place
            self._chains[child_id] = self._chains[parent_id].copy()
        if self._observers:
            self._emit(BlockEvent("fork", child_id, tuple(child.block_ids), parent=parent_id))
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
        freed = [block_id for block_id in order if self._allocator.free(block_id)]
        if self._observers:
            self._emit(BlockEvent("free", seq_id, tuple(table.block_ids), freed=tuple(freed)))
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
            self._emit(BlockEvent("copy_on_write", seq_id, _flat(copies), copies=tuple(copies)))
        if isinstance(self._allocator, CachingBlockAllocator) and end > start:
            size = self.block_size
            for logical in range(start // size, (end - 1) // size + 1):
                base = logical * size
                first, last = max(start, base) - base, min(end, base + size) - base
                if self._allocator.record_write(table.block_ids[logical], first, last):
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
        if isinstance(self._allocator, CachingBlockAllocator):
            return self._allocator.prefix_cache.stats
        return PrefixCacheStats()

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Each block that holds a prompt's hash (used or free), with the token ids it holds."""
        if isinstance(self._allocator, CachingBlockAllocator):
            return self._allocator.prefix_cache.cached_blocks()
        return {}

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash and zero the counters; return how many blocks held one (0 if not caching).

        Live sequences keep their blocks; the free list keeps its order.
        """
        if isinstance(self._allocator, CachingBlockAllocator):
            return self._allocator.prefix_cache.reset()
        return 0

    def usage(self) -> BlockUsage:
        """Blocks used, free and shared; tokens held and reserved; waste; utilization (shared ones once)."""
        return BlockUsage.of_tables(
            self._tables.values(),
            num_blocks=self.num_blocks,
            free_blocks=self._allocator.num_free_blocks,
            block_size=self.block_size,
        )

    def snapshot(self) -> AllocatorSnapshot:
        """A frozen copy of the bookkeeping: free list, ref counts and tables."""
        return AllocatorSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_block_ids=self._allocator.free_block_ids,
            ref_counts=tuple(self._allocator.ref_count(b) for b in range(self.num_blocks)),
            tables={seq_id: table.copy() for seq_id, table in self._tables.items()},
        )

    # ------------------------------------------------------------------------------- helpers

    def _allocate_slots(
        self,
        seq_id: Hashable,
        num_new_tokens: int,
        token_ids: Sequence[int] | None,
        computed: ComputedBlocks | None,
        num_tokens_to_fit: int | None,
        keep_free: int,
        preempted: bool = False,
    ) -> list[int] | None:
        """:meth:`allocate_slots` for a new sequence, a full-sequence check or an observed manager."""
        keep_free = check_count("keep_free", keep_free)
        table = self._tables.get(check_hashable("seq_id", seq_id))
        if table is not None and computed is not None:
            raise ValueError(f"computed blocks are a new sequence's, but {seq_id!r} is allocated already")
        held = list(computed.block_ids) if computed is not None else table.block_ids if table else []
        start = computed.num_tokens if computed is not None else table.num_tokens if table else 0
        end = start + num_new_tokens
        if token_ids is not None and len(token_ids) < end:
            raise ValueError(
                f"token_ids must cover the sequence's {end} tokens, through the new ones, "
                f"got {len(token_ids)}"
            )
        if computed is not None and computed.block_ids:
            cache = self._allocator.prefix_cache  # type: ignore[attr-defined]  # hits come from one
            if any(cache.entry(entry.block_id) is not entry for entry in computed.entries):
                raise ValueError("computed blocks are no longer cached: look them up again")
        if table is not None and self._allocator.num_shared_blocks and self._shared_blocks(table, start, end):
            self._refuse_shared(seq_id)
        hit_ids = held if table is None else []
        free = self._allocator.num_free_blocks
        fit = (
            end
            if num_tokens_to_fit is None
            else max(end, check_count("num_tokens_to_fit", num_tokens_to_fit))
        )
        if self._blocks_needed(len(held), hit_ids, fit) + keep_free > free:
            return None
        if table is None:
            if isinstance(self._allocator, CachingBlockAllocator):
                self._allocator.take_hits(hit_ids)
                if token_ids is not None:
                    self._allocator.prefix_cache.record(len(token_ids), start, preempted)
                    last = computed.entries[-1] if computed is not None and computed.entries else None
                    self._chains[seq_id] = HashChain(last, len(hit_ids))
            table = self._tables[seq_id] = BlockTable(list(hit_ids), start)
            if start:
                self._cached_tokens[seq_id] = start
            if start and self._observers:
                self._emit(BlockEvent("cache_hit", seq_id, tuple(hit_ids), tokens=(1, start)))
            taken = self._allocator.allocate_blocks(self._blocks_needed(len(hit_ids), [], end))
            table.block_ids += taken
            table.num_tokens = end
            if self._chains and end > start:
                self._advance_chain(seq_id, table, _new_ids(token_ids, start, end))
            if self._observers:
                self._emit(BlockEvent("allocate", seq_id, tuple(table.block_ids), tokens=(1, end)))
            return list(table.block_ids)
        return self.append_tokens(seq_id, num_new_tokens, _new_ids(token_ids, start, end))[0]

    def _blocks_needed(self, num_held: int, hit_ids: Sequence[int], num_tokens: int) -> int:
        """Free blocks a table of ``num_held`` blocks (``hit_ids`` among them, still to be taken)
        takes to hold ``num_tokens``: its fresh blocks, and the hits that sit on the free list."""
        fresh = max(0, blocks_for_tokens(num_tokens, self.block_size) - num_held)
        if hit_ids and isinstance(self._allocator, CachingBlockAllocator):
            return fresh + self._allocator.num_revived(hit_ids)
        return fresh

    def _refuse_shared(self, seq_id: Hashable) -> None:
        raise ValueError(
            f"the new tokens of sequence {seq_id!r} would land in a block another sequence holds: "
            f"allocate_slots never copies; a fork's copy-on-write is append_tokens'"
        )

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
        return self._allocator.allocate_blocks(count)

    def _check_free(self, count: int, what: str) -> None:
        if count > self._allocator.num_free_blocks:
            raise OutOfBlocksError(count, self._allocator.num_free_blocks, what)

    def _advance_chain(self, seq_id: Hashable, table: BlockTable, token_ids: Sequence[int] | None) -> None:
        """After an append: cache the blocks the new tokens filled, or drop the sequence's chain when
        their ids are unknown (``None``) or the chain ended."""
        chain = self._chains.get(seq_id)
        if chain is None:
            return
        if token_ids is None or not self._allocator.cache_full_blocks(  # type: ignore[attr-defined]
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
        if end <= start or not self._allocator.num_shared_blocks:
            return []
        first = start // self.block_size
        last = min(len(table.block_ids), blocks_for_tokens(end, self.block_size))
        if last - first == 1:  # one block, as for every decode token: one look-up
            return [first] if self._allocator.ref_count(table.block_ids[first]) > 1 else []
        return [i for i in range(first, last) if self._allocator.ref_count(table.block_ids[i]) > 1]

    def _copy_on_write(self, table: BlockTable, logical_blocks: Sequence[int]) -> Copies:
        """Put a fresh block in place of each shared block of ``logical_blocks``; return the pairs.

        The caller has checked that enough blocks are free. The shared block loses one holder and
        stays in use with the others.
        """
        copies: Copies = []
        for logical in logical_blocks:
            source = table.block_ids[logical]
            copy = self._allocator.allocate()
            table.block_ids[logical] = copy
            if isinstance(self._allocator, CachingBlockAllocator):
                self._allocator.copy_written(source, copy)
            self._allocator.free(source)  # shared, so it keeps at least one holder
            copies.append((source, copy))
        return copies


def _flat(copies: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The blocks of ``(shared, copy)`` pairs, each shared block followed by its copy."""
    return tuple(block_id for pair in copies for block_id in pair)


def _new_ids(token_ids: Sequence[int] | None, start: int, end: int) -> Sequence[int] | None:
    """The ids of positions ``start .. end - 1`` of a sequence's ``token_ids`` (``None`` when unknown)."""
    return None if token_ids is None else token_ids[start:end]

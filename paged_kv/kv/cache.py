"""The paged KV cache: preallocated K/V tensors, a block pool and one block table per sequence."""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Iterable, Sequence

import torch

from paged_kv.core.block import BlockTable, blocks_for_tokens
from paged_kv.core.block_allocator import BlockAllocator
from paged_kv.core.prefix_cache import CachingBlockAllocator, PrefixCacheStats, check_token_ids
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.core.trace import (
    TraceFrame,
    allocate_caption,
    block_caption,
    copy_caption,
    fork_caption,
    free_caption,
    start_caption,
    token_caption,
)
from paged_kv.core.usage import BlockUsage
from paged_kv.errors import OutOfBlocksError, UnknownSequenceError
from paged_kv.kv import mapping
from paged_kv.validate import check_count, check_hashable

Positions = int | Sequence[int] | torch.Tensor


class PagedKVCacheAllocator:
    """A KV cache cut into fixed-size blocks, shared by many sequences of different lengths.

    ``k_cache`` and ``v_cache`` are allocated once, with shape
    ``(num_blocks, num_heads, block_size, head_dim)``. Token ``p`` of a sequence lives in physical
    block ``block_ids[p // block_size]`` at offset ``p % block_size``, where ``block_ids`` is the
    sequence's :class:`~paged_kv.core.block.BlockTable`.

    Invariants, true after every call (and unchanged by a call that raises):

    * every sequence has ``num_tokens <= len(block_ids) * block_size``;
    * a block's ref count equals the number of block tables that hold it, and a block is on the
      free list exactly when that count is 0;
    * used blocks + free blocks == ``num_blocks``;
    * no sequence writes into a block another sequence holds: a block with a ref count above 1
      (after :meth:`fork`) is never written; the sequence about to write into it (``append_tokens``
      or ``write_kv``, checked in :meth:`_shared_blocks`) first gets its own copy
      (:meth:`_copy_on_write`). So every holder of a shared block holds the same tokens in it.

    Sequence ids can be any hashable value (ints or strings, say). The translation and the
    boundary rule themselves are the pure functions of :mod:`paged_kv.kv.mapping`; the methods here
    check their arguments, look the sequence up and delegate.

    With ``record=True`` the allocator also keeps :attr:`trace`, a list of
    :class:`~paged_kv.core.trace.TraceFrame`: the empty pool, then one snapshot with a caption after every
    successful allocate, fork, free and appended block, after *each token* of ``append_tokens``, so an
    animation can step token by token, and after a ``write_kv`` that copied shared blocks.
    Recording never changes what the allocator does.

    With ``enable_prefix_caching=True``, a prompt allocated with its ``token_ids`` reuses the blocks
    of its longest prefix already in the cache (full blocks only, checked token by token, see
    :mod:`paged_kv.core.prefix_cache`); freed blocks stay cached on the free list until they are needed,
    least recently freed first. :meth:`num_cached_tokens` says how much of a prompt needs no
    computing, and :attr:`prefix_cache_stats` counts queries and hits in tokens.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        record: bool = False,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = check_count("block_size", block_size, minimum=1)
        self.num_heads = check_count("num_heads", num_heads, minimum=1)
        self.head_dim = check_count("head_dim", head_dim, minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        shape = (self.num_blocks, self.num_heads, self.block_size, self.head_dim)
        try:
            self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, AssertionError, TypeError) as error:
            raise ValueError(f"device {device!r} cannot hold the cache: {error}") from None
        pool = CachingBlockAllocator if enable_prefix_caching else BlockAllocator
        self._allocator: BlockAllocator = pool(self.num_blocks)
        self._cached_tokens: dict[Hashable, int] = {}
        self._tables: dict[Hashable, BlockTable] = {}
        self._trace: list[TraceFrame] | None = [] if record else None
        self._last_copies: list[tuple[int, int]] = []
        self._record("start", None, start_caption(self.num_blocks, self.block_size), ())

    def __repr__(self) -> str:
        return (
            f"PagedKVCacheAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, sequences={len(self._tables)}, device='{self.device}')"
        )

    # ----------------------------------------------------------------------------- properties

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of ``k_cache`` and ``v_cache``."""
        return self.k_cache.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``k_cache`` and ``v_cache``."""
        return self.k_cache.device

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are free."""
        return self._allocator.num_free_blocks

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """The live sequences, in the order they were allocated."""
        return tuple(self._tables)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._allocator.ref_count(block_id)

    @property
    def trace(self) -> list[TraceFrame]:
        """The recorded frames, oldest first (a new list); empty unless built with ``record=True``."""
        return list(self._trace or ())

    # ------------------------------------------------------------------------ the life of a sequence

    def allocate_for_sequence(
        self, seq_id: Hashable, num_prompt_tokens: int, token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> BlockTable:
        """Give a new sequence the blocks for its prompt: ``ceil(num_prompt_tokens / block_size)``.

        With prefix caching (``enable_prefix_caching=True``) and the prompt's ``token_ids``, the
        leading full blocks of the prompt that an earlier prompt already holds or left cached are
        reused instead of fresh ones (see :mod:`paged_kv.core.prefix_cache`), and
        :meth:`num_cached_tokens` says how many leading tokens they cover. Their K/V are already in
        the cache: the caller computes and writes only the rest of the prompt,
        ``write_kv(seq_id, k[c:], v[c:], start_position=c)`` with ``c = num_cached_tokens(seq_id)``,
        and need not write into the first ``c`` positions. At least the last prompt token is always
        left to compute. The prompt's fresh full blocks are cached for later prompts, so write their
        K/V before allocating another sequence that may reuse them. Once written, a cached block is
        immutable under its hash, as in vLLM: :meth:`write_kv` copies a block another sequence
        holds before writing into it, and a cached block that only this sequence holds loses its
        hash when it is written again, so the cache never serves new K/V for old tokens.
        Without prefix caching, ``token_ids`` are checked and otherwise ignored.

        Returns:
            A copy of the sequence's new block table.

        Raises:
            ValueError: ``seq_id`` is already allocated, ``num_prompt_tokens`` is negative, or
                ``token_ids`` is not ``num_prompt_tokens`` non-negative integers.
            OutOfBlocksError: too few blocks are free (nothing is allocated, and nothing is
                counted in :attr:`prefix_cache_stats`). Cached blocks that sit on the free list
                count among the blocks the prompt takes.
        """
        self._check_new_id(seq_id)
        num_prompt_tokens = check_count("num_prompt_tokens", num_prompt_tokens)
        if token_ids is not None:
            token_ids = check_token_ids(token_ids, num_prompt_tokens)
        what = f"sequence {seq_id!r} ({num_prompt_tokens} tokens)"
        if isinstance(self._allocator, CachingBlockAllocator) and token_ids is not None:
            block_ids, cached = self._allocator.allocate_prompt(token_ids, self.block_size, what)
            self._cached_tokens[seq_id] = cached
        else:
            block_ids = self._take_blocks(blocks_for_tokens(num_prompt_tokens, self.block_size), what)
        table = BlockTable(block_ids, num_prompt_tokens)
        self._tables[seq_id] = table
        self._record("allocate", seq_id, allocate_caption(seq_id, num_prompt_tokens, block_ids), block_ids)
        return table.copy()

    def append_tokens(self, seq_id: Hashable, n: int = 1) -> list[int]:
        """Grow a sequence by ``n`` tokens, taking new blocks only when its last block is full or shared.

        A sequence holding ``t`` tokens in full blocks (``t % block_size == 0``) needs a new block
        before token ``t + 1``; in any other case the next token fits in the last block.

        Copy-on-write, lazily as in vLLM: when a new token lands in a block another sequence also
        holds (after :meth:`fork`; the shared block is then partly full, or reserved ahead and
        empty), the sequence first gets a fresh block holding a copy of the shared block's K and V,
        made on the device, in the shared block's place in its table; the shared block loses one
        reference and stays, unchanged, with its other holders. Full shared blocks take no new token
        and stay shared. :attr:`last_copies` lists the ``(shared block, copy)`` pairs.

        Returns:
            The ids of the blocks the sequence took, in table order: the copies of shared blocks,
            then the blocks appended (often none). A sequence that shares nothing takes copies never.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: ``n`` is negative.
            OutOfBlocksError: too few blocks are free for the copies and the new blocks together
                (the sequence does not grow at all and nothing is copied).
        """
        # The hot path of every decode step: plain arithmetic, and the error message is only built
        # when the call fails.
        table = self._table(seq_id)
        n = check_count("n", n)
        new_total = table.num_tokens + n
        shared = self._shared_blocks(table, table.num_tokens, new_total)
        missing = max(0, -(-new_total // self.block_size) - len(table.block_ids))
        if len(shared) + missing > self._allocator.num_free_blocks:
            self._check_free(len(shared) + missing, _appending(n, seq_id))
        if self._trace is not None:
            return self._append_recorded(seq_id, table, n)
        copies = self._copy_on_write(table, shared) if shared else []
        appended = self._allocator.allocate_blocks(missing) if missing else []
        if appended:
            table.block_ids.extend(appended)
        table.num_tokens = new_total
        self._last_copies = copies
        return [copy for _, copy in copies] + appended if copies else appended

    def append_block_to_sequence(self, seq_id: Hashable) -> int:
        """Append one free block to a sequence's table without adding tokens (the low-level step).

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            OutOfBlocksError: no block is free.
        """
        table = self._table(seq_id)
        (block_id,) = self._take_blocks(1, f"a new block for sequence {seq_id!r}")
        table.append_block(block_id)
        self._record("new_block", seq_id, block_caption(seq_id, block_id), (block_id,))
        return block_id

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token takes a free block: exactly when ``append_tokens(seq_id)`` would.

        That is when its blocks are all full, or when the block the token lands in is shared with
        another sequence (it is copied first, see :meth:`append_tokens`).
        """
        table = self._table(seq_id)
        full = mapping.needs_new_block(table.num_tokens, table.num_blocks, self.block_size)
        return full or bool(self._shared_blocks(table, table.num_tokens, table.num_tokens + 1))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> BlockTable:
        """Start sequence ``child_id`` as a copy of ``parent_id`` that shares all of its blocks.

        For parallel sampling or beam search: the child's block table holds the same block ids and
        the same number of tokens as the parent's, and each of those blocks gains one reference.
        Nothing is copied, on the host or on the device: O(the parent's blocks). The two then read
        the same K/V for their common prefix; the first append or write into a shared block copies it
        for the writer alone (see :meth:`append_tokens` and :meth:`write_kv`). Freeing either leaves
        the other's blocks and K/V intact.

        Returns:
            A copy of the child's new block table.

        Raises:
            UnknownSequenceError: ``parent_id`` is not allocated.
            ValueError: ``child_id`` is already allocated (``parent_id`` itself included), or an id
                is not hashable. Nothing changes.
        """
        parent = self._table(check_hashable("parent_id", parent_id))
        if check_hashable("child_id", child_id) in self._tables:
            raise ValueError(f"child_id {child_id!r} is already allocated; fork into a new id")
        for block_id in parent.block_ids:
            self._allocator.add_ref(block_id)
        child = parent.copy()
        self._tables[child_id] = child
        self._record("fork", child_id, fork_caption(parent_id, child_id, child.block_ids), child.block_ids)
        return child.copy()

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Drop a sequence and its references to its blocks.

        An unknown id is a no-op that returns ``[]``: a request may be cancelled before it was ever
        allocated.

        With prefix caching, the blocks that hold a prompt's hash keep it on the free list: they
        stay cached, for a later prompt to reuse, until ``allocate`` hands them out again.

        Returns:
            The ids of the blocks that went back to the free list (a block still held by another
            table stays in use), in the order they were appended to it: table order, or, with
            prefix caching, reverse table order, so that the last block of a cached prefix is
            evicted before its first (a cached block is only found after its whole prefix).
        """
        table = self._tables.pop(check_hashable("seq_id", seq_id), None)
        if table is None:
            return []
        self._cached_tokens.pop(seq_id, None)
        order = reversed(table.block_ids) if self.enable_prefix_caching else table.block_ids
        freed = [block_id for block_id in order if self._allocator.free(block_id)]
        self._record("free", seq_id, free_caption(seq_id, table.block_ids, freed), table.block_ids)
        return freed

    # ------------------------------------------------------------------------- prefix caching

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether prompts given with ``token_ids`` reuse cached blocks (set when the cache is built)."""
        return isinstance(self._allocator, CachingBlockAllocator)

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """How many leading prompt tokens of the sequence came from the prefix cache.

        A multiple of ``block_size``; 0 without prefix caching, without ``token_ids``, or for a
        sequence that was not allocated by ``allocate_for_sequence`` (a fork).

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
        """Forget every cached hash and zero :attr:`prefix_cache_stats` (after new model weights, say).

        Live sequences keep their blocks and K/V; later prompts just cannot reuse them. The free
        list keeps its order.

        Returns:
            How many blocks held a hash (0 without prefix caching).
        """
        if isinstance(self._allocator, CachingBlockAllocator):
            return self._allocator.prefix_cache.reset()
        return 0

    # ------------------------------------------------------------------------------- look-ups

    def get_block_table(self, seq_id: Hashable) -> BlockTable:
        """A copy of the sequence's block table."""
        return self._table(seq_id).copy()

    def get_block_mapping(self, seq_id: Hashable) -> list[int]:
        """The physical block ids of the sequence, logical block 0 first (a copy)."""
        return list(self._table(seq_id).block_ids)

    def sequence_length(self, seq_id: Hashable) -> int:
        """How many tokens the sequence holds."""
        return self._table(seq_id).num_tokens

    def physical_location(
        self, seq_id: Hashable, position: Positions
    ) -> tuple[int, int] | tuple[torch.Tensor, torch.Tensor]:
        """Translate logical positions to ``(block_id, offset)`` in the physical cache.

        For an ``int`` position, returns two ints; for a list or 1-D tensor of positions, returns
        two ``LongTensor``\\ s on the cache's device. Position ``p`` maps to block
        ``block_ids[p // block_size]`` at offset ``p % block_size``.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: a position is negative or not below the sequence's length.
        """
        table = self._table(seq_id)
        if isinstance(position, numbers.Integral) and not isinstance(position, bool):
            if not 0 <= position < table.num_tokens:
                raise ValueError(_out_of_range("position", position, table.num_tokens))
            return mapping.physical_location(table.block_ids, position, self.block_size)
        positions = self._positions(table, position, "position")
        return mapping.physical_locations(self._block_table(table), positions, self.block_size)

    def slot_mapping(self, seq_id: Hashable, positions: Positions | None = None) -> torch.Tensor:
        """The flat slot ``block_id * block_size + offset`` of each position, as a ``LongTensor``.

        ``positions`` defaults to every token of the sequence, ``0 .. length - 1``. Computed with
        tensor indexing, with no Python loop over tokens.
        """
        table = self._table(seq_id)
        positions = self._positions(table, positions, "positions")
        return mapping.slot_mapping(self._block_table(table), positions, self.block_size)

    def block_tables_tensor(self, seq_ids: Iterable[Hashable], pad: int = -1) -> torch.Tensor:
        """The block tables of a batch as one ``(batch, max_blocks)`` int32 tensor for kernels.

        Shorter tables are padded on the right with ``pad``.
        """
        tables = [self._table(seq_id) for seq_id in seq_ids]
        width = max((t.num_blocks for t in tables), default=0)
        rows = [t.block_ids + [pad] * (width - t.num_blocks) for t in tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(rows), width)

    # ---------------------------------------------------------------------------------- K/V data

    def write_kv(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor, start_position: int = 0) -> None:
        """Store K and V for positions ``start_position .. start_position + len(k) - 1``.

        ``k`` and ``v`` have shape ``(num_tokens, num_heads, head_dim)`` and the cache's dtype and
        device. The positions must already belong to the sequence (allocate or append first).

        A block the positions fall in that another sequence also holds (after :meth:`fork`) is
        copied first, as in :meth:`append_tokens`: the write lands in the sequence's own copy and
        the other holders keep reading the old K/V. :attr:`last_copies` lists the copies. With
        prefix caching, a cached block that only this sequence holds and that is written again
        (slots written before are overwritten) loses its hash first: it is no longer served to
        later prompts, since its K/V may no longer be those of its tokens.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: a tensor has the wrong shape, dtype or device, or the positions run past the
                sequence's length (nothing is written).
            OutOfBlocksError: too few blocks are free for the copies (nothing is copied or written).
        """
        table = self._table(seq_id)
        start_position = check_count("start_position", start_position)
        self._check_kv("k", k)
        self._check_kv("v", v)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        end = start_position + k.shape[0]
        if end > table.num_tokens:
            raise ValueError(
                f"start_position {start_position} + {k.shape[0]} tokens runs to position {end - 1}, "
                f"but sequence {seq_id!r} holds {table.num_tokens} tokens; call append_tokens first"
            )
        shared = self._shared_blocks(table, start_position, end)
        self._check_free(len(shared), f"copying the shared blocks sequence {seq_id!r} writes into")
        copies = self._copy_on_write(table, shared)
        if copies:
            self._record("copy_on_write", seq_id, copy_caption(seq_id, copies), _flat(copies))
        self._last_copies = copies
        if self.enable_prefix_caching:
            self._forget_overwritten(table, start_position, end)
        mapping.write_kv(self.k_cache, self.v_cache, self._block_table(table), k, v, start_position)

    def read_kv(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the sequence's K and V back into contiguous ``(num_tokens, num_heads, head_dim)``."""
        table = self._table(seq_id)
        return mapping.read_kv(self.k_cache, self.v_cache, self._block_table(table), table.num_tokens)

    # ------------------------------------------------------------------------------------ metrics

    def usage(self) -> BlockUsage:
        """The pool's metrics: blocks used, free and shared, tokens held and reserved, waste, utilisation.

        A shared block (after :meth:`fork`) counts once among the used blocks and its tokens once
        among the tokens held; see :class:`~paged_kv.core.usage.BlockUsage`.
        """
        return BlockUsage.of_tables(
            self._tables.values(),
            num_blocks=self.num_blocks,
            free_blocks=self._allocator.num_free_blocks,
            block_size=self.block_size,
        )

    @property
    def last_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write of the last successful ``append_tokens`` or ``write_kv``, as a new list.

        One ``(shared block, its copy)`` pair per block copied, in table order; empty when that call
        copied nothing. Calls that fail, and other methods, leave it as it was.
        """
        return list(self._last_copies)

    def snapshot(self) -> AllocatorSnapshot:
        """A frozen copy of the bookkeeping (free list, ref counts, tables), without K/V data."""
        return AllocatorSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_block_ids=self._allocator.free_block_ids,
            ref_counts=tuple(self._allocator.ref_count(b) for b in range(self.num_blocks)),
            tables={seq_id: table.copy() for seq_id, table in self._tables.items()},
        )

    # ------------------------------------------------------------------------------------ helpers

    def _table(self, seq_id: Hashable) -> BlockTable:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None
        except TypeError:  # not hashable: the same message as everywhere else
            check_hashable("seq_id", seq_id)
            raise

    def _check_new_id(self, seq_id: Hashable) -> None:
        if check_hashable("seq_id", seq_id) in self._tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated; free it first or pick a new id")

    def _take_blocks(self, count: int, what: str) -> list[int]:
        self._check_free(count, what)
        return self._allocator.allocate_blocks(count)

    def _check_free(self, count: int, what: str) -> None:
        if not self._allocator.can_allocate(count):
            raise OutOfBlocksError(count, self._allocator.num_free_blocks, what)

    # ------------------------------------------------------------------------- copy-on-write

    def _shared_blocks(self, table: BlockTable, start: int, end: int) -> list[int]:
        """The logical blocks of ``table`` holding positions ``start .. end - 1`` that another table holds.

        The one place a write into a shared block is caught: ``append_tokens`` and ``write_kv`` ask
        it before touching anything. Positions past the table's blocks (blocks yet to append) are
        not shared.
        """
        if end <= start or not self._allocator.num_shared_blocks:
            return []
        last = min(table.num_blocks, blocks_for_tokens(end, self.block_size))
        logical = range(start // self.block_size, last)
        return [i for i in logical if self._allocator.ref_count(table.block_ids[i]) > 1]

    def _forget_overwritten(self, table: BlockTable, start: int, end: int) -> None:
        """Report the write of positions ``start .. end - 1`` to the caching allocator, block by block."""
        size = self.block_size
        for logical in range(start // size, (end - 1) // size + 1):
            base = logical * size
            first, last = max(start, base) - base, min(end, base + size) - base
            self._allocator.record_write(table.block_ids[logical], first, last)

    def _copy_on_write(self, table: BlockTable, logical_blocks: Sequence[int]) -> list[tuple[int, int]]:
        """Give ``table`` its own copy of each shared block in ``logical_blocks``; return the pairs.

        The caller has checked that enough blocks are free. Each copy is a fresh block from the head
        of the free list; one indexing operation per tensor copies all the shared blocks' K and V
        on the device, whole blocks (the slots past the sequence's tokens are never read, and a whole
        block is one contiguous piece of memory). The copy takes the shared block's place in the
        table, and the shared block drops one reference: it stays in use, with its other holders.
        """
        if not logical_blocks:
            return []
        sources = [table.block_ids[i] for i in logical_blocks]
        copies = self._allocator.allocate_blocks(len(sources))
        source_index = torch.tensor(sources, dtype=torch.long, device=self.device)
        copy_index = torch.tensor(copies, dtype=torch.long, device=self.device)
        self.k_cache[copy_index] = self.k_cache[source_index]
        self.v_cache[copy_index] = self.v_cache[source_index]
        for logical, copy in zip(logical_blocks, copies, strict=True):
            table.block_ids[logical] = copy
        for source in sources:
            self._allocator.free(source)  # shared, so it keeps at least one holder
        return list(zip(sources, copies, strict=True))

    # ------------------------------------------------------------------------------ recording

    def _record(self, event: str, seq_id: Hashable | None, caption: str, highlight: Iterable[int]) -> None:
        """Append a frame with a snapshot taken now; a no-op unless built with ``record=True``."""
        if self._trace is not None:
            self._trace.append(TraceFrame(self.snapshot(), caption, event, seq_id, tuple(highlight)))

    def _append_recorded(self, seq_id: Hashable, table: BlockTable, n: int) -> list[int]:
        """``append_tokens`` one token at a time, a frame each: the same blocks, in the same order.

        The caller has checked the free blocks, so a failed call still changes nothing. A token that
        lands in a shared block copies it (a ``copy_on_write`` frame for that token); the shared
        blocks all come before the blocks to append, so the blocks come off the head of the free
        list in the order the bulk path takes them: the copies, then the appended blocks.
        """
        copies: list[tuple[int, int]] = []
        appended: list[int] = []
        for _ in range(n):
            token = table.num_tokens + 1  # 1-based, as in the captions
            new_block = mapping.needs_new_block(table.num_tokens, table.num_blocks, self.block_size)
            copied = self._copy_on_write(table, self._shared_blocks(table, token - 1, token))
            if new_block:
                appended.append(self._allocator.allocate())
                table.append_block(appended[-1])
            table.num_tokens = token
            block_id = table.block_ids[(token - 1) // self.block_size]
            if copied:
                copies += copied
                self._record("copy_on_write", seq_id, copy_caption(seq_id, copied, token), _flat(copied))
            else:
                caption = token_caption(seq_id, token, block_id, new_block)
                self._record("new_block" if new_block else "append", seq_id, caption, (block_id,))
        self._last_copies = copies
        return [copy for _, copy in copies] + appended

    def _positions(self, table: BlockTable, positions: Positions | None, name: str) -> torch.Tensor:
        """Positions as a 1-D LongTensor on the cache's device, each in ``[0, num_tokens)``."""
        if positions is None:
            return torch.arange(table.num_tokens, device=self.device)
        try:
            tensor = torch.as_tensor(positions, device=self.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be integers, got {positions!r}") from None
        if tensor.numel() == 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be integers, got dtype {tensor.dtype}")
        if tensor.dim() > 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
        tensor = tensor.reshape(-1).long()
        if tensor.numel():
            low, high = torch.stack([tensor.min(), tensor.max()]).tolist()  # one device sync
            if low < 0 or high >= table.num_tokens:
                raise ValueError(_out_of_range(name, low if low < 0 else high, table.num_tokens))
        return tensor

    def _block_table(self, table: BlockTable) -> torch.Tensor:
        """The table's block ids as a 1-D LongTensor on the cache's device, for :mod:`paged_kv.kv.mapping`."""
        return torch.tensor(table.block_ids, dtype=torch.long, device=self.device)

    def _check_kv(self, name: str, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        expected = (self.num_heads, self.head_dim)
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected:
            raise ValueError(
                f"{name} must have shape (num_tokens, {self.num_heads}, {self.head_dim}), "
                f"got {tuple(tensor.shape)}"
            )
        if tensor.dtype != self.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype} but the cache holds {self.dtype}")
        if tensor.device != self.device:
            raise ValueError(f"{name} is on {tensor.device} but the cache is on {self.device}")


def _out_of_range(name: str, bad: int, num_tokens: int) -> str:
    """The message for a position outside a sequence of ``num_tokens`` tokens."""
    return (
        f"{name} {bad} is out of range: the sequence holds {num_tokens} tokens, "
        f"so positions run from 0 to {num_tokens - 1}"
    )


def _flat(copies: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The blocks of ``(shared, copy)`` pairs, each shared block followed by its copy: a frame's highlight."""
    return tuple(block_id for pair in copies for block_id in pair)


def _appending(n: int, seq_id: Hashable) -> str:
    """What an append that runs out of blocks was doing, for its error message."""
    return f"appending {n} tokens to sequence {seq_id!r}"

"""The one-layer paged KV cache of lessons 02 to 08: a block manager and one layer of K/V storage.

:class:`PagedKVCacheAllocator` is a facade: the bookkeeping is a
:class:`~paged_kv.core.block_manager.BlockManager` (:attr:`~PagedKVCacheAllocator.manager`), the
tensors a one-layer :class:`~paged_kv.kv.storage.KVStorage` (:attr:`~PagedKVCacheAllocator.storage`).
A method checks its arguments, asks the manager what changes, copies the blocks the manager names
and reads or writes the storage. A model uses the same two parts with one storage layer per model
layer (:class:`~paged_kv.model.kv_cache.PagedKVCache`).
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Iterable, Sequence

import torch

from paged_kv.core import mapping
from paged_kv.core.block import BlockTable
from paged_kv.core.block_manager import BlockManager
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.core.trace import Recorder, TraceFrame
from paged_kv.core.usage import BlockUsage
from paged_kv.kv import slots
from paged_kv.kv.storage import KVStorage
from paged_kv.validate import check_count

Positions = int | Sequence[int] | torch.Tensor


class PagedKVCacheAllocator:
    """A KV cache cut into fixed-size blocks, shared by many sequences of different lengths.

    ``k_cache`` and ``v_cache`` are allocated once, with shape
    ``(num_blocks, num_heads, block_size, head_dim)``. Token ``p`` of a sequence lives in physical
    block ``block_ids[p // block_size]`` at offset ``p % block_size``, where ``block_ids`` is the
    sequence's :class:`~paged_kv.core.block.BlockTable`.

    Invariants, true after every call (and unchanged by a call that raises): those of the
    :class:`~paged_kv.core.block_manager.BlockManager` (every token has a slot; ref counts equal
    holders; used + free == ``num_blocks``; nobody writes into a block another sequence holds: the
    writer first gets its own copy, made on the device, so every holder of a shared block holds the
    same tokens in it).

    Sequence ids can be any hashable value (ints or strings, say). The translation and the
    boundary rule themselves are the pure functions of :mod:`paged_kv.core.mapping`.

    With ``record=True`` the cache keeps :attr:`trace`, a list of
    :class:`~paged_kv.core.trace.TraceFrame` made from the manager's events by a
    :class:`~paged_kv.core.trace.Recorder`: the empty pool, then one snapshot with a caption after
    every allocate, fork, free and appended block, after *each token* of ``append_tokens``, and after
    a ``write_kv`` that copied shared blocks. Recording never changes what the cache does.

    With ``enable_prefix_caching=True``, a prompt allocated with its ``token_ids`` reuses the blocks
    of its longest prefix already in the cache (full blocks only, checked token by token, see
    :mod:`paged_kv.core.prefix_cache`); freed blocks stay cached on the free list until they are
    needed, least recently freed first. :meth:`num_cached_tokens` says how much of a prompt needs no
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
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.storage = KVStorage(1, num_blocks, block_size, num_heads, head_dim, dtype, device)
        self.k_cache, self.v_cache = self.storage.k_caches[0], self.storage.v_caches[0]
        self._recorder = Recorder(self.manager) if record else None
        self._last_copies: list[tuple[int, int]] = []

    def __repr__(self) -> str:
        return (
            f"PagedKVCacheAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, sequences={len(self.manager.tables)}, device='{self.device}')"
        )

    # ----------------------------------------------------------------------------- properties

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of ``k_cache`` and ``v_cache``."""
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``k_cache`` and ``v_cache``."""
        return self.storage.device

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are free."""
        return self.manager.num_free_blocks

    @property
    def seq_ids(self) -> tuple[Hashable, ...]:
        """The live sequences, in the order they were allocated."""
        return self.manager.seq_ids

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.manager

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self.manager.ref_count(block_id)

    @property
    def trace(self) -> list[TraceFrame]:
        """The recorded frames, oldest first (a new list); empty unless built with ``record=True``."""
        return list(self._recorder.frames) if self._recorder is not None else []

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
        return self.manager.allocate(seq_id, num_prompt_tokens, token_ids)

    def append_tokens(
        self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> list[int]:
        """Grow a sequence by ``n`` tokens, taking new blocks only when its last block is full or shared.

        A sequence holding ``t`` tokens in full blocks (``t % block_size == 0``) needs a new block
        before token ``t + 1``; in any other case the next token fits in the last block.

        Copy-on-write, lazily as in vLLM: when a new token lands in a block another sequence also
        holds (after :meth:`fork`; the shared block is then partly full, or reserved ahead and
        empty), the sequence first gets a fresh block holding a copy of the shared block's K and V,
        made on the device, in the shared block's place in its table; the shared block loses one
        reference and stays, unchanged, with its other holders. Full shared blocks take no new token
        and stay shared. :attr:`last_copies` lists the ``(shared block, copy)`` pairs.

        ``token_ids``, the ids of the ``n`` new tokens, matter with prefix caching: for a sequence
        allocated with its ``token_ids`` and grown with them ever since, each block the new tokens
        fill is cached under its chained hash, exactly as a prompt's full block is, so a later
        prompt that starts with this sequence's tokens (the previous prompt, the answer and a new
        message) reuses it. Write the new tokens' K/V before allocating such a prompt. An append
        without ids stops the caching of the sequence's later blocks. Without prefix caching
        ``token_ids`` are checked and otherwise ignored.

        Returns:
            The ids of the blocks the sequence took, in table order: the copies of shared blocks,
            then the blocks appended (often none). A sequence that shares nothing takes copies never.

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: ``n`` is negative, or ``token_ids`` is not ``n`` non-negative integers.
            OutOfBlocksError: too few blocks are free for the copies and the new blocks together
                (the sequence does not grow at all and nothing is copied).
        """
        taken, copies = self.manager.append_tokens(seq_id, n, token_ids)
        if copies:
            self.storage.copy_blocks(copies)
        self._last_copies = copies
        return taken

    def append_batch(
        self, seq_ids: Iterable[Hashable], token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> None:
        """One token for every sequence of a decode step, all or none (see :meth:`BlockManager.append_batch`).

        ``token_ids``, one per sequence, are the new tokens' ids, as for :meth:`append_tokens`.
        Shared blocks the tokens land in are copied first; :attr:`last_copies` lists the copies.

        Raises:
            UnknownSequenceError, ValueError, OutOfBlocksError: as the manager's, changing nothing.
        """
        copies = self.manager.append_batch(seq_ids, token_ids)
        self.storage.copy_blocks(copies)
        self._last_copies = copies

    def append_block_to_sequence(self, seq_id: Hashable) -> int:
        """Append one free block to a sequence's table without adding tokens (the low-level step).

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            OutOfBlocksError: no block is free.
        """
        return self.manager.append_block(seq_id)

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token takes a free block: exactly when ``append_tokens(seq_id)`` would.

        That is when its blocks are all full, or when the block the token lands in is shared with
        another sequence (it is copied first, see :meth:`append_tokens`).
        """
        return self.manager.needs_new_block(seq_id)

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
        return self.manager.fork(parent_id, child_id)

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
        return self.manager.free(seq_id)

    # ------------------------------------------------------------------------- prefix caching

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether prompts given with ``token_ids`` reuse cached blocks (set when the cache is built)."""
        return self.manager.enable_prefix_caching

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """How many leading prompt tokens of the sequence came from the prefix cache.

        A multiple of ``block_size``; 0 without prefix caching, without ``token_ids``, or for a
        sequence that was not allocated by ``allocate_for_sequence`` (a fork).

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
        """
        return self.manager.num_cached_tokens(seq_id)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompts, prompt tokens looked up and prompt tokens found; all 0 without prefix caching."""
        return self.manager.prefix_cache_stats

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Each block that holds a prompt's hash (used or free), with the token ids it holds."""
        return self.manager.cached_blocks()

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash and zero :attr:`prefix_cache_stats` (after new model weights, say).

        Live sequences keep their blocks and K/V; later prompts just cannot reuse them. The free
        list keeps its order.

        Returns:
            How many blocks held a hash (0 without prefix caching).
        """
        return self.manager.reset_prefix_cache()

    # ------------------------------------------------------------------------------- look-ups

    def get_block_table(self, seq_id: Hashable) -> BlockTable:
        """A copy of the sequence's block table."""
        return self.manager.get_block_table(seq_id)

    def get_block_mapping(self, seq_id: Hashable) -> list[int]:
        """The physical block ids of the sequence, logical block 0 first (a copy)."""
        return self.manager.get_block_table(seq_id).block_ids

    def sequence_length(self, seq_id: Hashable) -> int:
        """How many tokens the sequence holds."""
        return self.manager.sequence_length(seq_id)

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
        table = self.manager.table(seq_id)
        if isinstance(position, numbers.Integral) and not isinstance(position, bool):
            if not 0 <= position < table.num_tokens:
                raise ValueError(_out_of_range("position", position, table.num_tokens))
            return mapping.physical_location(table.block_ids, position, self.block_size)
        positions = self._positions(table, position, "position")
        return slots.physical_locations(self._block_ids(table), positions, self.block_size)

    def slot_mapping(self, seq_id: Hashable, positions: Positions | None = None) -> torch.Tensor:
        """The flat slot ``block_id * block_size + offset`` of each position, as a ``LongTensor``.

        ``positions`` defaults to every token of the sequence, ``0 .. length - 1``. Computed with
        tensor indexing, with no Python loop over tokens.
        """
        table = self.manager.table(seq_id)
        positions = self._positions(table, positions, "positions")
        return slots.slot_mapping(self._block_ids(table), positions, self.block_size)

    def block_tables_tensor(self, seq_ids: Iterable[Hashable], pad: int = -1) -> torch.Tensor:
        """The block tables of a batch as one ``(batch, max_blocks)`` int32 tensor for kernels.

        Shorter tables are padded on the right with ``pad``.
        """
        rows = self.manager.block_rows(seq_ids, pad)
        width = len(rows[0]) if rows else 0
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
        length = self.manager.sequence_length(seq_id)
        start_position = check_count("start_position", start_position)
        self.storage.check_kv_pair(k, v)
        end = start_position + k.shape[0]
        if end > length:
            raise ValueError(
                f"start_position {start_position} + {k.shape[0]} tokens runs to position {end - 1}, "
                f"but sequence {seq_id!r} holds {length} tokens; call append_tokens first"
            )
        copies = self.manager.prepare_write(seq_id, start_position, end)
        self.storage.copy_blocks(copies)
        self._last_copies = copies
        self.storage.write(0, self._block_ids(self.manager.table(seq_id)), k, v, start_position)

    def read_kv(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the sequence's K and V back into contiguous ``(num_tokens, num_heads, head_dim)``."""
        table = self.manager.table(seq_id)
        return self.storage.read(0, self._block_ids(table), table.num_tokens)

    # ------------------------------------------------------------------------------------ metrics

    def usage(self) -> BlockUsage:
        """The pool's metrics: blocks used, free and shared, tokens held and reserved, waste, utilization.

        A shared block (after :meth:`fork`) counts once among the used blocks and its tokens once
        among the tokens held; see :class:`~paged_kv.core.usage.BlockUsage`.
        """
        return self.manager.usage()

    @property
    def last_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write of the last successful ``append_tokens`` or ``write_kv``, as a new list.

        One ``(shared block, its copy)`` pair per block copied, in table order; empty when that call
        copied nothing. Calls that fail, and other methods, leave it as it was.
        """
        return list(self._last_copies)

    def snapshot(self) -> AllocatorSnapshot:
        """A frozen copy of the bookkeeping (free list, ref counts, tables), without K/V data."""
        return self.manager.snapshot()

    # ------------------------------------------------------------------------------------ helpers

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

    def _block_ids(self, table: BlockTable) -> torch.Tensor:
        """The table's block ids as a 1-D LongTensor on the cache's device, for the mapping functions."""
        return self.storage.block_index(table.block_ids)


def _out_of_range(name: str, bad: int, num_tokens: int) -> str:
    """The message for a position outside a sequence of ``num_tokens`` tokens."""
    return (
        f"{name} {bad} is out of range: the sequence holds {num_tokens} tokens, "
        f"so positions run from 0 to {num_tokens - 1}"
    )

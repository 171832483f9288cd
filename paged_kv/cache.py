"""The paged KV cache: preallocated K/V tensors, a block pool and one block table per sequence."""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Iterable, Sequence

import torch

from . import mapping
from ._checks import check_count, check_hashable
from .block import BlockTable, blocks_for_tokens
from .block_allocator import BlockAllocator
from .errors import OutOfBlocksError, UnknownSequenceError
from .snapshot import AllocatorSnapshot
from .trace import TraceFrame, allocate_caption, block_caption, free_caption, start_caption, token_caption
from .usage import BlockUsage

Positions = int | Sequence[int] | torch.Tensor


class PagedKVCacheAllocator:
    """A KV cache cut into fixed-size blocks, shared by many sequences of different lengths.

    ``k_cache`` and ``v_cache`` are allocated once, with shape
    ``(num_blocks, num_heads, block_size, head_dim)``. Token ``p`` of a sequence lives in physical
    block ``block_ids[p // block_size]`` at offset ``p % block_size``, where ``block_ids`` is the
    sequence's :class:`~paged_kv.block.BlockTable`.

    Invariants, true after every call (and unchanged by a call that raises):

    * every sequence has ``num_tokens <= len(block_ids) * block_size``;
    * a block's ref count equals the number of block tables that hold it, and a block is on the
      free list exactly when that count is 0;
    * used blocks + free blocks == ``num_blocks``.

    Sequence ids can be any hashable value (ints or strings, say). The translation and the
    boundary rule themselves are the pure functions of :mod:`paged_kv.mapping`; the methods here
    check their arguments, look the sequence up and delegate.

    With ``record=True`` the allocator also keeps :attr:`trace`, a list of
    :class:`~paged_kv.trace.TraceFrame`: the empty pool, then one snapshot with a caption after every
    successful allocate, free and appended block, and after *each token* of ``append_tokens``, so an
    animation can step token by token. Recording never changes what the allocator does.
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
    ) -> None:
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = check_count("block_size", block_size, minimum=1)
        self.num_heads = check_count("num_heads", num_heads, minimum=1)
        self.head_dim = check_count("head_dim", head_dim, minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        shape = (self.num_blocks, self.num_heads, self.block_size, self.head_dim)
        try:
            self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, AssertionError, TypeError) as error:
            raise ValueError(f"device {device!r} cannot hold the cache: {error}") from None
        self._allocator = BlockAllocator(self.num_blocks)
        self._tables: dict[Hashable, BlockTable] = {}
        self._trace: list[TraceFrame] | None = [] if record else None
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

    def allocate_for_sequence(self, seq_id: Hashable, num_prompt_tokens: int) -> BlockTable:
        """Give a new sequence the blocks for its prompt: ``ceil(num_prompt_tokens / block_size)``.

        Returns:
            A copy of the sequence's new block table.

        Raises:
            ValueError: ``seq_id`` is already allocated, or ``num_prompt_tokens`` is negative.
            OutOfBlocksError: too few blocks are free (nothing is allocated).
        """
        self._check_new_id(seq_id)
        num_prompt_tokens = check_count("num_prompt_tokens", num_prompt_tokens)
        needed = blocks_for_tokens(num_prompt_tokens, self.block_size)
        block_ids = self._take_blocks(needed, f"sequence {seq_id!r} ({num_prompt_tokens} tokens)")
        table = BlockTable(block_ids, num_prompt_tokens)
        self._tables[seq_id] = table
        self._record("allocate", seq_id, allocate_caption(seq_id, num_prompt_tokens, block_ids), block_ids)
        return table.copy()

    def append_tokens(self, seq_id: Hashable, n: int = 1) -> list[int]:
        """Grow a sequence by ``n`` tokens, taking new blocks only when its last block is full.

        A sequence holding ``t`` tokens in full blocks (``t % block_size == 0``) needs a new block
        before token ``t + 1``; in any other case the next token fits in the last block.

        Returns:
            The ids of the blocks appended to the table (often none).

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: ``n`` is negative.
            OutOfBlocksError: too few blocks are free (the sequence does not grow at all).
        """
        table = self._table(seq_id)
        n = check_count("n", n)
        new_total = table.num_tokens + n
        missing = max(0, blocks_for_tokens(new_total, self.block_size) - table.num_blocks)
        if self._trace is not None:
            return self._append_recorded(seq_id, table, n, missing, _appending(n, seq_id))
        new_ids = self._take_blocks(missing, _appending(n, seq_id)) if missing else []
        table.block_ids.extend(new_ids)
        table.num_tokens = new_total
        return new_ids

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
        """Whether the sequence's next token needs a new block: its blocks are all full."""
        table = self._table(seq_id)
        return mapping.needs_new_block(table.num_tokens, table.num_blocks, self.block_size)

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Drop a sequence and its references to its blocks.

        An unknown id is a no-op that returns ``[]``: a request may be cancelled before it was ever
        allocated.

        Returns:
            The ids of the blocks that went back to the free list, in table order (a block still
            held by another table stays in use).
        """
        table = self._tables.pop(check_hashable("seq_id", seq_id), None)
        if table is None:
            return []
        freed = [block_id for block_id in table.block_ids if self._allocator.free(block_id)]
        self._record("free", seq_id, free_caption(seq_id, table.block_ids, freed), table.block_ids)
        return freed

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

        Raises:
            UnknownSequenceError: ``seq_id`` is not allocated.
            ValueError: a tensor has the wrong shape, dtype or device, or the positions run past the
                sequence's length (nothing is written).
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
        mapping.write_kv(self.k_cache, self.v_cache, self._block_table(table), k, v, start_position)

    def read_kv(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the sequence's K and V back into contiguous ``(num_tokens, num_heads, head_dim)``."""
        table = self._table(seq_id)
        return mapping.read_kv(self.k_cache, self.v_cache, self._block_table(table), table.num_tokens)

    # ------------------------------------------------------------------------------------ metrics

    def usage(self) -> BlockUsage:
        """The pool's metrics: blocks used and free, tokens held and reserved, waste, utilisation."""
        return BlockUsage.measure(
            used_blocks=self._allocator.num_used_blocks,
            free_blocks=self._allocator.num_free_blocks,
            allocated_tokens=sum(table.num_tokens for table in self._tables.values()),
            block_size=self.block_size,
        )

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
            return self._tables[check_hashable("seq_id", seq_id)]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None

    def _check_new_id(self, seq_id: Hashable) -> None:
        if check_hashable("seq_id", seq_id) in self._tables:
            raise ValueError(f"seq_id {seq_id!r} is already allocated; free it first or pick a new id")

    def _take_blocks(self, count: int, what: str) -> list[int]:
        self._check_free(count, what)
        return self._allocator.allocate_blocks(count)

    def _check_free(self, count: int, what: str) -> None:
        if not self._allocator.can_allocate(count):
            raise OutOfBlocksError(count, self._allocator.num_free_blocks, what)

    # ------------------------------------------------------------------------------ recording

    def _record(self, event: str, seq_id: Hashable | None, caption: str, highlight: Iterable[int]) -> None:
        """Append a frame with a snapshot taken now; a no-op unless built with ``record=True``."""
        if self._trace is not None:
            self._trace.append(TraceFrame(self.snapshot(), caption, event, seq_id, tuple(highlight)))

    def _append_recorded(
        self, seq_id: Hashable, table: BlockTable, n: int, missing: int, what: str
    ) -> list[int]:
        """``append_tokens`` one token at a time, a frame each: the same blocks, in the same order.

        The free-block check comes first, so a failed call still changes nothing; the blocks then come
        off the head of the free list one by one, exactly as ``allocate_blocks(missing)`` takes them.
        """
        self._check_free(missing, what)
        new_ids: list[int] = []
        for _ in range(n):
            new_block = mapping.needs_new_block(table.num_tokens, table.num_blocks, self.block_size)
            if new_block:
                new_ids.append(self._allocator.allocate())
                table.append_block(new_ids[-1])
            table.num_tokens += 1
            block_id = table.block_ids[(table.num_tokens - 1) // self.block_size]
            caption = token_caption(seq_id, table.num_tokens, block_id, new_block)
            self._record("new_block" if new_block else "append", seq_id, caption, (block_id,))
        return new_ids

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
        """The table's block ids as a 1-D LongTensor on the cache's device, for :mod:`paged_kv.mapping`."""
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


def _appending(n: int, seq_id: Hashable) -> str:
    """What an append that runs out of blocks was doing, for its error message."""
    return f"appending {n} tokens to sequence {seq_id!r}"

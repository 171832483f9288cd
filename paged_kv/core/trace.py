"""A recorded trace of the block manager: one :class:`TraceFrame` per event, for the widgets' animations.

A :class:`Recorder` is an observer of a :class:`~paged_kv.core.block_manager.BlockManager`: it turns
the events the manager emits (:mod:`paged_kv.core.changes`) into frames, so recording never changes
what the manager does and has no code path of its own. The trace is a "start" frame of the empty
pool, then one frame after every allocation, fork, copy-on-write and release, and one after *each
token* an append places, so an animation can step token by token. Each frame holds a snapshot, a
one-line caption, the event's name, the sequence it concerns and the blocks it touched (the ones a
picture outlines). ``PagedKVCacheAllocator(..., record=True)`` keeps one (lessons 00, 02, 04, 08).
The caption helpers below are the only place the wording lives.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from paged_kv.core.changes import BlockChange
from paged_kv.core.snapshot import AllocatorSnapshot

if TYPE_CHECKING:
    from paged_kv.core.block_manager import BlockManager

EVENTS = ("start", "allocate", "append", "new_block", "free", "fork", "copy_on_write")


@dataclass(frozen=True)
class TraceFrame:
    """One step of a recorded trace: the allocator's state right after ``event``.

    Fields:
        snapshot: the bookkeeping after the event (a frozen copy; later calls never change it).
        caption: one line, such as ``"seq B, token 17: block 5 appended"``.
        event: ``"start"``, ``"allocate"``, ``"append"``, ``"new_block"``, ``"free"``, ``"fork"`` or
            ``"copy_on_write"`` (a shared block copied for the sequence about to write into it).
        seq_id: the sequence the event concerns (for ``"fork"``, the new child); ``None`` for ``"start"``.
        highlight: the ids of the blocks the event touched, in table order.
    """

    snapshot: AllocatorSnapshot
    caption: str
    event: str
    seq_id: Hashable | None
    highlight: tuple[int, ...]


def start_caption(num_blocks: int, block_size: int) -> str:
    """``"empty pool: 64 blocks of 16 slots, all free"``."""
    return f"empty pool: {num_blocks} blocks of {block_size} slots, all free"


def allocate_caption(seq_id: Hashable, num_tokens: int, block_ids: Sequence[int]) -> str:
    """``"seq A: 9-token prompt takes blocks [0]"`` (``takes no block`` for an empty prompt)."""
    taken = f"takes blocks {list(block_ids)}" if block_ids else "takes no block"
    return f"seq {seq_id}: {num_tokens}-token prompt {taken}"


def token_caption(seq_id: Hashable, token: int, block_id: int, new_block: bool) -> str:
    """``"seq B, token 17: block 5 appended"`` or ``"seq B, token 18 fits in block 5"`` (1-based)."""
    if new_block:
        return f"seq {seq_id}, token {token}: block {block_id} appended"
    return f"seq {seq_id}, token {token} fits in block {block_id}"


def block_caption(seq_id: Hashable, block_id: int) -> str:
    """``"seq B: block 5 appended ahead of its next token"``: a block taken without a token."""
    return f"seq {seq_id}: block {block_id} appended ahead of its next token"


def free_caption(seq_id: Hashable, block_ids: Sequence[int], freed: Sequence[int]) -> str:
    """``"seq A finished: blocks [0, 3] back to the free list"``, naming blocks still shared.

    ``block_ids`` is the finished sequence's table, ``freed`` the blocks whose ref count reached 0.
    """
    freed_set = set(freed)
    kept = [block_id for block_id in block_ids if block_id not in freed_set]
    caption = f"seq {seq_id} finished: "
    caption += f"blocks {list(freed)} back to the free list" if freed else "no block back to the free list"
    if kept:
        caption += f", blocks {list(kept)} still held by another sequence"
    return caption


def fork_caption(parent_id: Hashable, child_id: Hashable, block_ids: Sequence[int]) -> str:
    """``"seq B forks from A: shares blocks [0, 1, 2]"`` (``shares no block`` for an empty parent)."""
    shared = f"shares blocks {list(block_ids)}" if block_ids else "shares no block"
    return f"seq {child_id} forks from {parent_id}: {shared}"


def copy_caption(seq_id: Hashable, copies: Sequence[tuple[int, int]], token: int | None = None) -> str:
    """A copy-on-write: ``"seq B, token 11: block 2 copied to block 5"`` (``token`` is 1-based).

    Without a token the copies were made for a write into shared blocks:
    ``"seq A, before a write: blocks [0, 1] copied to blocks [4, 5]"``.
    """
    where = f"seq {seq_id}, token {token}" if token is not None else f"seq {seq_id}, before a write"
    if len(copies) == 1:
        ((source, copy),) = copies
        return f"{where}: block {source} copied to block {copy}"
    sources, targets = [s for s, _ in copies], [c for _, c in copies]
    return f"{where}: blocks {sources} copied to blocks {targets}"


class Recorder:
    """Keeps :attr:`frames`, the trace of a manager: built from the start, it subscribes itself.

    Invariant: the frames are the manager's states in order, each one the snapshot right after the
    event its caption names; for an append that placed several tokens in one block, one frame per
    token, the same snapshot but for the sequence's length. Cache hits and evictions make no frame
    of their own (the allocation that follows a hit shows its blocks).
    """

    def __init__(self, manager: BlockManager) -> None:
        self._manager = manager
        start = start_caption(manager.num_blocks, manager.block_size)
        self.frames: list[TraceFrame] = [TraceFrame(manager.snapshot(), start, "start", None, ())]
        manager.subscribe(self)

    def __call__(self, event: BlockChange) -> None:
        if event.kind in ("cache_hit", "evict"):
            return
        snapshot = self._manager.snapshot()
        if event.tokens is not None and event.kind in ("append", "new_block", "copy_on_write"):
            self._tokens(event, snapshot)
            return
        seq_id = event.seq_id
        if event.kind == "allocate":
            caption = allocate_caption(seq_id, event.tokens[1], event.blocks)
        elif event.kind == "new_block":
            caption = block_caption(seq_id, event.blocks[0])
        elif event.kind == "copy_on_write":
            caption = copy_caption(seq_id, event.copies)
        elif event.kind == "fork":
            caption = fork_caption(event.parent, seq_id, event.blocks)
        else:  # "free"
            caption = free_caption(seq_id, event.blocks, event.freed)
        self.frames.append(TraceFrame(snapshot, caption, event.kind, seq_id, event.blocks))

    def _tokens(self, event: BlockChange, snapshot: AllocatorSnapshot) -> None:
        """One frame per token of an append into one block: the first names what the block took."""
        seq_id, (block_id,) = event.seq_id, event.blocks
        first, last = event.tokens
        table = snapshot.tables[seq_id]
        for token in range(first, last + 1):
            tables = {
                **snapshot.tables,
                seq_id: replace(table, block_ids=list(table.block_ids), num_tokens=token),
            }
            frame_snapshot = snapshot if token == last else replace(snapshot, tables=tables)
            if token == first and event.kind == "copy_on_write":
                caption, kind, highlight = (
                    copy_caption(seq_id, event.copies, token),
                    event.kind,
                    event.copies[0],
                )
            else:
                new = token == first and event.kind == "new_block"
                caption = token_caption(seq_id, token, block_id, new)
                kind, highlight = ("new_block" if new else "append"), (block_id,)
            self.frames.append(TraceFrame(frame_snapshot, caption, kind, seq_id, tuple(highlight)))

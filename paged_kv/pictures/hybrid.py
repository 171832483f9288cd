"""Pictures of a hybrid model's KV cache: its groups over one pool, as snapshots and traces.

Lesson 13 shows them.

A :class:`~paged_kv.core.kv_cache_manager.KVCacheManager` (over its
:class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator`) holds one block table per request
*and* KV-cache group, all over one pool whose block 0 is the null block. The course's pool picture
(:func:`~paged_kv.pictures.pool.render_allocator`) and player
(:class:`~paged_kv.pictures.widgets.AllocationPlayer`) draw an
:class:`~paged_kv.core.snapshot.AllocatorSnapshot`, one table per name, so:

* the manager's own snapshot (:meth:`~paged_kv.core.kv_cache_manager.KVCacheManager.snapshot`)
  is one: a table per request and group named ``"sw·a"`` (request ``a``'s table in a
  sliding-window group) or ``"full·a"`` (in a full-attention group), with the snapshot's
  ``null_block`` set: the picture draws the null block and the null entries in grey. The group
  comes first in the name so that the colour, which the picture takes from the end of a name, is
  the request's in every group, and so that the name fits the pool's six-character label. A model
  with several groups of one kind numbers them, ``"sw0·a"``, ``"sw1·a"``
  (:func:`~paged_kv.core.kv_cache_coordinator.group_names`).
* :class:`HybridRecorder` drives the manager step by step (a prompt, decode steps, a request
  that finishes) and keeps a :class:`~paged_kv.core.trace.TraceFrame` after each, whose caption
  says which blocks each group took and which blocks left a window, the null block in their place.
  Its :attr:`~HybridRecorder.frames` feed the player.

Nothing here changes what the manager does: the recorder calls its public methods, as the
engine's memory does (``allocate_slots`` frees the blocks a window left before it takes new ones).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from types import SimpleNamespace

from paged_kv.core.block_pool import NULL_BLOCK
from paged_kv.core.kv_cache_coordinator import group_names
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.core.trace import TraceFrame
from paged_kv.validate import check_count, check_hashable

__all__ = ["HybridRecorder"]


class HybridRecorder:
    """A KV-cache manager driven step by step, and its trace: one frame per call, for the player.

    Build it on a manager that holds no request yet; the first frame is the empty pool. Then
    :meth:`allocate` a prompt, :meth:`decode` tokens and :meth:`free` requests in any order; each
    call returns what the manager returned and appends a frame. A refused allocation (too few
    free blocks) raises :class:`ValueError` and appends nothing.

    Invariant: each frame is the manager's state right after the call its caption names, and it
    outlines the blocks the call took or gave back.
    """

    def __init__(self, memory: KVCacheManager) -> None:
        if not isinstance(memory, KVCacheManager):
            raise ValueError(f"memory must be a KVCacheManager, got {type(memory).__name__}")
        if memory.request_ids:
            raise ValueError("the memory must hold no request yet: the trace starts from the empty pool")
        self.memory = memory
        self.names = group_names(memory.kv_cache_groups)
        caption = (
            f"empty pool: {memory.num_blocks} blocks of {memory.block_size} slots, block "
            f"{NULL_BLOCK} the null block; {len(self.names)} groups ({', '.join(self.names)})"
        )
        self.frames: list[TraceFrame] = [TraceFrame(memory.snapshot(), caption, "start", None, ())]

    def allocate(self, request_id: Hashable, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """A new request's prompt of ``num_tokens`` tokens: its blocks in every group, all or none."""
        check_hashable("request_id", request_id)
        check_count("num_tokens", num_tokens, minimum=1)
        if request_id in self.memory:
            raise ValueError(f"request {request_id!r} holds blocks already: decode it, or free it first")
        gained = self._allocate(request_id, num_tokens, f"{request_id}: {num_tokens}-token prompt")
        taken = "; ".join(f"{name} takes {list(ids)}" for name, ids in zip(self.names, gained, strict=True))
        self._frame(f"{request_id}: {num_tokens}-token prompt; {taken}", "allocate", request_id, gained, [])
        return gained

    def decode(self, request_id: Hashable, num_steps: int = 1) -> None:
        """``num_steps`` decode steps of a request, one token and one frame each.

        Before each token's block is counted, every sliding-window group gives back the blocks wholly
        before the window of the token about to be computed (the manager's ``allocate_slots``).
        """
        check_count("num_steps", num_steps, minimum=1)
        if request_id not in self.memory:
            raise ValueError(f"request {request_id!r} holds no blocks: allocate its prompt first")
        for _ in range(num_steps):
            token = self.memory.num_tokens(request_id) + 1  # 1-based, as the other traces count
            before = self.memory.get_block_ids(request_id)
            gained = self._allocate(request_id, 1, f"{request_id}, token {token}")
            after = self.memory.get_block_ids(request_id)
            freed = [  # an entry that turned null left the window (its block may be taken again at once)
                [b for b, now in zip(old, new, strict=False) if b != NULL_BLOCK and now == NULL_BLOCK]
                for old, new in zip(before, after, strict=True)
            ]
            self._frame(
                self._token_caption(request_id, token, gained, freed), "append", request_id, gained, freed
            )

    def free(self, request_id: Hashable) -> list[int]:
        """The request finishes: every block of it goes back, in every group."""
        if request_id not in self.memory:
            raise ValueError(f"request {request_id!r} holds no blocks")
        freed = self.memory.free(request_id)
        caption = (
            f"{request_id} finished: blocks {freed} back to the free list, each group's last block first"
        )
        self._frame(caption, "free", request_id, [], [freed])
        return freed

    # ------------------------------------------------------------------------------- helpers

    def _allocate(self, request_id: Hashable, num_tokens: int, what: str) -> tuple[tuple[int, ...], ...]:
        free = self.memory.num_free_blocks
        gained = self.memory.allocate_slots(SimpleNamespace(request_id=request_id), num_tokens)
        if gained is None:
            raise ValueError(f"{what} refused: too few free blocks ({free} free); nothing was taken")
        return gained

    def _token_caption(
        self,
        request_id: Hashable,
        token: int,
        gained: Sequence[Sequence[int]],
        freed: Sequence[Sequence[int]],
    ) -> str:
        parts = []
        for name, new, old in zip(self.names, gained, freed, strict=True):
            if new:
                parts.append(f"{name} takes block {new[0]}" if len(new) == 1 else f"{name} takes {list(new)}")
            if old:
                gone = f"block {old[0]}" if len(old) == 1 else f"blocks {list(old)}"
                parts.append(f"{name} frees {gone} (out of the window; null in its place)")
        return f"{request_id}, token {token}: " + ("; ".join(parts) if parts else "fits in its last blocks")

    def _frame(
        self,
        caption: str,
        event: str,
        request_id: Hashable,
        gained: Sequence[Sequence[int]],
        freed: Sequence[Sequence[int]],
    ) -> None:
        touched = tuple(b for ids in (*gained, *freed) for b in ids if b != NULL_BLOCK)
        self.frames.append(TraceFrame(self.memory.snapshot(), caption, event, request_id, touched))

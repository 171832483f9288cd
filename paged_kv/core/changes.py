"""What the lessons' block manager tells its observers: one :class:`BlockChange` per change of its
bookkeeping, the pictures' trace (lessons 02, 04, 08).

Not vLLM's KV-cache events: those (``BlockStored``, ``BlockRemoved``) say which hashes a pool
cached and evicted, and hang at :class:`~paged_kv.core.block_pool.BlockPool`'s listeners. A change
here is any step of a sequence's table that a picture shows.

:class:`~paged_kv.core.block_manager.BlockManager` announces a change after each successful call, to
every observer given to :meth:`~paged_kv.core.block_manager.BlockManager.subscribe`, in the order
the changes happen. An observer sees the manager already changed, so it can take a snapshot.
Recording a trace for the widgets (:class:`~paged_kv.core.trace.Recorder`) is one such observer; a
call that raises emits nothing, so an observer only ever sees what really happened.

The kinds:

* ``"allocate"``: a prompt got its blocks (``blocks``, the new table; ``tokens``, ``(1, n)`` for a
  prompt of ``n`` tokens, ``n`` possibly 0);
* ``"cache_hit"``: the prompt reused cached blocks (``blocks``) for its tokens ``tokens[0] ..
  tokens[1]``, emitted before its ``"allocate"``;
* ``"append"``: tokens ``tokens[0] .. tokens[1]`` (1-based) landed in a block the sequence had
  (``blocks``, that one block);
* ``"new_block"``: as ``"append"``, but the block was taken from the free list for its first token;
  with ``tokens`` ``None``, a block appended ahead of any token;
* ``"copy_on_write"``: the sequence got its own copies of shared blocks (``copies``, ``(shared,
  copy)`` pairs), before tokens ``tokens[0] .. tokens[1]`` landed in the copy, or, with ``tokens``
  ``None``, before a write into them;
* ``"fork"``: ``seq_id`` started sharing every block of ``parent`` (``blocks``);
* ``"free"``: ``seq_id`` left; ``blocks`` was its table, ``freed`` the blocks back on the free list;
* ``"evict"``: a cached block lost its hash, because new data took it (``blocks``, that block).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

CHANGE_KINDS = ("allocate", "cache_hit", "append", "new_block", "copy_on_write", "fork", "free", "evict")


@dataclass(frozen=True)
class BlockChange:
    """One change of the block manager's bookkeeping; the fields a kind does not use stay empty."""

    kind: str
    seq_id: Hashable | None = None
    blocks: tuple[int, ...] = ()
    tokens: tuple[int, int] | None = None
    copies: tuple[tuple[int, int], ...] = ()
    freed: tuple[int, ...] = ()
    parent: Hashable | None = None


Observer = Callable[[BlockChange], None]
"""Anything called with each :class:`BlockChange`; what it returns is ignored."""

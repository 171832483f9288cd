"""The host tier's manager: an LRU of block hashes over a fixed number of host blocks (lesson 11).

vLLM 0.33.0's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``) keeps, per block hash,
a status with two fields, ``ref_cnt`` and ``chunk_id``, and delegates the eviction order to a cache
policy (``cpu/policies/lru.py`` by default, ARC as an option). This one keeps the same status and
the LRU order itself, in one ordered dict.

A block's ``ref_cnt`` says what may happen to it:

* ``-1``: being stored (:meth:`~CPUOffloadingManager.prepare_store` reserved it): held but not
  readable, ``lookup`` says ``HIT_PENDING``; it cannot be loaded or evicted;
* ``0``: stored and idle: loadable, and evictable;
* ``n > 0``: ``n`` loads read it (:meth:`~CPUOffloadingManager.prepare_load`, each undone by a
  :meth:`~CPUOffloadingManager.complete_load`): loadable, not evictable.

Recency: a store's new keys and a touch's keys become the most recently used, the *first* key of
the call the most recent of all (vLLM's LRU policy ranks a request's blocks so: a prefix's tail is
evicted before its head, which more requests share). Loading a block does not change its
recency; the scheduler touches what a request used (vLLM applies a request's accesses when it
finishes).

Invariants (checked by ``tests/test_kv_offload.py`` against a plain reference LRU):

* every key held has its own host block id in ``0 .. num_blocks - 1``; held plus free blocks are
  ``num_blocks``; fresh ids are handed out in order, then freed ones, the last freed first;
* only idle blocks (``ref_cnt == 0``) are evicted, least recently used first, and never one of the
  keys of the offer that evicts;
* :meth:`~CPUOffloadingManager.prepare_store` stores all the new keys of an offer or none (it
  returns ``None`` then, changing nothing); any call that raises changes nothing;
* with ``enable_events``, a key is announced stored when its store completes and removed when it is
  evicted after that; a failed store announces nothing (vLLM records a ``metadata_only`` removal,
  which its events tracker does not publish).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

from paged_kv.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)
from paged_kv.kv_offload.cpu.common import CPULoadStoreSpec
from paged_kv.validate import check_count, check_hashable


@dataclass(slots=True)
class BlockStatus:
    """One held block: its host block id and its ``ref_cnt`` (see the module)."""

    block_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        """Whether the block's store has completed: it can be loaded."""
        return self.ref_cnt >= 0


class HeldBlock(NamedTuple):
    """A held block as :meth:`CPUOffloadingManager.lru_blocks` lists it."""

    key: OffloadKey
    block_id: int
    ref_cnt: int


class CPUOffloadingManager(OffloadingManager):
    """An LRU of block hashes over ``num_blocks`` host blocks (see the module for the rules).

    ``enable_events``: record :class:`~paged_kv.kv_offload.base.OffloadingEvent` s for
    :meth:`take_events` (vLLM records them only when KV-cache events are enabled).

    Raises:
        ValueError: ``num_blocks`` is not a positive integer.
    """

    medium = Medium.CPU

    def __init__(self, num_blocks: int, enable_events: bool = False) -> None:
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self._blocks: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()  # least recently used first
        self._num_allocated_blocks = 0  # ids 0 .. this - 1 were handed out at least once
        self._free_list: list[int] = []  # freed ids, reused last in first out
        self._num_evictable_blocks = 0  # held blocks with ref_cnt == 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    def __repr__(self) -> str:
        return f"CPUOffloadingManager(num_blocks={self.num_blocks}, held={len(self)})"

    def __len__(self) -> int:
        """The number of blocks held, being stored or stored."""
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    @property
    def num_free_blocks(self) -> int:
        """Host blocks holding no key."""
        return self.num_blocks - len(self._blocks)

    @property
    def num_evictable_blocks(self) -> int:
        """Held blocks that are stored and idle (``ref_cnt == 0``)."""
        return self._num_evictable_blocks

    def lru_blocks(self) -> list[HeldBlock]:
        """Every held block, least recently used first."""
        return [HeldBlock(key, s.block_id, s.ref_cnt) for key, s in self._blocks.items()]

    # --- OffloadingManager ---

    def lookup(self, key: OffloadKey) -> LookupResult:
        """``MISS``, ``HIT`` or ``HIT_PENDING`` (held but still being stored) for the block ``key``."""
        status = self._blocks.get(check_hashable("key", key))
        if status is None:
            return LookupResult.MISS
        return LookupResult.HIT if status.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey]) -> CPULoadStoreSpec:
        """Pin ``keys`` against eviction (one ``ref_cnt`` each, a key named twice twice) and return
        their host block ids, in order.

        Raises:
            ValueError: a key the tier does not hold, or one still being stored; nothing is pinned.
        """
        statuses = [self._ready(key) for key in keys]
        for status in statuses:
            if status.ref_cnt == 0:
                self._num_evictable_blocks -= 1
            status.ref_cnt += 1
        return CPULoadStoreSpec(status.block_id for status in statuses)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Make the held ``keys`` the most recently used, ``keys[0]`` the most recent; others are
        ignored (the device's prefix cache may hit blocks the tier never held)."""
        for key in reversed([check_hashable("key", key) for key in keys]):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Undo one :meth:`prepare_load` pin of each of ``keys``.

        Raises:
            ValueError: a key that no load pins (as many times as it is named); nothing changes.
        """
        statuses = []
        pins: dict[OffloadKey, int] = {}
        for key in keys:
            status = self._blocks.get(check_hashable("key", key))
            pins[key] = pins.get(key, 0) + 1
            if status is None or pins[key] > status.ref_cnt:
                raise ValueError(f"block {key!r} is not being loaded: complete_load without prepare_load")
            statuses.append(status)
        for status in statuses:
            status.ref_cnt -= 1
            if status.ref_cnt == 0:
                self._num_evictable_blocks += 1

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve a host block for each offered key the tier does not hold (``ref_cnt = -1``),
        evicting idle blocks, least recently used first and none of ``keys``, when too few are free.

        Returns:
            The keys to store, their host blocks and the evicted keys; ``None``, changing nothing,
            when not enough idle blocks can be evicted (vLLM's connector then skips the store).
        """
        keys = [check_hashable("key", key) for key in keys]
        keys_to_store = list(dict.fromkeys(key for key in keys if key not in self._blocks))
        num_to_evict = len(keys_to_store) - self.num_free_blocks
        evicted_keys: list[OffloadKey] = []
        if num_to_evict > 0:
            protected = set(keys)
            idle = (k for k, s in self._blocks.items() if s.ref_cnt == 0 and k not in protected)
            evicted_keys = list(islice(idle, num_to_evict))
            if len(evicted_keys) < num_to_evict:
                return None
            for key in evicted_keys:
                self._free_list.append(self._blocks.pop(key).block_id)
            self._num_evictable_blocks -= num_to_evict
            self._record(evicted_keys, removed=True)
        block_ids = [self._allocate_block_id() for _ in keys_to_store]
        for key, block_id in zip(reversed(keys_to_store), reversed(block_ids), strict=True):
            self._blocks[key] = BlockStatus(block_id)  # the offer's first key ends the most recent
        return PrepareStoreOutput(keys_to_store, CPULoadStoreSpec(block_ids), evicted_keys)

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """The store of ``keys`` finished: each one still being stored becomes loadable and idle
        (announced stored), or with ``success=False`` is dropped and its block freed. Keys not being
        stored are ignored, as vLLM's manager ignores them."""
        stored: list[OffloadKey] = []
        for key in [check_hashable("key", key) for key in keys]:
            status = self._blocks.get(key)
            if status is None or status.is_ready:
                continue
            if success:
                status.ref_cnt = 0
                self._num_evictable_blocks += 1
                stored.append(key)
            else:
                del self._blocks[key]
                self._free_list.append(status.block_id)
        self._record(stored, removed=False)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The events recorded since the last call, oldest first (none unless ``enable_events``)."""
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Drop every block, as vLLM's ``reset_cache`` does, announcing nothing (the engine's
        ``AllBlocksCleared`` says it).

        Raises:
            RuntimeError: a block is being loaded or stored (vLLM fences those jobs first); nothing
                is dropped.
        """
        busy = len(self._blocks) - self._num_evictable_blocks
        if busy:
            raise RuntimeError(
                f"cannot reset the CPU offloading cache: {busy} blocks are being loaded or stored"
            )
        self._blocks.clear()
        self._free_list.clear()
        self._num_allocated_blocks = self._num_evictable_blocks = 0

    # --- helpers ---

    def _ready(self, key: OffloadKey) -> BlockStatus:
        status = self._blocks.get(check_hashable("key", key))
        if status is None:
            raise ValueError(f"block {key!r} is not in the CPU offloading cache")
        if not status.is_ready:
            raise ValueError(f"block {key!r} is still being stored: it cannot be loaded yet")
        return status

    def _allocate_block_id(self) -> int:
        if self._num_allocated_blocks < self.num_blocks:
            self._num_allocated_blocks += 1
            return self._num_allocated_blocks - 1
        return self._free_list.pop()

    def _record(self, keys: list[OffloadKey], removed: bool) -> None:
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys, self.medium, removed))

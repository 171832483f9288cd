"""The offloading tier's two halves and what passes between them, by vLLM 0.33.0's names (lesson 11).

vLLM's native KV offloading (``--kv-offloading-size``, ``vllm/v1/kv_offload/base.py``) splits a
tier in two:

* the **manager** (:class:`OffloadingManager`) runs in the scheduler and holds no tensors: it knows
  which block hashes the tier holds and where, answers :meth:`~OffloadingManager.lookup`, pins
  the blocks a load reads or a store writes, chooses what to evict, and records the
  :class:`OffloadingEvent` s that become ``BlockStored`` / ``BlockRemoved`` with ``medium="CPU"``;
* the **worker** (:class:`OffloadingWorker`) runs beside the model and copies K/V between the device
  pool and the tier's memory, given block ids on both sides.

A :class:`LoadStoreSpec` is how the manager tells the worker where a block lives: the device's
block ids (:class:`GPULoadStoreSpec`, from the scheduler's block tables) and the tier's own block
ids (:class:`~paged_kv.kv_offload.cpu.common.CPULoadStoreSpec`, from the manager). A transfer is one
job, identified by an id the scheduler gives it; the worker reports it done with a
:class:`TransferResult`, and the scheduler then calls the manager's ``complete_load`` or
``complete_store``.

Where this package is simpler than vLLM 0.33.0 (the names are the same):

* a key is a block hash as the prefix cache computes it (vLLM's ``OffloadKey`` packs the hash with
  the KV-cache group's index; a caller offloading several groups passes ``(hash, group)`` keys);
* one offloaded block is one device block (vLLM's default, ``blocks_per_chunk=1``; vLLM can
  coalesce several into one "chunk");
* the manager's methods take no ``ReqContext`` (vLLM's carries per-request state for its cache
  policies and tiers, which one LRU does not need), and :class:`LookupResult` has no ``RETRY``
  (an asynchronous lookup, which a host tier never needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum, auto

from paged_kv.validate import check_count

#: What identifies an offloaded block: its block hash (vLLM's ``OffloadKey``).
OffloadKey = Hashable


class Medium(Enum):
    """Where an offloading tier keeps its blocks; the value is the ``medium`` its events carry."""

    CPU = "CPU"


class LookupResult(Enum):
    """What :meth:`OffloadingManager.lookup` says of one block."""

    #: The tier does not hold the block.
    MISS = auto()
    #: The tier holds the block, ready to be loaded.
    HIT = auto()
    #: The block is being stored: held, but not readable until its store completes.
    HIT_PENDING = auto()


class LoadStoreSpec:
    """Where a worker finds, or puts, blocks of K/V: the manager's answer to a load or a store."""


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks named by their ids, in order: the ``i``-th id of a source spec is copied to the
    ``i``-th id of its destination spec.

    Raises:
        ValueError: an id that is not a non-negative integer (the message names it).
    """

    def __init__(self, block_ids: Iterable[int]) -> None:
        self.block_ids: tuple[int, ...] = tuple(
            check_count(f"block_ids[{i}]", block_id) for i, block_id in enumerate(block_ids)
        )

    def __len__(self) -> int:
        return len(self.block_ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.block_ids)})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Block ids of the device pool (vLLM's name, whatever the device): a store's source, a load's
    destination."""


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What :meth:`OffloadingManager.prepare_store` decided.

    ``keys_to_store`` are the offered keys the tier did not hold, in the offer's order, and
    ``store_spec`` the tier's blocks they go to (one id each, the same order); ``evicted_keys``
    are the keys evicted to make room, least recently used first.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys the tier stored (``removed=False``) or removed (``removed=True``), on ``medium``: the
    scheduler turns them into ``BlockStored`` / ``BlockRemoved`` KV events."""

    keys: list[OffloadKey]
    medium: Medium
    removed: bool


@dataclass(frozen=True)
class TransferResult:
    """A finished transfer: its job id, whether it succeeded, its bytes and seconds."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class OffloadingManager(ABC):
    """The scheduler's side of an offloading tier: which blocks it holds, and their lifecycle.

    A block is stored in two steps, :meth:`prepare_store` (the tier reserves a block, not readable
    yet) then :meth:`complete_store` (readable); it is loaded in two, :meth:`prepare_load` (pinned
    against eviction) then :meth:`complete_load`. :meth:`touch` marks blocks recently used,
    separately from loading, so that blocks the device's prefix cache hit stay warm in the tier too.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """Whether the tier holds the block ``key``, and whether it is ready to load."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        """Pin the blocks ``keys`` (each a :attr:`LookupResult.HIT`) until :meth:`complete_load`,
        and say where they are."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark the blocks ``keys`` recently used; keys the tier does not hold are ignored."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """The load of ``keys`` (prepared by :meth:`prepare_load`) finished: unpin them."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve blocks for the offered ``keys`` the tier does not hold, evicting if it must;
        ``None`` when it cannot make room (nothing changes then)."""

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """The store of ``keys`` finished: they become loadable, or, when ``success`` is false,
        are dropped."""

    @abstractmethod
    def take_events(self) -> Iterable[OffloadingEvent]:
        """The events recorded since the last call, oldest first."""

    @abstractmethod
    def reset_cache(self) -> None:
        """Drop every block the tier holds."""


class OffloadingWorker(ABC):
    """The model's side of an offloading tier: copies K/V between the device pool and the tier."""

    @abstractmethod
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy device blocks ``src_spec`` to the tier's blocks ``dst_spec``."""

    @abstractmethod
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Copy the tier's blocks ``src_spec`` to device blocks ``dst_spec``."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """The transfers finished since the last call, in the order they were submitted."""

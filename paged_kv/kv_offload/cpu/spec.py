"""Sizing the host tier from ``kv_offloading_size`` as vLLM does, and building its two halves (lesson 11).

vLLM 0.33.0's arithmetic, in three places:

* ``VllmConfig._post_init_kv_transfer_config`` (``vllm/config/vllm.py``) turns
  ``kv_offloading_size`` (GiB, ``CacheConfig``; ``kv_offloading_backend="native"``) into the
  connector's ``cpu_bytes_to_use = kv_offloading_size * (1 << 30)``. With tensor parallelism the
  size is the total over all ranks (``CacheConfig``'s docstring);
* ``build_offloading_config`` (``offloading/config.py``) counts ``worker_kv_bytes_per_block``: the
  bytes one block takes on one worker, every layer's K and V (a rank holds its share of the heads);
* ``CPUOffloadingSpec.__init__`` (``vllm/v1/kv_offload/cpu/spec.py``) multiplies that by the
  ``world_size`` (every rank's share of a block sits side by side in one host chunk), by
  ``blocks_per_chunk`` (1 here), rounds it up to ``BLOCK_SIZE_ALIGNMENT``, the host page size
  (``mmap.PAGESIZE``, so that each chunk starts on a page of its shared region), and divides:
  ``num_chunks = int(cpu_bytes_to_use) // aligned_kv_bytes_per_chunk``.

So ``world_size`` ranks of ``1 / world_size`` of the heads hold as many host blocks as one rank of
all of them, and a block smaller than a page costs a whole page. vLLM starts with 0 chunks when the
size is too small (and refuses a size of 0); here both are a ``ValueError`` that says the smallest
size that holds one block.
"""

from __future__ import annotations

import math
import mmap
import numbers

from paged_kv.kv.storage import KVStorage
from paged_kv.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from paged_kv.kv_offload.cpu.manager import CPUOffloadingManager
from paged_kv.validate import check_count

GIB = 1 << 30

#: What each host block's bytes are rounded up to (vLLM's ``SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT``).
BLOCK_SIZE_ALIGNMENT = mmap.PAGESIZE


def cpu_bytes_to_use(kv_offloading_size: object) -> int:
    """``kv_offloading_size`` GiB in bytes, as vLLM's connector receives them (``int`` of the product).

    Raises:
        ValueError: ``kv_offloading_size`` is not a number (a bool, a string, ``None``), is not
            finite, or is not above 0 (the message names it).
    """
    size = kv_offloading_size
    if isinstance(size, bool) or not isinstance(size, numbers.Real):
        raise ValueError(f"kv_offloading_size must be a number of GiB, got {type(size).__name__} {size!r}")
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
    return int(size * GIB)


class CPUOffloadingSpec:
    """The host tier of ``kv_offloading_size`` GiB for blocks of ``worker_kv_bytes_per_block`` bytes
    on each of ``world_size`` ranks (vLLM's ``CPUOffloadingSpec``; see the module).

    Invariant: ``num_blocks * kv_bytes_per_block <= cpu_bytes_to_use < (num_blocks + 1) *
    kv_bytes_per_block``, ``num_blocks >= 1``, and ``kv_bytes_per_block`` is the smallest multiple of
    :data:`BLOCK_SIZE_ALIGNMENT` that holds a block of every rank.

    Raises:
        ValueError: a bad ``kv_offloading_size`` (:func:`cpu_bytes_to_use`), a count that is not a
            positive integer, or a size too small to hold one block (the message gives the least).
    """

    def __init__(
        self,
        kv_offloading_size: float,
        worker_kv_bytes_per_block: int,
        world_size: int = 1,
        enable_events: bool = False,
    ) -> None:
        self.cpu_bytes_to_use = cpu_bytes_to_use(kv_offloading_size)
        self.worker_kv_bytes_per_block = check_count(
            "worker_kv_bytes_per_block", worker_kv_bytes_per_block, minimum=1
        )
        self.world_size = check_count("world_size", world_size, minimum=1)
        unaligned = self.worker_kv_bytes_per_block * self.world_size
        #: One host block's bytes, all ranks' shares, rounded up to the alignment.
        self.kv_bytes_per_block = -(-unaligned // BLOCK_SIZE_ALIGNMENT) * BLOCK_SIZE_ALIGNMENT
        #: How many blocks the tier holds.
        self.num_blocks = self.cpu_bytes_to_use // self.kv_bytes_per_block
        if self.num_blocks == 0:
            raise ValueError(
                f"kv_offloading_size={kv_offloading_size!r} GiB cannot hold one block of "
                f"{self.kv_bytes_per_block:,} bytes; it must be at least "
                f"{self.kv_bytes_per_block / GIB:.3g} GiB"
            )
        self.enable_events = enable_events
        self._manager: CPUOffloadingManager | None = None

    def __repr__(self) -> str:
        return (
            f"CPUOffloadingSpec(num_blocks={self.num_blocks}, kv_bytes_per_block={self.kv_bytes_per_block}, "
            f"world_size={self.world_size})"
        )

    @classmethod
    def for_storage(
        cls, kv_offloading_size: float, storage: KVStorage, enable_events: bool = False
    ) -> CPUOffloadingSpec:
        """The tier for one rank holding ``storage`` (its blocks' bytes, every layer's K and V)."""
        return cls(kv_offloading_size, storage.bytes_per_block, enable_events=enable_events)

    def get_manager(self) -> CPUOffloadingManager:
        """The scheduler's half, made on the first call and the same one after."""
        if self._manager is None:
            self._manager = CPUOffloadingManager(self.num_blocks, enable_events=self.enable_events)
        return self._manager

    def get_worker(self, storage: KVStorage) -> CPUOffloadingWorker:
        """The worker's half: :attr:`num_blocks` host blocks for ``storage``.

        Raises:
            ValueError: ``storage``'s blocks are not of ``worker_kv_bytes_per_block`` bytes.
        """
        if not isinstance(storage, KVStorage) or storage.bytes_per_block != self.worker_kv_bytes_per_block:
            got = storage.bytes_per_block if isinstance(storage, KVStorage) else type(storage).__name__
            raise ValueError(
                f"storage must be a KVStorage with blocks of {self.worker_kv_bytes_per_block} bytes, the "
                f"spec's worker_kv_bytes_per_block, got {got}"
            )
        return CPUOffloadingWorker(storage, self.num_blocks)

"""What the host tier's two halves share: the spec naming its blocks (vLLM's ``cpu/common.py``;
lesson 11)."""

from __future__ import annotations

from paged_kv.kv_offload.base import BlockIDsLoadStoreSpec


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Block ids of the host tier, ``0 .. num_cpu_blocks - 1``: a store's destination, a load's
    source (the manager hands them out; the worker's host tensors are indexed by them)."""

"""Forking by copying: the child takes fresh blocks and a copy of the parent's K/V, sharing nothing."""

from paged_kv.core.block import BlockTable
from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.fork"
MESSAGE = "fork takes no block and moves no K/V"


def fork(cache, parent_id, child_id):
    parent = cache.tables[parent_id]
    if child_id in cache.tables:
        raise ValueError(f"child_id {child_id!r} is already allocated")
    copies = [cache.allocator.allocate() for _ in parent.block_ids]  # the mistake: an eager copy
    for source, copy in zip(parent.block_ids, copies, strict=True):
        cache.k_cache[copy] = cache.k_cache[source]
        cache.v_cache[copy] = cache.v_cache[source]
    cache.tables[child_id] = BlockTable(copies, parent.num_tokens)
    return list(copies)

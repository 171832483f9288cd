"""Forking by storing the parent's own BlockTable under the child's id, so the two tables are one object."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.fork"
MESSAGE = "copy of the parent's table"


def fork(cache, parent_id, child_id):
    parent = cache.tables[parent_id]
    if child_id in cache.tables:
        raise ValueError(f"child_id {child_id!r} is already allocated")
    for block_id in parent.block_ids:
        cache.allocator.add_ref(block_id)
    cache.tables[child_id] = parent  # the mistake: the child's next token would grow the parent too
    return list(parent.block_ids)

"""Forking without adding a reference to the shared blocks: the first of the two to finish frees them."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.fork"
MESSAGE = "add one reference to each of the parent's blocks"


def fork(cache, parent_id, child_id):
    parent = cache.tables[parent_id]
    if child_id in cache.tables:
        raise ValueError(f"child_id {child_id!r} is already allocated")
    cache.tables[child_id] = parent.copy()  # the mistake: no add_ref, so the ref counts stay at 1
    return list(parent.block_ids)

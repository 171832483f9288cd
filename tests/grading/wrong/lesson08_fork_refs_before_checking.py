"""Adding the references before refusing a child id that is already allocated: the failed fork leaks them."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.fork"
MESSAGE = "raise ValueError before you add any reference"


def fork(cache, parent_id, child_id):
    parent = cache.tables[parent_id]
    for block_id in parent.block_ids:  # the mistake: the references are added before the check
        cache.allocator.add_ref(block_id)
    if child_id in cache.tables:
        raise ValueError(f"child_id {child_id!r} is already allocated")
    cache.tables[child_id] = parent.copy()
    return list(parent.block_ids)

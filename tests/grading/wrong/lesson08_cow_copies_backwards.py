"""Copy-on-write that copies the fresh block over the shared one: the other holders' K/V are destroyed."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.copy_on_write"
MESSAGE = "copy from the shared block into the new one"


def append_token(cache, seq_id):
    table = cache.tables[seq_id]
    n = table.num_tokens
    if n == len(table.block_ids) * cache.block_size:
        table.block_ids.append(cache.allocator.allocate())
        table.num_tokens += 1
        return table.block_ids[-1]
    logical = n // cache.block_size
    old = table.block_ids[logical]
    table.num_tokens += 1
    if cache.allocator.ref_count(old) == 1:
        return None
    new = cache.allocator.allocate()
    cache.k_cache[old] = cache.k_cache[new]  # the mistake: the direction of the copy
    cache.v_cache[old] = cache.v_cache[new]
    table.block_ids[logical] = new
    cache.allocator.free(old)
    return new

"""Copy-on-write that never drops the writer's reference to the shared block, which then leaks."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.copy_on_write"
MESSAGE = "drop one reference to it"


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
    cache.k_cache[new] = cache.k_cache[old]
    cache.v_cache[new] = cache.v_cache[old]
    table.block_ids[logical] = new  # the mistake: no cache.allocator.free(old)
    return new

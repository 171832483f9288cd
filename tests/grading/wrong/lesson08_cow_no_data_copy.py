"""Copy-on-write that swaps in a fresh block but copies no K/V into it: the writer loses its prefix."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.copy_on_write"
MESSAGE = "copy the shared block's K and V into the new block"


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
    new = cache.allocator.allocate()  # the mistake: its stale K/V are never replaced by the shared block's
    table.block_ids[logical] = new
    cache.allocator.free(old)
    return new

"""Copy-on-write that drops the shared block's reference before taking the copy: out of blocks, it leaks."""

from paged_kv.reference.lesson08 import *  # every other task stays right
from paged_kv.reference.lesson08 import append_token as right_append_token

BREAKS = "08.copy_on_write"
MESSAGE = "raise OutOfBlocksError before changing anything"


def append_token(cache, seq_id):
    table = cache.tables[seq_id]
    n = table.num_tokens
    if n == len(table.block_ids) * cache.block_size:
        return right_append_token(cache, seq_id)
    logical = n // cache.block_size
    old = table.block_ids[logical]
    if cache.allocator.ref_count(old) == 1:
        table.num_tokens += 1
        return None
    cache.allocator.free(old)  # the mistake: the reference is dropped before allocate() can fail
    table.num_tokens += 1
    new = cache.allocator.allocate()
    cache.k_cache[new] = cache.k_cache[old]
    cache.v_cache[new] = cache.v_cache[old]
    table.block_ids[logical] = new
    return new

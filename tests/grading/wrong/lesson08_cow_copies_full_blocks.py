"""Copy-on-write of every shared block of the table, full ones included, instead of the one written into."""

from paged_kv.reference.lesson08 import *  # every other task stays right
from paged_kv.reference.lesson08 import append_token as right_append_token

BREAKS = "08.copy_on_write"
MESSAGE = "full blocks take no new token, so they stay shared"


def append_token(cache, seq_id):
    table = cache.tables[seq_id]
    shared = [i for i, b in enumerate(table.block_ids) if cache.allocator.ref_count(b) > 1]
    if not shared or len(table.block_ids) * cache.block_size == table.num_tokens:
        return right_append_token(cache, seq_id)
    new_blocks = []
    for logical in shared:  # the mistake: full shared blocks are copied too
        old, new = table.block_ids[logical], cache.allocator.allocate()
        cache.k_cache[new] = cache.k_cache[old]
        cache.v_cache[new] = cache.v_cache[old]
        table.block_ids[logical] = new
        cache.allocator.free(old)
        new_blocks.append(new)
    table.num_tokens += 1
    return new_blocks[-1]

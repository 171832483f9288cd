"""Appending with the boundary rule alone: a token lands in a shared block, which nobody copies."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.copy_on_write"
MESSAGE = "copy it into a fresh block"


def append_token(cache, seq_id):
    table = cache.tables[seq_id]
    table.num_tokens += 1
    if table.num_tokens > len(table.block_ids) * cache.block_size:  # the mistake: sharing is ignored
        table.block_ids.append(cache.allocator.allocate())
        return table.block_ids[-1]
    return None

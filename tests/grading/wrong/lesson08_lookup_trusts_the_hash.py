"""Trusting the hash of a cached block without comparing its tokens with the prompt's."""

from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.prefix_lookup"
MESSAGE = "compare the stored token ids"


def cached_prefix(token_ids, block_size, cache):
    limit = max(0, (len(token_ids) - 1) // block_size)
    hits = []
    for h in block_hashes(token_ids, block_size)[:limit]:
        if h not in cache:  # the mistake: a hash that matches is taken as proof
            break
        hits.append(cache[h][1])
    return hits

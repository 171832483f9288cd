"""Serving every prompt token from the cache, the last one included: nothing is left to sample from."""

from paged_kv.core.prefix_cache import full_blocks
from paged_kv.reference.lesson08 import *  # every other task stays right

BREAKS = "08.prefix_lookup"
MESSAGE = "at most len(token_ids) - 1 tokens come from the cache"


def cached_prefix(token_ids, block_size, cache):
    blocks, hashes = full_blocks(token_ids, block_size), block_hashes(token_ids, block_size)
    hits = []
    for tokens, h in zip(blocks, hashes, strict=True):
        entry = cache.get(h)  # the mistake: no limit of (len(token_ids) - 1) // block_size blocks
        if entry is None or tuple(entry[0]) != tokens:
            break
        hits.append(entry[1])
    return hits

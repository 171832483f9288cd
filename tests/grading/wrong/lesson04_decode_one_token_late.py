"""A decode step that takes a block when length % block_size == 1, one token after the blocks filled
up: at a full block it takes none, and the cache's append_tokens takes the block itself, so the
closing run's log shows no new block while the usage climbs."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.decode_step"
MESSAGE = "cache.append_tokens took block 1 for it itself, so the pool's usage climbs"


def decode_step(cache, seq_ids):
    needs = {seq_id: cache.sequence_length(seq_id) % cache.block_size == 1 for seq_id in seq_ids}
    if sum(needs.values()) > cache.num_free_blocks:
        raise OutOfBlocksError(sum(needs.values()), cache.num_free_blocks)
    taken = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)
    return taken

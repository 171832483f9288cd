"""A decode step that refuses when exactly as many blocks are free as the batch needs (>= for >)."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.decode_step"
MESSAGE = "exactly"


def decode_step(cache, seq_ids):
    needs = {seq_id: cache.needs_new_block(seq_id) for seq_id in seq_ids}
    needed = sum(needs.values())
    if needed >= cache.num_free_blocks:
        raise OutOfBlocksError(needed, cache.num_free_blocks)
    taken = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)
    return taken

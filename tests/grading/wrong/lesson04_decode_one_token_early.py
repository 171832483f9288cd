"""A decode step that takes a block when (length + 1) % block_size == 0, while a slot is still free."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.decode_step"
MESSAGE = "one token early"


def decode_step(cache, seq_ids):
    needs = {seq_id: (cache.sequence_length(seq_id) + 1) % cache.block_size == 0 for seq_id in seq_ids}
    if sum(needs.values()) > cache.num_free_blocks:
        raise OutOfBlocksError(sum(needs.values()), cache.num_free_blocks)
    taken = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)
    return taken

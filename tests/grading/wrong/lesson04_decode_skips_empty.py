"""A decode step that takes a block only for a non-empty sequence whose length is a multiple of block_size."""

from paged_kv import OutOfBlocksError
from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.decode_step"
MESSAGE = "its first token needs a block"


def decode_step(cache, seq_ids):
    lengths = {seq_id: cache.sequence_length(seq_id) for seq_id in seq_ids}
    needs = {seq_id: n > 0 and n % cache.block_size == 0 for seq_id, n in lengths.items()}
    if sum(needs.values()) > cache.num_free_blocks:
        raise OutOfBlocksError(sum(needs.values()), cache.num_free_blocks)
    taken = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)
    return taken

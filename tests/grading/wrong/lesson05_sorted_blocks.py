"""The blocks gathered in sorted order of their ids, not in the order of the block table."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import gather_kv as right_gather_kv

BREAKS = "05.gather_kv"
MESSAGE = "the blocks are in sorted order"


def gather_kv(k_cache, v_cache, block_table, seq_len):
    needed = -(-seq_len // k_cache.shape[2])
    in_id_order = sorted(
        int(block) for block in block_table[:needed]
    )  # the mistake: the table's order is lost
    return right_gather_kv(k_cache, v_cache, in_id_order, seq_len)

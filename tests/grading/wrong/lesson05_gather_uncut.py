"""Every slot of the table's blocks gathered: the positions past seq_len are not cut off."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import gather_kv as right_gather_kv

BREAKS = "05.gather_kv"
MESSAGE = "the positions past seq_len are kept"


def gather_kv(k_cache, v_cache, block_table, seq_len):
    whole_blocks = len(block_table) * k_cache.shape[2]  # the mistake: should stop at seq_len
    return right_gather_kv(k_cache, v_cache, block_table, whole_blocks)

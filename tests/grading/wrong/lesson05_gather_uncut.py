"""Every slot of the table's blocks gathered: the positions past context_len are not cut off."""

from paged_kv.grading.reference.lesson05 import *  # every other task stays right
from paged_kv.grading.reference.lesson05 import gather_kv as right_gather_kv

BREAKS = "05.gather_kv"
MESSAGE = "the positions past context_len are kept"


def gather_kv(k_cache, v_cache, block_table, context_len):
    whole_blocks = len(block_table) * k_cache.shape[2]  # the mistake: should stop at context_len
    return right_gather_kv(k_cache, v_cache, block_table, whole_blocks)

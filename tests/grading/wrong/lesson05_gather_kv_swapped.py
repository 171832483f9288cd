"""K and V swapped in the gather: the pair comes back as (v, k)."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import gather_kv as right_gather_kv

BREAKS = "05.gather_kv"
MESSAGE = "K and V are swapped"


def gather_kv(k_cache, v_cache, block_table, seq_len):
    k, v = right_gather_kv(k_cache, v_cache, block_table, seq_len)
    return v, k  # the mistake

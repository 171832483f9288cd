"""Gathering both k and v from k_cache."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import gather_kv as right_gather_kv

BREAKS = "05.gather_kv"
MESSAGE = "the v you return holds K: gather v from v_cache"


def gather_kv(k_cache, v_cache, block_table, seq_len):
    k, _ = right_gather_kv(k_cache, v_cache, block_table, seq_len)
    return k, k.clone()  # the mistake: v from k_cache

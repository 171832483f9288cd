"""Gathering from the right caches but returning (v, k) instead of (k, v)."""

from paged_kv.kv.slots import read_kv as _read_kv
from paged_kv.reference.lesson03 import *  # every other task stays right

BREAKS = "03.write_read_kv"
MESSAGE = "K and V are swapped"


def read_kv(k_cache, v_cache, block_table, num_tokens):
    k, v = _read_kv(k_cache, v_cache, block_table, num_tokens)
    return v, k

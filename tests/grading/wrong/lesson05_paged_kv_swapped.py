"""K and V swapped in paged attention: v_cache is read as the keys and k_cache as the values."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import paged_decode_attention as right_paged_decode_attention

BREAKS = "05.paged_decode_attention"
MESSAGE = "K and V are swapped"


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    return right_paged_decode_attention(query, v_cache, k_cache, block_tables, seq_lens)  # the mistake

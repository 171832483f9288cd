"""The query heads counted: the cache of a grouped-query model taken as large as a multi-head one's."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.kv_bytes_per_token"
MESSAGE = "you counted the query heads"


def kv_bytes_per_token(config, bytes_per_number):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = config.num_attention_heads  # the mistake: the cache holds the K/V heads only
    return 2 * config.num_hidden_layers * heads * head_dim * bytes_per_number

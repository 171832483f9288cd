"""One layer's K and V: the layers forgotten."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.kv_bytes_per_token"
MESSAGE = "one layer only"


def kv_bytes_per_token(config, bytes_per_number):
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * num_kv_heads * head_dim * bytes_per_number  # the mistake: times num_hidden_layers is missing

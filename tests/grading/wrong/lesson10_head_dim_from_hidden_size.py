"""The head size always computed from hidden_size, even where the config gives head_dim."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.kv_bytes_per_token"
MESSAGE = "the head size comes from hidden_size // num_attention_heads although the config gives head_dim"


def kv_bytes_per_token(config, bytes_per_number):
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads  # the mistake: config.head_dim ignored
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * bytes_per_number

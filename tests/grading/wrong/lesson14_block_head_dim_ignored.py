"""Taking the head size as hidden_size // num_attention_heads even when the config gives head_dim."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.block_bytes"
MESSAGE = "use the config's head_dim when it gives one"


def block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1):
    dtype = config["torch_dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    heads = max(1, config["num_key_value_heads"] // tensor_parallel_size)
    return 2 * config["num_hidden_layers"] * heads * head_dim * block_size * DTYPE_BYTES[dtype]

"""Counting K only: one vector a token, a K/V head and a layer, where a block holds K and V."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.block_bytes"
MESSAGE = "you forgot the factor 2 of K and V"


def block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1):
    dtype = config["torch_dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = max(1, config["num_key_value_heads"] // tensor_parallel_size)
    return config["num_hidden_layers"] * heads * head_dim * block_size * DTYPE_BYTES[dtype]

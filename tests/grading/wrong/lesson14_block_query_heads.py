"""Counting the query heads, num_attention_heads, where only the K/V heads are cached."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.block_bytes"
MESSAGE = "not the query heads num_attention_heads"


def block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1):
    dtype = config["torch_dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = max(1, config["num_attention_heads"] // tensor_parallel_size)
    return 2 * config["num_hidden_layers"] * heads * head_dim * block_size * DTYPE_BYTES[dtype]

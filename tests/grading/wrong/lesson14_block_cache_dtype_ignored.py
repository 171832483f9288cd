"""Sizing the cache in the model's dtype whatever kv_cache_dtype says, so an fp8 block costs bfloat16's."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.block_bytes"
MESSAGE = "kv_cache_dtype decides the bytes of a cached number"


def block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1):
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = max(1, config["num_key_value_heads"] // tensor_parallel_size)
    return (
        2 * config["num_hidden_layers"] * heads * head_dim * block_size * DTYPE_BYTES[config["torch_dtype"]]
    )

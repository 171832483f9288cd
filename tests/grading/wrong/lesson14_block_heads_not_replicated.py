"""num_key_value_heads // tensor_parallel_size with no floor: 0 heads, 0 bytes, past one GPU a K/V head."""

from paged_kv.reference.lesson14 import *  # every other task stays right

BREAKS = "14.block_bytes"
MESSAGE = "with more GPUs than K/V heads vLLM replicates them"


def block_bytes(config, block_size=16, kv_cache_dtype="auto", tensor_parallel_size=1):
    dtype = config["torch_dtype"] if kv_cache_dtype == "auto" else kv_cache_dtype
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config["num_key_value_heads"] // tensor_parallel_size
    return 2 * config["num_hidden_layers"] * heads * head_dim * block_size * DTYPE_BYTES[dtype]

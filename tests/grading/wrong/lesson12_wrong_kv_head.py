"""Query head q reads KV head q % num_kv_heads: program kv_head takes heads kv_head + i * num_kv_heads."""

from tests.grading.wrong._kernels import wrong_kv_head as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a query head reads the wrong KV head"

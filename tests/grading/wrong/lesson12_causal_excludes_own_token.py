"""The causal mask written kv_pos < query_pos: no query sees its own token (a fresh prompt's first
token sees nothing at all)."""

from tests.grading.wrong._kernels import causal_excludes_own as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the causal mask leaves out the query's own token"

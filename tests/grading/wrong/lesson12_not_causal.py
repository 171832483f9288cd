"""No causal mask: the query tokens of a prompt or a chunk see the tokens after them in their tile."""

from tests.grading.wrong._kernels import not_causal as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the causal mask is missing"

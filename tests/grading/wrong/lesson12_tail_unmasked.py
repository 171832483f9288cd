"""Only the padding to a power of two is masked: the last block's slots past seq_len are loaded
(NaN there poisons the output)."""

from tests.grading.wrong._kernels import tail_unmasked as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the tail of the last block is not masked"

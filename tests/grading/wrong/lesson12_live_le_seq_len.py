"""The live mask written <= seq_len: the slot at position seq_len, past the sequence, is loaded
(NaN there poisons the output)."""

from tests.grading.wrong._kernels import live_le_seq_len as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the live mask lets in one slot too many: kv_pos <= seq_len"

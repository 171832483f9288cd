"""The block loop runs to tl.cdiv(kv_len, BLOCK_SIZE) - 1: the last block is never visited."""

from tests.grading.wrong._kernels import loop_one_short as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the block loop stops one block short: range(0, tl.cdiv(kv_len, BLOCK_SIZE) - 1)"

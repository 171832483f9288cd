"""The block loop runs to kv_len // BLOCK_SIZE: a partly full last block is never visited."""

from tests.grading.wrong._kernels import loop_rounds_down as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = (
    "the block loop stops one block short when the last block it needs is partly full: kv_len // BLOCK_SIZE"
)

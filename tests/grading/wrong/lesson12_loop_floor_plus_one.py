"""The block loop runs to kv_len // BLOCK_SIZE + 1: one block too many when the last block is full."""

from tests.grading.wrong._kernels import loop_floor_plus_one as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the block loop runs one block too many"
# Seen only in Triton's interpreter, which records the table entries a kernel reads.
INTERPRETED_ONLY = True

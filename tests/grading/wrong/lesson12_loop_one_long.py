"""The block loop runs to tl.cdiv(kv_len, BLOCK_SIZE) + 1: it reads the table entry past the
sequence's blocks, though its output is right (the extra block has no live slot)."""

from tests.grading.wrong._kernels import loop_one_long as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the block loop runs one block too many"
# Seen only in Triton's interpreter, which records the table entries a kernel reads.
INTERPRETED_ONLY = True

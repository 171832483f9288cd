"""The live mask written <= context_len: the slot at position context_len, past the sequence, is attended."""

from tests.grading.wrong._kernels import live_le_context_len as paged_decode_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the live mask lets in one slot too many: j * BLOCK_SIZE + slots <= context_len"

"""The live slots of a block counted from position 1: the last token of each sequence is never loaded."""

from tests.grading.wrong._kernels import off_by_one as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a token's position is off by one in the live mask"

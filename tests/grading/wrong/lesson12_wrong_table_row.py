"""A sequence's row found with the entry stride: every sequence but the first reads the first one's row."""

from tests.grading.wrong._kernels import wrong_table_row as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a block id is read from the wrong row of the table"

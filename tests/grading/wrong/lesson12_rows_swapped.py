"""A program's row r taken as query token r % GROUP and head r // GROUP: tokens and heads swapped,
some heads never computed."""

from tests.grading.wrong._kernels import rows_swapped as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a row's query token and query head are swapped"

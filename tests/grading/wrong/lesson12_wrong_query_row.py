"""Query token i of every sequence read from row i of the packed batch, not query_start + i: each
sequence meets the first sequence's queries."""

from tests.grading.wrong._kernels import wrong_query_row as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a query is read from the wrong row of the packed batch"

"""The rows masked with token <= query_len, not <: each sequence's last tile also stores the row after
its last query token, a row of the next sequence or past the batch. Triton's interpreter runs the
programs in order, so the next sequence's program overwrites the damage and the output is right; on a
GPU they race. The check sees the rows each program stores (interpreted) and the stale rows around the
output (any device)."""

from tests.grading.wrong._kernels import rows_past_query_len as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a program writes rows outside its own tile"

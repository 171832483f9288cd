"""The rows masked with rows <= QUERY_TILE * GROUP, not <: with 3 query heads per KV head a tile of 5
tokens is 15 rows padded to 16, and row 15 stores the next tile's first token, wrongly. Triton's
interpreter runs the next tile's program after, which overwrites it, so the output is right; on a GPU
the two race. Only the stores seen per program (in the interpreter) show it."""

from tests.grading.wrong._kernels import rows_le_tile as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a program writes rows outside its own tile"
INTERPRETED_ONLY = True

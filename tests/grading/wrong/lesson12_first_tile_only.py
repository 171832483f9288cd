"""Every tile takes the first QUERY_TILE query tokens of its sequence: a prompt longer than one tile
has its later tokens never computed."""

from tests.grading.wrong._kernels import first_tile_only as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "every tile computes the sequence's first query tokens"

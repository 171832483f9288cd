"""K of slot s read at slot s + 1: each score pairs the query with the next token's key."""

from tests.grading.wrong._kernels import k_slot_plus_one as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "K is read one slot after its own"

"""V of slot s read at slot s + 1: each weight multiplies the next token's value."""

from tests.grading.wrong._kernels import v_slot_plus_one as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "V is read one slot after its own"

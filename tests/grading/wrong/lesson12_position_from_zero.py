"""A query's position counted from 0: query token i sits at i, not at context_len + i after the
sequence's cached tokens (a decode sees only position 0)."""

from tests.grading.wrong._kernels import position_from_zero as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "a query's position is counted from 0"

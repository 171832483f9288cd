"""The running maximum is updated, but the running total and acc are not multiplied by exp(m_old - m_new)."""

from tests.grading.wrong._kernels import max_not_rescaled as paged_attention_kernel

BREAKS = "12.paged_decode_kernel"
MESSAGE = "the running maximum is not rescaled"

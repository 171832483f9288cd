"""Exercise 12 graded on the package: ``paged_attention_kernel`` is the package's own kernel,
:func:`paged_kv.attention.triton_kernel.paged_attention_kernel`, whose module imports Triton through
:mod:`paged_kv.attention.triton_language`, as an exercise notebook does (in its interpreter where
there is no GPU).
"""

from paged_kv.attention.triton_kernel import paged_attention_kernel

__all__ = ["paged_attention_kernel"]

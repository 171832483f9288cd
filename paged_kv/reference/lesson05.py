"""Exercise 05 graded on the package: ``gather_kv`` and ``decode_attention`` are the one-sequence
functions of :mod:`paged_kv.attention.paged` (reading K/V through a block table, and attention of one query
over them), which share their gather and their attention with ``paged_attention``; and
``paged_decode_attention`` is ``paged_kv.attention.paged.paged_attention`` itself, the batched, masked
version (its extra ``scale`` argument keeps its default, ``1 / sqrt(head_dim)``). They are bound
here at import, so the checks, which make ``paged_kv.attention.paged``'s functions raise while a learner's
code runs (the package's answer is not the learner's own), still grade the package through them.
"""

from paged_kv.attention.paged import decode_attention, gather_kv
from paged_kv.attention.paged import paged_attention as paged_decode_attention

__all__ = ["decode_attention", "gather_kv", "paged_decode_attention"]

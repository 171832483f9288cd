"""Attention over the paged cache (decode, prefill, a packed step): gather, in place, FlexAttention,
Triton (lessons 05, 06, 12).

The package's face: ``from paged_kv.attention import paged_attention`` works; each name lives in
:mod:`paged_kv.attention.paged` (patch it there).
"""

from paged_kv.attention.paged import (
    STRATEGIES,
    decode_attention,
    gather_kv,
    paged_attention,
    paged_attention_varlen,
    paged_prefill_attention,
)

__all__ = [
    "STRATEGIES",
    "decode_attention",
    "gather_kv",
    "paged_attention",
    "paged_attention_varlen",
    "paged_prefill_attention",
]

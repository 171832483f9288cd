"""Attention over the paged cache (lessons 05, 06, 12): the backends, their registry, and the
lessons' functions.

The package's face: ``from paged_kv.attention import paged_attention`` works; each name lives in
its own module (patch it there): the lessons' functions in :mod:`paged_kv.attention.paged`, the
backends' base and the layer's cache in :mod:`paged_kv.attention.backend`, the step's metadata in
:mod:`paged_kv.attention.metadata`, the names and the platform's default in
:mod:`paged_kv.attention.registry`.
"""

from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.attention.paged import (
    decode_attention,
    gather_kv,
    paged_attention,
    paged_attention_varlen,
    paged_prefill_attention,
)
from paged_kv.attention.registry import ATTENTION_BACKENDS, attention_backend, default_backend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionImpl",
    "AttentionMetadata",
    "LayerKVCache",
    "attention_backend",
    "decode_attention",
    "default_backend",
    "gather_kv",
    "paged_attention",
    "paged_attention_varlen",
    "paged_prefill_attention",
]

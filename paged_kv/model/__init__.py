"""The tiny GPT, its two KV caches and greedy generation (lesson 09).

The package's face: ``from paged_kv.model import TinyGPT, generate`` works as ``from paged_kv import ...``
does; each name lives in one module below.
"""

from paged_kv.model.attend import causal_attention
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import GenerationResult, generate, is_token
from paged_kv.model.kv_cache import ContiguousKVCache, KVCache, PagedKVCache
from paged_kv.model.tiny_gpt import DecoderLayer, TinyGPT, decode, encode

__all__ = [
    "ContiguousKVCache",
    "DecoderLayer",
    "GPTConfig",
    "GenerationResult",
    "KVCache",
    "PagedKVCache",
    "TinyGPT",
    "causal_attention",
    "decode",
    "encode",
    "generate",
    "is_token",
]

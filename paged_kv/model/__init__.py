"""The tiny GPT, Hugging Face models on the paged cache, the two KV caches and greedy generation (lesson 09).

The package's face: ``from paged_kv.model import TinyGPT, generate`` works as ``from paged_kv import ...``
does; each name lives in one module below.
"""

from paged_kv.attention.contiguous import causal_attention
from paged_kv.model.causal_lm import CausalLM, as_causal_lm
from paged_kv.model.config import GPTConfig, LayerAttention
from paged_kv.model.generation import GenerationResult, generate, is_token
from paged_kv.model.hf import SUPPORTED_ARCHITECTURES, HFCausalLM
from paged_kv.model.hub import load_model
from paged_kv.model.kv_cache import ContiguousKVCache, KVCache, PagedKVCache
from paged_kv.model.tiny_gpt import DecoderLayer, TinyGPT, decode, encode

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ContiguousKVCache",
    "DecoderLayer",
    "GPTConfig",
    "GenerationResult",
    "HFCausalLM",
    "KVCache",
    "LayerAttention",
    "PagedKVCache",
    "TinyGPT",
    "as_causal_lm",
    "causal_attention",
    "decode",
    "encode",
    "generate",
    "is_token",
    "load_model",
]

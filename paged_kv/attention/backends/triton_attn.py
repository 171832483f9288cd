"""``TRITON_ATTN``: the course's Triton kernel, one launch for a whole step (lessons 06, 12).

The kernel (:mod:`paged_kv.attention.triton_kernel`, which lesson 12 writes) walks each request's
block table itself, one program per (request, KV head, tile of query tokens), with an online
softmax; :func:`~paged_kv.attention.triton_decode.triton_attention` launches it over the step's
``seq_lens`` and ``query_start_loc``, its grid sized by ``max_query_len``, so the launch reads
nothing back from the device. It is compiled on CUDA and runs in Triton's interpreter on the CPU
(with ``TRITON_INTERPRET=1`` set before triton is first imported), where it is for checking, not for
speed. It reads float32, float16, bfloat16 and fp8 caches, of any strides (a permuted view of vLLM's
cache is read in place). vLLM 0.33.0: ``TritonAttentionImpl.forward`` in
``vllm/v1/attention/backends/triton_attn.py`` calls ``unified_attention``
(``vllm/v1/attention/ops/triton_unified_attention.py``) the same way.
"""

from __future__ import annotations

import torch

from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.attention.triton_decode import (
    KERNEL_DTYPES,
    triton_attention,
    triton_available,
    triton_interpreted,
)
from paged_kv.kv.fp8 import is_fp8


class TritonAttentionImpl(AttentionImpl):
    """The Triton kernel over the step (see the module); its errors say why it cannot run here."""

    name = "TRITON_ATTN"

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
        if not triton_available():
            return "TRITON_ATTN needs the triton package (Linux wheels only): it is not installed"
        if cache_dtype not in KERNEL_DTYPES and not is_fp8(cache_dtype):
            return f"TRITON_ATTN reads float32, float16, bfloat16 and fp8 caches, not {cache_dtype}"
        if device.type != "cuda" and not triton_interpreted():
            return f"TRITON_ATTN compiles for CUDA and runs on {device.type} only in Triton's interpreter"
        if (
            cache_dtype == torch.float8_e4m3fn
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)
        ):
            return "TRITON_ATTN reads float8_e4m3fn on GPUs of compute capability 8.9 or later, as vLLM's"
        return ""

    def _attend(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return triton_attention(
            query,
            kv_cache.k_cache,
            kv_cache.v_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.logits_soft_cap,
            k_scale=kv_cache.k_scale,
            v_scale=kv_cache.v_scale,
        )

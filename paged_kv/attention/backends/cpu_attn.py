"""``CPU_ATTN``: a C kernel that reads the blocks in place, at about the speed of contiguous attention,
on the CPU (lessons 05, 06).

vLLM runs its own C++ kernels on the CPU (``CPU_ATTN``, ``vllm/v1/attention/backends/cpu_attn.py``,
``cpu_attention_with_kv_cache``); this is the course's, in about 250 lines of C
(``paged_kv/attention/csrc/cpu_attn.c``), compiled once with the machine's compiler
(:mod:`paged_kv.attention.cpu_build`) and called through ctypes on the tensors' memory. One call
computes the whole step: one task per (request, KV head, tile of query tokens), spread over torch's
intra-op threads with OpenMP when the step is large enough to pay for them; each task walks its
request's block table with an online softmax in float32, reading each block where it lies, only
the slots its queries see, and prefetching the next block. The cost is one pass over the K/V the
step reads, as for ``scaled_dot_product_attention`` over contiguous tensors (``bench/bench_attention.py``
measures the two side by side).

It takes float32, float16 and bfloat16 queries (computed in float32, returned in the query's
dtype) over float32, float16, bfloat16 and fp8 caches (``float8_e4m3fn``, ``float8_e5m2``), all read
in place: float32 as it is, the others converted to float32 block by block as they are read (an fp8
cache's ``k_scale`` folded into the score scale, its ``v_scale`` into the output, as the Triton
kernel does). It refuses float64 (the kernel computes in float32; ``GATHER`` keeps float64) and
tensors off the CPU. Where no C compiler is found it cannot run, and says why
(:func:`~paged_kv.attention.cpu_build.unavailable_reason`); the platform default then is ``GATHER``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.cpu_build import cpu_kernel, unavailable_reason
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.kv.fp8 import fp8_dtypes

#: The query dtypes it takes; it computes in float32.
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The kernel's ``cache_kind`` of each cache dtype it reads (see the C source).
CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2} | {dtype: 3 for dtype in fp8_dtypes()}
#: Below this much work (query tokens x positions x heads x head_dim), one thread: OpenMP's hand-off
#: costs more than it saves on the small steps of a tiny model.
PARALLEL_WORK = 1 << 20


class CPUAttentionImpl(AttentionImpl):
    """The compiled kernel over the step (see the module). vLLM 0.33.0: ``CPUAttentionBackendImpl``."""

    name = "CPU_ATTN"

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
        if device.type != "cpu":
            return f"CPU_ATTN runs on CPU tensors, not on {device.type}"
        if dtype not in QUERY_DTYPES:
            return f"CPU_ATTN computes in float32 for float32, float16 and bfloat16 queries, not {dtype}"
        if cache_dtype not in CACHE_KINDS:
            return f"CPU_ATTN reads float32, float16, bfloat16 and fp8 caches, not {cache_dtype}"
        reason = unavailable_reason()
        return f"CPU_ATTN cannot be built here: {reason}" if reason else ""

    def _attend(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache.k_cache, kv_cache.v_cache
        reason = self.unavailable(query.device, query.dtype, k_cache.dtype)
        if reason:
            raise ValueError(reason)
        q = query.to(torch.float32).contiguous()
        out = torch.empty(q.shape, dtype=torch.float32)
        table = metadata.block_table.to(torch.int32)
        if table.stride(1) != 1:
            table = table.contiguous()
        seq_lens = metadata.seq_lens.to(torch.int32).contiguous()
        starts = metadata.query_start_loc.to(torch.int32).contiguous()
        kind = CACHE_KINDS[k_cache.dtype]
        lut = _lookup_table(k_cache.dtype)
        work = metadata.num_tokens * table.shape[1] * kv_cache.block_size * self.num_heads * self.head_size
        failed = cpu_kernel()(
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            kind,
            None if lut is None else lut.data_ptr(),
            (ctypes.c_int64 * 4)(*k_cache.stride()),
            (ctypes.c_int64 * 4)(*v_cache.stride()),
            table.data_ptr(),
            table.stride(0),
            seq_lens.data_ptr(),
            starts.data_ptr(),
            metadata.num_reqs,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            kv_cache.block_size,
            self.scale * kv_cache.k_scale,
            kv_cache.v_scale,
            self.sliding_window or 0,
            self.logits_soft_cap or 0.0,
            torch.get_num_threads() if work >= PARALLEL_WORK else 1,
        )
        if failed:
            raise MemoryError("CPU_ATTN could not allocate its work buffers")
        return out if query.dtype == torch.float32 else out.to(query.dtype)


@functools.cache
def _lookup_table(dtype: torch.dtype) -> torch.Tensor | None:
    """The float32 value of every bit pattern of a float16 or fp8 ``dtype`` (65,536 or 256 numbers,
    indexed by the pattern read as an unsigned integer); ``None`` for float32 and bfloat16, which
    the kernel converts itself."""
    if dtype in (torch.float32, torch.bfloat16):
        return None
    bits, signed = (16, torch.int16) if dtype == torch.float16 else (8, torch.int8)
    patterns = torch.arange(1 << bits, dtype=torch.int32)
    as_signed = (patterns - (patterns >= 1 << (bits - 1)).int() * (1 << bits)).to(signed)
    return as_signed.view(dtype).to(torch.float32)

"""Paged attention as a Triton kernel that does the address translation itself, for decodes and
prompt chunks packed in one launch (lessons 05, 12).

Lesson 05 computes paged attention with PyTorch operations: gather the blocks, or read them in place
with batched products. Lesson 12 writes the kernel a real engine runs instead: it is handed the
whole cache and the block tables, and each program finds its sequence's tokens itself, lesson 03's
translation done in pointer arithmetic (token ``p`` is offset ``p % block_size`` of block
``block_tables[b, p // block_size]``), and combines the blocks with lesson 05's online softmax.
The kernel's source is :func:`paged_kv.attention.triton_kernel.paged_attention_kernel`; this module
launches it: :func:`triton_attention` for a packed batch of any number of query tokens per sequence,
decodes (one query token each) and chunks alike: the ``TRITON_ATTN`` backend's work
(:mod:`paged_kv.attention.backends.triton_attn`).

One program runs per (sequence, KV head, tile of query tokens), ``grid = (batch, num_kv_heads,
ceil(max_query_len / QUERY_TILE))``, and handles the ``num_heads // num_kv_heads`` query heads that
read its KV head (query head ``q`` reads KV head ``q // (num_heads // num_kv_heads)``,
:mod:`paged_kv.attention.heads`) for up to ``QUERY_TILE`` query tokens, causal inside its
sequence. So each block's K and V are loaded once per KV head and tile and met by every (query
token, query head) row of it; a program per query head and token would load them once per row.

The kernel takes every tensor's strides, so it reads any view of the cache whose axes are
``(num_blocks, num_kv_heads, block_size, head_dim)``: this course's layout, contiguous, and vLLM
v1's, without a copy. In vLLM 0.33.0 an attention backend receives one tensor per layer, a view
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` of memory laid out ``(num_blocks,
block_size, num_kv_heads, 2 * head_size)`` (``KVCacheLayout`` in ``vllm/v1/kv_cache_layout.py``):
the first ``head_size`` numbers of its last axis are K, the rest V, and both halves are read in
place through their strides.

Where vLLM's Triton attention lives (vLLM 0.33.0): ``vllm/v1/attention/backends/triton_attn.py``
is the ``TRITON_ATTN`` backend. Its ``TritonAttentionImpl.forward`` splits the layer's cache into
``key_cache`` and ``value_cache`` and calls ``unified_attention`` from
``vllm/v1/attention/ops/triton_unified_attention.py`` with ``cu_seqlens_q`` (the step's
``query_start_loc``), ``seqused_k`` (``seq_lens``) and ``max_seqlen_q``; it launches
``kernel_unified_attention`` on ``grid = (total_num_q_blocks, num_kv_heads)``: one program per
(block of ``BLOCK_Q`` query tokens, KV head), its ``BLOCK_M`` rows the (query token, query head)
pairs of that block, prefill chunks and decodes in the same launch. The first axis counts every
sequence's query blocks at once, ``q.shape[0] // BLOCK_Q + num_seqs`` (an upper bound that needs no
length from the device), and a program finds its sequence by a binary search over the query starts
(``find_seq_idx`` in ``vllm/v1/attention/ops/triton_attention_helpers.py``); this launcher has a
sequence axis instead, sized by ``max_query_len``, and lets the programs past a sequence's query
tokens return. vLLM's kernel loads the physical block id of each tile of keys from the block table,
computes the K/V offsets from the cache's four strides, keeps a running maximum ``M``, sum ``L`` and
accumulator ``acc`` in float32, and adds ALiBi and a split of long contexts into segments
(``IS_3D``), which this kernel leaves out. Sliding windows and soft-capping this kernel
has too, as trailing constexprs (``SLIDING_WINDOW``, ``SOFTCAP``; vLLM's kernel takes
``SLIDING_WINDOW`` and ``USE_SOFTCAP`` constexprs): the launcher passes them only when a window or
a cap is asked for, so a kernel written without them (lesson 12's exercise) launches as before.

**fp8 caches** (lesson 10: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``) the kernel reads as
they are: a load takes its element type from the pointer, and ``.to(tl.float32)`` converts fp8 as
it converts 16-bit numbers, compiled and in Triton's interpreter alike (``tests/test_fp8.py`` runs
it there); compiled, e4m3 needs a GPU of compute capability 8.9 or later, as vLLM's Triton backend
does (``TritonAttentionImpl`` refuses fp8 below it). The per-tensor scales take no parameter of the
kernel, whose signature stays the one lesson 12's exercise writes: ``k_scale`` is folded into the
score scale it is given, ``scale * k_scale`` (the scores of ``stored * k_scale`` are ``scale *
k_scale * q · stored``), and the output, linear in V, is multiplied by ``v_scale`` after the launch
(the kernel then writes float32, for a query of another dtype). vLLM's kernel folds them the same
way when its queries are fp8 too (``score_scale`` and ``value_scale`` in
``kernel_unified_attention``); with 16-bit queries it multiplies each tile of K and V instead
(``_cast_kv_tile``).

Triton is optional: ``import paged_kv`` never imports it, and :func:`triton_available` says
whether it is installed. On CUDA the kernel is compiled. On the CPU it runs in Triton's
interpreter, which executes it with numpy, when ``TRITON_INTERPRET=1`` was in the environment
when triton was first imported: ``triton.jit`` reads the variable when it is called, and
``triton.language`` calls it on its own helpers at its import, so the mode is fixed then, for the
process (:func:`triton_interpreted` says which). This module imports triton only on the first call,
and makes the kernel then.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from paged_kv.kv.fp8 import is_fp8

#: The query and float cache dtypes the kernel reads; it accumulates in float32 whatever the dtype.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_available() -> bool:
    """Whether the triton package can be imported here (it publishes Linux wheels only)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter in this process (False where it is not installed).

    ``triton.jit`` reads ``TRITON_INTERPRET`` when it is called, and ``triton.language`` calls it on
    its own helpers (``tl.zeros``, ``tl.cdiv``, ...) when it is imported: so the mode is fixed, for
    the whole process, by the variable at triton's first import, and the type of a helper tells it.
    """
    if not triton_available():
        return False
    import triton
    import triton.language as tl

    return not isinstance(tl.zeros, triton.JITFunction)


def triton_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float | None,
    kernel: Callable | None = None,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Paged attention of checked inputs (:class:`~paged_kv.attention.metadata.AttentionMetadata`)
    with the Triton kernel: any number of query tokens per sequence, causal inside a chunk, decodes
    and chunks in one launch.

    ``query`` is ``(num_tokens, num_heads, head_dim)`` in the caches' dtype, one of
    :data:`KERNEL_DTYPES` (or over caches of an fp8 dtype, with their checked scales ``k_scale`` and
    ``v_scale``: see the module), the query tokens of sequence ``b`` being rows ``query_start_loc[b] ..
    query_start_loc[b + 1] - 1``; ``k_cache`` and ``v_cache`` have the axes ``(num_blocks, num_kv_heads,
    block_size, head_dim)`` with any strides (a permuted view of vLLM's cache is read in place),
    ``num_kv_heads`` dividing ``num_heads``; ``block_tables`` is ``(batch, max_blocks)`` of any integer
    dtype whose first ``ceil(seq_lens[b] / block_size)`` entries of row ``b`` are valid block ids;
    ``seq_lens`` holds each sequence's tokens, its query tokens included (at least its query length),
    and ``query_start_loc`` ``(batch + 1,)`` starts at 0 and never decreases, both integer tensors on
    the query's device; ``max_query_len`` is at least the longest query length (a host integer: it sizes
    the grid, so the launch reads nothing back from the device). Returns ``(num_tokens, num_heads,
    head_dim)`` in the query's dtype, computed in float32.

    The grid is ``(batch, num_kv_heads, ceil(max_query_len / QUERY_TILE))``: program ``(seq,
    kv_head, tile)`` takes ``QUERY_TILE`` query tokens of sequence ``seq`` (1 for a batch of
    decodes; else as many as fit 16 rows of (token, query head), as vLLM's ``BLOCK_M`` of 16), and
    a program whose tile is past its sequence's query tokens returns at once.

    ``kernel`` is the plain function to launch, made a kernel by ``triton.jit`` on first use: by
    default :func:`~paged_kv.attention.triton_kernel.paged_attention_kernel`; lesson 12's exercise
    passes the learner's, which takes the same arguments. ``out``, when given, is the tensor the
    kernel writes (the query's shape and dtype, as vLLM's ``unified_attention`` takes its ``out``);
    lesson 12's check fills it with NaN first, so a row a kernel never stores shows.

    ``sliding_window`` (an int of at least 1) and ``softcap`` (a positive float), checked by
    :class:`~paged_kv.attention.backend.AttentionImpl`, reach the kernel as its trailing constexprs
    ``SLIDING_WINDOW`` and ``SOFTCAP``, each only when given: a kernel without those parameters
    (lesson 12's) launches as before when neither is asked for. Each value is a constexpr, so each
    compiles a kernel of its own (once per model, as a model has one window and one cap).

    Raises:
        ValueError: Triton is not installed; the caches' dtype is neither one of
            :data:`KERNEL_DTYPES` nor fp8; ``TRITON_INTERPRET`` has changed since triton was
            imported; the tensors are not on CUDA and Triton is not in interpreter mode (see
            :func:`triton_interpreted`); or a ``sliding_window`` or ``softcap`` is asked of a
            ``kernel`` that lacks the parameter (the message names the argument).
    """
    if not triton_available():
        raise ValueError("TRITON_ATTN needs the triton package (Linux wheels only): it is not installed")
    import triton

    if k_cache.dtype not in KERNEL_DTYPES and not is_fp8(k_cache.dtype):
        names = ", ".join(str(d).removeprefix("torch.") for d in KERNEL_DTYPES)
        raise ValueError(f"TRITON_ATTN reads {names} caches and fp8 ones, got {k_cache.dtype}")
    interpret = triton_interpreted()
    if triton.knobs.runtime.interpret != interpret:
        raise ValueError(
            f"TRITON_INTERPRET has changed since triton was imported (the interpreter was "
            f"{'on' if interpret else 'off'} then): Triton's mode is fixed when it is first imported, so "
            "set the variable before that (in a notebook, restart the kernel)"
        )
    if query.device.type != "cuda" and not interpret:
        raise ValueError(
            f"TRITON_ATTN compiles for CUDA; on {query.device.type} tensors it runs in Triton's "
            "interpreter only: set TRITON_INTERPRET=1 in the environment before triton is first imported"
        )
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    num_heads = query.shape[1]
    batch = block_tables.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    scale = head_dim**-0.5 if scale is None else scale
    # An fp8 cache's scales: k_scale folded into the score scale, v_scale applied to the output
    # (the weighted sum of V is linear in V), computed in float32 for a query of another dtype.
    target = out
    if v_scale != 1.0 and out.dtype != torch.float32:
        target = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    query_tile = query_tile_for(max_query_len, group)
    if kernel is None:
        from paged_kv.attention.triton_kernel import paged_attention_kernel as kernel
    extras = _extras(kernel, sliding_window, softcap)  # checked even when there is nothing to compute
    if not out.numel() or not batch:
        return out
    _jit(kernel)[(batch, num_kv_heads, triton.cdiv(max_query_len, query_tile))](
        target,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens.contiguous(),
        query_start_loc.contiguous(),
        scale * k_scale,
        *target.stride(),
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        GROUP=group,
        QUERY_TILE=query_tile,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        ROWS_PADDED=triton.next_power_of_2(query_tile * group),
        BLOCK_PADDED=triton.next_power_of_2(block_size),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        **extras,
    )
    if v_scale != 1.0:
        if target is out:
            out.mul_(v_scale)
        else:
            out.copy_(target.mul_(v_scale))
    return out


def _extras(kernel: Callable, sliding_window: int | None, softcap: float | None) -> dict[str, object]:
    """The trailing constexprs to pass ``kernel``, each only when asked for: ``SLIDING_WINDOW`` and
    ``SOFTCAP``; a ``ValueError`` naming the argument when ``kernel`` has no such parameter."""
    asked = {"sliding_window": ("SLIDING_WINDOW", sliding_window), "softcap": ("SOFTCAP", softcap)}
    extras = {name: value for name, value in asked.values() if value is not None}
    parameters = inspect.signature(kernel).parameters if extras else {}
    for argument, (name, value) in asked.items():
        if value is not None and name not in parameters:
            raise ValueError(
                f"{argument} needs a kernel with the trailing constexpr parameter {name}, and "
                f"{getattr(kernel, '__name__', kernel)} has none (the package's paged_attention_kernel "
                "has it; lesson 12's computes full attention, without a soft cap)"
            )
    return extras


#: The rows of (query token, query head) a program of several query tokens takes, as vLLM's
#: ``BLOCK_M``: ``QUERY_TILE = ROWS // GROUP`` tokens (at least 1).
ROWS = 16


def query_tile_for(max_query_len: int, group: int) -> int:
    """The query tokens per program: 1 for decodes (``max_query_len <= 1``), else ``ROWS // group``
    (at least 1), no more than ``max_query_len`` rounded up to a power of two."""
    if max_query_len <= 1:
        return 1
    return max(1, min(ROWS // group, 1 << (max_query_len - 1).bit_length()))


@functools.cache
def _jit(kernel: Callable) -> Callable:
    """``kernel`` made a kernel by ``triton.jit``, once per function and process, in the process's one
    mode (the caller checked that ``TRITON_INTERPRET`` still says what it said when triton was imported)."""
    import triton

    return triton.jit(kernel)

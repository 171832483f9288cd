"""Paged attention: decode (one query token per sequence), prefill and a whole engine step of both,
attending to K/V kept in blocks.

The kernel never sees a contiguous K or V. It follows each sequence's block table: logical block
``j`` of sequence ``b`` is physical block ``block_tables[b, j]`` of the cache, so token ``p`` sits
at offset ``p % block_size`` of block ``block_tables[b, p // block_size]``. This module is the
reference implementation the course builds in lesson 05: it gathers every sequence's blocks with
advanced indexing, then runs ordinary attention with the positions past ``context_len`` masked out.
A fast kernel such as vLLM's computes the same thing while reading the blocks in place, without the
gathered copy; :mod:`paged_kv.attention.triton_decode` is such a kernel, in Triton (lesson 12).

The two halves are public for one sequence as well: :func:`gather_kv` reads a sequence's K and V
through its block table into contiguous tensors, and :func:`decode_attention` is the attention of
one query token over them. :func:`paged_attention` does both for a whole batch at once, with the
same gather and the same attention. :func:`paged_prefill_attention` is the prefill counterpart:
several new tokens per sequence, packed, each attending causally to its sequence's tokens up to its
own position. :func:`paged_attention_varlen` is the same attention in vLLM's words, for an engine
step: the packed batch described by ``query_start_loc`` and ``seq_lens``, decodes and prompt chunks
mixed, one call per layer.

**The invariants of the packed batch** (what :func:`paged_prefill_attention` and
:func:`paged_attention_varlen` check, and every strategy relies on): sequence ``b`` holds
``seq_lens[b]`` tokens (the package's ``context_lens``), at least 1, in the first
``ceil(seq_lens[b] / block_size)`` entries of its table row; its ``query_lens[b]`` query tokens,
``0 .. seq_lens[b]`` of them, are its last ones, rows ``query_start_loc[b] .. query_start_loc[b +
1] - 1`` of ``query`` (``query_start_loc`` is ``0`` then the running sum of ``query_lens``); query
token ``i`` of sequence ``b`` is at position ``seq_lens[b] - query_lens[b] + i`` and sees positions
``0`` through its own, and its K/V are already in the cache. A decode is a sequence with one query
token, a fresh prompt one whose query tokens are all its tokens, a chunk anything in between.

Two options of every function and strategy serve hybrid models (Mistral, Qwen2, Gemma 2 and 3). A
**sliding window** of ``W`` tokens (``sliding_window=W``): the query token at position ``p`` sees
positions ``max(0, p - W + 1) .. p`` only, and a sequence's table entries wholly before the window
of its first query token take no part, whatever block they name (an engine's sliding-window layer
puts its null block there once those blocks fall out of the window): no strategy's output depends on
what those blocks hold, NaN included. A **soft cap** ``c`` (``softcap=c``, Gemma 2's attention logit
soft-capping): each score ``s = scale * q · k`` becomes ``c * tanh(s / c)`` before the mask.

Every function and strategy reads an **fp8 cache** too (lesson 10): ``k_cache`` and ``v_cache`` of
``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, any float query, and the cache's per-tensor
scales ``k_scale`` and ``v_scale`` (keywords, 1.0 by default; a float cache's must be 1.0). The
result is the attention, in the query's dtype, over the dequantized cache, ``stored * scale`` cast to
the query's dtype (:func:`~paged_kv.kv.fp8.dequantize`, vLLM's ``_cast_kv_tile``). ``"gather"``
dequantizes the blocks it gathers, after the gather (one byte a number moved, not four);
``"in_place"`` and ``"auto"`` gather an fp8 cache, as they gather a half-precision one (they compute
in the caches' dtype, and no product runs in fp8 here); ``"flex"`` dequantizes the keys it runs
over (the pool, or the copy of the windows' blocks); ``"triton"``'s kernel loads the fp8 bytes and
converts them as it converts any cache, with ``k_scale`` folded into the score scale and ``v_scale``
applied to its output (:mod:`paged_kv.attention.triton_decode`).

Every function takes grouped-query attention. In GQA, ``num_heads`` query heads share
``num_kv_heads`` K/V heads in equal groups (Llama-3-8B: 32 over 8), so the cache holds only the
K/V heads; multi-query attention (MQA) is the extreme case of a single K/V head shared by all, and
ordinary multi-head attention the case of equal counts. Query head ``h`` reads K/V head
``h // (num_heads // num_kv_heads)``, the pairing of Hugging Face's ``repeat_kv`` and of SDPA's
``enable_gqa=True``; the kernels view the queries as ``(num_kv_heads, group)`` and let the
products broadcast over the group, so K and V are never copied once per query head. vLLM's
kernels take the two counts too: in ``vllm/v1/attention/backends/flash_attn.py``,
``FlashAttentionImpl`` is built with ``num_heads`` and ``num_kv_heads``, its queries are
``[num_tokens, num_heads, head_size]`` over one cache tensor per layer, ``[num_blocks,
num_kv_heads, block_size, 2 * head_size]`` (K and V side by side in the last axis; vLLM 0.33.0),
and ``num_queries_per_kv = num_heads // num_kv_heads``. Its ``forward`` hands the step's packed
batch to one varlen call with ``cu_seqlens_q = attn_metadata.query_start_loc``, ``seqused_k =
attn_metadata.seq_lens`` and ``max_seqlen_q = attn_metadata.max_query_len``, as the Triton backend
(``vllm/v1/attention/backends/triton_attn.py``, ``TritonAttentionImpl.forward``) hands them to
``unified_attention``; the fields come from ``CommonAttentionMetadata``
(``vllm/v1/attention/backend.py``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from paged_kv.attention.flex import flex_decode, flex_varlen
from paged_kv.attention.triton_decode import triton_attention, triton_decode
from paged_kv.core.block import blocks_for_tokens
from paged_kv.kv.fp8 import check_scale, dequantize, is_fp8
from paged_kv.validate import check_count

STRATEGIES = ("auto", "gather", "in_place", "flex", "triton")


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
    *,
    strategy: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention for a batch of sequences whose K/V live in a paged cache.

    Args:
        query: ``(batch, num_heads, head_dim)``, the new token of each sequence.
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``, with ``num_kv_heads``
            dividing ``num_heads`` (equal: multi-head; fewer: grouped-query; one: multi-query).
            Query head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``. In the query's
            dtype, or both of one fp8 dtype (see ``k_scale``).
        block_tables: ``(batch, max_blocks)`` integer tensor of physical block ids; entries past
            the blocks a sequence needs are padding (``-1`` by convention, any value works).
        context_lens: ``(batch,)`` integers, the tokens each sequence holds, each in
            ``1 .. needed_blocks * block_size`` where its first ``needed_blocks`` entries are valid.
        scale: the factor applied to ``q · k``; defaults to ``1 / sqrt(head_dim)``.
        strategy: how the blocks are read, with the same result either way.
            ``"gather"`` copies each sequence's blocks into a contiguous batch first (the
            reference). ``"in_place"`` reads the cache where it lies, block by block in physical
            order, with the query of the one row that reads each block; blocks read by several rows
            (after a fork, or from a prefix cache) are copied once each and met by every row's query
            at once. It computes in the caches' dtype, so half-precision and fp8 caches are gathered
            instead.
            ``"auto"`` (default) reads in place when the caches are in the compute dtype, the batch
            reads at least half the pool, and shared blocks, if any, are read by at least a quarter
            of the rows on average; it gathers otherwise. ``"flex"``
            runs FlexAttention over the whole pool with a block mask built from the tables
            (:mod:`paged_kv.attention.flex`; torch 2.5 or later): compiled into one kernel on CUDA, unfused
            and slow elsewhere. ``"triton"`` runs this course's Triton kernel, one program per
            (sequence, KV head) walking its block table with an online softmax
            (:mod:`paged_kv.attention.triton_decode`; the triton package, Linux only): compiled on
            CUDA, in Triton's interpreter on the CPU (``TRITON_INTERPRET=1`` in the environment
            before triton is imported); it reads float32, float16, bfloat16 and fp8 caches, and
            caches of any strides, such as a permuted view of vLLM's. ``"auto"`` never picks
            ``"flex"`` or ``"triton"``.
        k_scale, v_scale: an fp8 cache's per-tensor scales, positive finite numbers: it holds ``K /
            k_scale`` and ``V / v_scale`` (vLLM's ``layer._k_scale``, ``layer._v_scale``), and every
            strategy attends over ``stored * scale``, cast to the query's dtype. A float cache's
            are 1.0 (the default).
        sliding_window: ``None`` (the default) for full attention, or ``W``, an integer of at least
            1, for a sliding window of ``W`` tokens: row ``b``'s query, at position ``p =
            context_lens[b] - 1``, sees positions ``max(0, p - W + 1) .. p``, its sequence's last
            ``W`` tokens, itself included (Hugging Face's ``kv_idx > q_idx - sliding_window``, vLLM's
            FlashAttention ``window_size=(W - 1, 0)``). The blocks wholly before the window take no
            part: their entries must still be block ids below ``num_blocks``, but any (an engine
            puts its null block there, or leaves the ids of blocks since given to other sequences),
            holding anything, NaN included. Every strategy skips them: ``"gather"`` copies only the
            blocks of the windows, ``"in_place"`` meets only those with the queries, ``"flex"`` runs
            over a copy of them alone, and ``"triton"``'s programs start their block loop at the
            window. ``"auto"`` chooses by its rule above, counting the blocks of the windows only.
        softcap: ``None`` (the default), or a positive finite number ``c``: each score ``s = scale
            * q · k`` becomes ``c * tanh(s / c)`` before the masking and the softmax, so no score
            leaves ``[-c, c]`` (Gemma 2's soft-capping of the attention logits, as Hugging Face's
            eager attention applies it).

    Returns:
        ``(batch, num_heads, head_dim)``, with the dtype and device of ``query``. Row ``b`` equals
        contiguous attention of ``query[b]`` over the first ``context_lens[b]`` tokens of its
        sequence (its last ``sliding_window`` of them, with a window), their K/V repeated along the
        head axis to ``num_heads`` heads (``repeat_interleave(num_heads // num_kv_heads)``), the
        scores soft-capped when ``softcap`` is given; over an fp8 cache, its K/V dequantized.
        Half and bfloat16 inputs are computed in float32 and cast back.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device (among them caches whose
            heads do not divide ``num_heads`` or whose head_dim differs from ``query``'s, float
            caches of another dtype than the query's, or an fp8 query), or a context
            length is below 1 or needs blocks its row does not hold (the message names the argument);
            or the strategy cannot run here (``"flex"`` on a torch before 2.5; ``"triton"`` without
            the triton package, on a dtype it does not read, off CUDA without Triton's interpreter,
            or with ``TRITON_INTERPRET`` changed since triton was imported); or ``sliding_window`` is
            not an integer of at least 1 (a bool is refused), or ``softcap`` not a positive finite
            number, or a scale not a positive finite number, or not 1.0 for a float cache (the
            message names the argument).
    """
    context_lens, _, _ = _check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    _check_strategy(strategy)
    window, softcap = _check_window(sliding_window), _check_softcap(softcap)
    fp8 = _check_scales(k_scale, v_scale, k_cache.dtype, query.dtype)
    return _decode(query, k_cache, v_cache, block_tables, context_lens, scale, strategy, window, softcap, fp8)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | Sequence[int],
    query_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
    *,
    strategy: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of sequences whose K/V live in a paged cache: prompts,
    chunks of prompts and decodes, in any mix.

    Sequence ``b`` holds ``context_lens[b]`` tokens in the cache, of which the last
    ``query_lens[b]`` are new: their queries are packed into ``query``, sequence after sequence.
    New token ``i`` of sequence ``b`` sits at position ``context_lens[b] - query_lens[b] + i`` and
    attends to positions ``0`` through its own (causal). A fresh prompt has ``query_lens ==
    context_lens``; ``query_lens`` of ones is decode, what :func:`paged_attention` computes; in
    between is a chunk of a prompt whose earlier chunks are cached; a query length of 0 is a
    sequence with nothing to compute this time. The K/V of the new tokens must already be written
    into the cache. (The invariants in full: the module's docstring.)

    Args:
        query: ``(total_new_tokens, num_heads, head_dim)`` with ``total_new_tokens ==
            sum(query_lens)``; rows ``sum(query_lens[:b]) ..`` are sequence ``b``'s, in order.
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``, with ``num_kv_heads``
            dividing ``num_heads``, grouped as for :func:`paged_attention`; in the query's dtype or
            of one fp8 dtype.
        block_tables: ``(batch, max_blocks)`` integer tensor of physical block ids; entries past
            the blocks a sequence needs are padding (``-1`` by convention, any value works).
        context_lens: ``(batch,)`` integers, the tokens each sequence holds (new ones included),
            each in ``1 .. needed_blocks * block_size`` as for :func:`paged_attention`.
        query_lens: ``(batch,)`` integers, each in ``0 .. context_lens[b]``.
        scale: the factor applied to ``q · k``; defaults to ``1 / sqrt(head_dim)``.
        strategy: how the blocks are read, with the same result either way (within rounding).
            ``"gather"`` gathers every sequence's blocks into a contiguous batch and pads the new
            tokens to the longest query length: one gather and one masked attention (the
            reference). ``"in_place"`` reads the cache where it lies: the sequences with one query
            token as :func:`paged_attention`'s in-place path, those with several with every block
            met by the queries of the row that reads it (padded to the longest of them), in one
            product over the pool; in the caches' dtype, so half-precision and fp8 caches are
            gathered.
            ``"auto"`` (default) splits the batch the same way: when every query length is 1 it is
            :func:`paged_attention`'s ``"auto"``; otherwise the rows of one query token go through
            it (read in place or gathered by its rule) and the rows of several are
            gathered, only theirs: so a step of many decodes and a chunk costs about a decode batch
            plus that chunk's attention, with no decode padded to the chunk's length. In place,
            a chunk meets every block of the pool with all its queries, which pays only when the
            chunks read nearly the whole pool: ``"auto"`` never does it.
            ``"flex"`` runs FlexAttention over the whole pool with a block mask that is causal
            inside each sequence (:func:`~paged_kv.attention.flex.flex_varlen`). ``"triton"`` runs
            the course's Triton kernel: one launch for the whole batch, one program per (sequence,
            KV head, tile of query tokens), causal inside a chunk
            (:func:`~paged_kv.attention.triton_decode.triton_attention`). ``"auto"`` never picks
            ``"flex"`` or ``"triton"``.
        k_scale, v_scale: an fp8 cache's per-tensor scales, as for :func:`paged_attention`.
        sliding_window: ``None`` (the default) for causal attention over the whole sequence, or
            ``W``, an integer of at least 1, for a sliding window of ``W`` tokens: query token ``i``
            of sequence ``b``, at position ``p = context_lens[b] - query_lens[b] + i``, sees
            positions ``max(0, p - W + 1) .. p``, itself included (Hugging Face's ``kv_idx > q_idx -
            sliding_window``, vLLM's FlashAttention ``window_size=(W - 1, 0)``). The blocks wholly
            before the window of a sequence's first query token take no part: their entries must
            still be block ids below ``num_blocks``, but any (an engine puts its null block there, or
            leaves the ids of blocks since given to other sequences), holding anything, NaN
            included. Every strategy skips them, as for :func:`paged_attention`; ``"gather"`` pads
            each row's copy to the blocks that ``longest query length + W - 1`` positions can span,
            not to the table's width.
        softcap: ``None`` (the default), or a positive finite number ``c``: each score ``s = scale
            * q · k`` becomes ``c * tanh(s / c)`` before the masking and the softmax (Gemma 2's
            soft-capping of the attention logits), as for :func:`paged_attention`.

    Returns:
        ``(total_new_tokens, num_heads, head_dim)``, packed like ``query``, with its dtype and
        device. Each row equals contiguous attention of that query over positions ``0 ..`` its
        own position of its sequence (the last ``sliding_window`` of those, with a window; K/V
        repeated to ``num_heads`` heads; the scores soft-capped when ``softcap`` is given; an fp8
        cache's K/V dequantized). Half and bfloat16 inputs are computed in float32 and cast back.

    Raises:
        ValueError: as :func:`paged_attention`, or ``query_lens`` has the wrong type or shape, a
            query length is outside ``0 .. context_lens[b]``, or they do not sum to the rows of
            ``query`` (the message names the argument); or the strategy is unknown or cannot run
            here, or ``sliding_window``, ``softcap`` or a scale is not valid, as for
            :func:`paged_attention`.
    """
    context_lens, query_lens, host_lens = _check_inputs(
        query, k_cache, v_cache, block_tables, context_lens, query_lens
    )
    _check_strategy(strategy)
    window, softcap = _check_window(sliding_window), _check_softcap(softcap)
    fp8 = _check_scales(k_scale, v_scale, k_cache.dtype, query.dtype)
    query_start_loc = torch.nn.functional.pad(torch.cumsum(query_lens, 0), (1, 0))
    batch = _Batch(context_lens, query_start_loc, query_lens, host_lens)
    return _varlen(query, k_cache, v_cache, block_tables, batch, scale, strategy, window, softcap, fp8)


def paged_attention_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    max_query_len: int | None = None,
    query_start_loc_cpu: torch.Tensor | None = None,
    strategy: str = "auto",
    check: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` for an engine step, in vLLM's words: the packed batch given
    by ``query_start_loc``, as a model runner holds it, rather than by query lengths.

    Args:
        query, k_cache, v_cache, block_tables, scale, strategy, k_scale, v_scale, sliding_window,
            softcap: as for :func:`paged_prefill_attention`: with a window of ``W``, query token
            ``i`` of sequence ``b``, at position ``p = seq_lens[b] - (query_start_loc[b + 1] -
            query_start_loc[b]) + i``, sees positions ``max(0, p - W + 1) .. p``, and the blocks
            wholly before the window of a sequence's first query token take no part (their entries
            name any block id below ``num_blocks``: the null block, say).
        seq_lens: ``(batch,)`` integer tensor on the query's device: the tokens each sequence holds,
            its query tokens included (the ``context_lens`` of :func:`paged_prefill_attention`).
        query_start_loc: ``(batch + 1,)`` integer tensor on the query's device: ``0``, then the
            running sum of the query lengths, so sequence ``b``'s query tokens are rows
            ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of ``query`` and the last entry is
            ``query.shape[0]`` (vLLM: ``CommonAttentionMetadata.query_start_loc``).
        max_query_len: the longest query length, when the caller knows it on the host (vLLM's
            metadata carries it): it spares the one read from the device that sizes the padding
            (``"gather"``) or the grid (``"triton"``). It must be right; it is not checked.
        query_start_loc_cpu: ``query_start_loc``'s copy on the host, when the caller keeps one
            (vLLM's metadata does, under this name): ``"auto"`` and ``"in_place"`` split the batch
            into decodes and chunks from it instead of reading the device. It must be right; it is
            not checked.
        check: ``False`` skips the checks of the values (that the lengths fit the tables and
            ``query_start_loc`` is consistent), which read the lengths and the tables back to the
            host once per call; the types, shapes, dtypes and devices are checked either way. For a
            caller that built the batch itself and checked it once per step, not once per layer.

    Returns:
        What :func:`paged_prefill_attention` returns for ``query_lens = query_start_loc[1:] -
        query_start_loc[:-1]``.

    Raises:
        ValueError: as :func:`paged_prefill_attention`, naming ``seq_lens`` or ``query_start_loc``
            (which must start at 0, never decrease and end at the rows of ``query``, each step at
            most its sequence's length); with ``check=False`` only the checks that read no value.
            ``sliding_window``, ``softcap`` and the scales are checked either way (they are host
            numbers).

    The hot path reads the device back at most once for itself: ``"triton"`` and ``"gather"`` not
    at all when ``max_query_len`` is given, ``"auto"`` and ``"in_place"`` to copy the query lengths
    to the host (they split the batch into decodes and chunks), unless ``query_start_loc_cpu`` is
    given; ``"flex"`` builds its block mask.
    """
    seq_lens, query_start_loc, host_lens = _check_inputs(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc=query_start_loc,
        values=check,
    )
    _check_strategy(strategy)
    window, softcap = _check_window(sliding_window), _check_softcap(softcap)
    fp8 = _check_scales(k_scale, v_scale, k_cache.dtype, query.dtype)
    if max_query_len is not None:
        max_query_len = check_count("max_query_len", max_query_len)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if host_lens is None and query_start_loc_cpu is not None:
        host_lens = torch.diff(query_start_loc_cpu.long())
    batch = _Batch(seq_lens, query_start_loc, query_lens, host_lens, max_query_len)
    return _varlen(query, k_cache, v_cache, block_tables, batch, scale, strategy, window, softcap, fp8)


def _check_strategy(strategy: object) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")


def _check_window(sliding_window: object) -> int | None:
    """``sliding_window`` as an ``int`` of at least 1, or ``None``; a ``ValueError`` naming it."""
    return None if sliding_window is None else check_count("sliding_window", sliding_window, minimum=1)


def _check_softcap(softcap: object) -> float | None:
    """``softcap`` as a positive finite ``float``, or ``None``; a ``ValueError`` naming it."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    return float(softcap)


class _Fp8(NamedTuple):
    """How an fp8 cache is read: its K stands for ``stored * k_scale``, its V for ``stored * v_scale``,
    dequantized to ``dtype``, the query's (:func:`~paged_kv.kv.fp8.dequantize`)."""

    k_scale: float
    v_scale: float
    dtype: torch.dtype

    def keywords(self) -> dict[str, float]:
        """The scales as the FlexAttention and Triton paths take them."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def _check_scales(
    k_scale: object, v_scale: object, cache_dtype: torch.dtype, query_dtype: torch.dtype
) -> _Fp8 | None:
    """The scales of an fp8 cache, checked (positive finite numbers), or ``None`` for a float cache,
    whose scales must be 1.0; a ``ValueError`` naming the argument."""
    k_scale, v_scale = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    if is_fp8(cache_dtype):
        return _Fp8(k_scale, v_scale, query_dtype)
    if (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(
            f"k_scale and v_scale apply to fp8 caches; a {cache_dtype} cache's are 1.0 (as vLLM enforces), "
            f"got {k_scale} and {v_scale}"
        )
    return None


def _first_entries(first_pos: torch.Tensor, window: int, block_size: int) -> torch.Tensor:
    """The first table entry each row's window reaches: the block of position ``first_pos - window +
    1`` (the first one the query at ``first_pos`` sees), or 0. Every entry before it lies wholly
    before the windows of the row's queries (at ``first_pos`` and after): it takes no part."""
    return (first_pos - window + 1).clamp(min=0) // block_size


def _blocks_spanned(positions: int, block_size: int) -> int:
    """The most blocks ``positions`` consecutive positions can touch (at least one position)."""
    return (max(positions, 1) + block_size - 2) // block_size + 1


def _decode(
    query, k_cache, v_cache, block_tables, context_lens, scale, strategy, window=None, softcap=None, fp8=None
) -> torch.Tensor:
    """:func:`paged_attention` of checked inputs: one query token per row (``window`` and
    ``softcap`` checked, ``None`` when not asked for; ``fp8`` the scales of an fp8 cache, ``None``
    for a float one)."""
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    scaled = {} if fp8 is None else fp8.keywords()
    if strategy == "flex":
        q = query if fp8 is not None else query.to(k_cache.dtype)
        out = flex_decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window=window,
            softcap=softcap,
            **scaled,
        )
        return out.to(query.dtype)
    if strategy == "triton":
        return triton_decode(
            query,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            sliding_window=window,
            softcap=softcap,
            **scaled,
        )
    num_blocks, _, block_size, _ = k_cache.shape
    # With a window, each row's entries before the first its query sees take no part.
    first = None if window is None else _first_entries(context_lens - 1, window, block_size)
    if strategy != "gather" and k_cache.dtype == compute_dtype:
        reads = _BlockReads.of(num_blocks, block_size, block_tables, context_lens, first)
        if strategy == "in_place" or reads.worth_reading_in_place(num_blocks, len(query)):
            q = query.to(k_cache.dtype)[:, None]  # one query per row
            query_pos = context_lens[:, None] - 1
            out = _in_place(
                q, k_cache, v_cache, block_tables, context_lens, query_pos, scale, reads, window, softcap
            )
            return out[:, :, 0].to(query.dtype)

    # 1. Gather each sequence's blocks in table order (padding is read from a real block, masked in 2);
    #    with a window, only the entries from the first the query sees, as many as a window can span.
    span = None if window is None else min(block_tables.shape[1], _blocks_spanned(window, block_size))
    k, v, positions = _gather_batch(k_cache, v_cache, block_tables, compute_dtype, first, span, fp8)

    # 2. Positions at or past the context length do not exist: the attention masks them out; so are
    #    those before the window, and V is zeroed there, as their blocks may hold anything (0 * NaN is NaN).
    beyond = positions >= context_lens[:, None]  # (batch, positions)
    if window is not None:
        beyond |= positions <= (context_lens - 1 - window)[:, None]
        v = v.masked_fill(beyond[:, None, :, None], 0)
    return _attend(query.to(compute_dtype), k, v, scale, beyond, softcap).to(query.dtype)


@dataclass(frozen=True)
class _Batch:
    """A checked packed batch: each row's ``seq_lens``, ``query_start_loc`` and ``query_lens`` (long
    tensors on the query's device), the query lengths on the host when the checks read them
    already, and ``max_query_len`` when the caller gave it."""

    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    host_query_lens: torch.Tensor | None = None
    max_query_len: int | None = None

    def host_lens(self) -> torch.Tensor:
        """The query lengths on the host: the checks' copy, else one read of the device."""
        return self.query_lens.cpu() if self.host_query_lens is None else self.host_query_lens

    def longest(self) -> int:
        """The longest query length: given, from the host copy, or one read of the device."""
        if self.max_query_len is not None:
            return self.max_query_len
        if not len(self.query_lens):
            return 0
        return int(self.host_lens().max())

    def rows(self, rows: torch.Tensor, host_lens: torch.Tensor) -> tuple[torch.Tensor, _Batch]:
        """The packed-batch token indices of ``rows`` (a host LongTensor), in order, and the batch
        of those rows alone (their query tokens packed again)."""
        lens = host_lens[rows]
        starts = (torch.cumsum(host_lens, 0) - host_lens)[rows]
        within = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        tokens = torch.repeat_interleave(starts, lens) + within
        device = self.seq_lens.device
        index = rows.to(device)
        sub_lens = lens.to(device)
        sub = _Batch(
            self.seq_lens[index],
            torch.nn.functional.pad(torch.cumsum(sub_lens, 0), (1, 0)),
            sub_lens,
            lens,
            int(lens.max()) if len(lens) else 0,
        )
        return tokens.to(device), sub


def _varlen(
    query, k_cache, v_cache, block_tables, batch: _Batch, scale, strategy, window=None, softcap=None, fp8=None
) -> torch.Tensor:
    """The packed batch of checked inputs, in ``strategy``: the body of :func:`paged_prefill_attention`
    (``fp8``: the scales of an fp8 cache, ``None`` for a float one)."""
    scaled = {} if fp8 is None else fp8.keywords()
    if strategy == "triton":
        return triton_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.longest(),
            scale,
            sliding_window=window,
            softcap=softcap,
            **scaled,
        )
    if strategy == "flex":
        q = query if fp8 is not None else query.to(k_cache.dtype)
        out = flex_varlen(
            q,
            k_cache,
            v_cache,
            block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            scale,
            sliding_window=window,
            softcap=softcap,
            **scaled,
        )
        return out.to(query.dtype)
    if strategy == "gather":
        return _chunks_gathered(query, k_cache, v_cache, block_tables, batch, scale, window, softcap, fp8)

    # "in_place" and "auto": the rows of one query token are a decode batch, the others chunks.
    host_lens = batch.host_lens()
    decodes, chunks = (host_lens == 1), (host_lens > 1)
    if bool(decodes.all()):  # every row one query token (a decode step): the decode path as it is
        lens = batch.seq_lens
        return _decode(query, k_cache, v_cache, block_tables, lens, scale, strategy, window, softcap, fp8)
    out = query.new_empty(query.shape)
    for selected, run in ((decodes, _decodes_of), (chunks, _chunks_of)):
        rows = torch.nonzero(selected).flatten()
        if not len(rows):
            continue
        if len(rows) == len(host_lens):  # all of them: no copy of the tables
            out = run(query, k_cache, v_cache, block_tables, batch, scale, strategy, window, softcap, fp8)
            continue
        tokens, sub = batch.rows(rows, host_lens)
        device_rows = rows.to(query.device)
        out[tokens] = run(
            query[tokens],
            k_cache,
            v_cache,
            block_tables[device_rows],
            sub,
            scale,
            strategy,
            window,
            softcap,
            fp8,
        )
    return out


def _decodes_of(
    query, k_cache, v_cache, block_tables, batch: _Batch, scale, strategy, window, softcap, fp8
) -> torch.Tensor:
    """A batch whose every row has one query token: the decode path."""
    lens = batch.seq_lens
    return _decode(query, k_cache, v_cache, block_tables, lens, scale, strategy, window, softcap, fp8)


def _chunks_of(
    query, k_cache, v_cache, block_tables, batch: _Batch, scale, strategy, window, softcap, fp8
) -> torch.Tensor:
    """A batch of rows with several query tokens each: read in place for ``"in_place"`` (when the
    caches are in the compute dtype), gathered otherwise (fp8 caches included).

    ``"auto"`` gathers them: a chunk's copy of its blocks is shared by all its query tokens, while
    the in-place product meets every block of the pool with the longest chunk's queries, so it pays
    only when the chunks read nearly the whole pool, and even then its products do the masked
    half of causal attention too. (Measured on this project's 2-core CPU, busy, 32 decodes of 1,024
    tokens and a chunk of 256, bench/bench_attention.py: ``"auto"`` within 10 % of the decode batch
    and the chunk run apart, 18 to 32 times faster than ``"gather"``, which pads every decode to 256
    queries, and 50 to 70 times faster than ``"in_place"``; 4 prompts of 512 alone: gathered 1.4 to
    3.5 times faster than in place.) A sliding window only widens the gap: the gathered copy holds
    the windows' blocks alone.
    """
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    if strategy == "in_place" and k_cache.dtype == compute_dtype:
        num_blocks, _, block_size, _ = k_cache.shape
        q, query_pos, seq, index = _padded(query, batch, batch.longest())
        first = None if window is None else _first_entries(query_pos[:, 0], window, block_size)
        reads = _BlockReads.of(num_blocks, block_size, block_tables, batch.seq_lens, first)
        out = _in_place(
            q, k_cache, v_cache, block_tables, batch.seq_lens, query_pos, scale, reads, window, softcap
        )
        return out.transpose(1, 2)[seq, index].to(query.dtype)
    return _chunks_gathered(query, k_cache, v_cache, block_tables, batch, scale, window, softcap, fp8)


def _padded(query, batch: _Batch, longest: int):
    """The packed query padded to ``(batch, longest, num_heads, head_dim)``, the position each padded
    query sees up to ``(batch, longest)``, and the ``(seq, index)`` of each packed row in it."""
    total, num_heads, head_dim = query.shape
    rows, device = len(batch.seq_lens), query.device
    seq = torch.repeat_interleave(torch.arange(rows, device=device), batch.query_lens, output_size=total)
    index = torch.arange(total, device=device) - batch.query_start_loc[seq]
    padded = query.new_zeros(rows, longest, num_heads, head_dim)
    padded[seq, index] = query
    # Slot i of row b is position seq_lens[b] - query_lens[b] + i and sees positions up to its own.
    # Padding slots (i >= query_lens[b]) lie past the sequence: what they see is dropped at the end.
    query_pos = (batch.seq_lens - batch.query_lens)[:, None] + torch.arange(longest, device=device)
    return padded, query_pos, seq, index


def _chunks_gathered(
    query, k_cache, v_cache, block_tables, batch: _Batch, scale, window=None, softcap=None, fp8=None
) -> torch.Tensor:
    """The reference: every row's blocks gathered, the queries padded to the longest, one masked
    attention for the whole batch, no Python loop over sequences; the padding rows dropped.

    With a window, each row's copy starts at the first entry its first query token sees and holds
    as many as ``longest + window - 1`` positions can span; V is zeroed at the positions none of the
    row's queries sees, which may hold anything (a zero weight does not cancel NaN)."""
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    longest = batch.longest()
    first = span = None
    if window is not None:
        block_size = k_cache.shape[2]
        first_pos = batch.seq_lens - batch.query_lens  # each row's first query token's position
        first = _first_entries(first_pos, window, block_size)
        span = min(block_tables.shape[1], _blocks_spanned(longest + window - 1, block_size))
    k, v, positions = _gather_batch(k_cache, v_cache, block_tables, compute_dtype, first, span, fp8)
    padded, query_pos, seq, index = _padded(query.to(compute_dtype), batch, longest)
    beyond = positions[:, None, :] > query_pos[:, :, None]  # (batch, max_q, positions)
    if window is not None:
        beyond |= positions[:, None, :] <= query_pos[:, :, None] - window
        unseen = (positions >= batch.seq_lens[:, None]) | (positions <= (first_pos - window)[:, None])
        v = v.masked_fill(unseen[:, None, :, None], 0)
    out = _attend(padded.transpose(1, 2), k, v, scale, beyond, softcap)  # (batch, heads, max_q, dim)
    return out.transpose(1, 2)[seq, index].to(query.dtype)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | Sequence[int],
    context_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, read through its block table into contiguous tensors.

    Args:
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``.
        block_table: the sequence's physical block ids in logical order, a list of ints or a 1-D
            integer tensor (a row of ``block_tables_tensor``, say). Entries past the first
            ``ceil(context_len / block_size)`` are padding (``-1`` by convention) and are never read.
        context_len: the tokens to read, positions ``0 .. context_len - 1``.

    Returns:
        ``(k, v)``, each ``(context_len, num_kv_heads, head_dim)`` on the caches' device, row ``p``
        holding token ``p``: what :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.read_kv` returns for
        a sequence of ``context_len`` tokens.

    Raises:
        ValueError: a cache is not 4-D or the two differ in shape, ``context_len`` is not a
            non-negative integer, ``block_table`` is not 1-D integers, or one of the entries read
            is missing or not a block id below ``num_blocks`` (the message names the argument).

    >>> k_cache = torch.arange(4.0).reshape(4, 1, 1, 1)  # 4 blocks of one token, K = block id
    >>> k, v = gather_kv(k_cache, -k_cache, [2, 0, 3, -1], 3)
    >>> k.flatten().tolist(), v.flatten().tolist()
    ([2.0, 0.0, 3.0], [-2.0, -0.0, -3.0])
    """
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (num_blocks, num_heads, block_size, head_dim)")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    context_len = check_count("context_len", context_len)
    num_blocks, _, block_size, _ = k_cache.shape
    needed = blocks_for_tokens(context_len, block_size)
    try:
        table = torch.as_tensor(block_table)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"block_table must be integers, got {block_table!r}") from None
    table = table if table.numel() else table.long()  # [] makes floats
    if (
        table.dim() != 1
        or table.dtype.is_floating_point
        or table.dtype.is_complex
        or table.dtype == torch.bool
    ):
        raise ValueError(
            f"block_table must be a 1-D list or tensor of ints, got {table.dtype} {tuple(table.shape)}"
        )
    ids = table[:needed].long()
    if len(ids) < needed or ((ids < 0) | (ids >= num_blocks)).any():
        raise ValueError(
            f"block_table must hold {needed} block ids below {num_blocks} for {context_len} tokens in blocks "
            f"of {block_size}, got {table.tolist()}"
        )
    blocks = ids.to(k_cache.device)[None]  # a batch of one
    k, v = (_gather_blocks(cache, blocks)[0, :, :context_len].transpose(0, 1) for cache in (k_cache, v_cache))
    return k.contiguous(), v.contiguous()


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention of one sequence's new token over its K and V (one query, no mask).

    For each query head ``h``: the scores are ``q[h] · k`` of K/V head ``h // (num_heads //
    num_kv_heads)`` times ``scale``, the weights a softmax of the scores over the tokens, and the
    output the weighted sum of that head's V.

    Args:
        q: ``(num_heads, head_dim)``, the new token's query.
        k, v: ``(num_tokens, num_kv_heads, head_dim)``, what :func:`gather_kv` returns, with
            ``num_kv_heads`` dividing ``num_heads``; at least one token.
        scale: the factor applied to ``q · k``; defaults to ``1 / sqrt(head_dim)``.

    Returns:
        ``(num_heads, head_dim)``, with the dtype and device of ``q``; it equals
        ``scaled_dot_product_attention`` of ``q`` over ``k`` and ``v`` (with ``enable_gqa=True``
        when there are fewer K/V heads). Half and bfloat16 inputs
        are computed in float32 and cast back.

    Raises:
        ValueError: an argument is not a float tensor of the right shape, dtype and device (the
            message names it).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or not q.dtype.is_floating_point:
        raise ValueError("q must be a 2-D float tensor (num_heads, head_dim)")
    for name, tensor in (("k", k), ("v", v)):
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dim() != 3
            or not _grouped_heads_fit(q.shape[0], tensor.shape[1])
            or tensor.shape[2] != q.shape[1]
        ):
            raise ValueError(
                f"{name} must be a tensor of shape (num_tokens, num_kv_heads, {q.shape[1]}) with "
                f"num_kv_heads dividing q's {q.shape[0]} heads"
                + (f", got {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else "")
            )
        if tensor.dtype != q.dtype or tensor.device != q.device:
            raise ValueError(f"{name} is {tensor.dtype} on {tensor.device} but q is {q.dtype} on {q.device}")
    if v.shape != k.shape or k.shape[0] == 0:
        raise ValueError(
            f"k and v must have the same shape, with at least 1 token: {tuple(k.shape)} and {tuple(v.shape)}"
        )
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    heads_first = [t.transpose(0, 1)[None].to(compute_dtype) for t in (k, v)]  # (1, heads, tokens, dim)
    return _attend(q[None].to(compute_dtype), *heads_first, scale)[0].to(q.dtype)


@dataclass(frozen=True)
class _BlockReads:
    """Which rows of a decode batch read which physical blocks.

    ``blocks`` and ``rows`` list every table entry the batch reads (row by row, in table order);
    ``shared`` holds the distinct blocks that more than one entry reads, and ``shared_entries``
    how many entries read them. ``first``, with a sliding window, is each row's first entry read
    (:func:`_first_entries`): the entries before it take no part, whatever block they name.
    """

    blocks: torch.Tensor
    rows: torch.Tensor
    shared: torch.Tensor
    shared_entries: int
    first: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        num_blocks: int,
        block_size: int,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        first: torch.Tensor | None = None,
    ) -> _BlockReads:
        needed = (context_lens + block_size - 1) // block_size
        entries = torch.arange(block_tables.shape[1], device=block_tables.device)
        used = entries < needed[:, None]
        if first is not None:
            used &= entries >= first[:, None]
        blocks = block_tables.long()[used]
        rows = torch.arange(len(block_tables), device=block_tables.device)[:, None].expand_as(used)[used]
        readers = torch.bincount(blocks, minlength=num_blocks)
        shared = torch.nonzero(readers > 1).flatten()
        return cls(blocks, rows, shared, int(readers[shared].sum()), first)

    def worth_reading_in_place(self, num_blocks: int, batch: int) -> bool:
        """``"auto"``'s choice: the batch reads at least half the pool (the in-place products cover
        all of it), and the shared blocks are not so thinly shared that meeting every row's query
        wastes more than four times the work."""
        distinct = len(self.blocks) - self.shared_entries + len(self.shared)
        thin = batch * len(self.shared) > 4 * self.shared_entries
        return 2 * distinct >= num_blocks and not thin


def _in_place(
    q, k_cache, v_cache, block_tables, context_lens, query_pos, scale, reads, window=None, softcap=None
) -> torch.Tensor:
    """Attention that reads the blocks where they lie, for ``q`` ``(batch, queries, num_heads,
    head_dim)`` in the caches' dtype: query ``i`` of row ``b`` sees positions ``0 ..
    query_pos[b, i]`` of its row (``query_pos[b, i] - window + 1 ..`` with a window; never one at
    or past ``context_lens[b]``), the scores soft-capped when ``softcap`` is given. Returns
    ``(batch, num_heads, queries, head_dim)``. A decode batch has one query per row, at
    ``context_lens - 1``. With a window, the entries before ``reads.first`` are not read: they go
    to the dummy, as padding does, so the blocks they name (the null block, say) meet no query.

    Each block only one row reads meets that row's queries once: scores for the whole pool come
    from one batched product in physical order, and so do the per-block partial outputs, without
    copying K or V; a block's rows are its reader's (query head, query) pairs grouped ``(num_kv_heads,
    group * queries)``, so each group meets its one K/V head in the same product. The blocks several
    rows read (``reads.shared``, typically a shared prompt prefix) are copied once each, and every
    row's queries meet them in one dense product. Only the small score and weight tensors move to
    each sequence's table order, where the softmax runs, and back. (On a CPU, copying every block
    of a batch costs several times the attention itself; bench/bench_attention.py measures it.)
    """
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    batch, num_queries, num_heads, _ = q.shape
    width = block_tables.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    num_shared = len(reads.shared)

    # Scores of every block with its one reader; row `batch` is a zero dummy, the "reader" of
    # blocks nobody reads and of shared blocks (their scores come from a dense product below).
    owner = torch.full((num_blocks,), batch, dtype=torch.long, device=q.device)
    positions = torch.arange(width * block_size, device=q.device)
    read = positions[::block_size][None, :] < context_lens[:, None]  # (batch, width): entries read
    if reads.first is not None:  # a window: not the entries before it
        read &= torch.arange(width, device=q.device)[None, :] >= reads.first[:, None]
    table = torch.where(read, block_tables.long(), num_blocks)  # padding -> the dummy
    if num_shared:
        shared_index = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=q.device)
        shared_index[reads.shared] = torch.arange(num_shared, device=q.device)
        alone = shared_index[reads.blocks] < 0
        owner[reads.blocks[alone]] = reads.rows[alone]
    else:
        owner[reads.blocks] = reads.rows
    heads_first = q.transpose(1, 2)  # (batch, heads, queries, dim)
    padded_q = torch.cat([heads_first, heads_first.new_zeros(1, num_heads, num_queries, head_dim)])
    # Block b's rows, grouped (kv_heads, group * queries, dim), against its K (kv_heads, dim, slots):
    # a group's heads and queries are the rows of one small product with their KV head's slots.
    owner_q = padded_q[owner].reshape(num_blocks, num_kv_heads, -1, head_dim)
    scores = torch.matmul(owner_q, k_cache.transpose(-1, -2)) * scale
    scores = scores.view(num_blocks, num_heads, num_queries, block_size)
    parts = [scores, scores.new_zeros(1, num_heads, num_queries, block_size)]
    index = table
    if num_shared:  # every row's queries against each shared block, copied once: (batch, shared, ...)
        k_shared, v_shared = k_cache[reads.shared], v_cache[reads.shared]
        grouped_q = _group_heads(heads_first, num_kv_heads, dim=1)  # (batch, kv, group, queries, dim)
        shared_scores = torch.einsum("bkgqd,skpd->bskgqp", grouped_q, k_shared) * scale
        parts.append(shared_scores.flatten(2, 3).flatten(0, 1))
        # A shared entry finds its scores in its own (row, shared block) row, after the dummy.
        row_start = num_blocks + 1 + torch.arange(batch, device=q.device)[:, None] * num_shared
        entry_shared = shared_index[table]
        index = torch.where(entry_shared >= 0, row_start + entry_shared, table)
    # `index` is distinct for every entry read, except that a row listing one shared block twice
    # finds both entries' scores in the same (row, shared block) row: their weights add up below.
    source = torch.cat(parts)  # (sources, heads, queries, slots)

    in_order = source[index].permute(0, 2, 3, 1, 4).reshape(batch, num_heads, num_queries, width * block_size)
    if softcap is not None:
        in_order = softcap * torch.tanh(in_order / softcap)
    unseen = (positions[None, None, :] > query_pos[:, :, None]) | (
        positions[None, None, :] >= context_lens[:, None, None]
    )  # (batch, queries, positions)
    if window is not None:
        unseen |= positions[None, None, :] <= query_pos[:, :, None] - window
    in_order = in_order.masked_fill(unseen[:, None], float("-inf"))
    weights = torch.softmax(in_order, dim=-1).view(batch, num_heads, num_queries, width, block_size)
    weights = weights.permute(0, 3, 1, 2, 4)  # (batch, width, heads, queries, slots)

    per_source = source.new_zeros(source.shape)
    # Back where the scores came from; padding lands on the dummy. Two entries of one row naming
    # the same block meet the same V, so their weights are summed (only shared blocks can repeat).
    per_source.index_put_((index,), weights, accumulate=bool(num_shared))
    by_block = per_source[:num_blocks].view(num_blocks, num_kv_heads, -1, block_size)
    partial = torch.matmul(by_block, v_cache).view(num_blocks, num_heads, num_queries, head_dim)
    out = q.new_zeros(batch + 1, num_heads, num_queries, head_dim).index_add_(0, owner, partial)[:batch]
    if num_shared:
        shared_weights = per_source[num_blocks + 1 :].view(
            batch, num_shared, num_heads, num_queries, block_size
        )
        grouped_weights = _group_heads(shared_weights, num_kv_heads, dim=2)
        out += torch.einsum("bskgqp,skpd->bkgqd", grouped_weights, v_shared).flatten(1, 2)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The slots of ``blocks`` (a ``(batch, n)`` LongTensor of block ids), in table order.

    Returns ``(batch, num_heads, n * block_size, head_dim)``: position ``p`` of row ``b`` is offset
    ``p % block_size`` of block ``blocks[b, p // block_size]``.
    """
    batch, n = blocks.shape
    _, num_heads, block_size, head_dim = cache.shape
    per_block = cache[blocks]  # (batch, n, heads, block_size, dim)
    return per_block.transpose(1, 2).reshape(batch, num_heads, n * block_size, head_dim)


def _gather_batch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    dtype: torch.dtype,
    first: torch.Tensor | None = None,
    span: int | None = None,
    fp8: _Fp8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's K and V in table order, in ``dtype``, and the positions they hold; from an fp8
    cache (``fp8``: its scales), the gathered bytes dequantized to the query's dtype first.

    Returns ``k`` and ``v`` of shape ``(batch, num_heads, n * block_size, head_dim)`` and the
    positions of their slots: all ``n = max_blocks`` entries of each row, ``positions = arange(n *
    block_size)[None]``; or, given ``first`` (a ``(batch,)`` LongTensor) and ``span``, the ``n =
    span`` entries ``first[b] ..`` of row ``b``, ``positions`` ``(batch, span * block_size)``.
    Padding entries and those past the table are clamped to a real block (any one will do): the
    caller masks out the positions they hold.
    """
    num_blocks, _, block_size, _ = k_cache.shape
    if first is None:
        blocks = block_tables.long().clamp(0, num_blocks - 1)
        positions = torch.arange(blocks.shape[1] * block_size, device=blocks.device)[None]
    else:
        entries = first[:, None] + torch.arange(span, device=first.device)  # (batch, span)
        table = block_tables.long().gather(1, entries.clamp(max=max(block_tables.shape[1] - 1, 0)))
        blocks = table.clamp(0, num_blocks - 1)
        slots = torch.arange(block_size, device=first.device)
        positions = (entries[:, :, None] * block_size + slots).flatten(1)
    if fp8 is None:
        k, v = (_gather_blocks(cache, blocks).to(dtype) for cache in (k_cache, v_cache))
    else:  # the gathered bytes, not the pool, dequantized: as the reference reads them, then as floats
        k, v = (
            dequantize(_gather_blocks(cache, blocks), factor, fp8.dtype).to(dtype)
            for cache, factor in ((k_cache, fp8.k_scale), (v_cache, fp8.v_scale))
        )
    return k, v, positions


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    beyond: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for a batch: q ``(batch, heads, [queries,] dim)``, k, v ``(batch, kv_heads, slots, dim)``.

    Decode has one query per row and no ``queries`` axis; prefill has one. ``heads`` is a multiple
    of ``kv_heads``: query head ``h`` meets KV head ``h // (heads // kv_heads)``. The query heads
    are viewed as ``(kv_heads, group)`` and the products broadcast over the group, so no K or V is
    copied per query head. ``softcap`` ``c``, when given, makes each score ``c * tanh(score / c)``.
    ``beyond`` is a ``(batch, [queries,] positions)`` bool mask of the positions a query must not
    see; they get a score of ``-inf`` before the softmax (after the soft cap: a NaN score there is
    replaced too). Returns q's shape.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grouped = _group_heads(q, k.shape[1], dim=1)  # (batch, kv_heads, group, [queries,] dim)
    scores = torch.einsum("bkg...d,bkpd->bkg...p", grouped, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if beyond is not None:
        scores = scores.masked_fill(beyond[:, None, None], float("-inf"))  # the same for every head
    weights = torch.softmax(scores, dim=-1)  # over the positions, for each head (and query)
    return torch.einsum("bkg...p,bkpd->bkg...d", weights, v).flatten(1, 2)


def _group_heads(t: torch.Tensor, num_kv_heads: int, dim: int) -> torch.Tensor:
    """``t`` with its query-head axis ``dim`` split into ``(num_kv_heads, group)``: a view, no copy.

    Query head ``h`` lands at ``(h // group, h % group)``: the heads of one group are consecutive
    and share KV head ``h // group``, as Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa`` pair
    them. ``flatten(dim, dim + 1)`` undoes it.
    """
    return t.unflatten(dim, (num_kv_heads, t.shape[dim] // num_kv_heads))


def _check_inputs(
    query,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_lens=None,
    *,
    query_start_loc=None,
    values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raise ``ValueError`` naming the bad argument; return the lengths as LongTensors on the
    query's device and, when the values were checked, the query lengths on the host.

    Three callers. Decode (no ``query_lens``, no ``query_start_loc``): ``query`` has one row per
    sequence; returns ``(context_lens, None, None)``. Prefill (``query_lens``): ``block_tables``
    gives the batch and ``query`` holds ``sum(query_lens)`` packed rows; returns ``(context_lens,
    query_lens, host query_lens)``. Varlen (``query_start_loc``, the lengths named ``seq_lens``):
    the same batch described by its starts; returns ``(seq_lens, query_start_loc, host query
    lengths or None)``. With ``values=False`` (varlen only) nothing is read back from the device.
    """
    varlen = query_start_loc is not None
    lens_name = "seq_lens" if varlen else "context_lens"
    named = {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or not query.dtype.is_floating_point or is_fp8(query.dtype):
        raise ValueError(f"query must be a 3-D float tensor, got {query.dtype} {tuple(query.shape)}")
    if (
        k_cache.dim() != 4
        or not _grouped_heads_fit(query.shape[1], k_cache.shape[1])
        or k_cache.shape[3] != query.shape[2]
    ):
        raise ValueError(
            f"k_cache must have shape (num_blocks, num_kv_heads, block_size, {query.shape[2]}) with "
            f"num_kv_heads dividing query's {query.shape[1]} heads, got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):  # an fp8 cache: read in any query dtype
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(f"v_cache has dtype {v_cache.dtype} but k_cache has {k_cache.dtype}")
    else:
        for name in ("k_cache", "v_cache"):
            if named[name].dtype != query.dtype:
                raise ValueError(f"{name} has dtype {named[name].dtype} but query has {query.dtype}")
    lengths = {lens_name: context_lens}
    if query_lens is not None:
        lengths["query_lens"] = query_lens
    if varlen:
        lengths["query_start_loc"] = query_start_loc
    for name, value in lengths.items():
        named[name] = _as_tensor(name, value, query.device)
    for name, tensor in named.items():
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    for name in ("block_tables", *lengths):
        dtype = named[name].dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {dtype}")
    packed = query_lens is not None or varlen
    if not packed:  # decode: one query row per sequence
        batch = query.shape[0]
        if block_tables.dim() != 2 or block_tables.shape[0] != batch:
            raise ValueError(f"block_tables must be ({batch}, max_blocks), got {tuple(block_tables.shape)}")
    else:  # prefill: the table rows are the sequences
        if block_tables.dim() != 2:
            raise ValueError(f"block_tables must be 2-D (batch, max_blocks), got {tuple(block_tables.shape)}")
        batch = block_tables.shape[0]
    shapes = {name: (batch,) for name in lengths}
    if varlen:
        shapes["query_start_loc"] = (batch + 1,)
    for name, shape in shapes.items():
        if named[name].shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(named[name].shape)}")
    context_lens = named[lens_name].long()
    if varlen:
        query_start_loc = named["query_start_loc"].long()
    if not values:
        return context_lens, query_start_loc, None

    # The values: one copy to the CPU, then every sequence checked at once.
    lens, table = context_lens.cpu(), block_tables.long().cpu()
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[2]
    needed = (lens + block_size - 1) // block_size
    used = torch.arange(table.shape[1]) < needed[:, None]  # the entries each sequence reads
    bad_len = (lens < 1) | (needed > table.shape[1]) | (used & (table < 0)).any(dim=1)
    if bad_len.any():
        b = int(bad_len.nonzero()[0])
        raise ValueError(
            f"{lens_name}[{b}] = {int(lens[b])} must be at least 1 and fit in its row of block_tables "
            f"({table[b].tolist()}, block_size {block_size})"
        )
    bad_id = used & (table >= num_blocks)
    if bad_id.any():
        b, j = bad_id.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{b}, {j}] = {int(table[b, j])} is not a block id below {num_blocks}")
    if not packed:
        return context_lens, None, None
    if varlen:
        starts = query_start_loc.cpu()
        new = starts[1:] - starts[:-1]
        if int(starts[0]) != 0 or bool((new < 0).any()) or int(starts[-1]) != query.shape[0]:
            raise ValueError(
                f"query_start_loc must start at 0, never decrease and end at the {query.shape[0]} rows of "
                f"query, got {starts.tolist()}"
            )
        bad_new = new > lens
        if bad_new.any():
            b = int(bad_new.nonzero()[0])
            raise ValueError(
                f"query_start_loc[{b + 1}] - query_start_loc[{b}] = {int(new[b])} query tokens, more than "
                f"seq_lens[{b}] = {int(lens[b])}"
            )
        return context_lens, query_start_loc, new
    query_lens = named["query_lens"].long()
    new = query_lens.cpu()
    bad_new = (new < 0) | (new > lens)
    if bad_new.any():
        b = int(bad_new.nonzero()[0])
        raise ValueError(
            f"query_lens[{b}] = {int(new[b])} must be in 0 .. context_lens[{b}] = {int(lens[b])}"
        )
    if int(new.sum()) != query.shape[0]:
        raise ValueError(f"query_lens must sum to the {query.shape[0]} rows of query, got {int(new.sum())}")
    return context_lens, query_lens, new


def _grouped_heads_fit(num_heads: int, num_kv_heads: int) -> bool:
    """Whether ``num_heads`` query heads can share ``num_kv_heads`` KV heads in equal groups."""
    return num_kv_heads >= 1 and num_heads % num_kv_heads == 0


def _as_tensor(name: str, value: object, device: torch.device) -> torch.Tensor:
    """``value`` if a tensor, else ``torch.as_tensor`` of it on ``device``; a ``ValueError`` naming it."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        tensor = torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be integers, got {value!r}") from None
    return tensor if tensor.numel() else tensor.long()  # [] makes floats

"""Paged attention as the lessons call it: decode, a packed batch of query lengths, and an engine step
in vLLM's words, each a thin call of one registered backend (lessons 05, 06, 12).

A paged kernel never sees a contiguous K or V. It follows each sequence's block table: logical
block ``j`` of sequence ``b`` is physical block ``block_tables[b, j]`` of the cache, so token ``p``
sits at offset ``p % block_size`` of block ``block_tables[b, p // block_size]``. Three functions
take a learner's tensors, check them (every bad argument is a ``ValueError`` naming it), build the
step's :class:`~paged_kv.attention.metadata.AttentionMetadata` and hand it to a backend's
``forward`` (:mod:`paged_kv.attention.registry`: ``backend=`` names one, ``None`` the platform's
default):

* :func:`paged_attention`: decode, one query token per sequence, the attention of lesson 05;
* :func:`paged_prefill_attention`: several query tokens per sequence, packed, by their query
  lengths: prompts, chunks after cached tokens and decodes in any mix (lesson 06);
* :func:`paged_attention_varlen`: the same batch given as a model runner holds it, by vLLM's
  ``query_start_loc`` (lesson 12).

**The invariants of the packed batch** (what the functions check, and every backend relies on):
sequence ``b`` holds ``seq_lens[b]`` tokens, at least 1, in the first ``ceil(seq_lens[b] /
block_size)`` entries of its table row; its ``query_lens[b]`` query tokens, ``0 .. seq_lens[b]``
of them, are its last ones, rows ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of
``query``; query token ``i`` of sequence ``b`` is at position ``seq_lens[b] - query_lens[b] + i`` and
sees positions ``0`` through its own, and its K/V are already in the cache.

Every function takes grouped-query attention (``num_kv_heads`` dividing the query's heads: query
head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``, the pairing of Hugging Face's
``repeat_kv`` and SDPA's ``enable_gqa=True``), a **sliding window** of ``W`` tokens
(``sliding_window=W``: the query at position ``p`` sees positions ``max(0, p - W + 1) .. p`` only,
and a sequence's table entries wholly before the window of its first query token take no part,
whatever block they name, NaN included), a **soft cap** (``softcap=c``, Gemma 2's ``c * tanh(s /
c)`` of each scaled score ``s``, before the mask) and an **fp8 cache** (``torch.float8_e4m3fn`` or
``torch.float8_e5m2`` pools read as ``stored * k_scale`` and ``stored * v_scale``, cast to the
query's dtype; a float cache's scales are 1.0), in every backend. Half-precision inputs are
computed in float32 and returned in their dtype.

:func:`gather_kv` and :func:`decode_attention` are the two halves of lesson 05's reference for one
sequence: its K and V read through its table into contiguous tensors, and the attention of one query
over them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_kv.attention.backend import LayerKVCache, check_inputs, check_positive, check_window, compute_dtype
from paged_kv.attention.backends.gather import attend, gather_blocks
from paged_kv.attention.heads import heads_fit
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.attention.registry import attention_backend, check_backend_name
from paged_kv.core.block import blocks_for_tokens
from paged_kv.validate import check_count


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
    *,
    backend: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention for a batch of sequences whose K/V live in a paged cache.

    Args:
        query: ``(batch, num_heads, head_dim)``, the new token of each sequence.
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``, with ``num_kv_heads``
            dividing ``num_heads`` (equal: multi-head; fewer: grouped-query; one: multi-query). In
            the query's dtype, or both of one fp8 dtype (see ``k_scale``).
        block_tables: ``(batch, max_blocks)`` integer tensor of physical block ids; entries past
            the blocks a sequence needs are padding (``-1`` by convention, any value works).
        seq_lens: ``(batch,)`` integers, the tokens each sequence holds, its new one included, each
            in ``1 .. needed_blocks * block_size`` where its first ``needed_blocks`` entries are valid.
        scale: the factor applied to ``q · k``; defaults to ``1 / sqrt(head_dim)``.
        backend: the registry's name of the backend that reads the blocks (``"GATHER"``,
            ``"IN_PLACE"``, ``"FLEX_ATTENTION"``, ``"TRITON_ATTN"``, ``"CPU_ATTN"``), or ``None`` for
            the platform's default: the same attention either way, within rounding
            (:mod:`paged_kv.attention.registry`).
        k_scale, v_scale: an fp8 cache's per-tensor scales, positive finite numbers: it holds ``K /
            k_scale`` and ``V / v_scale`` (vLLM's ``layer._k_scale``, ``layer._v_scale``). A float
            cache's are 1.0 (the default).
        sliding_window: ``None`` (the default) for full attention, or ``W``, an integer of at least
            1: row ``b``'s query, at position ``p = seq_lens[b] - 1``, sees positions ``max(0, p - W
            + 1) .. p`` (Hugging Face's ``kv_idx > q_idx - sliding_window``, vLLM's FlashAttention
            ``window_size=(W - 1, 0)``); the entries wholly before the window must still be block
            ids below ``num_blocks``, holding anything.
        softcap: ``None`` (the default), or a positive finite number ``c``: each score ``s = scale
            * q · k`` becomes ``c * tanh(s / c)`` before the masking and the softmax.

    Returns:
        ``(batch, num_heads, head_dim)``, with the dtype and device of ``query``. Row ``b`` equals
        contiguous attention of ``query[b]`` over the first ``seq_lens[b]`` tokens of its sequence
        (its last ``sliding_window`` of them, with a window), their K/V repeated along the head axis
        to ``num_heads`` heads, the scores soft-capped when ``softcap`` is given; over an fp8 cache,
        its K/V dequantized.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device (among them caches whose
            heads do not divide ``num_heads`` or whose head_dim differs from ``query``'s, float
            caches of another dtype than the query's, or an fp8 query), a length is below 1 or
            needs blocks its row does not hold, ``backend`` is not a registry name, or
            ``sliding_window``, ``softcap``, ``scale`` or a scale of the cache is not valid (the
            message names the argument); or the backend cannot run here (its message says why).
    """
    seq_lens = _as_tensor("seq_lens", seq_lens, query)
    batch = len(query) if isinstance(query, torch.Tensor) and query.dim() else None
    check_inputs(query, k_cache, v_cache, block_tables, batch=batch, seq_lens=seq_lens)
    _check_values(k_cache, block_tables, seq_lens)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device=query.device),
        query_start_loc_cpu=torch.arange(batch + 1),
        query_lens=torch.ones(batch, dtype=torch.long, device=query.device),
        seq_lens=seq_lens.long(),
        block_table=block_tables,
        num_reqs=batch,
        max_query_len=min(batch, 1),
    )
    return _run(query, k_cache, v_cache, metadata, backend, scale, k_scale, v_scale, sliding_window, softcap)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | Sequence[int],
    query_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
    *,
    backend: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for a packed batch of sequences whose K/V live in a paged cache: prompts,
    chunks of prompts and decodes, in any mix.

    Sequence ``b`` holds ``seq_lens[b]`` tokens in the cache, of which the last ``query_lens[b]``
    are new: their queries are packed into ``query``, sequence after sequence. New token ``i`` of
    sequence ``b`` sits at position ``seq_lens[b] - query_lens[b] + i`` and attends to positions
    ``0`` through its own (causal). A fresh prompt has ``query_lens == seq_lens``; ``query_lens``
    of ones is decode, what :func:`paged_attention` computes; in between is a chunk of a prompt
    whose earlier chunks are cached; a query length of 0 is a sequence with nothing to compute this
    time. The K/V of the new tokens must already be in the cache.

    Args:
        query: ``(total_new_tokens, num_heads, head_dim)`` with ``total_new_tokens ==
            sum(query_lens)``; rows ``sum(query_lens[:b]) ..`` are sequence ``b``'s, in order.
        k_cache, v_cache, block_tables, scale, backend, k_scale, v_scale, softcap: as for
            :func:`paged_attention`.
        seq_lens: ``(batch,)`` integers, the tokens each sequence holds (new ones included), each
            in ``1 .. needed_blocks * block_size``.
        query_lens: ``(batch,)`` integers, each in ``0 .. seq_lens[b]``.
        sliding_window: as for :func:`paged_attention`, for each query token at its own position
            ``p``: the blocks wholly before the window of a sequence's first query token take no part.

    Returns:
        ``(total_new_tokens, num_heads, head_dim)``, packed like ``query``, with its dtype and
        device. Each row equals contiguous attention of that query over positions ``0 ..`` its own
        of its sequence (the last ``sliding_window`` of those, with a window).

    Raises:
        ValueError: as :func:`paged_attention`, or ``query_lens`` has the wrong type or shape, a
            query length is outside ``0 .. seq_lens[b]``, or they do not sum to the rows of
            ``query`` (the message names the argument).
    """
    seq_lens = _as_tensor("seq_lens", seq_lens, query)
    query_lens = _as_tensor("query_lens", query_lens, query)
    check_inputs(query, k_cache, v_cache, block_tables, seq_lens=seq_lens, query_lens=query_lens)
    lens = _check_values(k_cache, block_tables, seq_lens)
    new = query_lens.long().cpu()
    bad_new = (new < 0) | (new > lens)
    if bad_new.any():
        b = int(bad_new.nonzero()[0])
        raise ValueError(f"query_lens[{b}] = {int(new[b])} must be in 0 .. seq_lens[{b}] = {int(lens[b])}")
    if int(new.sum()) != query.shape[0]:
        raise ValueError(f"query_lens must sum to the {query.shape[0]} rows of query, got {int(new.sum())}")
    starts = torch.nn.functional.pad(torch.cumsum(new, 0), (1, 0))
    metadata = AttentionMetadata(
        query_start_loc=starts.to(query.device),
        query_start_loc_cpu=starts,
        query_lens=query_lens.long(),
        seq_lens=seq_lens.long(),
        block_table=block_tables,
        num_reqs=len(new),
        max_query_len=int(new.max()) if len(new) else 0,
    )
    return _run(query, k_cache, v_cache, metadata, backend, scale, k_scale, v_scale, sliding_window, softcap)


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
    backend: str | None = None,
    check: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`paged_prefill_attention` in vLLM's words: the packed batch given by
    ``query_start_loc``, as a model runner holds it, rather than by query lengths.

    Args:
        query, k_cache, v_cache, block_tables, scale, backend, k_scale, v_scale, sliding_window,
            softcap: as for :func:`paged_prefill_attention`.
        seq_lens: ``(batch,)`` integer tensor on the query's device: the tokens each sequence holds,
            its query tokens included (vLLM: ``CommonAttentionMetadata.seq_lens``).
        query_start_loc: ``(batch + 1,)`` integer tensor on the query's device: ``0``, then the
            running sum of the query lengths, so sequence ``b``'s query tokens are rows
            ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of ``query`` and the last entry is
            ``query.shape[0]`` (vLLM: ``CommonAttentionMetadata.query_start_loc``).
        max_query_len: the longest query length, when the caller knows it on the host (vLLM's
            metadata carries it); it must be right, and is not checked against the starts.
        query_start_loc_cpu: ``query_start_loc``'s copy on the host, when the caller keeps one (vLLM's
            metadata does, under this name); it must be right. Without it the starts are read from
            the device once.
        check: ``False`` skips the checks of the values (that the lengths fit the tables and the
            starts are consistent), which read the lengths and the tables back to the host; the
            types, shapes, dtypes and devices are checked either way.

    Returns:
        What :func:`paged_prefill_attention` returns for ``query_lens = query_start_loc[1:] -
        query_start_loc[:-1]``.

    Raises:
        ValueError: as :func:`paged_prefill_attention`, naming ``seq_lens`` or ``query_start_loc``
            (which must start at 0, never decrease and end at the rows of ``query``, each step at
            most its sequence's length), or ``max_query_len`` below 0; with ``check=False`` only the
            checks that read no value.
    """
    check_inputs(query, k_cache, v_cache, block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc)
    if max_query_len is not None:
        max_query_len = check_count("max_query_len", max_query_len)
    starts = query_start_loc.long().cpu() if query_start_loc_cpu is None else query_start_loc_cpu.long()
    new = starts[1:] - starts[:-1]
    if check:
        lens = _check_values(k_cache, block_tables, seq_lens)
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
    if max_query_len is None:
        max_query_len = int(new.max()) if len(new) else 0
    metadata = AttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=starts,
        query_lens=query_start_loc[1:].long() - query_start_loc[:-1].long(),
        seq_lens=seq_lens.long(),
        block_table=block_tables,
        num_reqs=len(new),
        max_query_len=max_query_len,
    )
    return _run(query, k_cache, v_cache, metadata, backend, scale, k_scale, v_scale, sliding_window, softcap)


def _run(query, k_cache, v_cache, metadata, backend, scale, k_scale, v_scale, sliding_window, softcap):
    """One registered backend's ``forward`` over checked tensors and metadata (the K/V in the cache)."""
    name = check_backend_name(backend)
    window = check_window(sliding_window)
    softcap = None if softcap is None else check_positive("softcap", softcap)
    kv_cache = LayerKVCache(k_cache, v_cache, k_scale, v_scale)
    impl = attention_backend(name, query.device, query.dtype, k_cache.dtype)(
        query.shape[1], query.shape[2], scale, k_cache.shape[1], window, softcap
    )
    return impl.forward(query, None, None, kv_cache, metadata)


def _check_values(k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The lengths on the host, after one read of the device: each at least 1 and within its row's
    block ids, which must lie below the pool's size; a ``ValueError`` naming the argument."""
    lens, table = seq_lens.long().cpu(), block_tables.long().cpu()
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[2]
    needed = (lens + block_size - 1) // block_size
    used = torch.arange(table.shape[1]) < needed[:, None]  # the entries each sequence reads
    bad_len = (lens < 1) | (needed > table.shape[1]) | (used & (table < 0)).any(dim=1)
    if bad_len.any():
        b = int(bad_len.nonzero()[0])
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} must be at least 1 and fit in its row of block_tables "
            f"({table[b].tolist()}, block_size {block_size})"
        )
    bad_id = used & (table >= num_blocks)
    if bad_id.any():
        b, j = bad_id.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{b}, {j}] = {int(table[b, j])} is not a block id below {num_blocks}")
    return lens


def _as_tensor(name: str, value: object, query: object) -> object:
    """``value`` if a tensor, else ``torch.as_tensor`` of it on the query's device; a ``ValueError``
    naming it when it is not numbers."""
    if isinstance(value, torch.Tensor):
        return value
    device = query.device if isinstance(query, torch.Tensor) else None
    try:
        tensor = torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be integers, got {value!r}") from None
    return tensor if tensor.numel() else tensor.long()  # [] makes floats


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | Sequence[int],
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, read through its block table into contiguous tensors.

    Args:
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``.
        block_table: the sequence's physical block ids in logical order, a list of ints or a 1-D
            integer tensor (a row of ``block_tables_tensor``, say). Entries past the first
            ``ceil(seq_len / block_size)`` are padding (``-1`` by convention) and are never read.
        seq_len: the tokens to read, positions ``0 .. seq_len - 1``.

    Returns:
        ``(k, v)``, each ``(seq_len, num_kv_heads, head_dim)`` on the caches' device, row ``p``
        holding token ``p``: what :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.read_kv` returns for
        a sequence of ``seq_len`` tokens.

    Raises:
        ValueError: a cache is not 4-D or the two differ in shape, ``seq_len`` is not a non-negative
            integer, ``block_table`` is not 1-D integers, or one of the entries read is missing or
            not a block id below ``num_blocks`` (the message names the argument).

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
    seq_len = check_count("seq_len", seq_len)
    num_blocks, _, block_size, _ = k_cache.shape
    needed = blocks_for_tokens(seq_len, block_size)
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
            f"block_table must hold {needed} block ids below {num_blocks} for {seq_len} tokens in blocks "
            f"of {block_size}, got {table.tolist()}"
        )
    blocks = ids.to(k_cache.device)[None]  # a batch of one
    k, v = (gather_blocks(cache, blocks)[0, :, :seq_len].transpose(0, 1) for cache in (k_cache, v_cache))
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
        when there are fewer K/V heads). Half and bfloat16 inputs are computed in float32 and cast
        back.

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
            or not heads_fit(q.shape[0], tensor.shape[1])
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
    dtype = compute_dtype(q.dtype)
    heads_first = [t.transpose(0, 1)[None].to(dtype) for t in (k, v)]  # (1, heads, tokens, dim)
    return attend(q[None].to(dtype), *heads_first, scale)[0].to(q.dtype)

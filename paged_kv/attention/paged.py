"""Paged attention: decode (one query token per sequence) and prefill, attending to K/V kept in blocks.

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
own position; it reuses the same gather and the same attention, with a causal mask instead.

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
and ``num_queries_per_kv = num_heads // num_kv_heads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_kv.attention.flex import flex_decode
from paged_kv.attention.triton_decode import triton_decode
from paged_kv.core.block import blocks_for_tokens
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
) -> torch.Tensor:
    """Decode attention for a batch of sequences whose K/V live in a paged cache.

    Args:
        query: ``(batch, num_heads, head_dim)``, the new token of each sequence.
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``, with ``num_kv_heads``
            dividing ``num_heads`` (equal: multi-head; fewer: grouped-query; one: multi-query).
            Query head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``.
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
            at once. It computes in the caches' dtype, so half-precision caches are gathered instead.
            ``"auto"`` (default) reads in place when the caches are in the compute dtype, the batch
            reads at least half the pool, and shared blocks, if any, are read by at least a quarter
            of the rows on average; it gathers otherwise. ``"flex"``
            runs FlexAttention over the whole pool with a block mask built from the tables
            (:mod:`paged_kv.attention.flex`; torch 2.5 or later): compiled into one kernel on CUDA, unfused
            and slow elsewhere. ``"triton"`` runs this course's Triton kernel, one program per
            (sequence, KV head) walking its block table with an online softmax
            (:mod:`paged_kv.attention.triton_decode`; the triton package, Linux only): compiled on
            CUDA, in Triton's interpreter on the CPU (``TRITON_INTERPRET=1`` in the environment
            before triton is imported); it reads float32, float16 and bfloat16 caches, and caches
            of any strides, such as a permuted view of vLLM's. ``"auto"`` never picks ``"flex"``
            or ``"triton"``.

    Returns:
        ``(batch, num_heads, head_dim)``, with the dtype and device of ``query``. Row ``b`` equals
        contiguous attention of ``query[b]`` over the first ``context_lens[b]`` tokens of its
        sequence, their K/V repeated along the head axis to ``num_heads`` heads
        (``repeat_interleave(num_heads // num_kv_heads)``). Half and bfloat16 inputs are computed in
        float32 and cast back.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device (among them caches whose
            heads do not divide ``num_heads`` or whose head_dim differs from ``query``'s), or a context
            length is below 1 or needs blocks its row does not hold (the message names the argument);
            or the strategy cannot run here (``"flex"`` on a torch before 2.5; ``"triton"`` without
            the triton package, on a dtype it does not read, off CUDA without Triton's interpreter,
            or with ``TRITON_INTERPRET`` changed since triton was imported).
    """
    context_lens, _ = _check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "flex":
        out = flex_decode(query.to(k_cache.dtype), k_cache, v_cache, block_tables, context_lens, scale)
        return out.to(query.dtype)
    if strategy == "triton":
        return triton_decode(query, k_cache, v_cache, block_tables, context_lens, scale)
    if strategy != "gather" and k_cache.dtype == compute_dtype:
        reads = _BlockReads.of(k_cache.shape[0], k_cache.shape[2], block_tables, context_lens)
        if strategy == "in_place" or reads.worth_reading_in_place(k_cache.shape[0], len(query)):
            return _decode_in_place(query, k_cache, v_cache, block_tables, context_lens, scale, reads)

    # 1. Gather each sequence's blocks in table order (padding is read from a real block, masked in 2).
    k, v, positions = _gather_batch(k_cache, v_cache, block_tables, compute_dtype)

    # 2. Positions at or past the context length do not exist: the attention masks them out.
    beyond = positions[None, :] >= context_lens[:, None]  # (batch, positions)
    return _attend(query.to(compute_dtype), k, v, scale, beyond).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | Sequence[int],
    query_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Causal prefill attention for a batch of sequences whose K/V live in a paged cache.

    Sequence ``b`` holds ``context_lens[b]`` tokens in the cache, of which the last
    ``query_lens[b]`` are new: their queries are packed into ``query``, sequence after sequence.
    New token ``i`` of sequence ``b`` sits at position ``context_lens[b] - query_lens[b] + i`` and
    attends to positions ``0`` through its own (causal). A fresh prompt has ``query_lens ==
    context_lens``; ``query_lens`` of ones is decode, what :func:`paged_attention` computes; in
    between is a chunk of a prompt whose earlier chunks are cached. The K/V of the new tokens must
    already be written into the cache.

    Args:
        query: ``(total_new_tokens, num_heads, head_dim)`` with ``total_new_tokens ==
            sum(query_lens)``; rows ``sum(query_lens[:b]) ..`` are sequence ``b``'s, in order.
        k_cache, v_cache: ``(num_blocks, num_kv_heads, block_size, head_dim)``, with ``num_kv_heads``
            dividing ``num_heads``, grouped as for :func:`paged_attention`.
        block_tables: ``(batch, max_blocks)`` integer tensor of physical block ids; entries past
            the blocks a sequence needs are padding (``-1`` by convention, any value works).
        context_lens: ``(batch,)`` integers, the tokens each sequence holds (new ones included),
            each in ``1 .. needed_blocks * block_size`` as for :func:`paged_attention`.
        query_lens: ``(batch,)`` integers, each in ``0 .. context_lens[b]``.
        scale: the factor applied to ``q · k``; defaults to ``1 / sqrt(head_dim)``.

    Returns:
        ``(total_new_tokens, num_heads, head_dim)``, packed like ``query``, with its dtype and
        device. Each row equals contiguous attention of that query over positions ``0 ..`` its
        own position of its sequence (K/V repeated to ``num_heads`` heads). Half and bfloat16
        inputs are computed in float32 and cast back.

    Raises:
        ValueError: as :func:`paged_attention`, or ``query_lens`` has the wrong type or shape, a
            query length is outside ``0 .. context_lens[b]``, or they do not sum to the rows of
            ``query`` (the message names the argument).

    The new tokens are padded to the longest query length, so the batch is one gather and one
    masked attention, with no Python loop over sequences; the padding rows are dropped at the end.
    """
    context_lens, query_lens = _check_inputs(query, k_cache, v_cache, block_tables, context_lens, query_lens)
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    device, (total, num_heads, head_dim), batch = query.device, query.shape, block_tables.shape[0]
    k, v, positions = _gather_batch(k_cache, v_cache, block_tables, compute_dtype)

    # Unpack: packed row t is new token index[t] of sequence seq[t]. Pad to (batch, max_q, ...).
    seq = torch.repeat_interleave(torch.arange(batch, device=device), query_lens, output_size=total)
    starts = torch.cumsum(query_lens, 0) - query_lens
    index = torch.arange(total, device=device) - starts[seq]
    max_q = int(query_lens.max()) if batch else 0  # the padded width is a shape: one sync
    padded = torch.zeros(batch, max_q, num_heads, head_dim, dtype=compute_dtype, device=device)
    padded[seq, index] = query.to(compute_dtype)

    # Slot i of row b is position context_lens[b] - query_lens[b] + i and sees positions up to its
    # own. Padding slots (i >= query_lens[b]) lie past the context: what they see is dropped below.
    query_positions = (context_lens - query_lens)[:, None] + torch.arange(max_q, device=device)
    beyond = positions[None, None, :] > query_positions[:, :, None]  # (batch, max_q, positions)
    out = _attend(padded.transpose(1, 2), k, v, scale, beyond)  # (batch, heads, max_q, dim)
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
    how many entries read them.
    """

    blocks: torch.Tensor
    rows: torch.Tensor
    shared: torch.Tensor
    shared_entries: int

    @classmethod
    def of(
        cls, num_blocks: int, block_size: int, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> _BlockReads:
        needed = (context_lens + block_size - 1) // block_size
        used = torch.arange(block_tables.shape[1], device=block_tables.device) < needed[:, None]
        blocks = block_tables.long()[used]
        rows = torch.arange(len(block_tables), device=block_tables.device)[:, None].expand_as(used)[used]
        readers = torch.bincount(blocks, minlength=num_blocks)
        shared = torch.nonzero(readers > 1).flatten()
        return cls(blocks, rows, shared, int(readers[shared].sum()))

    def worth_reading_in_place(self, num_blocks: int, batch: int) -> bool:
        """``"auto"``'s choice: the batch reads at least half the pool (the in-place products cover
        all of it), and the shared blocks are not so thinly shared that meeting every row's query
        wastes more than four times the work."""
        distinct = len(self.blocks) - self.shared_entries + len(self.shared)
        thin = batch * len(self.shared) > 4 * self.shared_entries
        return 2 * distinct >= num_blocks and not thin


def _decode_in_place(query, k_cache, v_cache, block_tables, context_lens, scale, reads) -> torch.Tensor:
    """Decode attention that reads the blocks where they lie.

    Each block only one row reads meets that row's query once: scores for the whole pool come from
    one batched product in physical order, and so do the per-block partial outputs, without copying
    K or V; a block's query heads are grouped ``(num_kv_heads, group)`` so each group meets its one
    K/V head in the same product. The blocks several rows read (``reads.shared``, typically a
    shared prompt prefix) are copied once each, and every row's query meets them in one dense
    product. Only the small score and weight tensors move to each sequence's table order, where the
    softmax runs, and back. (On a CPU, copying every block of a batch costs several times the
    attention itself; bench/bench_attention.py measures it.)
    """
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    num_heads = query.shape[1]
    batch, width = block_tables.shape
    scale = head_dim**-0.5 if scale is None else scale
    q = query.to(k_cache.dtype)
    num_shared = len(reads.shared)

    # Scores of every block with its one reader; row `batch` is a zero dummy, the "reader" of
    # blocks nobody reads and of shared blocks (their scores come from a dense product below).
    owner = torch.full((num_blocks,), batch, dtype=torch.long, device=q.device)
    positions = torch.arange(width * block_size, device=q.device)
    read = positions[::block_size][None, :] < context_lens[:, None]  # (batch, width): entries read
    table = torch.where(read, block_tables.long(), num_blocks)  # padding -> the dummy
    if num_shared:
        shared_index = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=q.device)
        shared_index[reads.shared] = torch.arange(num_shared, device=q.device)
        alone = shared_index[reads.blocks] < 0
        owner[reads.blocks[alone]] = reads.rows[alone]
    else:
        owner[reads.blocks] = reads.rows
    padded_q = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])
    # Block b's query heads, grouped (kv_heads, group, dim), against its K (kv_heads, dim, slots):
    # a group's heads are the rows of one small product with their KV head's slots.
    owner_q = _group_heads(padded_q[owner], num_kv_heads, dim=1)
    scores = (torch.matmul(owner_q, k_cache.transpose(-1, -2)) * scale).flatten(
        1, 2
    )  # (blocks, heads, slots)
    parts = [scores, scores.new_zeros(1, num_heads, block_size)]
    index = table
    if num_shared:  # every row's query against each shared block, copied once: (batch, shared, ...)
        k_shared, v_shared = k_cache[reads.shared], v_cache[reads.shared]
        grouped_q = _group_heads(q, num_kv_heads, dim=1)
        shared_scores = torch.einsum("bkgd,skpd->bskgp", grouped_q, k_shared) * scale
        parts.append(shared_scores.flatten(2, 3).flatten(0, 1))
        # A shared entry finds its scores in its own (row, shared block) row, after the dummy.
        row_start = num_blocks + 1 + torch.arange(batch, device=q.device)[:, None] * num_shared
        entry_shared = shared_index[table]
        index = torch.where(entry_shared >= 0, row_start + entry_shared, table)
    # `index` is distinct for every entry read, except that a row listing one shared block twice
    # finds both entries' scores in the same (row, shared block) row: their weights add up below.
    source = torch.cat(parts)

    in_order = source[index].permute(0, 2, 1, 3).reshape(batch, num_heads, width * block_size)
    in_order = in_order.masked_fill((positions[None, :] >= context_lens[:, None])[:, None], float("-inf"))
    weights = torch.softmax(in_order, dim=-1).view(batch, num_heads, width, block_size).permute(0, 2, 1, 3)

    per_source = source.new_zeros(source.shape)
    # Back where the scores came from; padding lands on the dummy. Two entries of one row naming
    # the same block meet the same V, so their weights are summed (only shared blocks can repeat).
    per_source.index_put_((index,), weights, accumulate=bool(num_shared))
    partial = torch.matmul(_group_heads(per_source[:num_blocks], num_kv_heads, dim=1), v_cache).flatten(1, 2)
    out = q.new_zeros(batch + 1, num_heads, head_dim).index_add_(0, owner, partial)[:batch]
    if num_shared:
        shared_weights = per_source[num_blocks + 1 :].view(batch, num_shared, num_heads, block_size)
        grouped_weights = _group_heads(shared_weights, num_kv_heads, dim=2)
        out += torch.einsum("bskgp,skpd->bkgd", grouped_weights, v_shared).flatten(1, 2)
    return out.to(query.dtype)


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
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's K and V in table order, in ``dtype``, and the positions they hold.

    Returns ``k`` and ``v`` of shape ``(batch, num_heads, max_blocks * block_size, head_dim)`` and
    ``positions = arange(max_blocks * block_size)``. Padding entries are clamped to a real block
    (any one will do): the caller masks out the positions they hold.
    """
    num_blocks, _, block_size, _ = k_cache.shape
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    k, v = (_gather_blocks(cache, blocks).to(dtype) for cache in (k_cache, v_cache))
    return k, v, torch.arange(blocks.shape[1] * block_size, device=k.device)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    beyond: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a batch: q ``(batch, heads, [queries,] dim)``, k, v ``(batch, kv_heads, slots, dim)``.

    Decode has one query per row and no ``queries`` axis; prefill has one. ``heads`` is a multiple
    of ``kv_heads``: query head ``h`` meets KV head ``h // (heads // kv_heads)``. The query heads
    are viewed as ``(kv_heads, group)`` and the products broadcast over the group, so no K or V is
    copied per query head. ``beyond`` is a ``(batch, [queries,] positions)`` bool mask of the
    positions a query must not see; they get a score of ``-inf`` before the softmax. Returns q's shape.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grouped = _group_heads(q, k.shape[1], dim=1)  # (batch, kv_heads, group, [queries,] dim)
    scores = torch.einsum("bkg...d,bkpd->bkg...p", grouped, k) * scale
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
    query, k_cache, v_cache, block_tables, context_lens, query_lens=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raise ``ValueError`` naming the bad argument; return ``context_lens``, ``query_lens`` as LongTensors.

    Decode (``query_lens`` None): ``query`` has one row per sequence. Prefill: ``block_tables``
    gives the batch and ``query`` holds ``sum(query_lens)`` packed rows.
    """
    named = {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or not query.dtype.is_floating_point:
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
    for name in ("k_cache", "v_cache"):
        if named[name].dtype != query.dtype:
            raise ValueError(f"{name} has dtype {named[name].dtype} but query has {query.dtype}")
    lengths = {"context_lens": context_lens, "query_lens": query_lens}
    if query_lens is None:  # decode
        del lengths["query_lens"]
    for name, value in lengths.items():
        named[name] = _as_tensor(name, value, query.device)
    for name, tensor in named.items():
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    for name in ("block_tables", *lengths):
        dtype = named[name].dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {dtype}")
    if query_lens is None:  # decode: one query row per sequence
        batch = query.shape[0]
        if block_tables.dim() != 2 or block_tables.shape[0] != batch:
            raise ValueError(f"block_tables must be ({batch}, max_blocks), got {tuple(block_tables.shape)}")
    else:  # prefill: the table rows are the sequences
        if block_tables.dim() != 2:
            raise ValueError(f"block_tables must be 2-D (batch, max_blocks), got {tuple(block_tables.shape)}")
        batch = block_tables.shape[0]
    for name in lengths:
        if named[name].shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(named[name].shape)}")
    context_lens = named["context_lens"]

    # The values: one copy to the CPU, then every sequence checked at once.
    lens, table = context_lens.long().cpu(), block_tables.long().cpu()
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[2]
    needed = (lens + block_size - 1) // block_size
    used = torch.arange(table.shape[1]) < needed[:, None]  # the entries each sequence reads
    bad_len = (lens < 1) | (needed > table.shape[1]) | (used & (table < 0)).any(dim=1)
    if bad_len.any():
        b = int(bad_len.nonzero()[0])
        raise ValueError(
            f"context_lens[{b}] = {int(lens[b])} must be at least 1 and fit in its row of block_tables "
            f"({table[b].tolist()}, block_size {block_size})"
        )
    bad_id = used & (table >= num_blocks)
    if bad_id.any():
        b, j = bad_id.nonzero()[0].tolist()
        raise ValueError(f"block_tables[{b}, {j}] = {int(table[b, j])} is not a block id below {num_blocks}")
    if query_lens is None:
        return context_lens.long(), None
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
    return context_lens.long(), query_lens


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

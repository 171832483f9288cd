"""``GATHER``, the course's reference backend: copy each request's blocks into contiguous K/V, then one
masked attention (lessons 05, 06).

This is the attention lesson 05 builds. Every request's table entries are gathered with advanced
indexing (``k_cache[blocks]``) into a ``(batch, heads, positions, head_dim)`` copy in table order,
the queries are padded to the longest query length, and one attention runs over the whole batch
with the positions a query may not see masked out: past its own position (causal inside a chunk),
past its request's length, and before its window. No Python loop over requests. Every block is read
to copy it, the copy written, then read again: three passes over K and V where attention needs
one, which is what the other backends avoid.

With a sliding window each request's copy starts at the first entry its first query token's window
reaches and holds as many entries as ``max_query_len + window - 1`` positions can span: the blocks
wholly before the windows are never copied. V is zeroed at the positions no query of the request
sees, which may hold anything (a zero weight does not cancel NaN). Half-precision inputs are
computed in float32 (float64 in float64); an fp8 cache's gathered bytes, not the pool, are
dequantized to the query's dtype (``stored * scale``, :func:`~paged_kv.kv.fp8.dequantize`).
"""

from __future__ import annotations

import torch

from paged_kv.attention.backend import AttentionImpl, LayerKVCache, compute_dtype
from paged_kv.attention.heads import group_heads
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.kv.fp8 import dequantize


class GatherImpl(AttentionImpl):
    """The reference: every request's blocks gathered, one masked attention (see the module)."""

    name = "GATHER"

    def _attend(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        dtype = compute_dtype(query.dtype)
        window = self.sliding_window
        longest = metadata.max_query_len
        first_pos = metadata.seq_lens - metadata.query_lens  # each row's first query token's position
        first = span = None
        if window is not None:
            first = first_entries(first_pos, window, kv_cache.block_size)
            span = min(
                metadata.block_table.shape[1], blocks_spanned(longest + window - 1, kv_cache.block_size)
            )
        k, v, positions = gather_batch(kv_cache, metadata.block_table, dtype, query.dtype, first, span)
        padded, query_pos, seq, index = pad_queries(query.to(dtype), metadata)
        beyond = positions[:, None, :] > query_pos[:, :, None]  # (batch, max_q, positions)
        if window is not None:
            beyond |= positions[:, None, :] <= query_pos[:, :, None] - window
            unseen = (positions >= metadata.seq_lens[:, None]) | (positions <= (first_pos - window)[:, None])
            v = v.masked_fill(unseen[:, None, :, None], 0)
        out = attend(padded.transpose(1, 2), k, v, self.scale, beyond, self.logits_soft_cap)
        return out.transpose(1, 2)[seq, index].to(query.dtype)


def first_entries(first_pos: torch.Tensor, window: int, block_size: int) -> torch.Tensor:
    """The first table entry each row's window reaches: the block of position ``first_pos - window +
    1`` (the first one the query at ``first_pos`` sees), or 0. Every entry before it lies wholly
    before the windows of the row's queries (at ``first_pos`` and after): it takes no part."""
    return (first_pos - window + 1).clamp(min=0) // block_size


def blocks_spanned(positions: int, block_size: int) -> int:
    """The most blocks ``positions`` consecutive positions can touch (at least one position)."""
    return (max(positions, 1) + block_size - 2) // block_size + 1


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The slots of ``blocks`` (a ``(batch, n)`` LongTensor of block ids), in table order.

    Returns ``(batch, num_heads, n * block_size, head_dim)``: position ``p`` of row ``b`` is offset
    ``p % block_size`` of block ``blocks[b, p // block_size]``.
    """
    batch, n = blocks.shape
    _, num_heads, block_size, head_dim = cache.shape
    per_block = cache[blocks]  # (batch, n, heads, block_size, dim)
    return per_block.transpose(1, 2).reshape(batch, num_heads, n * block_size, head_dim)


def gather_batch(
    kv_cache: LayerKVCache,
    block_tables: torch.Tensor,
    dtype: torch.dtype,
    query_dtype: torch.dtype,
    first: torch.Tensor | None = None,
    span: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's K and V in table order, in ``dtype``, and the positions they hold; from an fp8
    cache, the gathered bytes dequantized to ``query_dtype`` first.

    Returns ``k`` and ``v`` of shape ``(batch, num_heads, n * block_size, head_dim)`` and the
    positions of their slots: all ``n = max_blocks`` entries of each row, ``positions = arange(n *
    block_size)[None]``; or, given ``first`` (a ``(batch,)`` LongTensor) and ``span``, the ``n =
    span`` entries ``first[b] ..`` of row ``b``, ``positions`` ``(batch, span * block_size)``.
    Padding entries and those past the table are clamped to a real block (any one will do): the
    caller masks out the positions they hold.
    """
    num_blocks, block_size = kv_cache.num_blocks, kv_cache.block_size
    if first is None:
        blocks = block_tables.long().clamp(0, num_blocks - 1)
        positions = torch.arange(blocks.shape[1] * block_size, device=blocks.device)[None]
    else:
        entries = first[:, None] + torch.arange(span, device=first.device)  # (batch, span)
        table = block_tables.long().gather(1, entries.clamp(max=max(block_tables.shape[1] - 1, 0)))
        blocks = table.clamp(0, num_blocks - 1)
        slots = torch.arange(block_size, device=first.device)
        positions = (entries[:, :, None] * block_size + slots).flatten(1)
    pairs = ((kv_cache.k_cache, kv_cache.k_scale), (kv_cache.v_cache, kv_cache.v_scale))
    if kv_cache.is_fp8:  # the gathered bytes, not the pool, dequantized: then as floats
        k, v = (
            dequantize(gather_blocks(cache, blocks), scale, query_dtype).to(dtype) for cache, scale in pairs
        )
    else:
        k, v = (gather_blocks(cache, blocks).to(dtype) for cache, _ in pairs)
    return k, v, positions


def pad_queries(
    query: torch.Tensor, metadata: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed query padded to ``(batch, max_query_len, num_heads, head_dim)``, the position each
    padded query sees up to ``(batch, max_query_len)``, and the ``(seq, index)`` of each packed row in it.

    Slot ``i`` of row ``b`` is position ``seq_lens[b] - query_lens[b] + i``; padding slots (``i >=
    query_lens[b]``) lie past the sequence, and what they see is dropped at the end.
    """
    total, num_heads, head_dim = query.shape
    rows, longest, device = metadata.num_reqs, metadata.max_query_len, query.device
    seq = torch.repeat_interleave(torch.arange(rows, device=device), metadata.query_lens, output_size=total)
    index = torch.arange(total, device=device) - metadata.query_start_loc[seq]
    padded = query.new_zeros(rows, longest, num_heads, head_dim)
    padded[seq, index] = query
    query_pos = (metadata.seq_lens - metadata.query_lens)[:, None] + torch.arange(longest, device=device)
    return padded, query_pos, seq, index


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    beyond: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for a batch: q ``(batch, heads, [queries,] dim)``, k, v ``(batch, kv_heads, slots, dim)``.

    A single query per row may have no ``queries`` axis. ``heads`` is a multiple of ``kv_heads``:
    query head ``h`` meets KV head ``h // (heads // kv_heads)``. The query heads are viewed as
    ``(kv_heads, group)`` and the products broadcast over the group, so no K or V is copied per
    query head. ``softcap`` ``c``, when given, makes each score ``c * tanh(score / c)``. ``beyond``
    is a ``(batch, [queries,] positions)`` bool mask of the positions a query must not see; they get
    a score of ``-inf`` before the softmax (after the soft cap: a NaN score there is replaced too).
    Returns q's shape.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grouped = group_heads(q, k.shape[1], dim=1)  # (batch, kv_heads, group, [queries,] dim)
    scores = torch.einsum("bkg...d,bkpd->bkg...p", grouped, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if beyond is not None:
        scores = scores.masked_fill(beyond[:, None, None], float("-inf"))  # the same for every head
    weights = torch.softmax(scores, dim=-1)  # over the positions, for each head (and query)
    return torch.einsum("bkg...p,bkpd->bkg...d", weights, v).flatten(1, 2)

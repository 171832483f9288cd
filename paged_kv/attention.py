"""Paged decode attention: one query token per sequence, attending to K/V kept in blocks.

The kernel never sees a contiguous K or V. It follows each sequence's block table: logical block
``j`` of sequence ``b`` is physical block ``block_tables[b, j]`` of the cache, so token ``p`` sits
at offset ``p % block_size`` of block ``block_tables[b, p // block_size]``. This module is the
reference implementation the course builds in lesson 05: it gathers every sequence's blocks with
advanced indexing, then runs ordinary attention with the positions past ``context_len`` masked out.
A fast kernel such as vLLM's computes the same thing while reading the blocks in place, without the
gathered copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor | Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention for a batch of sequences whose K/V live in a paged cache.

    Args:
        query: ``(batch, num_heads, head_dim)``, the new token of each sequence.
        k_cache, v_cache: ``(num_blocks, num_heads, block_size, head_dim)``.
        block_tables: ``(batch, max_blocks)`` integer tensor of physical block ids; entries past
            the blocks a sequence needs are padding (``-1`` by convention, any value works).
        context_lens: ``(batch,)`` integers, the tokens each sequence holds, each in
            ``1 .. needed_blocks * block_size`` where its first ``needed_blocks`` entries are valid.
        scale: the factor applied to ``q · k``; defaults to ``1 / sqrt(head_dim)``.

    Returns:
        ``(batch, num_heads, head_dim)``, with the dtype and device of ``query``. Row ``b`` equals
        contiguous attention of ``query[b]`` over the first ``context_lens[b]`` tokens of its
        sequence. Half and bfloat16 inputs are computed in float32 and cast back.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype or device, or a context length is
            below 1 or needs blocks its row does not hold (the message names the argument).
    """
    context_lens = _check_inputs(query, k_cache, v_cache, block_tables, context_lens)
    batch, num_heads, head_dim = query.shape
    num_blocks, _, block_size, _ = k_cache.shape
    scale = head_dim**-0.5 if scale is None else scale
    compute_dtype = torch.promote_types(query.dtype, torch.float32)

    # 1. Gather each sequence's blocks in table order. Padding is clamped to a real block (any one
    #    will do) and masked out in step 3.
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        per_block = cache[blocks].to(compute_dtype)  # (batch, max_blocks, heads, block_size, dim)
        return per_block.transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)

    # 2. Scores of the query against every gathered position: (batch, heads, positions).
    scores = torch.einsum("bhd,bhpd->bhp", query.to(compute_dtype), k) * scale

    # 3. Positions at or past the context length do not exist: mask them before the softmax.
    positions = torch.arange(num_positions, device=query.device)
    beyond = positions[None, :] >= context_lens[:, None]  # (batch, positions)
    scores = scores.masked_fill(beyond[:, None, :], float("-inf"))

    # 4. Softmax over positions, then the weighted sum of V.
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bhp,bhpd->bhd", weights, v).to(query.dtype)


def _check_inputs(query, k_cache, v_cache, block_tables, context_lens) -> torch.Tensor:
    """Raise ``ValueError`` naming the bad argument; return ``context_lens`` as a LongTensor."""
    named = {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or not query.dtype.is_floating_point:
        raise ValueError(f"query must be a 3-D float tensor, got {query.dtype} {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[1] != query.shape[1] or k_cache.shape[3] != query.shape[2]:
        raise ValueError(
            f"k_cache must have shape (num_blocks, {query.shape[1]}, block_size, {query.shape[2]}) "
            f"to match query's heads and head_dim, got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    for name in ("k_cache", "v_cache"):
        if named[name].dtype != query.dtype:
            raise ValueError(f"{name} has dtype {named[name].dtype} but query has {query.dtype}")
    if not isinstance(context_lens, torch.Tensor):
        try:
            context_lens = torch.as_tensor(context_lens, device=query.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"context_lens must be integers, got {context_lens!r}") from None
        context_lens = context_lens if context_lens.numel() else context_lens.long()  # [] makes floats
    named["context_lens"] = context_lens
    for name, tensor in named.items():
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    for name in ("block_tables", "context_lens"):
        dtype = named[name].dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {dtype}")
    batch = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be ({batch}, max_blocks), got {tuple(block_tables.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must have shape ({batch},), got {tuple(context_lens.shape)}")

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
    return context_lens.long()

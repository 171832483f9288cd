"""Paged decode attention through PyTorch's FlexAttention: the optional fast path for CUDA.

FlexAttention (``torch.nn.attention.flex_attention``, torch 2.5 and later) runs attention with a
*mask function* that says, for each query and key position, whether the query may see the key,
and a *block mask* that lets the kernel skip whole tiles nobody may see. Compiled with
``torch.compile`` on a GPU it becomes one fused Triton kernel.

Paged decode maps onto it without moving a byte of K or V:

* the keys are the **whole pool**, viewed as one long sequence of ``num_blocks * block_size``
  positions (``k_cache.transpose(0, 1)`` flattened: a view, no copy when the cache is contiguous);
* the queries are the batch's new tokens, one query position per sequence;
* query ``b`` may see key ``kv`` when physical block ``kv // block_size`` appears in row ``b`` of
  the block table, at logical index ``j``, and the logical position ``j * block_size +
  kv % block_size`` is below ``context_lens[b]``. A small inverse table ``logical[b, block]``
  (-1 where the row does not hold the block) answers that in one lookup, and it allows the same
  physical block in several rows, so blocks shared by fork or a prefix cache need nothing special.

The result equals :func:`paged_kv.attention.paged_attention` (the reference). On a CPU FlexAttention
runs unfused (it materialises the scores over the whole pool), which is correct but slow: this path
is for CUDA, and tests check it against the reference wherever it runs. One difference from the
reference: a masked-out slot still meets a zero weight in ``weights @ V``, so the pool must hold
finite values (it starts as zeros and only ever holds K/V written to it; NaN planted in a free block
would leak through, where the reference ignores it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def flex_available() -> bool:
    """Whether this torch has FlexAttention (torch 2.5 or later)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Decode attention of checked inputs (see ``paged_attention``) with FlexAttention.

    ``query`` is ``(batch, heads, dim)`` in the caches' dtype; ``context_lens`` is a long tensor on
    the query's device. ``compiled`` defaults to ``True`` on CUDA and ``False`` elsewhere.

    Raises:
        ValueError: this torch has no FlexAttention.
    """
    if not flex_available():
        raise ValueError(
            f"strategy 'flex' needs torch 2.5 or later (FlexAttention); this is {torch.__version__}"
        )
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks, num_heads, block_size, head_dim = k_cache.shape
    batch = query.shape[0]
    device = query.device
    if compiled is None:
        compiled = device.type == "cuda"
    mask_mod = _paged_mask(
        _logical_index(block_tables, context_lens, num_blocks, block_size), context_lens, block_size
    )
    pool = num_blocks * block_size
    block_mask = create_block_mask(mask_mod, None, None, batch, pool, device=device, _compile=compiled)
    keys = k_cache.transpose(0, 1).reshape(1, num_heads, pool, head_dim)
    values = v_cache.transpose(0, 1).reshape(1, num_heads, pool, head_dim)
    queries = query.transpose(0, 1).unsqueeze(0)  # (1, heads, batch, dim): one query position per row
    attend = _compiled_flex_attention() if compiled else flex_attention
    out = attend(queries, keys, values, block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)


@functools.cache
def _compiled_flex_attention() -> Callable:
    """``flex_attention`` compiled once per process: the fused kernel (Triton on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _logical_index(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """``(batch, num_blocks)``: the logical index of each physical block in each row, or -1.

    Only the entries a row reads (its first ``ceil(context_len / block_size)``) count, so padding
    never maps a block. One scatter, no loop.
    """
    batch, width = block_tables.shape
    index = torch.arange(width, device=block_tables.device).expand(batch, width)
    read = index < ((context_lens + block_size - 1) // block_size)[:, None]
    logical = torch.full((batch, num_blocks + 1), -1, dtype=torch.long, device=block_tables.device)
    targets = torch.where(read, block_tables.long(), num_blocks)  # unread entries go to a spare column
    logical.scatter_(1, targets, torch.where(read, index, -1))
    return logical[:, :num_blocks]


def _paged_mask(logical: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> Callable:
    """The mask function: query ``q`` (a sequence) sees pool position ``kv`` (a slot) or not."""

    def mask_mod(b, h, q, kv):
        j = logical[q, kv // block_size]
        return (j >= 0) & (j * block_size + kv % block_size < context_lens[q])

    return mask_mod

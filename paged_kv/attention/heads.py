"""Grouped-query attention's head grouping: which K/V head each query head reads (lessons 05, 06, 09).

With grouped-query attention a model has ``num_heads`` query heads but stores only
``num_kv_heads`` K/V heads, a divisor of it; multi-query attention is ``num_kv_heads == 1``. Query
head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``: consecutive query heads share one.
"""

from __future__ import annotations

import torch


def heads_fit(num_heads: int, num_kv_heads: int) -> bool:
    """Whether ``num_heads`` query heads can share ``num_kv_heads`` K/V heads in equal groups."""
    return num_kv_heads >= 1 and num_heads % num_kv_heads == 0


def repeat_kv_heads(t: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """``t`` with each of its K/V heads (axis ``dim``) repeated for the query heads it serves.

    Query head ``h`` of ``num_heads`` reads K/V head ``h // (num_heads // num_kv_heads)``, as in
    Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa``; with as many K/V heads as query heads
    ``t`` is returned as it is.
    """
    group = num_heads // t.shape[dim]
    return t if group == 1 else t.repeat_interleave(group, dim=dim)


def group_heads(t: torch.Tensor, num_kv_heads: int, dim: int) -> torch.Tensor:
    """``t`` with its query-head axis ``dim`` split into ``(num_kv_heads, group)``: a view, no copy.

    Query head ``h`` lands at ``(h // group, h % group)``: the heads of one group are consecutive
    and share KV head ``h // group``, as Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa`` pair
    them. ``flatten(dim, dim + 1)`` undoes it.
    """
    return t.unflatten(dim, (num_kv_heads, t.shape[dim] // num_kv_heads))

"""Grouped-query attention's head grouping: which K/V head each query head reads (lessons 05, 09).

With grouped-query attention a model has ``num_heads`` query heads but stores only
``num_kv_heads`` K/V heads, a divisor of it; multi-query attention is ``num_kv_heads == 1``. Query
head ``h`` reads K/V head ``h // (num_heads // num_kv_heads)``: consecutive query heads share one.
"""

from __future__ import annotations

import torch


def repeat_kv_heads(t: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """``t`` with each of its K/V heads (axis ``dim``) repeated for the query heads it serves.

    Query head ``h`` of ``num_heads`` reads K/V head ``h // (num_heads // num_kv_heads)``, as in
    Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa``; with as many K/V heads as query heads
    ``t`` is returned as it is.
    """
    group = num_heads // t.shape[dim]
    return t if group == 1 else t.repeat_interleave(group, dim=dim)

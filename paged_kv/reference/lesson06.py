"""Exercise 06 graded on the package: ``gqa_decode_attention`` is
:func:`paged_kv.attention.paged.paged_attention` itself (it takes caches of fewer K/V heads than the
query has, query head ``h`` reading K/V head ``h // (num_heads // num_kv_heads)``); ``packed_attention``
is :func:`paged_kv.attention.paged.paged_prefill_attention` itself, and ``chunk_attention`` is that
function on a batch of one sequence, all its query rows new. Their extra ``scale`` keeps its default,
``1 / sqrt(head_dim)``. They are bound here at import, so the checks, which make
``paged_kv.attention.paged``'s functions raise while a learner's code runs, still grade the package
through them.
"""

from collections.abc import Sequence as _Sequence

import torch as _torch

from paged_kv.attention.paged import paged_attention as gqa_decode_attention
from paged_kv.attention.paged import paged_prefill_attention as packed_attention

__all__ = ["chunk_attention", "gqa_decode_attention", "packed_attention"]


def chunk_attention(
    query: _torch.Tensor,
    k_cache: _torch.Tensor,
    v_cache: _torch.Tensor,
    block_table: _torch.Tensor | _Sequence[int],
    seq_len: int,
) -> _torch.Tensor:
    """The last ``query.shape[0]`` of a sequence's ``seq_len`` positions, attending causally."""
    row = _torch.as_tensor(block_table, device=query.device)[None]
    return packed_attention(query, k_cache, v_cache, row, [int(seq_len)], [query.shape[0]])

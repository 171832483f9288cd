"""Attention over contiguous K and V, the reference every paged attention is held to (lessons 05, 09, 13).

A prefill with no cache, the contiguous baseline cache, and the tests' references all attend over K
and V held as one tensor per sequence. :func:`causal_attention` is that attention with every
variation a model's layer may ask for: grouped-query heads, a sliding window (the token at
position ``p`` sees positions ``p - sliding_window + 1 .. p``, Hugging Face's and vLLM's
convention), a score scale and Gemma 2's soft cap of the scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_kv.attention.heads import repeat_kv_heads


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``(batch, tokens, heads, head_dim)`` tensors, ``q``'s shape out.

    ``q``'s tokens are the last ``q.shape[1]`` of ``k``'s: query ``i`` sits at position
    ``k.shape[1] - q.shape[1] + i`` and sees positions up to its own, only the last
    ``sliding_window`` of them when it is set. Scores are ``scale * q · k`` (default
    ``1 / sqrt(head_dim)``), then ``softcap * tanh(score / softcap)`` when ``softcap`` is set,
    before the mask and the softmax (Gemma 2's order). ``k`` and ``v`` may have fewer heads than
    ``q`` (grouped-query attention): they are repeated.
    """
    k, v = (repeat_kv_heads(t, q.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, tokens, dim)
    num_queries, num_keys = q.shape[2], k.shape[2]
    if sliding_window is None and softcap is None and num_queries in (1, num_keys):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=num_queries > 1, scale=scale)
        return out.transpose(1, 2)
    positions = torch.arange(num_keys, device=q.device)
    query_positions = positions[num_keys - num_queries :, None]
    visible = positions[None, :] <= query_positions
    if sliding_window is not None:
        visible &= positions[None, :] > query_positions - sliding_window
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap is not None:  # Gemma 2: scores squashed into (-softcap, softcap)
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return (weights @ v.float()).to(q.dtype).transpose(1, 2)

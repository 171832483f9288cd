"""The chunk attends over its own new tokens alone, as a fresh prompt would: the cached ones go unseen."""

import torch

from paged_kv.grading.reference.lesson06 import *  # every other task stays right

BREAKS = "06.chunk_attention"
MESSAGE = "the chunk attends over its own tokens only"


def chunk_attention(query, k_cache, v_cache, block_table, context_len):
    q, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    blocks = torch.as_tensor(block_table, device=query.device).long()[: -(-context_len // block_size)]

    def gather(cache):
        return cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :context_len]

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("ikgd,kpd->kgip", query.view(q, num_kv_heads, group, head_dim), k) * head_dim**-0.5
    own = context_len - q + torch.arange(q, device=query.device)[:, None]
    p = torch.arange(context_len, device=query.device)[None, :]
    later = (p > own) | (p < context_len - q)  # the mistake: the cached positions are hidden
    scores = scores.masked_fill(later, float("-inf"))
    out = torch.einsum("kgip,kpd->ikgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(q, num_heads, head_dim)

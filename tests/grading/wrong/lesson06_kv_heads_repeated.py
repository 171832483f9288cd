"""K and V repeated with .repeat, not repeat_interleave: query head h meets KV head h % num_kv_heads."""

import torch

from paged_kv.reference.lesson06 import *  # every other task stays right

BREAKS = "06.gqa_decode_attention"
MESSAGE = "query head h reads KV head h % num_kv_heads"


def gqa_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    batch, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        k = cache[blocks].transpose(1, 2).reshape(batch, num_kv_heads, num_positions, head_dim)
        return k.repeat(1, num_heads // num_kv_heads, 1, 1)  # the mistake: kv0, kv1, kv0, kv1, ...

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5
    beyond = torch.arange(num_positions, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)

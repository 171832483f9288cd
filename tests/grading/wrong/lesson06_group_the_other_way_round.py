"""Query head h paired with KV head h // num_kv_heads, the group computed the other way round."""

import torch

from paged_kv.reference.lesson06 import *  # every other task stays right

BREAKS = "06.gqa_decode_attention"
MESSAGE = "the group is computed the other way round"


def gqa_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    batch, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size
    kv_head = torch.arange(num_heads, device=query.device) // num_kv_heads  # the mistake: // group

    def gather(cache):
        k = cache[blocks].transpose(1, 2).reshape(batch, num_kv_heads, num_positions, head_dim)
        return k[:, kv_head]

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5
    beyond = torch.arange(num_positions, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)

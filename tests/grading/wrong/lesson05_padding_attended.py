"""The padding clamped to a real block but never masked: its block, another sequence's, is attended."""

import torch

from paged_kv.reference.lesson05 import *  # every other task stays right

BREAKS = "05.paged_decode_attention"
MESSAGE = "the padding is clamped but still attended"


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    batch, num_heads, head_dim = query.shape
    num_blocks, _, block_size, _ = k_cache.shape
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5  # the mistake: no mask follows
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)

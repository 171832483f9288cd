"""Grouped heads right, but no mask: the stale slots past seq_len (and the padding) are attended."""

import torch

from paged_kv.reference.lesson06 import *  # every other task stays right

BREAKS = "06.gqa_decode_attention"
MESSAGE = "the positions past seq_len are not masked"


def gqa_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    batch, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    blocks = block_tables.long().clamp(0, num_blocks - 1)
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(batch, num_kv_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    grouped = query.view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bkpd->bkgp", grouped, k) * head_dim**-0.5  # the mistake: nothing masked
    out = torch.einsum("bkgp,bkpd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(batch, num_heads, head_dim)

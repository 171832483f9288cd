"""The padding -1 used as a block index: k_cache[-1], the last block of the cache, is read and attended."""

import torch

from paged_kv.reference.lesson05 import *  # every other task stays right

BREAKS = "05.paged_decode_attention"
MESSAGE = "k_cache[-1] is the last block of the cache"


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    batch, num_heads, head_dim = query.shape
    block_size = k_cache.shape[2]
    blocks = block_tables.long()  # the mistake: -1 names a block (the last one), and nothing masks it
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)

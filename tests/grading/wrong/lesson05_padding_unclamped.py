"""The padding used as a block index, unclamped: masked, -1 passes, but padding past all block ids crashes."""

import torch

from paged_kv.reference.lesson05 import *  # every other task stays right

BREAKS = "05.paged_decode_attention"
MESSAGE = "clamp block_tables to 0 .. num_blocks - 1 before indexing"


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens):
    batch, num_heads, head_dim = query.shape
    block_size = k_cache.shape[2]
    blocks = block_tables.long()  # the mistake: the padding indexes the cache as it is
    num_positions = blocks.shape[1] * block_size

    def gather(cache):
        return cache[blocks].transpose(1, 2).reshape(batch, num_heads, num_positions, head_dim)

    k, v = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bhd,bhpd->bhp", query, k) * head_dim**-0.5
    beyond = torch.arange(num_positions, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(beyond[:, None, :], float("-inf"))
    return torch.einsum("bhp,bhpd->bhd", torch.softmax(scores, dim=-1), v)

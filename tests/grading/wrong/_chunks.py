"""Exercise 06's wrong chunk attentions, each the right one with one mistake in its mask; the
``lesson06_chunk_*.py`` files import one each as the learner's ``chunk_attention`` (the grader keeps
a file's imports, not its other assignments)."""

import torch


def masked(hidden):
    """``chunk_attention`` that hides position ``p`` from query ``i`` where ``hidden(p, own, n, q)``
    holds, ``own`` being query ``i``'s position ``n - q + i`` (the right mask is ``p > own``)."""

    def chunk_attention(query, k_cache, v_cache, block_table, seq_len):
        q, num_heads, head_dim = query.shape
        _, num_kv_heads, block_size, _ = k_cache.shape
        group = num_heads // num_kv_heads
        blocks = torch.as_tensor(block_table, device=query.device).long()[: -(-seq_len // block_size)]

        def gather(cache):
            return cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]

        k, v = gather(k_cache), gather(v_cache)
        grouped = query.view(q, num_kv_heads, group, head_dim)
        scores = torch.einsum("ikgd,kpd->kgip", grouped, k) * head_dim**-0.5
        own = seq_len - q + torch.arange(q, device=query.device)[:, None]
        p = torch.arange(seq_len, device=query.device)[None, :]
        scores = scores.masked_fill(hidden(p, own, seq_len, q), float("-inf"))
        out = torch.einsum("kgip,kpd->ikgd", torch.softmax(scores, dim=-1), v)
        return out.reshape(q, num_heads, head_dim)

    return chunk_attention


# The cached positions are hidden too: the chunk attends over its own tokens alone.
chunk_alone = masked(lambda p, own, n, q: (p > own) | (p < n - q))
# No position is hidden: every query sees all n positions, later ones included.
not_causal = masked(lambda p, own, n, q: p > n + 0 * own)
# The offset taken as 0: query i sees positions 0 .. i.
from_position_zero = masked(lambda p, own, n, q: p > own - (n - q))
# One position too many: query i also sees the position after its own.
sees_one_more = masked(lambda p, own, n, q: p > own + 1)

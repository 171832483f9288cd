"""Each sequence's rows start at the previous sequence's last row: one row early."""

import torch

from paged_kv.reference.lesson06 import *  # every other task stays right

BREAKS = "06.packed_attention"
MESSAGE = "each sequence's rows start one row off"


def packed_attention(query, k_cache, v_cache, block_tables, seq_lens, query_lens):
    ends = torch.cumsum(query_lens, 0) - 1  # the last row of each sequence
    outputs = []
    for b, (row, seq_len, num_new) in enumerate(zip(block_tables, seq_lens, query_lens, strict=True)):
        start = (
            int(ends[b - 1]) if b else 0
        )  # the mistake: the previous sequence's last row, not the one after
        outputs.append(chunk_attention(query[start : start + num_new], k_cache, v_cache, row, int(seq_len)))
    return torch.cat(outputs)

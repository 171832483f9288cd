"""The attention metadata of one step: the packed batch every backend reads (lessons 06, 09, 12).

A step's queries are packed: request ``b``'s ``query_lens[b]`` query tokens are rows
``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of the query, and they are the last of its
``seq_lens[b]`` tokens, so query token ``i`` of request ``b`` sits at position ``seq_lens[b] -
query_lens[b] + i`` and sees positions ``0`` through its own (causal inside a chunk). A decode is a
request of one query token, a fresh prompt one whose query tokens are all its tokens, a chunk
anything in between; a request of no query token computes nothing. Its tokens' K/V live in the
blocks of its row of ``block_table``: position ``p`` is offset ``p % block_size`` of block
``block_table[b, p // block_size]``.

vLLM keeps the same fields in ``CommonAttentionMetadata`` (``vllm/v1/attention/backend.py``), which
every backend's metadata builder reads: ``query_start_loc`` and its host copy
``query_start_loc_cpu``, ``seq_lens``, ``num_reqs``, ``max_query_len``, ``block_table_tensor`` and
``slot_mapping``. The model's step builds it once for every layer (``prepare_attention`` in
:mod:`paged_kv.model.step`), and the teaching functions of :mod:`paged_kv.attention.paged` build it
from the lengths a learner passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's packed batch, as every attention backend reads it (vLLM: ``CommonAttentionMetadata``).

    Invariants, which whoever builds it checks once (the backends do not read the device to check
    them again): ``query_start_loc`` starts at 0, never decreases and ends at the query's rows;
    each request's query length ``query_lens[b] = query_start_loc[b + 1] - query_start_loc[b]`` is
    in ``0 .. seq_lens[b]``; ``seq_lens[b]`` is at least 1 and the first ``ceil(seq_lens[b] /
    block_size)`` entries of ``block_table[b]`` are block ids of the cache (the others are padding,
    never read; with a sliding window, neither are the entries wholly before the window of the
    request's first query token, which may name any block id below the pool's size, the null block
    say). ``query_start_loc_cpu`` holds the same numbers as ``query_start_loc``, on the host;
    ``max_query_len`` is the largest query length, ``num_reqs`` the rows. Tensors are on the cache's
    device but ``query_start_loc_cpu``.

    ``slot_mapping`` (``(num_tokens,)``: the slot ``block * block_size + offset`` each query token's
    K/V goes to), ``positions`` (each token's position, for the model's embeddings) and
    ``logits_indices`` (each request's last token in the batch, for the sampler) belong to an
    engine step and are ``None`` where nobody writes or samples (the teaching functions' batches,
    whose K/V are in the cache already).
    """

    query_start_loc: torch.Tensor  # (num_reqs + 1,) int
    query_start_loc_cpu: torch.Tensor  # (num_reqs + 1,) int, on the host
    query_lens: torch.Tensor  # (num_reqs,) long
    seq_lens: torch.Tensor  # (num_reqs,) long
    block_table: torch.Tensor  # (num_reqs, width) int
    num_reqs: int
    max_query_len: int
    slot_mapping: torch.Tensor | None = None  # (num_tokens,) long
    positions: torch.Tensor | None = None  # (num_tokens,) long
    logits_indices: torch.Tensor | None = None  # (num_reqs,) long

    @cached_property
    def num_tokens(self) -> int:
        """The query tokens of the step, all requests' together (a host read: no device sync; once)."""
        return int(self.query_start_loc_cpu[-1]) if len(self.query_start_loc_cpu) else 0

    @property
    def is_decode_only(self) -> bool:
        """Whether every request has exactly one query token (a step of decodes)."""
        return self.max_query_len == 1 and self.num_tokens == self.num_reqs

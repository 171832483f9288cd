"""``IN_PLACE``, the course's block-by-block backend: batched products over the pool in its own order,
no copy of K or V (lessons 05, 06).

Each physical block a request alone reads meets that request's queries once: one batched product
over ``k_cache`` in physical order gives the scores of every block with its reader, and one over
``v_cache`` the per-block partial outputs, without copying K or V. A block's rows are its reader's
(query head, query) pairs grouped ``(num_kv_heads, group * queries)``, so each group meets its one
K/V head in the same product. The blocks several requests read (a shared prompt prefix, a fork) are
copied once each, and every request's queries meet them in one dense product. Only the small score
and weight tensors move to each request's table order, where the mask and the softmax run, and
back. The price: the products cover the whole pool, so blocks nobody reads cost as much as the
others, and a chunk's queries meet every block (lesson 06 measures both).

The step's decodes (one query token each) are read in place together and its chunks (several query
tokens each, padded to the longest) together; a request of no query token takes no part. The
products run in the caches' dtype, so a cache of another dtype than the compute dtype (float16,
bfloat16, fp8) is attended by ``GATHER`` instead, which converts what it copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from paged_kv.attention.backend import LayerKVCache, compute_dtype
from paged_kv.attention.backends.gather import GatherImpl, first_entries, pad_queries
from paged_kv.attention.heads import group_heads
from paged_kv.attention.metadata import AttentionMetadata


class InPlaceImpl(GatherImpl):
    """Reads every block where it lies, in batched products over the pool (see the module); a cache
    not in the compute dtype is gathered, as :class:`~paged_kv.attention.backends.gather.GatherImpl`."""

    name = "IN_PLACE"

    def _attend(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if kv_cache.k_cache.dtype != compute_dtype(query.dtype):
            return super()._attend(query, kv_cache, metadata)
        query_lens = torch.diff(metadata.query_start_loc_cpu.long())
        if metadata.is_decode_only:
            return self._read_in_place(query, kv_cache, metadata)
        out = query.new_empty(query.shape)
        for selected in (query_lens == 1, query_lens > 1):  # the decodes, then the chunks
            rows = torch.nonzero(selected).flatten()
            if len(rows):
                tokens, sub = rows_of(metadata, rows, query_lens)
                out[tokens] = self._read_in_place(query[tokens], kv_cache, sub)
        return out

    def _read_in_place(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, query_pos, seq, index = pad_queries(query, metadata)
        first = None
        if self.sliding_window is not None:
            first = first_entries(query_pos[:, 0], self.sliding_window, kv_cache.block_size)
        reads = BlockReads.of(
            kv_cache.num_blocks, kv_cache.block_size, metadata.block_table, metadata.seq_lens, first
        )
        out = read_in_place(
            q, kv_cache, metadata, query_pos, self.scale, reads, self.sliding_window, self.logits_soft_cap
        )
        return out.transpose(1, 2)[seq, index]


def rows_of(
    metadata: AttentionMetadata, rows: torch.Tensor, query_lens: torch.Tensor
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The packed-batch token indices of ``rows`` (a host LongTensor), in order, and the metadata of
    those rows alone, their query tokens packed again (``query_lens``: every row's, on the host)."""
    lens = query_lens[rows]
    starts = metadata.query_start_loc_cpu.long()[rows]
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    tokens = torch.repeat_interleave(starts, lens) + within
    device = metadata.seq_lens.device
    index = rows.to(device)
    starts_cpu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
    sub = replace(
        metadata,
        query_start_loc=starts_cpu.to(device),
        query_start_loc_cpu=starts_cpu,
        query_lens=lens.to(device),
        seq_lens=metadata.seq_lens[index],
        block_table=metadata.block_table[index],
        num_reqs=len(rows),
        max_query_len=int(lens.max()),
        slot_mapping=None,
        positions=None,
        logits_indices=None,
    )
    return tokens.to(device), sub


@dataclass(frozen=True)
class BlockReads:
    """Which rows of a batch read which physical blocks.

    ``blocks`` and ``rows`` list every table entry the batch reads (row by row, in table order);
    ``shared`` holds the distinct blocks that more than one entry reads, and ``shared_entries``
    how many entries read them. ``first``, with a sliding window, is each row's first entry read
    (:func:`~paged_kv.attention.backends.gather.first_entries`): the entries before it take no
    part, whatever block they name.
    """

    blocks: torch.Tensor
    rows: torch.Tensor
    shared: torch.Tensor
    shared_entries: int
    first: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        num_blocks: int,
        block_size: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        first: torch.Tensor | None = None,
    ) -> BlockReads:
        needed = (seq_lens + block_size - 1) // block_size
        entries = torch.arange(block_tables.shape[1], device=block_tables.device)
        used = entries < needed[:, None]
        if first is not None:
            used &= entries >= first[:, None]
        blocks = block_tables.long()[used]
        rows = torch.arange(len(block_tables), device=block_tables.device)[:, None].expand_as(used)[used]
        readers = torch.bincount(blocks, minlength=num_blocks)
        shared = torch.nonzero(readers > 1).flatten()
        return cls(blocks, rows, shared, int(readers[shared].sum()), first)


def read_in_place(
    q, kv_cache: LayerKVCache, metadata: AttentionMetadata, query_pos, scale, reads, window=None, softcap=None
) -> torch.Tensor:
    """Attention that reads the blocks where they lie, for ``q`` ``(batch, queries, num_heads,
    head_dim)`` in the caches' dtype: query ``i`` of row ``b`` sees positions ``0 ..
    query_pos[b, i]`` of its row (``query_pos[b, i] - window + 1 ..`` with a window; never one at
    or past ``seq_lens[b]``), the scores soft-capped when ``softcap`` is given. Returns ``(batch,
    num_heads, queries, head_dim)``. With a window, the entries before ``reads.first`` are not
    read: they go to the dummy, as padding does, so the blocks they name (the null block, say) meet
    no query.

    Scores of every block with its one reader come from one batched product in physical order;
    a dummy row ``batch`` of zeros is the "reader" of the blocks nobody reads and of the shared
    blocks, whose scores come from a dense product of every row's queries with their copy.
    """
    k_cache, v_cache = kv_cache.k_cache, kv_cache.v_cache
    block_tables, seq_lens = metadata.block_table, metadata.seq_lens
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    batch, num_queries, num_heads, _ = q.shape
    width = block_tables.shape[1]
    num_shared = len(reads.shared)

    owner = torch.full((num_blocks,), batch, dtype=torch.long, device=q.device)
    positions = torch.arange(width * block_size, device=q.device)
    read = positions[::block_size][None, :] < seq_lens[:, None]  # (batch, width): entries read
    if reads.first is not None:  # a window: not the entries before it
        read &= torch.arange(width, device=q.device)[None, :] >= reads.first[:, None]
    table = torch.where(read, block_tables.long(), num_blocks)  # padding -> the dummy
    if num_shared:
        shared_index = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=q.device)
        shared_index[reads.shared] = torch.arange(num_shared, device=q.device)
        alone = shared_index[reads.blocks] < 0
        owner[reads.blocks[alone]] = reads.rows[alone]
    else:
        owner[reads.blocks] = reads.rows
    heads_first = q.transpose(1, 2)  # (batch, heads, queries, dim)
    padded_q = torch.cat([heads_first, heads_first.new_zeros(1, num_heads, num_queries, head_dim)])
    # Block b's rows, grouped (kv_heads, group * queries, dim), against its K (kv_heads, dim, slots):
    # a group's heads and queries are the rows of one small product with their KV head's slots.
    owner_q = padded_q[owner].reshape(num_blocks, num_kv_heads, -1, head_dim)
    scores = torch.matmul(owner_q, k_cache.transpose(-1, -2)) * scale
    scores = scores.view(num_blocks, num_heads, num_queries, block_size)
    parts = [scores, scores.new_zeros(1, num_heads, num_queries, block_size)]
    index = table
    if num_shared:  # every row's queries against each shared block, copied once: (batch, shared, ...)
        k_shared, v_shared = k_cache[reads.shared], v_cache[reads.shared]
        grouped_q = group_heads(heads_first, num_kv_heads, dim=1)  # (batch, kv, group, queries, dim)
        shared_scores = torch.einsum("bkgqd,skpd->bskgqp", grouped_q, k_shared) * scale
        parts.append(shared_scores.flatten(2, 3).flatten(0, 1))
        # A shared entry finds its scores in its own (row, shared block) row, after the dummy.
        row_start = num_blocks + 1 + torch.arange(batch, device=q.device)[:, None] * num_shared
        entry_shared = shared_index[table]
        index = torch.where(entry_shared >= 0, row_start + entry_shared, table)
    # `index` is distinct for every entry read, except that a row listing one shared block twice
    # finds both entries' scores in the same (row, shared block) row: their weights add up below.
    source = torch.cat(parts)  # (sources, heads, queries, slots)

    in_order = source[index].permute(0, 2, 3, 1, 4).reshape(batch, num_heads, num_queries, width * block_size)
    if softcap is not None:
        in_order = softcap * torch.tanh(in_order / softcap)
    unseen = (positions[None, None, :] > query_pos[:, :, None]) | (
        positions[None, None, :] >= seq_lens[:, None, None]
    )  # (batch, queries, positions)
    if window is not None:
        unseen |= positions[None, None, :] <= query_pos[:, :, None] - window
    in_order = in_order.masked_fill(unseen[:, None], float("-inf"))
    weights = torch.softmax(in_order, dim=-1).view(batch, num_heads, num_queries, width, block_size)
    weights = weights.permute(0, 3, 1, 2, 4)  # (batch, width, heads, queries, slots)

    per_source = source.new_zeros(source.shape)
    # Back where the scores came from; padding lands on the dummy. Two entries of one row naming
    # the same block meet the same V, so their weights are summed (only shared blocks can repeat).
    per_source.index_put_((index,), weights, accumulate=bool(num_shared))
    by_block = per_source[:num_blocks].view(num_blocks, num_kv_heads, -1, block_size)
    partial = torch.matmul(by_block, v_cache).view(num_blocks, num_heads, num_queries, head_dim)
    out = q.new_zeros(batch + 1, num_heads, num_queries, head_dim).index_add_(0, owner, partial)[:batch]
    if num_shared:
        shared_weights = per_source[num_blocks + 1 :].view(
            batch, num_shared, num_heads, num_queries, block_size
        )
        grouped_weights = group_heads(shared_weights, num_kv_heads, dim=2)
        out += torch.einsum("bskgqp,skpd->bkgqd", grouped_weights, v_shared).flatten(1, 2)
    return out

"""Where the tiny GPT keeps its K and V: a contiguous baseline and the paged cache (lessons 08, 09).

* :class:`ContiguousKVCache`, the baseline: per layer and per sequence, K and V are tensors that
  grow by concatenation, and decode attention is ``scaled_dot_product_attention`` over them.
* :class:`PagedKVCache`, the paged one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

from paged_kv.attention.paged import paged_attention, paged_prefill_attention
from paged_kv.kv import swap
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.model.tiny_gpt import GPTConfig


class KVCache:
    """What the attention layers call. K/V tensors are ``(tokens, num_heads, head_dim)``."""

    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make room for a prompt of ``num_tokens`` before its prefill."""
        raise NotImplementedError

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's K and V for one layer."""
        raise NotImplementedError

    def attend_prefill(
        self, layer: int, seq_id: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Store the K/V of prompt positions ``start ..`` (the prompt's last ``len(k)``) for one layer
        and attend causally with their ``q`` over the whole prompt, cached positions included.

        Only a cache with prefix caching needs it: :meth:`TinyGPT.prefill` calls it when
        ``start > 0``. Returns ``(len(q), heads, dim)``.
        """
        raise NotImplementedError

    def append(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Grow each sequence by one token; return the new tokens' positions ``(batch,)``."""
        raise NotImplementedError

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store the new tokens' K/V ``(batch, heads, dim)``; attend with ``q`` over each whole sequence."""
        raise NotImplementedError

    def free(self, seq_id: Hashable) -> None:
        """Forget a finished sequence."""
        raise NotImplementedError


class ContiguousKVCache(KVCache):
    """Per layer and per sequence, K and V tensors grown by concatenation (the baseline)."""

    def __init__(self, config: GPTConfig, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.k: list[dict[Hashable, torch.Tensor]] = [{} for _ in range(config.num_layers)]
        self.v: list[dict[Hashable, torch.Tensor]] = [{} for _ in range(config.num_layers)]
        self.lengths: dict[Hashable, int] = {}

    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> None:
        if seq_id in self.lengths:
            raise ValueError(f"seq_id {seq_id!r} is already in the cache")
        self.lengths[seq_id] = num_tokens

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][seq_id], self.v[layer][seq_id] = k, v

    def append(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        positions = [self.lengths[s] for s in seq_ids]
        for s in seq_ids:
            self.lengths[s] += 1
        return torch.tensor(positions, device=self.device)

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = []
        for b, s in enumerate(seq_ids):  # a plain loop: each sequence has its own length
            self.k[layer][s] = torch.cat([self.k[layer][s], k[b : b + 1]])
            self.v[layer][s] = torch.cat([self.v[layer][s], v[b : b + 1]])
            keys, values = (t[layer][s].transpose(0, 1)[None] for t in (self.k, self.v))
            out.append(F.scaled_dot_product_attention(q[b, :, None][None], keys, values)[0, :, 0])
        return torch.stack(out)

    def free(self, seq_id: Hashable) -> None:
        self.lengths.pop(seq_id, None)
        for per_layer in (*self.k, *self.v):
            per_layer.pop(seq_id, None)


class PagedKVCache(KVCache):
    """One :class:`~paged_kv.kv.cache.PagedKVCacheAllocator` per layer, all with identical block tables.

    ``record=True`` makes every allocator keep its trace, to watch blocks arrive at the boundaries.
    ``enable_prefix_caching=True`` builds every allocator with prefix caching: a prompt added with
    its ``token_ids`` reuses the cached blocks of its longest cached prefix in every layer (the
    layers get the same calls, so they find the same blocks; :meth:`num_cached_tokens` checks it).
    """

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        record: bool = False,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.allocators = [
            PagedKVCacheAllocator(
                num_blocks,
                block_size,
                config.num_heads,
                config.head_dim,
                dtype,
                device,
                record,
                enable_prefix_caching=enable_prefix_caching,
            )
            for _ in range(config.num_layers)
        ]
        self.block_size, self.device = block_size, self.allocators[0].device

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether prompts added with ``token_ids`` reuse cached blocks (set when the cache is built)."""
        return self.allocators[0].enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, the same in every layer's pool."""
        return self.allocators[0].num_free_blocks

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token starts a new block (it is exactly at a block boundary)."""
        return self.allocators[0].needs_new_block(seq_id)

    def add_sequence(
        self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> None:
        """Allocate the prompt's blocks in every layer; with prefix caching and ``token_ids``, the
        cached prefix's blocks are reused (see :meth:`num_cached_tokens`)."""
        for allocator in self.allocators:
            allocator.allocate_for_sequence(seq_id, num_tokens, token_ids)

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """How many leading prompt tokens of the sequence the prefix cache served: prefill from there.

        Raises:
            UnknownSequenceError: ``seq_id`` is not in the cache.
            RuntimeError: the layers disagree (their allocators did not get the same calls).
        """
        counts = [allocator.num_cached_tokens(seq_id) for allocator in self.allocators]
        if len(set(counts)) != 1:
            raise RuntimeError(
                f"the layers' allocators disagree on the cached tokens of sequence {seq_id!r}: "
                f"{counts}; every layer must get the same calls"
            )
        return counts[0]

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a whole prompt's K and V for one layer.

        Raises:
            ValueError: part of the prompt came from the prefix cache: those blocks hold K/V that
                other sequences may read, so only the rest is written, with :meth:`attend_prefill`.
        """
        allocator = self.allocators[layer]
        cached = allocator.num_cached_tokens(seq_id)
        if cached:
            raise ValueError(
                f"the first {cached} tokens of sequence {seq_id!r} come from the prefix cache: "
                f"prefill from start={cached} (attend_prefill) instead of writing the whole prompt"
            )
        allocator.write_kv(seq_id, k, v)

    def attend_prefill(
        self, layer: int, seq_id: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Store the K/V of prompt positions ``start ..`` for one layer; attend causally over the prompt.

        The positions are the prompt's uncached tail: ``start`` is :meth:`num_cached_tokens` and
        ``len(k)`` the tokens after it, so the cached blocks are never written and no position is
        left unwritten. Attention is :func:`~paged_kv.attention.paged.paged_prefill_attention` over the
        sequence's blocks.

        Raises:
            ValueError: ``start`` is not the sequence's cached tokens, ``start + len(k)`` is not
                its length, or ``q`` has another shape than ``k``; or ``k``, ``v`` are bad as for
                ``write_kv``. Nothing is written.
        """
        allocator = self.allocators[layer]
        length, cached = allocator.sequence_length(seq_id), allocator.num_cached_tokens(seq_id)
        if start != cached or start + len(k) != length:
            raise ValueError(
                f"start {start} and {len(k)} new tokens must be the uncached tail of sequence "
                f"{seq_id!r}: its {length} tokens from the {cached} cached ones on"
            )
        if q.shape != k.shape:
            raise ValueError(f"q must have the shape of k, {tuple(k.shape)}, got {tuple(q.shape)}")
        allocator.write_kv(seq_id, k, v, start_position=start)
        tables = allocator.block_tables_tensor([seq_id])
        return paged_prefill_attention(q, allocator.k_cache, allocator.v_cache, tables, [length], [len(k)])

    def append(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        positions = [self.allocators[0].sequence_length(s) for s in seq_ids]
        for allocator in self.allocators:  # bookkeeping: a new block only at a block boundary
            for s in seq_ids:
                allocator.append_tokens(s)
        return torch.tensor(positions, device=self.device)

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        allocator = self.allocators[layer]
        tables = allocator.block_tables_tensor(seq_ids).long()  # (batch, max_blocks), -1 padded
        lengths = torch.tensor([allocator.sequence_length(s) for s in seq_ids], device=self.device)
        # The new token of each sequence sits at position length - 1: scatter the batch in one go.
        last = lengths - 1
        blocks = tables.gather(1, (last // self.block_size)[:, None])[:, 0]
        allocator.k_cache[blocks, :, last % self.block_size] = k
        allocator.v_cache[blocks, :, last % self.block_size] = v
        return paged_attention(q, allocator.k_cache, allocator.v_cache, tables, lengths)

    def free(self, seq_id: Hashable) -> None:
        for allocator in self.allocators:
            allocator.free_sequence(seq_id)

    def swap_out(self, seq_id: Hashable) -> swap.SwappedKV:
        """Copy the sequence's K/V, every layer, to host memory and free its blocks (lesson 08)."""
        return swap.swap_out(self.allocators, seq_id)

    def swap_in(self, seq_id: Hashable, saved: swap.SwappedKV) -> None:
        """Give the sequence fresh blocks and copy back what :meth:`swap_out` saved (lesson 08)."""
        swap.swap_in(self.allocators, seq_id, saved)

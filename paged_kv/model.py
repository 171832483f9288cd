"""A tiny GPT whose attention reads its KV cache from a contiguous or a paged back-end (lesson 09).

The model is small and its weights come from a seeded generator, never from a download: the point
is the cache, not the text. Byte-level tokens (``encode`` / ``decode``) keep the vocabulary at 256.

Generation runs in two phases. *Prefill* runs one prompt through the model with ordinary causal
attention over the prompt's own q/k/v and stores every layer's K and V in the cache. *Decode* then
feeds one new token per sequence, for the whole batch at once: each layer stores the new token's K
and V and attends over everything the sequence holds.

The attention layers only see the small :class:`KVCache` interface, with two back-ends:

* :class:`ContiguousKVCache`, the baseline: per layer and per sequence, K and V are tensors that
  grow by concatenation, and decode attention is ``scaled_dot_product_attention`` over them.
* :class:`PagedKVCache`, the paged one: **one** :class:`~paged_kv.cache.PagedKVCacheAllocator`
  **per layer**, each owning that layer's ``k_cache`` and ``v_cache`` pool. Every layer stores the
  same tokens at the same positions, so the allocators receive the same calls in the same order and
  hold identical block tables (a real engine such as vLLM keeps a single block table shared by the
  layers' pools; one allocator per layer lets each layer use the package's API unchanged). A prompt
  is allocated with ``allocate_for_sequence`` and written with ``write_kv``; each decode step calls
  ``append_tokens`` (a new block only at a block boundary), scatters the batch's new K/V into their
  slots in one indexing operation, and attends with :func:`~paged_kv.attention.paged_attention`
  through ``block_tables_tensor``: no per-sequence loop beyond the bookkeeping.

  With ``enable_prefix_caching=True`` the allocators reuse the blocks of a prompt prefix that an
  earlier prompt computed (:mod:`paged_kv.prefix_cache`): ``add_sequence(seq_id, n, token_ids)``
  looks the prompt up, :meth:`PagedKVCache.num_cached_tokens` says how many leading tokens ``c``
  need no computing, and ``prefill(prompt, seq_id, cache, start=c)`` runs only positions
  ``c .. n - 1``, writing their K/V after the cached ones and attending over both with
  :func:`~paged_kv.attention.paged_prefill_attention`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import swap
from ._checks import check_count
from .attention import paged_attention, paged_prefill_attention
from .block import blocks_for_tokens
from .cache import PagedKVCacheAllocator

# attend(layer, q, k, v) -> out, all (batch, tokens, num_heads, head_dim)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text``: the token ids of the byte-level vocabulary."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """The text of byte token ids; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of :class:`TinyGPT`; the model width is ``num_heads * head_dim``."""

    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    max_len: int = 256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "head_dim", "max_len"):
            check_count(name, getattr(self, name), minimum=1)

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of ``(batch, tokens, num_heads, head_dim)`` tensors, same shape out."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return out.transpose(1, 2)


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        d, self.layer, self.config = config.d_model, layer, config
        self.norm1, self.norm2 = nn.LayerNorm(d, device="meta"), nn.LayerNorm(d, device="meta")
        self.qkv = nn.Linear(d, 3 * d, device="meta")
        self.proj = nn.Linear(d, d, device="meta")
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d, device="meta"), nn.GELU(), nn.Linear(4 * d, d, device="meta")
        )

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        batch, tokens, _ = x.shape
        heads = (batch, tokens, self.config.num_heads, self.config.head_dim)
        q, k, v = (t.reshape(heads) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        x = x + self.proj(attend(self.layer, q, k, v).reshape(batch, tokens, -1))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and learned position embeddings, pre-norm blocks, a final norm and an untied head.

    The weights are drawn on the CPU from ``torch.Generator().manual_seed(seed)``, so the same seed
    gives the same model on any device (move it with ``.to(device)``); the global RNG is untouched.
    """

    def __init__(self, config: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        d = config.d_model
        self.token_embedding = nn.Embedding(config.vocab_size, d, device="meta")
        self.position_embedding = nn.Embedding(config.max_len, d, device="meta")
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.num_layers))
        self.norm = nn.LayerNorm(d, device="meta")
        self.head = nn.Linear(d, config.vocab_size, bias=False, device="meta")
        self.to_empty(device="cpu")  # built on "meta" so no default init draws from the global RNG
        generator = torch.Generator().manual_seed(check_count("seed", seed))
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:  # embeddings get unit variance, matrices 1 / fan_in
                    std = 1.0 if "embedding" in name else 1 / math.sqrt(param.shape[1])
                    param.copy_(torch.randn(param.shape, generator=generator) * std)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Logits ``(batch, tokens, vocab)`` of ``(batch, tokens)`` ids at ``positions``."""
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The full-sequence forward with no cache: ``(batch, tokens)`` ids to logits."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.run(tokens, positions, lambda layer, q, k, v: causal_attention(q, k, v))

    def prefill(self, prompt: torch.Tensor, seq_id: Hashable, cache: KVCache, start: int = 0) -> torch.Tensor:
        """Run one prompt ``(tokens,)`` from position ``start`` on, storing its K/V in ``cache``.

        ``cache.add_sequence(seq_id, len(prompt))`` must come first. With ``start == 0`` (the
        default) the whole prompt runs with causal attention over its own K/V, which the cache
        stores. With ``start > 0`` the cache already holds the K/V of positions ``0 .. start - 1``
        (a prefix cache hit: ``cache.add_sequence(seq_id, len(prompt), token_ids)`` came first,
        and ``start`` is ``cache.num_cached_tokens(seq_id)``): only positions
        ``start .. len(prompt) - 1`` run, their K/V are stored after the cached ones
        (:meth:`KVCache.attend_prefill`) and each attends to every position up to its own, cached
        or new.

        Returns:
            The logits of the positions that ran, ``(len(prompt) - start, vocab)``: the last row
            predicts the next token either way.

        Raises:
            ValueError: ``start`` is not an integer in ``0 .. len(prompt) - 1``.
        """
        start = check_count("start", start)
        if start >= len(prompt):
            raise ValueError(
                f"start must be below the prompt's {len(prompt)} tokens (the last one is always "
                f"computed), got {start}"
            )
        if start == 0:

            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                cache.write_prompt(layer, seq_id, k[0], v[0])
                return causal_attention(q, k, v)

        else:

            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return cache.attend_prefill(layer, seq_id, q[0], k[0], v[0], start)[None]

        positions = torch.arange(start, len(prompt), device=prompt.device)
        return self.run(prompt[None, start:], positions[None], attend)[0]

    def decode_step(self, tokens: torch.Tensor, seq_ids: Sequence[Hashable], cache: KVCache) -> torch.Tensor:
        """Feed one new token per sequence ``(batch,)``; logits ``(batch, vocab)``."""
        positions = cache.append(seq_ids)  # where each new token goes

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return cache.attend(layer, seq_ids, q[:, 0], k[:, 0], v[:, 0])[:, None]

        return self.run(tokens[:, None], positions[:, None], attend)[:, 0]


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
    """One :class:`~paged_kv.cache.PagedKVCacheAllocator` per layer, all with identical block tables.

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
        left unwritten. Attention is :func:`~paged_kv.attention.paged_prefill_attention` over the
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


@dataclass(frozen=True)
class GenerationResult:
    """``tokens[i]``: the new token ids of prompt ``i``; ``logits[step, i]``: the logits they came from."""

    tokens: list[list[int]]
    logits: torch.Tensor  # (max_new_tokens, batch, vocab)


def generate(
    model: TinyGPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    cache: str | KVCache = "paged",
    block_size: int = 16,
    num_blocks: int | None = None,
    device: str | torch.device | None = None,
) -> GenerationResult:
    """Greedy generation for a batch of prompts of any lengths.

    Each prompt is prefilled on its own; then every decode step feeds the batch's last tokens at
    once. ``cache`` is ``"contiguous"``, ``"paged"`` (a :class:`PagedKVCache` of ``num_blocks``
    blocks of ``block_size``, by default just enough for the batch) or a cache you built (then
    ``block_size`` and ``num_blocks`` are not used); the sequences (ids ``"prompt-0"``,
    ``"prompt-1"``...) are freed from it at the end. ``device`` defaults to the model's and must be
    the model's.

    Raises:
        ValueError: a bad argument (the message names it); the cache's own errors, such as
            :class:`~paged_kv.errors.OutOfBlocksError`, pass through.
    """
    config = model.config
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, minimum=1)
    block_size = check_count("block_size", block_size, minimum=1)
    model_device = next(model.parameters()).device
    device = model_device if device is None else torch.device(device)
    if device != model_device:
        raise ValueError(f"device {device} differs from the model's {model_device}; call model.to(device)")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists")
    for i, prompt in enumerate(prompts):
        if not prompt or not all(is_token(t, config.vocab_size) for t in prompt):
            raise ValueError(f"prompts[{i}] must be non-empty token ids in [0, {config.vocab_size})")
        if len(prompt) + max_new_tokens > config.max_len:
            raise ValueError(
                f"prompts[{i}] ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_len {config.max_len}"
            )
    if cache == "contiguous":
        cache = ContiguousKVCache(config, device)
    elif cache == "paged":
        needed = sum(blocks_for_tokens(len(p) + max_new_tokens, block_size) for p in prompts)
        num_blocks = needed if num_blocks is None else check_count("num_blocks", num_blocks, minimum=1)
        cache = PagedKVCache(config, num_blocks, block_size, device, model.head.weight.dtype)
    elif not isinstance(cache, KVCache):
        raise ValueError(f"cache must be 'contiguous', 'paged' or a KVCache, got {cache!r}")

    seq_ids = [f"prompt-{i}" for i in range(len(prompts))]
    added: list[str] = []  # freed at the end, even after an error
    steps: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            last = []
            for prompt, seq_id in zip(prompts, seq_ids, strict=True):
                cache.add_sequence(seq_id, len(prompt))
                added.append(seq_id)
                last.append(model.prefill(torch.tensor(prompt, device=device), seq_id, cache)[-1])
            steps.append(torch.stack(last))
            for _ in range(max_new_tokens - 1):
                steps.append(model.decode_step(steps[-1].argmax(dim=-1), seq_ids, cache))
    finally:
        for seq_id in added:
            cache.free(seq_id)
    logits = torch.stack(steps)
    return GenerationResult(tokens=logits.argmax(dim=-1).T.tolist(), logits=logits)


def is_token(value: object, vocab_size: int) -> bool:
    """Whether ``value`` is an integer token id below ``vocab_size`` (booleans are not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < vocab_size

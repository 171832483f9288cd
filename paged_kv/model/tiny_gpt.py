"""A tiny GPT whose attention reads its KV cache through a small interface (lesson 09).

The model is small and its weights come from a seeded generator, never from a download: the point
is the cache, not the text. Byte-level tokens (``encode`` / ``decode``) keep the vocabulary at 256.

Generation runs in two phases. *Prefill* runs one prompt through the model with ordinary causal
attention over the prompt's own q/k/v and stores every layer's K and V in the cache. *Decode* then
feeds one new token per sequence, for the whole batch at once: each layer stores the new token's K
and V and attends over everything the sequence holds. The attention layers only see the
:class:`~paged_kv.model.kv_cache.KVCache` interface; :mod:`paged_kv.model.kv_cache` has its two
back-ends, and :mod:`paged_kv.model.attend` how a layer meets them (the Hugging Face models of
:mod:`paged_kv.model.hf` meet them the same way).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_kv.kv.sizing import module_bytes
from paged_kv.model.attend import (
    Attend,
    append_decode,
    check_prefill_start,
    decode_attend,
    layer_causal_attention,
    pack_prefills,
    prefill_attend,
)
from paged_kv.model.config import GPTConfig
from paged_kv.validate import check_count

if TYPE_CHECKING:
    from paged_kv.model.kv_cache import KVCache


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text``: the token ids of the byte-level vocabulary."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """The text of byte token ids; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


class DecoderLayer(nn.Module):
    """A pre-norm transformer block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        d, self.layer, self.config = config.d_model, layer, config
        self.norm1, self.norm2 = nn.LayerNorm(d, device="meta"), nn.LayerNorm(d, device="meta")
        self.qkv = nn.Linear(d, d + 2 * config.kv_dim, device="meta")  # q, then the K/V heads
        self.proj = nn.Linear(d, d, device="meta")
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d, device="meta"), nn.GELU(), nn.Linear(4 * d, d, device="meta")
        )

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        batch, tokens, _ = x.shape
        c = self.config
        q, k, v = self.qkv(self.norm1(x)).split([c.d_model, c.kv_dim, c.kv_dim], dim=-1)
        q = q.reshape(batch, tokens, c.num_heads, c.head_dim)
        k, v = (t.reshape(batch, tokens, c.num_kv_heads, c.head_dim) for t in (k, v))
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
        # a given _weight skips nn.Embedding's default init, whose normal_ on "meta" imports torch._dynamo
        self.token_embedding = nn.Embedding(
            config.vocab_size, d, _weight=torch.empty(config.vocab_size, d, device="meta")
        )
        self.position_embedding = nn.Embedding(
            config.max_len, d, _weight=torch.empty(config.max_len, d, device="meta")
        )
        self.blocks = nn.ModuleList(DecoderLayer(config, layer) for layer in range(config.num_layers))
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

    eos_token_ids: tuple[int, ...] = ()
    """The tiny GPT names no end-of-sequence token: a sequence runs to its length."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights, which the model's K/V cache takes too."""
        return self.head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def weight_bytes(self) -> int:
        """The bytes of the weights: what the model takes of a device besides its KV cache."""
        return module_bytes(self)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Logits ``(batch, tokens, vocab)`` of ``(batch, tokens)`` ids at ``positions``."""
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))

    def forward_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """One engine step: the flattened batch's ``(num_tokens,)`` ids at ``positions``; the logits
        ``(len(logits_indices), vocab)`` of the tokens ``logits_indices`` names (each request's last)."""
        x = self.token_embedding(input_ids[None]) + self.position_embedding(positions[None])
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x[0, logits_indices]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The full-sequence forward with no cache: ``(batch, tokens)`` ids to logits."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        layers = self.config.layer_attention
        return self.run(
            tokens, positions, lambda layer, q, k, v: layer_causal_attention(q, k, v, layers[layer])
        )

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
        start = check_prefill_start(start, len(prompt))
        positions = torch.arange(start, len(prompt), device=prompt.device)
        return self.run(
            prompt[None, start:],
            positions[None],
            prefill_attend(cache, seq_id, start, self.config.layer_attention),
        )[0]

    def prefill_batch(
        self,
        prompts: Sequence[torch.Tensor],
        seq_ids: Sequence[Hashable],
        cache: KVCache,
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """:meth:`prefill` of several prompts in one forward, their tokens packed one after another.

        Prompt ``i`` runs from position ``starts[i]`` (default 0) on, as :meth:`prefill` runs it
        alone, and its K/V are stored the same way. Returns the logits of each prompt's last token,
        ``(len(prompts), vocab)``.
        """
        packed = pack_prefills(prompts, seq_ids, cache, starts, self.config.layer_attention)
        return self.run(packed.tokens, packed.positions, packed.attend)[0, packed.last]

    def decode_step(self, tokens: torch.Tensor, seq_ids: Sequence[Hashable], cache: KVCache) -> torch.Tensor:
        """Feed one new token per sequence ``(batch,)``; logits ``(batch, vocab)``."""
        positions = append_decode(cache, seq_ids, tokens)  # where each new token goes
        return self.run(tokens[:, None], positions[:, None], decode_attend(cache, seq_ids))[:, 0]

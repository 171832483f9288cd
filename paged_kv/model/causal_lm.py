"""What generation asks of a model: the :class:`CausalLM` interface, and :func:`as_causal_lm` (lesson 09).

:func:`~paged_kv.model.generate`, the engine's :class:`~paged_kv.serving.model_runner.ModelRunner`
and the caches talk to a model only through :class:`CausalLM`: its sizes (``config``), its
``dtype`` and ``device``, a prefill of one prompt and a batched decode step. The tiny GPT is one
as it is; a Hugging Face model is wrapped in :class:`~paged_kv.model.hf.HFCausalLM`. (vLLM's
model runner sees every architecture the same way: a ``forward`` over the batch's tokens and
positions, with the attention reading the paged cache.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

import torch

from paged_kv.model.attend import Attend
from paged_kv.model.config import GPTConfig
from paged_kv.model.hf import HFCausalLM
from paged_kv.model.kv_cache import KVCache


@runtime_checkable
class CausalLM(Protocol):
    """A model that generation can run on a :class:`~paged_kv.model.kv_cache.KVCache`.

    ``config`` gives the sizes its cache must have (layers, K/V heads, head size), its vocabulary
    and ``max_len``, the most positions a sequence may take.
    """

    config: GPTConfig

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its weights, and of its K/V cache."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def weight_bytes(self) -> int:
        """The bytes its parameters and buffers take: the memory that is not the KV cache."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Its end-of-sequence tokens, at which a sequence ends unless ``ignore_eos`` (none: runs to
        its length)."""
        ...

    def prefill(self, prompt: torch.Tensor, seq_id: Hashable, cache: KVCache, start: int = 0) -> torch.Tensor:
        """Run prompt positions ``start ..`` (after ``cache.add_sequence``), storing their K/V.

        Returns logits ``(rows, vocab)`` whose last row predicts the prompt's next token.
        """
        ...

    def prefill_batch(
        self,
        prompts: Sequence[torch.Tensor],
        seq_ids: Sequence[Hashable],
        cache: KVCache,
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Several prefills in one forward (tokens packed, each prompt from ``starts[i]``, default 0);
        returns each prompt's last logits ``(len(prompts), vocab)``."""
        ...

    def decode_step(self, tokens: torch.Tensor, seq_ids: Sequence[Hashable], cache: KVCache) -> torch.Tensor:
        """Feed one token per sequence ``(batch,)``; logits ``(batch, vocab)``."""
        ...

    def forward_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """One engine step over a flattened batch of ``(num_tokens,)`` ids at ``positions``: the
        logits ``(len(logits_indices), vocab)`` of the tokens ``logits_indices`` names."""
        ...


def as_causal_lm(model: object) -> CausalLM:
    """``model`` as a :class:`CausalLM`: a :class:`~paged_kv.model.tiny_gpt.TinyGPT` (or any
    :class:`CausalLM`) as it is, a Hugging Face ``transformers`` model wrapped in
    :class:`~paged_kv.model.hf.HFCausalLM`.

    Raises:
        ValueError: ``model`` is none of these, or a Hugging Face model of an architecture
            :data:`~paged_kv.model.hf.SUPPORTED_ARCHITECTURES` does not list (the message lists them).
    """
    if isinstance(model, CausalLM):  # the tiny GPT is one
        return model
    return HFCausalLM(model)  # which refuses anything but a model of a supported architecture

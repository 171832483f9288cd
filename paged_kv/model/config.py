"""The sizes a model shows its KV cache: TinyGPT is built from them, and its caches too (lessons 05, 09, 13).

A Hugging Face model's sizes are read from its own config (:mod:`paged_kv.model.hf`) into the same
:class:`GPTConfig`, so every cache is built the same way whichever model it serves. So is how each
layer attends (:class:`LayerAttention`): a hybrid model's sliding-window layers, and Gemma 2's
soft-capped scores (lesson 13).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from paged_kv.attention.backend import AttentionImpl
from paged_kv.attention.registry import attention_backend
from paged_kv.validate import check_count


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's queries meet the cache: the token at position ``p`` sees positions
    ``p - sliding_window + 1 .. p`` (``None``: ``0 .. p``, full attention); scores are
    ``scale * q · k`` (``None``: ``1 / sqrt(head_dim)``), then ``softcap * tanh(score / softcap)``
    when ``softcap`` is set (Gemma 2's ``attn_logit_softcapping``)."""

    sliding_window: int | None = None
    scale: float | None = None
    softcap: float | None = None

    def window_and_cap(self) -> dict[str, float]:
        """The keywords an attention function takes for this layer's window and soft cap, only
        those set (a full-attention layer passes none)."""
        extra: dict[str, float] = {}
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        return extra

    def impl(
        self, backend: str | None, query: torch.Tensor, num_kv_heads: int, cache_dtype: torch.dtype
    ) -> AttentionImpl:
        """This layer's attention in backend ``backend`` (a registry name; ``None``: the platform's
        default for the query's device and dtype and ``cache_dtype``), for queries shaped like
        ``query`` (``(..., num_heads, head_dim)``) over a cache of ``num_kv_heads`` K/V heads."""
        return attention_backend(backend, query.device, query.dtype, cache_dtype)(
            query.shape[-2], query.shape[-1], self.scale, num_kv_heads, self.sliding_window, self.softcap
        )


FULL_ATTENTION = LayerAttention()


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of :class:`TinyGPT` and of the KV cache a model needs.

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (default: as many as query heads,
    plain multi-head attention); ``num_kv_heads`` must divide ``num_heads``: grouped-query attention
    when it is smaller, multi-query when it is 1. The cache stores only the K/V heads. The tiny
    model's width is ``num_heads * head_dim``.

    ``sliding_windows`` gives each layer's window (``None`` for a full-attention layer; the whole
    field ``None``: every layer attends fully), ``attention_scale`` and ``attn_softcap`` every
    layer's score scale and soft cap (see :class:`LayerAttention`): :attr:`layer_attention`.
    """

    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    max_len: int = 256
    num_kv_heads: int | None = None
    sliding_windows: tuple[int | None, ...] | None = None
    attention_scale: float | None = None
    attn_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "head_dim", "max_len"):
            check_count(name, getattr(self, name), minimum=1)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        check_count("num_kv_heads", self.num_kv_heads, minimum=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}: "
                f"each K/V head serves the same number of query heads"
            )
        if self.sliding_windows is not None:
            windows = tuple(self.sliding_windows)
            if len(windows) != self.num_layers:
                raise ValueError(
                    f"sliding_windows must give one window per layer ({self.num_layers}), got {len(windows)}"
                )
            for layer, window in enumerate(windows):
                if window is not None:
                    check_count(f"sliding_windows[{layer}]", window, minimum=1)
            object.__setattr__(self, "sliding_windows", windows)
        for name in ("attention_scale", "attn_softcap"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")

    def __repr__(self) -> str:
        """The sizes, and the attention settings only where they are set (a hybrid model's)."""
        names = ["vocab_size", "num_layers", "num_heads", "head_dim", "max_len", "num_kv_heads"]
        names += [
            n for n in ("sliding_windows", "attention_scale", "attn_softcap") if getattr(self, n) is not None
        ]
        return f"GPTConfig({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def layer_attention(self) -> tuple[LayerAttention, ...]:
        """How each layer attends, in layer order."""
        windows = self.sliding_windows or (None,) * self.num_layers
        return tuple(LayerAttention(w, self.attention_scale, self.attn_softcap) for w in windows)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer slides: its KV cache is then managed in groups (lesson 13)."""
        return any(w is not None for w in self.sliding_windows or ())

    @property
    def kv_dim(self) -> int:
        """The width of one token's K (or V) in one layer, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

"""The sizes a model shows its KV cache: TinyGPT is built from them, and its caches too (lessons 05, 09).

A Hugging Face model's sizes are read from its own config (:mod:`paged_kv.model.hf`) into the same
:class:`GPTConfig`, so every cache is built the same way whichever model it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_kv.validate import check_count


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of :class:`TinyGPT` and of the KV cache a model needs.

    ``num_heads`` query heads share ``num_kv_heads`` K/V heads (default: as many as query heads,
    plain multi-head attention); ``num_kv_heads`` must divide ``num_heads``: grouped-query attention
    when it is smaller, multi-query when it is 1. The cache stores only the K/V heads. The tiny
    model's width is ``num_heads * head_dim``.
    """

    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 16
    max_len: int = 256
    num_kv_heads: int | None = None

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

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """The width of one token's K (or V) in one layer, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

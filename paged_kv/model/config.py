"""The sizes of the tiny GPT, which its caches are built from too (lesson 09)."""

from __future__ import annotations

from dataclasses import dataclass

from paged_kv.validate import check_count


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

"""What the scheduler and the engine need of a paged cache, as `typing.Protocol` classes (lessons 07-09).

A protocol states a contract by its methods, not by a base class: the package's
:class:`~paged_kv.model.kv_cache.PagedKVCache`, lesson 09's ``MyPagedCache`` and the tensor-free
bookkeeping of the simulator (:class:`~paged_kv.simulation.workload.BlockBookkeeping`) all satisfy
them without inheriting from them. The layers:

* :class:`BlockCache`: the bookkeeping the scheduler admits into: free blocks, whether a
  sequence's next token needs a block, adding a prompt, growing every sequence of a batch by one
  token, freeing a sequence;
* :class:`PagedCache`: a :class:`BlockCache` the model also reads and writes, with the attention
  methods of :class:`~paged_kv.model.kv_cache.KVCache` (what :class:`~paged_kv.serving.engine.Engine`
  drives);
* two capabilities on top, each checked with ``isinstance`` before a run needs it:
  :class:`SwappingCache` (``preemption="swap"``, lesson 11) and :class:`PrefixCachingCache`
  (``enable_prefix_caching=True``, lesson 08).

``runtime_checkable`` protocols check that the methods exist, not their signatures; the engine's
tests check the rest.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class BlockCache(Protocol):
    """Block bookkeeping: what :class:`~paged_kv.serving.memory.PagedMemory` asks and changes."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (with prefix caching, cached blocks nobody holds count as free)."""
        ...

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token starts a new block."""
        ...

    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give a prompt of ``num_tokens`` its blocks before its prefill."""
        ...

    def append(self, seq_ids: Sequence[Hashable]) -> object:
        """Grow each sequence by one token, taking a block where one is needed."""
        ...

    def free(self, seq_id: Hashable) -> None:
        """Give a sequence's blocks back."""
        ...


@runtime_checkable
class PagedCache(BlockCache, Protocol):
    """A :class:`BlockCache` that also stores K/V and attends: what the engine's model runs on."""

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def attend_prefill(
        self, layer: int, seq_id: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor: ...

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class SwappingCache(Protocol):
    """A cache that can copy a sequence's K/V to host memory and back (lesson 11)."""

    def swap_out(self, seq_id: Hashable) -> object:
        """Copy the sequence's K/V to host memory, free its blocks, return what was saved."""
        ...

    def swap_in(self, seq_id: Hashable, saved: object) -> None:
        """Give the sequence fresh blocks and copy back what :meth:`swap_out` saved."""
        ...


@runtime_checkable
class PrefixCachingCache(Protocol):
    """A cache whose prompts, added with their token ids, reuse cached prefix blocks (lesson 08).

    ``add_sequence(seq_id, num_tokens, token_ids=...)`` takes the prompt's token ids as well.
    """

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """The leading prompt tokens the prefix cache served: whole blocks, fewer than the prompt's."""
        ...

    def attend_prefill(
        self, layer: int, seq_id: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor: ...

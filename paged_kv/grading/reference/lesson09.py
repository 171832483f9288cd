"""Exercise 09 graded on the package: ``decode_slots`` is lesson 04's all-or-nothing ``decode_step``
(:mod:`paged_kv.grading.reference.lesson04`) followed by the slot mapping of each new token's position
(:meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.slot_mapping`), and ``MyPagedCache`` is
:class:`paged_kv.model.kv_cache.PagedKVCache`, the cache the engine uses by default (its ``__init__`` takes
the exercise's arguments). ``can_admit`` is the engine's admission rule,
:func:`paged_kv.serving.memory.admits` (with the default watermark of 0), given the prompt's tokens.
"""

from collections.abc import Hashable as _Hashable
from collections.abc import Iterable as _Iterable

import torch as _torch

from paged_kv.core.block import blocks_for_tokens as _blocks_for_tokens
from paged_kv.grading.reference.lesson04 import decode_step as _decode_step
from paged_kv.kv.cache import PagedKVCacheAllocator as _PagedKVCacheAllocator
from paged_kv.model.kv_cache import PagedKVCache as MyPagedCache
from paged_kv.serving.memory import admits as _admits

__all__ = ["MyPagedCache", "can_admit", "decode_slots"]


def can_admit(num_free_blocks: int, prompt_tokens: int, num_running: int, block_size: int) -> bool:
    """The prompt's blocks plus one block of headroom per running sequence, the new one included, are free."""
    return _admits(num_free_blocks, _blocks_for_tokens(prompt_tokens, block_size), num_running)


def decode_slots(allocator: _PagedKVCacheAllocator, seq_ids: _Iterable[_Hashable]) -> _torch.Tensor:
    """Grow each sequence by one token, all or nothing; the slot of each new token, a LongTensor."""
    seq_ids = list(seq_ids)
    _decode_step(allocator, seq_ids)
    slots = [allocator.slot_mapping(seq_id, [allocator.sequence_length(seq_id) - 1]) for seq_id in seq_ids]
    return _torch.cat(slots) if slots else _torch.zeros(0, dtype=_torch.long, device=allocator.device)

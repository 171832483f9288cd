"""Exercise 09 graded on the package: ``decode_slots`` is lesson 04's all-or-nothing ``decode_step``
(:mod:`paged_kv.reference.lesson04`) followed by the slot mapping of each new token's position
(:meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.slot_mapping`), and ``MyPagedCache`` is
:class:`paged_kv.model.kv_cache.PagedKVCache`, the cache :func:`~paged_kv.model.generate` builds for
``cache="paged"`` (its ``__init__`` takes the exercise's arguments). ``can_admit`` is the engine's
admission rule, vLLM's: the blocks a request needs to be admitted,
:func:`paged_kv.core.kv_cache_manager.blocks_alone` (its whole prompt's), fit in the free blocks (what
:meth:`~paged_kv.core.kv_cache_manager.KVCacheManager.allocate_slots` checks with ``num_tokens_to_fit``, with
the default watermark of 0); the running requests do not count.
"""

from collections.abc import Hashable as _Hashable
from collections.abc import Iterable as _Iterable

import torch as _torch

from paged_kv.core.kv_cache_manager import blocks_alone as _blocks_alone
from paged_kv.kv.cache import PagedKVCacheAllocator as _PagedKVCacheAllocator
from paged_kv.model.kv_cache import PagedKVCache as MyPagedCache
from paged_kv.reference.lesson04 import decode_step as _decode_step

__all__ = ["MyPagedCache", "can_admit", "decode_slots"]


def can_admit(num_free_blocks: int, prompt_tokens: int, num_running: int, block_size: int) -> bool:
    """The whole prompt's blocks are free; ``num_running`` does not count (vLLM keeps no headroom)."""
    return _blocks_alone(prompt_tokens, 1, block_size)[0] <= num_free_blocks


def decode_slots(allocator: _PagedKVCacheAllocator, seq_ids: _Iterable[_Hashable]) -> _torch.Tensor:
    """Grow each sequence by one token, all or nothing; the slot of each new token, a LongTensor."""
    seq_ids = list(seq_ids)
    _decode_step(allocator, seq_ids)
    slots = [allocator.slot_mapping(seq_id, [allocator.sequence_length(seq_id) - 1]) for seq_id in seq_ids]
    return _torch.cat(slots) if slots else _torch.zeros(0, dtype=_torch.long, device=allocator.device)

"""Exercise 13 graded on the package: ``num_skipped_tokens`` is :class:`~paged_kv.core.kv_cache_groups.
SlidingWindowSpec`'s (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``); ``remove_skipped_blocks``
runs :class:`~paged_kv.core.single_type_kv_cache_manager.SlidingWindowManager`'s on a pool holding the table's
blocks; ``hybrid_hit`` asks a :class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator` with
prefix caching, whose groups cached a prompt's blocks and then lost those the flags say are gone.
"""

from collections.abc import Sequence as _Sequence
from types import SimpleNamespace as _SimpleNamespace

from paged_kv.core.block_pool import BlockPool as _BlockPool
from paged_kv.core.kv_cache_groups import KVCacheGroupSpec as _KVCacheGroupSpec
from paged_kv.core.kv_cache_groups import SlidingWindowSpec as _SlidingWindowSpec
from paged_kv.core.kv_cache_groups import attention_spec as _attention_spec
from paged_kv.core.kv_cache_manager import KVCacheManager as _KVCacheManager
from paged_kv.core.single_type_kv_cache_manager import SlidingWindowManager as _SlidingWindowManager

__all__ = ["hybrid_hit", "num_skipped_tokens", "remove_skipped_blocks"]


def num_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """The leading tokens that neither the next token nor any later one reads."""
    return _SlidingWindowSpec(block_size=1, sliding_window=sliding_window).num_skipped_tokens(
        num_computed_tokens
    )


def remove_skipped_blocks(
    block_ids: _Sequence[int],
    num_computed_tokens: int,
    sliding_window: int,
    block_size: int,
    null_block: int = 0,
) -> tuple[list[int], list[int]]:
    """The table with the blocks wholly before the window nulled, and those blocks, last first."""
    table = list(block_ids)
    real = [b for b in table if b != null_block]
    # A pool whose block 0 is the null block, holding every block of the table: the ids are renamed
    # so that the table's null block is the pool's.
    ids = {null_block: 0, **{b: i + 1 for i, b in enumerate(dict.fromkeys(real))}}
    names = {i: b for b, i in ids.items()}
    pool = _BlockPool(len(ids) + 1)  # the null block (taken already), the table's, and one to spare
    pool.get_new_blocks(len(ids) - 1)
    manager = _SlidingWindowManager(_SlidingWindowSpec(block_size, sliding_window), pool, 0)
    manager.req_to_blocks["r"] = [ids[b] for b in table]
    freed = manager.remove_skipped_blocks("r", num_computed_tokens)
    return [names[b] for b in manager.req_to_blocks["r"]], [names[b] for b in freed]


def hybrid_hit(
    cached: _Sequence[_Sequence[bool]],
    windows: _Sequence[int | None],
    block_size: int,
    num_tokens: int,
) -> int:
    """The prefix-cache hit, in blocks, that every group agrees on (the engine's memory's answer)."""
    groups = [
        _KVCacheGroupSpec((layer,), _attention_spec(window, block_size))
        for layer, window in enumerate(windows)
    ]
    per_group = -(-num_tokens // block_size)
    memory = _KVCacheManager(2 + len(groups) * per_group, kv_cache_groups=groups, enable_caching=True)
    tokens = list(range(num_tokens))
    taken = memory.allocate_slots(_SimpleNamespace(request_id="prompt"), num_tokens, tokens)
    memory.free("prompt")  # every full block stays cached, on the free list
    for flags, block_ids in zip(cached, taken, strict=True):
        for is_cached, block_id in zip(flags, block_ids, strict=False):
            if not is_cached:
                memory.block_pool.evict(block_id)
    return memory.get_computed_blocks(None, tokens).num_tokens // block_size

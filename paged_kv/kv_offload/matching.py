"""How many tokens past the device's prefix-cache hit the host tier can supply (lesson 11).

vLLM's scheduler first asks its own prefix cache (``get_computed_blocks``: ``num_computed_tokens``,
whole blocks), then the connector: ``get_num_new_matched_tokens(request, num_computed_tokens)``,
whose answer becomes the request's ``num_external_computed_tokens``. The offloading connector
(``OffloadingConnectorScheduler._lookup_complete_chunks`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) counts the tier's
consecutive hits from the first block the device lacks (``_maximal_prefix_lookup``) and turns
them into tokens. For one group of full-attention layers and one block per chunk, that is
:func:`get_num_new_matched_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_kv.kv_offload.base import LookupResult, OffloadingManager, OffloadKey
from paged_kv.validate import check_count


def maximal_prefix_lookup(manager: OffloadingManager, keys: Sequence[OffloadKey]) -> int | None:
    """The number of ``keys`` the tier holds one after another from the first; ``None`` when one
    of them is still being stored (``HIT_PENDING``: the scheduler asks again at a later step)."""
    num_hits, pending = 0, False
    for key in keys:
        result = manager.lookup(key)
        if result is LookupResult.MISS:
            break
        num_hits += 1
        pending |= result is LookupResult.HIT_PENDING
    return None if pending else num_hits


def get_num_new_matched_tokens(
    manager: OffloadingManager,
    block_hashes: Sequence[OffloadKey],
    num_computed_tokens: int,
    num_tokens: int,
    block_size: int,
    max_num_new_tokens: int | None = None,
) -> int | None:
    """The tokens past ``num_computed_tokens`` (the device's hit, whole blocks) that the tier can load
    for a request of ``num_tokens`` tokens whose full blocks hash to ``block_hashes``: vLLM's
    ``get_num_new_matched_tokens`` of the offloading connector. ``None``: ask again later (a block
    is still being stored).

    ``max_num_new_tokens`` caps it (a block only partly allowed is still loaded whole, its tail
    then computed). The answer is whole blocks otherwise, and at least one block or 0. It may
    reach ``num_tokens``: a prompt hit in full; vLLM's scheduler then recomputes the last token
    (``num_computed_tokens = num_tokens - 1``) so that the next one can be sampled.

    Raises:
        ValueError: a count that is not a non-negative integer, ``num_computed_tokens`` not a
            multiple of ``block_size`` or past ``num_tokens``, or more hashes than full blocks.
    """
    block_size = check_count("block_size", block_size, minimum=1)
    num_tokens = check_count("num_tokens", num_tokens)
    computed = check_count("num_computed_tokens", num_computed_tokens)
    if computed % block_size or computed > num_tokens:
        raise ValueError(
            f"num_computed_tokens must be whole blocks of {block_size} within the {num_tokens} tokens, "
            f"got {computed}"
        )
    if len(block_hashes) * block_size > num_tokens:
        raise ValueError(
            f"{len(block_hashes)} block_hashes of {block_size} tokens are more than {num_tokens} tokens hold"
        )
    max_hit_tokens = min(num_tokens, len(block_hashes) * block_size)
    if max_num_new_tokens is not None:
        max_hit_tokens = min(max_hit_tokens, computed + check_count("max_num_new_tokens", max_num_new_tokens))
    if max_hit_tokens - computed < block_size:
        return 0
    start = computed // block_size
    num_hits = maximal_prefix_lookup(manager, block_hashes[start : -(-max_hit_tokens // block_size)])
    if num_hits is None:
        return None
    num_hit_tokens = min(max_hit_tokens, (start + num_hits) * block_size) - computed
    return num_hit_tokens if num_hit_tokens >= block_size else 0

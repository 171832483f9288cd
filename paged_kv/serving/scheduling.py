"""The decode-time side of a scheduler, on a :class:`~paged_kv.kv.cache.PagedKVCacheAllocator`.

Each step of a continuous-batching server does two things with the cache: every running sequence
gains one token (:func:`decode_step`, which takes a block only for a sequence whose blocks are full,
and takes the blocks of the whole batch or none), and then the finished sequences give their blocks
back at once while waiting requests join in arrival order (:func:`finish_and_admit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

from paged_kv.core.block import blocks_for_tokens
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.validate import check_count


def decode_step(cache: PagedKVCacheAllocator, seq_ids: Iterable[Hashable]) -> dict[Hashable, int | None]:
    """Add one token to every sequence of the batch, taking the blocks they need, or none at all.

    Two passes, the way a scheduler does it: first look at every sequence (does its next token need a
    block? :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.needs_new_block`), and refuse the step if the
    batch needs more blocks than are free; then, in the order of ``seq_ids``, take a block where one
    is needed and record the token.

    Returns:
        ``{seq_id: the id of the block taken, or None}`` for every sequence of the batch.

    Raises:
        UnknownSequenceError: a sequence is not allocated.
        ValueError: a sequence appears twice in the batch.
        OutOfBlocksError: the batch needs more blocks than are free (``needed`` and ``free`` are the
            counts of the whole batch).

        A step that raises changes nothing.
    """
    seq_ids = list(seq_ids)
    needs = {seq_id: cache.needs_new_block(seq_id) for seq_id in seq_ids}
    if len(needs) != len(seq_ids):
        repeated = next(seq_id for i, seq_id in enumerate(seq_ids) if seq_id in seq_ids[:i])
        raise ValueError(f"seq_ids must be distinct, but {repeated!r} appears more than once")
    needed = sum(needs.values())
    if needed > cache.num_free_blocks:
        raise OutOfBlocksError(needed, cache.num_free_blocks, f"a decode step of {len(seq_ids)} sequences")
    taken: dict[Hashable, int | None] = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)  # a slot is free now: takes no block
    return taken


def finish_and_admit(
    cache: PagedKVCacheAllocator,
    finished: Iterable[Hashable],
    waiting: deque[tuple[Hashable, int]],
    max_running: int,
) -> list[Hashable]:
    """Free the finished sequences at once, then admit waiting requests in arrival order while they fit.

    ``waiting`` holds ``(seq_id, prompt_tokens)`` pairs, oldest first. While the cache holds fewer
    than ``max_running`` sequences and the oldest request's prompt fits in the free blocks, it is
    popped from the left and given its blocks. Admission stops at the first request that does not
    fit: none skips ahead of an older one.

    Returns:
        The ids admitted, in order.

    Raises:
        ValueError: ``max_running`` is negative, or a waiting request cannot be allocated (its
            prompt is not a count of tokens, or its id is already allocated); that request stays
            at the front of ``waiting``, and the sequences freed and admitted before it stay so.
    """
    max_running = check_count("max_running", max_running)
    for seq_id in finished:
        cache.free_sequence(seq_id)
    admitted = []
    while waiting and len(cache.seq_ids) < max_running:
        seq_id, prompt_tokens = waiting[0]
        prompt_tokens = check_count("prompt_tokens", prompt_tokens)
        if blocks_for_tokens(prompt_tokens, cache.block_size) > cache.num_free_blocks:
            break
        cache.allocate_for_sequence(seq_id, prompt_tokens)
        waiting.popleft()
        admitted.append(seq_id)
    return admitted

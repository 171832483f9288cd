"""Exercise 04 graded on the package: ``needs_new_block`` is the boundary rule of :mod:`paged_kv.core.mapping`
(the one ``PagedKVCacheAllocator.needs_new_block`` applies to a sequence); ``BlockManager`` is lesson
02's ``SequenceAllocator``, so :class:`paged_kv.kv.cache.PagedKVCacheAllocator`, whose
``append_block_to_sequence`` is the one graded, seen through the seed lesson's names
(``blocks``, ``free_blocks``, ``sequence_block_tables``, read only); and ``decode_step`` and
``finish_and_admit`` are lesson 04's teaching scheduler steps, written here on the package's cache
(:class:`~paged_kv.kv.cache.PagedKVCacheAllocator`). The package itself has one scheduler,
:class:`~paged_kv.serving.scheduler.Scheduler`, vLLM v1's (lessons 07, 09, 11): it admits by the same
rule as ``finish_and_admit`` (the prompt's blocks are free, nothing kept back for the running
requests), but gives the running requests their slots first, one request at a time, and preempts the
newest when one finds no block, where ``decode_step`` refuses the whole batch; lesson 11 reuses
``decode_step`` as lesson 04's.
"""

from collections import deque as _deque
from collections.abc import Hashable as _Hashable
from collections.abc import Iterable as _Iterable

from paged_kv.core.block import Block as _Block
from paged_kv.core.block import BlockTable as _BlockTable
from paged_kv.core.block import blocks_for_tokens as _blocks_for_tokens
from paged_kv.core.mapping import needs_new_block
from paged_kv.errors import OutOfBlocksError as _OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator as _PagedKVCacheAllocator
from paged_kv.reference.lesson02 import SequenceAllocator as _SequenceAllocator
from paged_kv.validate import check_count as _check_count

__all__ = ["BlockManager", "decode_step", "finish_and_admit", "needs_new_block"]


class BlockManager(_SequenceAllocator):
    """The package's cache (with tensors too small to matter, block ids back) under the exercise's names."""

    @property
    def blocks(self) -> list[_Block]:
        """A handle per block with its ref count (a snapshot)."""
        return [_Block(block_id, self.ref_count(block_id)) for block_id in range(self.num_blocks)]

    @property
    def free_blocks(self) -> _deque[int]:
        """The free list, head first (a snapshot)."""
        return _deque(self.manager.allocator.free_block_ids)

    @property
    def sequence_block_tables(self) -> dict[_Hashable, _BlockTable]:
        """The live block tables, by sequence id."""
        return self.manager.tables


def decode_step(cache: _PagedKVCacheAllocator, seq_ids: _Iterable[_Hashable]) -> dict[_Hashable, int | None]:
    """Add one token to every sequence of the batch, taking the blocks they need, or none at all.

    Two passes, lesson 04's teaching step: first look at every sequence (does its next token need a
    block? :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.needs_new_block`), and refuse the step if the
    batch needs more blocks than are free; then, in the order of ``seq_ids``, take a block where one
    is needed and record the token. (vLLM's scheduler asks for each request's slots in turn, with
    ``KVCacheManager.allocate_slots``, and preempts the newest running request when one finds no
    block, instead of refusing the step: lesson 11.)

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
        raise _OutOfBlocksError(needed, cache.num_free_blocks, f"a decode step of {len(seq_ids)} sequences")
    taken: dict[_Hashable, int | None] = {}
    for seq_id in seq_ids:
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needs[seq_id] else None
        cache.append_tokens(seq_id, 1)  # a slot is free now: takes no block
    return taken


def finish_and_admit(
    cache: _PagedKVCacheAllocator,
    finished: _Iterable[_Hashable],
    waiting: _deque[tuple[_Hashable, int]],
    max_running: int,
) -> list[_Hashable]:
    """Free the finished sequences at once, then admit waiting requests in arrival order while they fit.

    ``waiting`` holds ``(seq_id, prompt_tokens)`` pairs, oldest first. While the cache holds fewer
    than ``max_running`` sequences and the oldest request's prompt fits in the free blocks, it is
    popped from the left and given its blocks. Admission stops at the first request that does not
    fit: none skips ahead of an older one. (vLLM admits by this rule too, first come first served,
    with no block kept back for the running requests; it frees a finished request at the end of a
    step and admits in the next, after the running requests have their slots.)

    Returns:
        The ids admitted, in order.

    Raises:
        ValueError: ``max_running`` is negative, or a waiting request cannot be allocated (its
            prompt is not a count of tokens, or its id is already allocated); that request stays
            at the front of ``waiting``, and the sequences freed and admitted before it stay so.
    """
    max_running = _check_count("max_running", max_running)
    for seq_id in finished:
        cache.free_sequence(seq_id)
    admitted = []
    while waiting and len(cache.seq_ids) < max_running:
        seq_id, prompt_tokens = waiting[0]
        prompt_tokens = _check_count("prompt_tokens", prompt_tokens)
        if _blocks_for_tokens(prompt_tokens, cache.block_size) > cache.num_free_blocks:
            break
        cache.allocate_for_sequence(seq_id, prompt_tokens)
        waiting.popleft()
        admitted.append(seq_id)
    return admitted

"""Exercise 11 graded on the package: ``admit_with_watermark`` is the engine's admission rule (vLLM's:
the prompt's blocks, and the watermark's ``ceil(watermark * num_blocks)`` blocks while another request
runs, :class:`paged_kv.core.kv_cache_manager.KVCacheManager`); ``choose_victims`` is the scheduler's
preemption on plain numbers (it pops the newest running request until the others' next tokens fit:
:meth:`paged_kv.serving.scheduler.Scheduler.schedule`), and ``requeue`` puts the victims back at the
front of the queue the way the scheduler does (``appendleft``, newest first); ``priority_victims`` is
the same preemption under vLLM's ``"priority"`` policy (the running request with the largest
``(priority, arrival_time)`` first, wherever it stands);
``swap_out`` and ``swap_in`` are :mod:`paged_kv.kv.swap` on one allocator, with the saved K/V as a
``(k, v)`` pair instead of a :class:`~paged_kv.kv.swap.SwappedKV`.
"""

from collections import deque as _deque
from collections.abc import Hashable as _Hashable
from collections.abc import Sequence as _Sequence

import torch as _torch

from paged_kv.core.kv_cache_manager import watermark_blocks
from paged_kv.errors import OutOfBlocksError as _OutOfBlocksError
from paged_kv.kv import swap as _swap
from paged_kv.kv.cache import PagedKVCacheAllocator as _PagedKVCacheAllocator
from paged_kv.validate import check_count as _check_count
from paged_kv.validate import check_hashable as _check_hashable

__all__ = ["admit_with_watermark", "choose_victims", "priority_victims", "requeue", "swap_in", "swap_out"]


def admit_with_watermark(
    num_free_blocks: int, prompt_blocks: int, num_running: int, num_blocks: int, watermark: float
) -> bool:
    """The prompt's blocks are free, and the watermark's too while another request runs (vLLM's rule)."""
    keep = watermark_blocks(watermark, num_blocks) if num_running else 0
    return prompt_blocks + keep <= num_free_blocks


def requeue(waiting: _deque, victims: list) -> None:
    """Put ``victims`` (newest first) at the front of ``waiting``, the oldest victim first."""
    waiting.extendleft(victims)


def swap_out(allocator: _PagedKVCacheAllocator, seq_id: _Hashable) -> tuple[_torch.Tensor, _torch.Tensor]:
    """The sequence's K and V copied to host memory; its blocks freed."""
    saved = _swap.swap_out(allocator.manager, allocator.storage, seq_id)
    return saved.k[0], saved.v[0]


def swap_in(
    allocator: _PagedKVCacheAllocator, seq_id: _Hashable, saved: tuple[_torch.Tensor, _torch.Tensor]
) -> None:
    """Fresh blocks for the saved tokens, the K and V copied back; all or nothing."""
    k, v = saved
    _swap.swap_in(allocator.manager, allocator.storage, seq_id, _swap.SwappedKV(k.shape[0], (k,), (v,)))


# A running sequence as preemption sees it: (seq_id, blocks preempting it frees, whether its next
# token takes a new block).
_Candidate = tuple[_Hashable, int, bool]


def choose_victims(running: _Sequence[_Candidate], num_free_blocks: int) -> list[_Hashable]:
    """The sequences to preempt so that the next decode step of the others fits, newest first.

    ``running`` lists the running sequences in admission order, oldest first, each as a
    ``(seq_id, blocks, needs_block)`` tuple: ``blocks`` is how many blocks preempting it frees (all
    it holds, when it shares none), ``needs_block`` whether its next token takes a new block. The
    step fits when the sequences left need at most ``num_free_blocks`` new blocks, counting the
    blocks the victims free. Victims are taken from the end of ``running`` (the newest) until the
    step fits; the oldest sequence is never taken, since with nothing left running no sequence
    would ever finish and free its blocks.

    Invariant of the answer: the victims are a suffix of ``running``, reversed, and the shortest
    suffix whose removal makes the step fit.

    Returns:
        The victims' ids, newest first; ``[]`` when the step fits already.

    Raises:
        ValueError: ``running`` is not a sequence of ``(seq_id, blocks, needs_block)`` tuples with
            distinct ids, counts for ``blocks`` and bools for ``needs_block``, or
            ``num_free_blocks`` is not a count; the message names the culprit.
        OutOfBlocksError: even the oldest sequence alone needs more blocks than are free.
    """
    free = _check_count("num_free_blocks", num_free_blocks)
    candidates = _check_running(running)
    return _take_victims(candidates[::-1], free, "the oldest running sequence alone")


def priority_victims(running: _Sequence[tuple], num_free_blocks: int) -> list[_Hashable]:
    """The sequences to preempt under the ``"priority"`` policy, in the order they are preempted.

    ``running`` lists the running sequences in admission order, each as a ``(seq_id, blocks,
    needs_block, priority, arrival)`` tuple: :func:`choose_victims`'s three, the request's
    ``priority`` (an int, lower first) and its ``arrival`` time (distinct for distinct sequences).
    Victims are taken by the largest ``(priority, arrival)`` first, wherever they stand in the list
    (vLLM: ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``), until the others'
    next tokens fit; the last sequence left is never taken.

    Invariant of the answer: the victims are the shortest run of ``running`` sorted by ``(priority,
    arrival)``, from the largest, whose removal makes the step fit; each ranks below every sequence
    left. The scheduler's loop, which preempts only when a request finds no block, takes the same.

    Raises:
        ValueError: a malformed ``running`` (as :func:`choose_victims`, and an int ``priority`` and
            a real ``arrival`` each), or ``num_free_blocks`` not a count; named.
        OutOfBlocksError: the last sequence left alone needs more blocks than are free.
    """
    free = _check_count("num_free_blocks", num_free_blocks)
    if isinstance(running, str | bytes) or not isinstance(running, _Sequence):
        raise ValueError(f"running must be a list of 5-tuples, got {running!r}")
    ranks = []
    for index, entry in enumerate(running):
        if not isinstance(entry, tuple) or len(entry) != 5:
            raise ValueError(
                f"running[{index}] must be a (seq_id, blocks, needs_block, priority, arrival) tuple, "
                f"got {entry!r}"
            )
        priority, arrival = entry[3:]
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"running[{index}]'s priority must be an int, got {priority!r}")
        if isinstance(arrival, bool) or not isinstance(arrival, int | float):
            raise ValueError(f"running[{index}]'s arrival must be a number, got {arrival!r}")
        ranks.append((priority, arrival, index))  # ties (not expected) go to the later admitted
    candidates = _check_running([entry[:3] for entry in running])
    order = sorted(range(len(candidates)), key=ranks.__getitem__, reverse=True)
    return _take_victims([candidates[i] for i in order], free, "the last running sequence alone")


def _take_victims(order: list[_Candidate], free: int, last: str) -> list[_Hashable]:
    """The one rule of both policies: take the candidates in ``order`` (the first is preempted
    first) until the others' next tokens fit, each victim's blocks freed and its need gone; never
    the last one left (``last`` says which it is, in the error)."""
    needed = sum(needs for _, _, needs in order)
    victims: list[_Hashable] = []
    while needed > free:
        if len(victims) == len(order) - 1:
            raise _OutOfBlocksError(needed, free, last)
        seq_id, blocks, needs = order[len(victims)]
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims


def _check_running(running: object) -> list[_Candidate]:
    if isinstance(running, str | bytes) or not isinstance(running, _Sequence):
        raise ValueError(f"running must be a list of (seq_id, blocks, needs_block) tuples, got {running!r}")
    seen: set[_Hashable] = set()
    candidates = []
    for index, entry in enumerate(running):
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise ValueError(f"running[{index}] must be a (seq_id, blocks, needs_block) tuple, got {entry!r}")
        seq_id, blocks, needs = entry
        _check_hashable(f"running[{index}]'s seq_id", seq_id)
        blocks = _check_count(f"running[{index}]'s blocks", blocks)
        if not isinstance(needs, bool):
            raise ValueError(f"running[{index}]'s needs_block must be True or False, got {needs!r}")
        if seq_id in seen:
            raise ValueError(f"running lists seq_id {seq_id!r} twice")
        seen.add(seq_id)
        candidates.append((seq_id, blocks, needs))
    return candidates

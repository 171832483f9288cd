"""Choosing what to preempt when a decode step finds too few free blocks (lesson 11).

A paged engine admits a request on a bet: that the blocks the running sequences will take as they
grow will be there when they are needed. When a decode step needs more new blocks than are free,
something must give. vLLM's answer, which :class:`~paged_kv.serving.engine.Engine` follows, is to preempt
*whole* sequences, the most recently admitted first, until the step fits:

* whole sequences, because every decode step of a sequence reads all of its K/V: a sequence that
  lost some of its blocks could not run anyway, so all of its blocks go, or none;
* newest first, because that is first come, first served: the requests that arrived earliest keep
  their place and finish first, and a victim is later resumed ahead of every waiting request.

:func:`choose_victims` is that rule on plain numbers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from paged_kv.errors import OutOfBlocksError
from paged_kv.validate import check_count, check_hashable

# A running sequence as preemption sees it: (seq_id, blocks preempting it frees, whether its next
# token takes a new block).
Candidate = tuple[Hashable, int, bool]


def choose_victims(running: Sequence[Candidate], num_free_blocks: int) -> list[Hashable]:
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
    free = check_count("num_free_blocks", num_free_blocks)
    candidates = _check_running(running)
    needed = sum(needs for _, _, needs in candidates)
    victims: list[Hashable] = []
    while needed > free:
        if len(victims) == len(candidates) - 1:
            raise OutOfBlocksError(needed, free, "the oldest running sequence alone")
        seq_id, blocks, needs = candidates[-1 - len(victims)]
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims


def _check_running(running: object) -> list[Candidate]:
    if isinstance(running, str | bytes) or not isinstance(running, Sequence):
        raise ValueError(f"running must be a list of (seq_id, blocks, needs_block) tuples, got {running!r}")
    seen: set[Hashable] = set()
    candidates = []
    for index, entry in enumerate(running):
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise ValueError(f"running[{index}] must be a (seq_id, blocks, needs_block) tuple, got {entry!r}")
        seq_id, blocks, needs = entry
        check_hashable(f"running[{index}]'s seq_id", seq_id)
        blocks = check_count(f"running[{index}]'s blocks", blocks)
        if not isinstance(needs, bool):
            raise ValueError(f"running[{index}]'s needs_block must be True or False, got {needs!r}")
        if seq_id in seen:
            raise ValueError(f"running lists seq_id {seq_id!r} twice")
        seen.add(seq_id)
        candidates.append((seq_id, blocks, needs))
    return candidates

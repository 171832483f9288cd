"""The KV memory a scheduler admits into: paged blocks or contiguous reservations (lessons 07, 09, 11).

:class:`~paged_kv.serving.scheduler.Scheduler` asks its memory the questions of
:class:`KVMemory` and nothing else, so the same scheduler runs the engine's paged and contiguous
modes and every policy of lesson 07's simulator:

* :class:`PagedMemory`: blocks of a :class:`~paged_kv.serving.protocols.BlockCache`, taken on
  demand as sequences grow. A request is admitted by **the** admission rule, :func:`admits`: its
  prompt's blocks, plus one block of headroom per running sequence (itself included: the most the
  next decode step can take), plus the watermark's blocks, are free. A sequence can be preempted
  (its blocks freed, or swapped out to host memory when the cache can swap).
* :class:`ContiguousMemory`: ``budget_tokens`` slots, one reservation per sequence made at
  admission and sized by a function of the request (the maximum model length, the next power of
  two of the final length, the final length itself). A sequence never outgrows its reservation,
  so nothing is ever preempted.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from paged_kv.core.block import blocks_for_tokens
from paged_kv.serving.protocols import BlockCache, SwappingCache
from paged_kv.serving.request import SchedulerRequest
from paged_kv.validate import check_count

if TYPE_CHECKING:
    from paged_kv.model.kv_cache import KVCache


class KVMemory(Protocol):
    """What :class:`~paged_kv.serving.scheduler.Scheduler` asks of the memory it admits into.

    Sequences are named by their request ids. Invariant: every method that returns True for a
    request leaves the memory able to do what it promised (an admitted prompt has its room, a
    swapped-in sequence its blocks).
    """

    can_swap: bool
    """Whether :meth:`swap_out` and :meth:`swap_in` work (paged memory over a swapping cache)."""

    def serves_alone(self, request: SchedulerRequest) -> bool:
        """Whether the request, alone in the memory, can be admitted and grow to its longest."""
        ...

    def can_admit(self, request: SchedulerRequest, num_running: int) -> bool:
        """Whether the request can join ``num_running`` running sequences now."""
        ...

    def can_swap_in(self, num_tokens: int, num_running: int) -> bool:
        """Whether a swapped-out sequence of ``num_tokens`` tokens can join ``num_running`` others."""
        ...

    def add_sequence(self, request: SchedulerRequest) -> int:
        """Give the request's prompt its room; return the leading prompt tokens the prefix cache served."""
        ...

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token takes a free block (never, in a contiguous reservation)."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (a contiguous memory, which has none to take, answers its free slots)."""
        ...

    def blocks_held(self, num_tokens: int) -> int:
        """The blocks a sequence of ``num_tokens`` tokens holds."""
        ...

    def append(self, seq_ids: Sequence[Hashable]) -> None:
        """Grow each sequence by one token (what a runner that runs no model does to the memory)."""
        ...

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's memory."""
        ...

    def swap_out(self, seq_id: Hashable) -> object:
        """Copy the sequence's K/V to host memory and free its blocks; return what was saved."""
        ...

    def swap_in(self, seq_id: Hashable, saved: object) -> None:
        """Give the sequence fresh blocks and copy back what :meth:`swap_out` saved."""
        ...

    @property
    def reserved_tokens(self) -> int:
        """The token slots the running sequences reserve: whole blocks, or whole reservations."""
        ...

    def describe_free(self) -> str:
        """The free memory in words, for an error message."""
        ...


# ------------------------------------------------------------------------------ the admission rule


def admits(num_free_blocks: int, blocks: int, num_running: int, keep_free: int = 0) -> bool:
    """The paged admission rule: can a sequence taking ``blocks`` blocks now join ``num_running`` others?

    Yes when its blocks, one block of headroom per running sequence (itself included: the most the
    next decode step can take) and ``keep_free`` blocks (the watermark) are all free (lessons 09, 11).
    """
    headroom = num_running + 1
    return blocks + headroom + keep_free <= num_free_blocks


def check_watermark(watermark: object) -> float:
    """``watermark`` as a float, or a ValueError naming it: a fraction of the blocks in ``[0, 1)``."""
    if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark!r}")
    return float(watermark)


def watermark_blocks(watermark: float, num_blocks: int) -> int:
    """The blocks an admission ``watermark`` (a fraction of the pool) keeps free: rounded up (lesson 11).

    Rounding up means any watermark above 0 keeps at least one block free (vLLM V0 rounded down).
    """
    return math.ceil(check_watermark(watermark) * check_count("num_blocks", num_blocks, minimum=1))


def blocks_alone(num_prompt_tokens: int, max_new_tokens: int, block_size: int) -> tuple[int, int]:
    """The blocks a request needs alone: to be admitted (prompt plus one of headroom), and at its longest.

    At its longest a sequence holds ``num_prompt_tokens + max_new_tokens - 1`` tokens: its last
    token is sampled, never fed back.
    """
    admit = blocks_for_tokens(num_prompt_tokens, block_size) + 1
    peak = blocks_for_tokens(num_prompt_tokens + max_new_tokens - 1, block_size)
    return admit, peak


def serves_alone(
    num_prompt_tokens: int, max_new_tokens: int, num_blocks: int, block_size: int, watermark: float
) -> bool:
    """Whether ``num_blocks`` can admit a request alone, watermark kept, and hold it at its longest."""
    admit, peak = blocks_alone(num_prompt_tokens, max_new_tokens, block_size)
    return admit + watermark_blocks(watermark, num_blocks) <= num_blocks and peak <= num_blocks


# ----------------------------------------------------------------------------------- the memories


class PagedMemory:
    """Blocks of ``cache`` (``num_blocks`` of ``block_size`` slots), admitted into by :func:`admits`.

    ``watermark`` (a fraction in ``[0, 1)``) keeps ``ceil(watermark * num_blocks)`` blocks free at
    admission; a swap-in keeps only the headroom. With ``enable_prefix_caching=True`` prompts are
    added with their token ids and the cache says how many leading tokens it served; admission
    still counts every block of the prompt, as if nothing were cached.

    With prefix caching the cache must have ``num_cached_tokens(seq_id)`` (the engine checks its
    cache is a :class:`~paged_kv.serving.protocols.PrefixCachingCache`).

    Raises:
        ValueError: a bad count or watermark, named.
    """

    def __init__(
        self,
        cache: BlockCache,
        num_blocks: int,
        block_size: int,
        *,
        watermark: float = 0.0,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.cache = cache
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = check_count("block_size", block_size, minimum=1)
        self.watermark = check_watermark(watermark)
        self.keep_free = watermark_blocks(self.watermark, self.num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.can_swap = isinstance(cache, SwappingCache)

    def serves_alone(self, request: SchedulerRequest) -> bool:
        return serves_alone(
            request.num_prompt_tokens,
            request.max_new_tokens,
            self.num_blocks,
            self.block_size,
            self.watermark,
        )

    def can_admit(self, request: SchedulerRequest, num_running: int) -> bool:
        """:func:`admits` beside running sequences; alone, the prompt's blocks must be free, no more.

        The headroom and the watermark keep room for the growth of *other* sequences, and a request
        that :meth:`serves_alone` grows to its longest within the pool, so alone it needs neither.
        A fresh request alone passes the rule anyway; a request resumed by recompute, whose prompt
        now holds its generated tokens, may not, and would otherwise never come back (vLLM, too,
        keeps its watermark only when some request is already scheduled).
        """
        blocks = blocks_for_tokens(request.num_prompt_tokens, self.block_size)
        if num_running == 0:
            return blocks <= self.cache.num_free_blocks
        return admits(self.cache.num_free_blocks, blocks, num_running, self.keep_free)

    def can_swap_in(self, num_tokens: int, num_running: int) -> bool:
        return admits(self.cache.num_free_blocks, self.blocks_held(num_tokens), num_running)

    def add_sequence(self, request: SchedulerRequest) -> int:
        """Add the prompt; with prefix caching, return the cached tokens, checked to be in ``0 .. n - 1``.

        Raises:
            RuntimeError: the cache reports cached tokens outside ``0 .. len(prompt) - 1``.
        """
        n = request.num_prompt_tokens
        if not self.enable_prefix_caching:
            self.cache.add_sequence(request.request_id, n)
            return 0
        self.cache.add_sequence(request.request_id, n, token_ids=request.prompt_token_ids)
        cached = self.cache.num_cached_tokens(request.request_id)
        if not 0 <= cached < n:
            raise RuntimeError(
                f"the cache reports {cached} cached tokens for request {request.request_id!r}, whose "
                f"prompt has {n}: expected 0 .. {n - 1}"
            )
        return cached

    def needs_new_block(self, seq_id: Hashable) -> bool:
        return self.cache.needs_new_block(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    def blocks_held(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def append(self, seq_ids: Sequence[Hashable]) -> None:
        self.cache.append(seq_ids)

    def free(self, seq_id: Hashable) -> None:
        self.cache.free(seq_id)

    def swap_out(self, seq_id: Hashable) -> object:
        return self.cache.swap_out(seq_id)  # type: ignore[attr-defined]  # only when can_swap

    def swap_in(self, seq_id: Hashable, saved: object) -> None:
        self.cache.swap_in(seq_id, saved)  # type: ignore[attr-defined]  # only when can_swap

    @property
    def reserved_tokens(self) -> int:
        """The slots of the blocks in use: ``(num_blocks - free) * block_size``."""
        return (self.num_blocks - self.cache.num_free_blocks) * self.block_size

    def describe_free(self) -> str:
        return (
            f"{self.cache.num_free_blocks} free blocks the cache reports out of {self.num_blocks}; "
            f"check the cache's num_free_blocks"
        )


class ContiguousMemory:
    """``budget_tokens`` slots shared out as one contiguous reservation per sequence.

    ``reserve(request)`` gives the slots a request reserves when it is admitted; they stay reserved
    until it is freed. A request is admitted while its reservation fits in the free slots. Nothing
    is ever preempted or swapped: a sequence's reservation holds it at its longest, which
    :meth:`serves_alone` checks. ``cache`` (the engine's
    :class:`~paged_kv.model.kv_cache.ContiguousKVCache`; None in a simulator) gets every sequence
    added and freed as well.

    Raises:
        ValueError: ``budget_tokens`` is not a count of at least 1, or ``reserve`` is not callable.
    """

    can_swap = False

    def __init__(
        self, budget_tokens: int, reserve: Callable[[SchedulerRequest], int], cache: KVCache | None = None
    ) -> None:
        self.cache = cache
        self.budget_tokens = check_count("budget_tokens", budget_tokens, minimum=1)
        if not callable(reserve):
            raise ValueError(f"reserve must be a function of a request, got {reserve!r}")
        self.reserve = reserve
        self.reservations: dict[Hashable, int] = {}  # request id -> slots reserved

    def serves_alone(self, request: SchedulerRequest) -> bool:
        size = self.reserve(request)
        return request.num_prompt_tokens + request.max_new_tokens - 1 <= size <= self.budget_tokens

    def can_admit(self, request: SchedulerRequest, num_running: int) -> bool:
        return self.reserve(request) <= self.free_tokens

    def can_swap_in(self, num_tokens: int, num_running: int) -> bool:
        raise NotImplementedError("a contiguous memory never swaps")

    @property
    def free_tokens(self) -> int:
        """The slots no admitted sequence has reserved."""
        return self.budget_tokens - self.reserved_tokens

    def add_sequence(self, request: SchedulerRequest) -> int:
        self.reservations[request.request_id] = self.reserve(request)
        if self.cache is not None:
            self.cache.add_sequence(request.request_id, request.num_prompt_tokens)
        return 0

    def needs_new_block(self, seq_id: Hashable) -> bool:
        return False

    @property
    def num_free_blocks(self) -> int:
        return self.free_tokens

    def blocks_held(self, num_tokens: int) -> int:
        return 0  # freeing a reservation frees no block a decode step could take

    def append(self, seq_ids: Sequence[Hashable]) -> None:
        """Nothing to do: the reservation was sized for the sequence's final length."""

    def free(self, seq_id: Hashable) -> None:
        del self.reservations[seq_id]
        if self.cache is not None:
            self.cache.free(seq_id)

    def swap_out(self, seq_id: Hashable) -> object:
        raise NotImplementedError("a contiguous memory never swaps")

    def swap_in(self, seq_id: Hashable, saved: object) -> None:
        raise NotImplementedError("a contiguous memory never swaps")

    @property
    def reserved_tokens(self) -> int:
        return sum(self.reservations.values())

    def describe_free(self) -> str:
        return f"{self.free_tokens} free token slots out of {self.budget_tokens}"

"""What the engine drives, as `typing.Protocol` classes: the one seam between the parts of a step.

A step has three parts (lessons 07, 09, 11), each behind one protocol here:

* the **KV memory** the scheduler takes blocks from, :class:`KVMemory`: the paged
  :class:`~paged_kv.core.kv_cache_manager.KVCacheManager` (vLLM's ``KVCacheManager``, one block
  stack for every model), the contiguous reservations of
  :class:`~paged_kv.serving.contiguous_memory.ContiguousMemory`, or the first-fit address space of
  lesson 07's simulator (:class:`~paged_kv.simulation.contiguous.FirstFitMemory`);
* the **runner** that computes a step, :class:`Runner`: the
  :class:`~paged_kv.serving.model_runner.ModelRunner` of a real model, or the
  :class:`~paged_kv.serving.model_runner.CountingRunner` of the simulators.

A protocol states a contract by its methods, not by a base class, and declares everything the
engine calls: nothing in the engine asks an object what it is (no ``isinstance`` probe, no
``getattr`` with a default).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from paged_kv.core.kv_cache_coordinator import BlockIds, ComputedBlocks
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.serving.outputs import ModelRunnerOutput, SchedulerOutput
from paged_kv.serving.request import EngineCoreRequest


class KVMemory(Protocol):
    """What the scheduler and the engine ask of the memory their requests' K/V live in.

    Requests are named by their ids. Invariant: :meth:`allocate_slots` is all or nothing, and a
    request's blocks are the ones it was given, in order, until :meth:`free`.
    """

    num_blocks: int
    """The blocks its block ids range over: ``0 .. num_blocks - 1``, the storage the runner needs."""
    block_size: int
    """The token slots of a block."""
    enable_caching: bool
    """Whether it caches prefixes (a lookup can find something)."""

    @property
    def usage(self) -> float:
        """The share of the memory in use, a fraction (vLLM's ``kv_cache_usage_perc``)."""
        ...

    @property
    def reserved_tokens(self) -> int:
        """The token slots the requests hold: whole blocks, or whole reservations."""
        ...

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters since the memory was built."""
        ...

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counts since the last call (a step's)."""
        ...

    def max_tokens(self, request: EngineCoreRequest) -> int:
        """The most tokens ``request`` could ever hold here, alone: more, and it can never be served."""
        ...

    def get_computed_blocks(
        self, request: EngineCoreRequest, token_ids: Sequence[int] | None
    ) -> ComputedBlocks:
        """The cached prefix of a new request's ``token_ids`` (prompt, and any tokens it resumes with)."""
        ...

    def allocate_slots(
        self,
        request: EngineCoreRequest,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        new_computed_blocks: ComputedBlocks | None = None,
        num_tokens_to_fit: int | None = None,
        has_scheduled_reqs: bool = True,
        preempted: bool = False,
    ) -> BlockIds | None:
        """Slots for ``num_new_tokens`` more tokens of the request, all or nothing: the block ids it
        gained, one tuple per KV-cache group (all of them for a new request), or ``None`` when they
        do not fit. ``preempted`` says a new request resumes after a preemption (its prefix-cache
        lookup counts apart, as vLLM counts a request with ``num_preemptions > 0``)."""
        ...

    def get_block_ids(self, request_id: Hashable) -> BlockIds:
        """The request's block ids, in table order, one tuple per KV-cache group."""
        ...

    def free(self, request_id: Hashable) -> None:
        """Release the request's memory (an unknown id is a no-op)."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix when no request holds memory; whether it did."""
        ...

    def snapshot(self) -> AllocatorSnapshot | None:
        """The pool and every request's table, frozen, for a picture (``None``: no pool to draw)."""
        ...

    def describe_free(self) -> str:
        """The free memory in words, for an error message."""
        ...


class Runner(Protocol):
    """Computes the step a :class:`~paged_kv.serving.scheduler.SchedulerOutput` describes (vLLM:
    the worker's ``execute_model``) and returns what it sampled."""

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput: ...

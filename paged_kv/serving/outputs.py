"""What one step passes between the scheduler and the runner: two frozen values (lessons 09, 10).

:class:`SchedulerOutput` is what :meth:`~paged_kv.serving.scheduler.Scheduler.schedule` decided
(vLLM: ``SchedulerOutput`` in ``vllm/v1/core/sched/output.py``), and :class:`ModelRunnerOutput`
what the runner computed (vLLM: ``ModelRunnerOutput`` in ``vllm/v1/outputs.py``). Between them
they are the whole seam: the runner needs nothing else from the scheduler, and the scheduler
nothing else from the runner.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from paged_kv.core.kv_cache_coordinator import BlockIds
from paged_kv.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorOutput
from paged_kv.serving.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from paged_kv.serving.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no row for: admitted, resumed after recompute, or swapped back in
    (vLLM: ``NewRequestData``).

    ``token_ids`` are its tokens so far (the prompt, then the tokens it generated before a
    preemption); ``block_ids`` all its blocks, one tuple per KV-cache group, prefix-cache hits
    first (a sliding-window group's hit starts with null blocks); ``num_computed_tokens`` the
    tokens whose K/V those blocks already hold (the hits, or a swapped-in request's K/V);
    ``sampling_params`` how its tokens are picked (None: greedy).
    """

    req_id: Hashable
    token_ids: tuple[int, ...] | None
    block_ids: BlockIds
    num_computed_tokens: int
    sampling_params: SamplingParams | None = None


@dataclass(frozen=True)
class CachedRequestData:
    """The requests the runner already has a row for, scheduled again (vLLM: ``CachedRequestData``):
    the blocks each gained this step, one tuple per KV-cache group (appended to its rows), and its
    computed tokens before the step. A block a sliding window freed is not announced: the runner's
    row keeps the old id, which no window reads again."""

    req_ids: tuple[Hashable, ...] = ()
    new_block_ids: tuple[BlockIds, ...] = ()
    num_computed_tokens: tuple[int, ...] = ()


class Preemption(NamedTuple):
    """A request preempted this step by ``way`` (``"recompute"`` or ``"swap"``); ``num_tokens`` is the
    K/V it held (for a recompute, what is thrown away and computed again)."""

    request_id: Hashable
    way: str
    num_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """What step ``step`` runs, as :meth:`Scheduler.schedule` decided it (vLLM: ``SchedulerOutput``).

    ``num_scheduled_tokens`` maps each scheduled request to its tokens this step, in the order the
    runner flattens them (the running requests in list order, then new ones), and
    ``total_num_scheduled_tokens`` is their sum. The blocks of those tokens are taken already: a
    new request's in ``scheduled_new_reqs``, the others' new ones in ``scheduled_cached_reqs``.
    ``preemptions`` lists the requests preempted to make room, newest first;
    ``blocks_to_swap_out`` maps each request swapped out to the blocks whose K/V the runner copies
    to host memory before the forward (vLLM V0's name), and ``blocks_to_swap_in`` each request
    swapped back to the blocks it copies them into, one tuple per KV-cache group.
    ``finished_req_ids`` are the requests that finished since the last step: the runner drops
    their rows. ``kv_connector_metadata`` is the KV connector's work for the step (its loads and
    stores; ``None``: no connector). Frozen: the runner needs nothing else from the scheduler.
    """

    step: int
    num_scheduled_tokens: Mapping[Hashable, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_new_reqs: tuple[NewRequestData, ...] = ()
    scheduled_cached_reqs: CachedRequestData = CachedRequestData()
    preemptions: tuple[Preemption, ...] = ()
    blocks_to_swap_out: Mapping[Hashable, BlockIds] = field(default_factory=dict)
    blocks_to_swap_in: Mapping[Hashable, BlockIds] = field(default_factory=dict)
    finished_req_ids: frozenset[Hashable] = frozenset()
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def preempted_req_ids(self) -> frozenset[Hashable]:
        """vLLM's ``preempted_req_ids``: the requests preempted this step, either way."""
        return frozenset(p.request_id for p in self.preemptions)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What a runner computed for a :class:`SchedulerOutput` (vLLM: ``ModelRunnerOutput``):
    ``sampled_token_ids`` maps each request whose scheduled tokens reached its end (a decode, or the
    last chunk of a prefill) to the token it sampled; a partial chunk samples nothing.

    ``logprobs`` holds the sampled token's :class:`~paged_kv.serving.logprobs.TokenLogprobs` for
    each request that asked for them; ``prompt_logprobs`` those of the prompt tokens this step
    scored, in order, for each request that asked for them (a chunk of positions ``c .. e - 1``
    scores prompt tokens ``c + 1 .. e``: token 0 is never scored, and the logits at the prompt's
    last position predict the first output token instead). ``kv_connector_output`` is what the KV
    connector's worker finished in the step (``None``: no connector)."""

    sampled_token_ids: Mapping[Hashable, int]
    logprobs: Mapping[Hashable, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: Mapping[Hashable, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None

"""The offloading connector: the KV connector over the host tier (vLLM's ``OffloadingConnector``,
``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``; lesson 11).

``--kv-offloading-size`` makes one of these per role over a
:class:`~paged_kv.kv_offload.cpu.spec.CPUOffloadingSpec`: the scheduler's half holds the spec's
manager (an LRU of block hashes, no tensors), the worker's half its worker (the host tensors).
What it does, by vLLM's rules:

* **stores**: each step, every scheduled request's full blocks whose tokens the step computes,
  from the first it has not offered yet, up to its prompt's end (``offload_prompt_only``, vLLM's
  default: a decode's blocks are not offered) are offered to the manager
  (``prepare_store``: the blocks the tier lacks, evicting its least recently used), and copied to
  host memory after the forward (:meth:`OffloadingConnector.wait_for_save`), one batched copy per
  step. An offer the tier cannot make room for is skipped, not retried, and counted;
* **loads**: when a waiting request is admitted, the tier's consecutive hits past the device's
  prefix hit (:func:`~paged_kv.kv_offload.matching.get_num_new_matched_tokens`, at most up to the
  prompt's last token, which is always computed) become its ``num_external_computed_tokens``; its
  blocks are allocated, the load is planned (``prepare_load`` pins the host blocks) and runs before
  the next forward (:meth:`OffloadingConnector.start_load_kv`), all of a step's loads as one copy.
  The request loads asynchronously (``load_kv_async=True``, as vLLM's): it waits out the step
  (vLLM's ``WAITING_FOR_REMOTE_KVS``) and is scheduled from the loaded tokens on at the next;
* **touches**: a finished request's full blocks become the tier's most recently used
  (:meth:`OffloadingConnector.request_finished`), so a prefix the device's cache keeps hitting
  stays warm in the tier too;
* **events**: the manager's stores and evictions become ``BlockStored`` / ``BlockRemoved`` with
  ``medium="CPU"`` (:meth:`OffloadingConnector.take_events`), in the same ``KVEventBatch`` as
  the pool's.

Invariants: a store's or load's host blocks stay pinned from the step that plans it to that
step's :meth:`update_connector_output` (the worker finishes every copy in its step, so no request
waits past one step, and a finished request's blocks are never freed under a pending store:
vLLM's ``delay_free_blocks`` is never needed); the counters only grow.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from paged_kv.core.kv_cache_manager import skip_reading_prefix_cache
from paged_kv.core.prefix_cache import PrefixCacheStats, chain_hashes, full_blocks, request_extra_keys
from paged_kv.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, to_external_block_hash
from paged_kv.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from paged_kv.kv.storage import KVStorage
from paged_kv.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadKey
from paged_kv.kv_offload.cpu.spec import CPUOffloadingSpec
from paged_kv.kv_offload.matching import get_num_new_matched_tokens


@dataclass(frozen=True)
class TransferJob:
    """One copy of a request's blocks: ``src`` to ``dst``, in order (a store's source is device
    blocks, a load's destination)."""

    job_id: int
    req_id: Hashable
    src: LoadStoreSpec
    dst: LoadStoreSpec


@dataclass(frozen=True)
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """A step's copies (vLLM's ``OffloadingConnectorMetadata``): ``reqs_to_load`` before the forward,
    ``reqs_to_store`` after it."""

    reqs_to_load: tuple[TransferJob, ...] = ()
    reqs_to_store: tuple[TransferJob, ...] = ()


@dataclass
class ConnectorPrefixCacheStats:
    """The tier's lookups (vLLM's ``connector_prefix_cache_stats``, the "External prefix cache hit
    rate"): the ``requests`` admitted (a resumed one not counted), their prompt tokens (``queries``)
    and the tokens loaded from the tier (``hits``); the loads done and the ones that failed (their
    tokens recomputed), the stores and the offers skipped (no room)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    num_loads: int = 0
    num_failed_loads: int = 0
    num_stores: int = 0
    num_skipped_stores: int = 0


@dataclass
class _ReqState:
    """What the scheduler's half knows of a live request."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    next_stored: int = 0  # the first block index not yet offered to the tier


class OffloadingConnector(KVConnectorBase_V1):
    """The ``role``'s half of the offloading connector over ``spec``'s tier, for blocks of
    ``block_size`` tokens (see the module). ``offload_prompt_only`` (vLLM's default) offers only
    prompt blocks to the tier.

    Raises:
        ValueError: ``spec`` is not a :class:`~paged_kv.kv_offload.cpu.spec.CPUOffloadingSpec`, or a
            bad ``role`` or ``block_size``.
    """

    def __init__(
        self,
        role: KVConnectorRole,
        spec: CPUOffloadingSpec,
        block_size: int,
        *,
        offload_prompt_only: bool = True,
    ) -> None:
        super().__init__(role)
        if not isinstance(spec, CPUOffloadingSpec):
            raise ValueError(f"spec must be a CPUOffloadingSpec, got {type(spec).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.spec, self.block_size = spec, block_size
        self.offload_prompt_only = bool(offload_prompt_only)
        self.manager = spec.get_manager() if role is KVConnectorRole.SCHEDULER else None
        self.worker = None  # the worker's half: register_kv_caches makes it
        self.stats = ConnectorPrefixCacheStats()
        self._step_stats = PrefixCacheStats()
        self._reqs: dict[Hashable, _ReqState] = {}
        self._loads: dict[Hashable, tuple[list[OffloadKey], tuple[int, ...]]] = {}  # planned, not done
        self._stores: dict[Hashable, list[list[OffloadKey]]] = {}  # submitted, not done
        self._new_loads: list[TransferJob] = []  # for the next metadata
        self._next_job_id = 0
        # The worker's half: the jobs of the bound step, and what they finished.
        self._jobs: dict[int, TransferJob] = {}
        self._load_errors: set[int] = set()

    # ---------------------------------------------------------------- the scheduler's half

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tier's hit past ``num_computed_tokens``, whole blocks, at most through the request's
        second-last token (its last is computed to sample the next); ``(0, False)`` for a request
        without token ids or one that skips reading the prefix cache (``prompt_logprobs``: its blocks
        are still stored)."""
        state = self._state(request)
        num_tokens = request.num_tokens
        if request.all_token_ids is None or skip_reading_prefix_cache(request.request):
            return 0, False
        hashes = self._hashes(state, num_tokens)
        num_new = get_num_new_matched_tokens(
            self.manager,
            hashes,
            num_computed_tokens,
            num_tokens,
            self.block_size,
            max_num_new_tokens=num_tokens - 1 - num_computed_tokens,
        )
        if num_new is None:
            return None, False
        return num_new, num_new > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` past the device's hit into ``blocks`` (the
        request's block ids, group 0's first): the host blocks are pinned until it completes. The
        lookup is counted in :attr:`stats` (as vLLM counts it: a resumed request's is not)."""
        if request.num_preemptions:
            step = self._step_stats
            self._step_stats = replace(
                step,
                preempted_requests=step.preempted_requests + 1,
                preempted_queries=step.preempted_queries + request.num_tokens,
                preempted_hits=step.preempted_hits + num_external_tokens,
            )
        else:
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_external_tokens
            step = self._step_stats
            self._step_stats = replace(
                step,
                requests=step.requests + 1,
                queries=step.queries + request.num_tokens,
                hits=step.hits + num_external_tokens,
            )
        if not num_external_tokens:
            return
        state = self._reqs[request.request_id]
        block_ids = list(blocks[0])
        start = request.num_computed_tokens // self.block_size
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        keys = state.hashes[start:end]
        src = self.manager.prepare_load(keys)
        dst_ids = tuple(block_ids[start:end])
        self._loads[request.request_id] = (keys, dst_ids)
        self._new_loads.append(self._job(request.request_id, src, GPULoadStoreSpec(dst_ids)))
        state.next_stored = max(state.next_stored, end)  # the tier holds them already

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        """This step's loads (planned at admission) and stores (see the module), read from
        ``scheduler_output``'s block ids and the requests' computed tokens after the step."""
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._reqs:
                self._reqs[new.req_id].block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_block_ids and new_block_ids[0] and req_id in self._reqs:
                self._reqs[req_id].block_ids.extend(new_block_ids[0])
        stores = [
            job for req_id in scheduler_output.num_scheduled_tokens if (job := self._plan_store(req_id))
        ]
        loads, self._new_loads = tuple(self._new_loads), []
        return OffloadingConnectorMetadata(loads, tuple(stores))

    def make_connector_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the last call (vLLM's scheduler: ``connector_prefix_cache_stats``, taken
        each step for the "External prefix cache hit rate"), a resumed request's apart."""
        stats, self._step_stats = self._step_stats, PrefixCacheStats()
        return stats

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete the loads and stores the worker finished; a load that left an invalid block is
        counted as failed (the scheduler recomputes its tokens)."""
        for req_id in connector_output.finished_recving:
            keys, dst_ids = self._loads.pop(req_id)
            self.manager.complete_load(keys)
            self.stats.num_loads += 1
            if connector_output.invalid_block_ids.intersection(dst_ids):
                self.stats.num_failed_loads += 1
        for req_id in connector_output.finished_sending:
            for keys in self._stores.pop(req_id, ()):
                self.manager.complete_store(keys)

    def request_finished(self, request: Any, block_ids: Any = None) -> tuple[bool, dict[str, Any] | None]:
        """Touch the request's full blocks in the tier (most recent first: its prefix's head) and
        forget it; its blocks are freed at once (its stores completed in their step)."""
        state = self._reqs.pop(request.request_id, None)
        if state is not None and state.hashes:
            self.manager.touch(state.hashes)
        return False, None

    def take_events(self) -> Iterator[KVCacheEvent]:
        """The tier's stores and evictions since the last call as KV-cache events, medium ``"CPU"``
        (vLLM's: one event per batch of keys, no token ids, no parent)."""
        for event in self.manager.take_events():
            hashes = [to_external_block_hash(key) for key in event.keys]
            medium = event.medium.value
            if event.removed:
                yield BlockRemoved(block_hashes=hashes, medium=medium)
            else:
                yield BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )

    def reset_cache(self) -> bool:
        """Drop every block the tier holds (vLLM's ``reset_cache``); True."""
        self.manager.reset_cache()
        return True

    def _state(self, request: Any) -> _ReqState:
        state = self._reqs.get(request.request_id)
        if state is None or state.request is not request:
            state = self._reqs[request.request_id] = _ReqState(request)
        return state

    def _hashes(self, state: _ReqState, num_tokens: int) -> list[int]:
        """The chained hashes of the request's full blocks through ``num_tokens`` tokens, kept and
        extended only when a block fills (vLLM's ``request.block_hashes``)."""
        if len(state.hashes) < num_tokens // self.block_size:
            request = state.request
            blocks = full_blocks(request.all_token_ids[:num_tokens], self.block_size)
            state.hashes = chain_hashes(blocks, request_extra_keys(request.request, self.block_size))
        return state.hashes

    def _plan_store(self, req_id: Hashable) -> TransferJob | None:
        """Offer the request's blocks that this step fills (see the module); the job, or None."""
        state = self._reqs.get(req_id)
        if state is None or state.request.all_token_ids is None:
            return None
        request = state.request
        limit = request.num_computed_tokens
        if self.offload_prompt_only:
            limit = min(limit, request.request.num_prompt_tokens)
        end = min(limit // self.block_size, len(state.block_ids))
        if end <= state.next_stored:
            return None
        hashes = self._hashes(state, end * self.block_size)
        start, state.next_stored = state.next_stored, end
        offered = hashes[start:end]
        prepared = self.manager.prepare_store(offered)
        if prepared is None:
            self.stats.num_skipped_stores += 1
            return None
        if not prepared.keys_to_store:
            return None
        index = {key: start + i for i, key in enumerate(offered)}
        src = GPULoadStoreSpec(state.block_ids[index[key]] for key in prepared.keys_to_store)
        self._stores.setdefault(req_id, []).append(list(prepared.keys_to_store))
        self.stats.num_stores += 1
        return self._job(req_id, src, prepared.store_spec)

    def _job(self, req_id: Hashable, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferJob:
        job = TransferJob(self._next_job_id, req_id, src, dst)
        self._next_job_id += 1
        return job

    # ---------------------------------------------------------------- the worker's half

    def register_kv_caches(self, kv_caches: KVStorage) -> None:
        """Make the host tensors for ``kv_caches``, the device's storage (the spec's worker)."""
        self.worker = self.spec.get_worker(kv_caches)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Copy this step's loads into the device pool, before the forward."""
        for job in self._get_connector_metadata().reqs_to_load:
            self._jobs[job.job_id] = job
            if not self.worker.submit_load(job.job_id, job.src, job.dst):
                self._load_errors.update(job.dst.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A no-op: :meth:`start_load_kv` loads every layer before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """A no-op: :meth:`wait_for_save` saves every layer after the forward."""

    def wait_for_save(self) -> None:
        """Copy this step's stores to host memory, after the forward wrote their blocks."""
        for job in self._get_connector_metadata().reqs_to_store:
            self._jobs[job.job_id] = job
            if not self.worker.submit_store(job.job_id, job.src, job.dst):
                raise RuntimeError(f"the host tier refused store job {job.job_id} of request {job.req_id!r}")

    def get_finished(
        self, finished_req_ids: set[Hashable]
    ) -> tuple[set[Hashable] | None, set[Hashable] | None]:
        """The requests whose stores and loads the worker finished; a load that failed names its
        device blocks in :meth:`get_block_ids_with_load_errors`.

        Raises:
            RuntimeError: a store failed (the native worker's copies complete or raise).
        """
        sending: set[Hashable] = set()
        recving: set[Hashable] = set()
        for result in self.worker.get_finished():
            job = self._jobs.pop(result.job_id)
            is_load = isinstance(job.dst, GPULoadStoreSpec)
            if not result.success:
                if not is_load:
                    raise RuntimeError(f"store job {job.job_id} of request {job.req_id!r} failed")
                self._load_errors.update(job.dst.block_ids)
            (recving if is_load else sending).add(job.req_id)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

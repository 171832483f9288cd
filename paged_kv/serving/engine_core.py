"""The engine core: the scheduler, the model runner and the K/V storage of one engine, built from its
config, and its step (lessons 09-11, 15).

vLLM's ``EngineCore`` (``vllm/v1/engine/core.py``) is what ``LLMEngine`` drives: built from a
``VllmConfig``, it plans the KV cache (``_initialize_kv_caches``), owns the scheduler and the
executor of the model, and runs one step at a time (``EngineCore.step``: ``schedule``,
``execute_model``, ``update_from_output``). :class:`EngineCore` is the same in one process:

1. **planning**: the config's block count, or start-up sizing
   (:func:`~paged_kv.serving.kv_cache_planning.get_kv_cache_config`, the cache's
   :class:`~paged_kv.serving.kv_cache_planning.KVCacheConfig`);
2. **the memory** the scheduler takes blocks from: the paged
   :class:`~paged_kv.core.kv_cache_manager.KVCacheManager` for every model (its KV-cache groups
   over one block pool), or the course's contiguous baseline;
3. **the storage and the runner**: a :class:`~paged_kv.kv.storage.KVStorage` of the plan's tensors,
   and a :class:`~paged_kv.serving.model_runner.ModelRunner` with its persistent block table;
4. :meth:`EngineCore.step`: one step of the three calls, which returns what the scheduler saw;
5. **KV-cache events**, with ``kv_events_config`` on: a
   :class:`~paged_kv.distributed.kv_events.KVCacheEvents` listens to the paged memory's pool
   (medium ``"GPU"``), and the scheduler publishes its events each step through the config's
   publisher (vLLM's scheduler makes it, ``EventPublisherFactory.create``), or one handed in and
   shared by several cores in turn (the offline ``Engine``'s runs). :meth:`EngineCore.shutdown`
   ends it: the pool goes with the core, told as a last ``AllBlocksCleared``, and a publisher of
   the core's own is shut down;
6. **the host tier**, with ``kv_offloading_size``: a
   :class:`~paged_kv.kv_offload.cpu.spec.CPUOffloadingSpec` for the storage's blocks, and an
   :class:`~paged_kv.distributed.kv_transfer.kv_connector.v1.offloading_connector.OffloadingConnector`
   per role over it: the scheduler's half in the scheduler, the worker's in the runner (vLLM makes
   them in its scheduler and in each worker). Its stores and evictions are events too, medium ``"CPU"``.

Nothing here checks a request: they come checked, from the input processor.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_groups import FullAttentionSpec
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.distributed.kv_events import (
    MEDIUM_GPU,
    EventPublisher,
    EventPublisherFactory,
    KVCacheEvents,
    NullEventPublisher,
)
from paged_kv.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from paged_kv.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from paged_kv.kv.storage import KVStorage
from paged_kv.kv_offload.cpu.spec import CPUOffloadingSpec
from paged_kv.model.causal_lm import CausalLM
from paged_kv.serving.config import VllmConfig
from paged_kv.serving.contiguous_memory import ContiguousMemory
from paged_kv.serving.kv_cache_planning import KVCacheConfig, get_kv_cache_config, sized
from paged_kv.serving.model_runner import ModelRunner
from paged_kv.serving.outputs import SchedulerOutput
from paged_kv.serving.protocols import KVMemory
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler, StepResult


def check_kv_offloading(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, enable_events: bool = False
) -> CPUOffloadingSpec | None:
    """The host tier's spec for ``vllm_config``'s ``kv_offloading_size`` over the plan's blocks
    (``None``: off), holding no memory yet (the runner's connector allocates it).

    Raises:
        ValueError: a model of several KV-cache groups or of a sliding window (the tier offloads
            one full-attention group's blocks), or a size too small for one block (named).
    """
    size = vllm_config.cache_config.kv_offloading_size
    if size is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].spec, FullAttentionSpec):
        raise ValueError(
            f"kv_offloading_size needs a model of one full-attention KV-cache group, this one has "
            f"{', '.join(type(g.spec).__name__ for g in groups)}"
        )
    bytes_per_block = kv_cache_config.kv_cache_spec.bytes_per_block(vllm_config.cache_config.block_size)
    return CPUOffloadingSpec(size, bytes_per_block, enable_events=enable_events)


class EngineCore:
    """The scheduler, memory, storage and runner of ``model`` under ``vllm_config`` (see the module).

    ``kv_cache_config`` is a plan made already (the offline engine plans once and runs many times);
    ``None`` plans now. :attr:`vllm_config` is the config with the block count settled.
    ``kv_event_publisher`` publishes the events instead of one made from the config (it outlives the
    core: :meth:`shutdown` leaves it open).

    Invariant between steps: the scheduler's memory holds blocks for exactly its running requests,
    and the runner has a row of the block table for exactly them.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        model: CausalLM,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        kv_event_publisher: EventPublisher | None = None,
    ) -> None:
        self.model = model
        self.kv_cache_config = (
            get_kv_cache_config(vllm_config, model) if kv_cache_config is None else kv_cache_config
        )
        self.vllm_config = vllm_config = sized(vllm_config, self.kv_cache_config)
        cache, scheduler_config = vllm_config.cache_config, vllm_config.scheduler_config
        plan = self.kv_cache_config
        events = vllm_config.kv_events_config
        self.kv_cache_events = KVCacheEvents(MEDIUM_GPU) if events and events.enable_kv_cache_events else None
        """The pool's events, queued for the scheduler (``None``: events off, or no pool)."""
        check_kv_offloading(vllm_config, plan)
        self.memory: KVMemory = self._make_memory()
        config = model.config
        self.storage = KVStorage(
            config.num_layers,
            self.memory.num_blocks,
            cache.block_size,
            config.num_kv_heads,
            config.head_dim,
            plan.kv_cache_dtype,
            vllm_config.device_config.device,
            layer_tensors=plan.layer_tensors(config.num_layers),
            calculate_kv_scales=cache.calculate_kv_scales,
        )
        self.offloading_spec: CPUOffloadingSpec | None = None
        """The host tier (``None``: ``kv_offloading_size`` off)."""
        connectors = (None, None)
        if cache.kv_offloading_size is not None:
            spec = self.offloading_spec = check_kv_offloading(
                vllm_config, plan, enable_events=self.kv_cache_events is not None
            )
            connectors = tuple(
                OffloadingConnector(role, spec, cache.block_size)
                for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
            )
        self.scheduler = Scheduler(
            self.memory,
            preemption=scheduler_config.preemption,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            reserve_full_prompt=scheduler_config.scheduler_reserve_full_isl,
            policy=scheduler_config.policy,
            kv_cache_events=self.kv_cache_events,
            connector=connectors[0],
        )
        self.model_runner = ModelRunner(
            model,
            self.storage,
            # A running request holds a block at least: the rows the table starts with (it grows).
            max_num_reqs=scheduler_config.max_num_seqs or self.memory.num_blocks,
            max_blocks_per_req=blocks_for_tokens(vllm_config.model_config.max_model_len, cache.block_size),
            attention_backend=vllm_config.attention_config.backend,
            kv_cache_groups=plan.kv_cache_groups,
            kv_connector=connectors[1],
        )
        """The runner of the model (vLLM: each worker's ``model_runner``, behind the core's executor)."""
        self._owns_publisher = kv_event_publisher is None
        self._shut_down = False
        # Last: a publisher binds its sockets and starts a thread, and nothing after it may fail.
        self.scheduler.kv_event_publisher = (
            EventPublisherFactory.create(events) if kv_event_publisher is None else kv_event_publisher
        )

    def _make_memory(self) -> KVMemory:
        cache, scheduler_config = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        plan = self.kv_cache_config
        if cache.mode == "contiguous":
            max_model_len = self.vllm_config.model_config.max_model_len
            memory = ContiguousMemory(
                plan.num_blocks * cache.block_size,
                lambda _: max_model_len,
                seat_tokens=max_model_len,
                block_size=cache.block_size,
            )
            self.kv_cache_events = None  # no pool, no prefix cache: nothing to tell
            return memory
        manager = KVCacheManager(
            plan.num_blocks,
            kv_cache_groups=plan.kv_cache_groups,
            enable_caching=cache.enable_prefix_caching,
            watermark=scheduler_config.watermark,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
        )
        if self.kv_cache_events is not None:
            manager.add_listener(self.kv_cache_events)
        return manager

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a checked request in the scheduler (vLLM: ``EngineCore.add_request``)."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[Hashable]) -> list[Hashable]:
        """Finish requests wherever they are; a running one's blocks go back at once (vLLM:
        ``EngineCore.abort_requests``). Returns the ids it finished."""
        return self.scheduler.finish_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> tuple[SchedulerOutput, StepResult]:
        """One step: ``schedule``, ``execute_model``, ``update_from_output`` (vLLM: ``EngineCore.step``)."""
        output = self.scheduler.schedule()
        return output, self.scheduler.update_from_output(output, self.model_runner.execute_model(output))

    def free_all(self) -> None:
        """Free every running request's blocks and forget every request (after an error, or at the
        end of an offline run)."""
        self.scheduler.free_all()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix; whether it did (vLLM: ``EngineCore.reset_prefix_cache``): see
        :meth:`Scheduler.reset_prefix_cache <paged_kv.serving.scheduler.Scheduler.reset_prefix_cache>`."""
        return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self) -> None:
        """The core's end (vLLM: ``EngineCore.shutdown``): every request forgotten; with events on,
        the pool's blocks go with it, published as ``AllBlocksCleared``, and a publisher of the core's
        own is shut down (its thread ended, its sockets closed). Idempotent; a step after it
        publishes nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        self.scheduler.free_all()
        scheduler = self.scheduler
        if self.kv_cache_events is not None:
            self.kv_cache_events.all_blocks_cleared()
            scheduler.publish_kv_events()
        if self._owns_publisher:
            scheduler.kv_event_publisher.shutdown()
        scheduler.kv_event_publisher = NullEventPublisher()

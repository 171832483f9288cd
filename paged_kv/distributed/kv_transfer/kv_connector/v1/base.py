"""The KV connector's interface, vLLM v1's (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``;
lesson 11).

A connector moves K/V between the device pool and somewhere else (host memory, another instance).
vLLM makes two of it per engine, one per :class:`KVConnectorRole`, and each uses its half:

* **the scheduler's half** decides, holding no tensors: :meth:`~KVConnectorBase_V1.get_num_new_matched_tokens`
  (how many tokens past the device's prefix hit it can supply: the request's
  ``num_external_computed_tokens``), :meth:`~KVConnectorBase_V1.update_state_after_alloc` (the
  blocks those tokens land in are allocated: plan the load), :meth:`~KVConnectorBase_V1.build_connector_meta`
  (everything the worker must do this step, as one :class:`KVConnectorMetadata`, which rides in the
  ``SchedulerOutput``), :meth:`~KVConnectorBase_V1.update_connector_output` (what the worker
  finished) and :meth:`~KVConnectorBase_V1.request_finished`;
* **the worker's half** copies, given that metadata: :meth:`~KVConnectorBase_V1.start_load_kv`
  before the forward, :meth:`~KVConnectorBase_V1.wait_for_layer_load` /
  :meth:`~KVConnectorBase_V1.save_kv_layer` around each layer, :meth:`~KVConnectorBase_V1.wait_for_save`
  after it, and :meth:`~KVConnectorBase_V1.get_finished`, whose answer rides back in the
  ``ModelRunnerOutput`` as a :class:`KVConnectorOutput`.

A connector that loads asynchronously (``get_num_new_matched_tokens`` answers ``load_kv_async=True``)
gets its blocks allocated, and the request waits (vLLM's ``WAITING_FOR_REMOTE_KVS``) until the
worker reports it in ``finished_recving``; a load that failed names its device blocks in
``invalid_block_ids``, and the scheduler recomputes them (vLLM's ``kv_load_failure_policy="recompute"``).
The course's runner calls the per-layer hooks nowhere: it loads the whole step's K/V before the
forward and saves after it, so :meth:`~KVConnectorBase_V1.wait_for_layer_load` and
:meth:`~KVConnectorBase_V1.save_kv_layer` are no-ops in its connectors.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is (vLLM's ``KVConnectorRole``)."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler's half tells the worker's half for one step (vLLM's base class: each
    connector subclasses it with its own fields)."""


@dataclass(frozen=True)
class KVConnectorOutput:
    """What the worker's half finished in a step (vLLM's ``KVConnectorOutput``): the requests whose
    stores (``finished_sending``) and loads (``finished_recving``) completed, and the device blocks
    a load failed to fill (``invalid_block_ids``: recompute them)."""

    finished_sending: frozenset[Hashable] = frozenset()
    finished_recving: frozenset[Hashable] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()


class KVConnectorBase_V1(ABC):
    """A KV connector of one ``role`` (see the module). Each method belongs to one half; calling the
    other half's is a mistake the subclass may refuse."""

    def __init__(self, role: KVConnectorRole) -> None:
        if not isinstance(role, KVConnectorRole):
            raise ValueError(f"role must be a KVConnectorRole, got {role!r}")
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ---------------------------------------------------------------- the worker's half

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's metadata, before the forward (vLLM's runner does it)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Forget this step's metadata, after the forward."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: bind_connector_metadata first")
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: Any) -> None:  # noqa: B027 - optional, as vLLM's
        """Learn the device's K/V tensors (vLLM passes them by layer; the course's
        :class:`~paged_kv.kv.storage.KVStorage`). Nothing by default."""

    @abstractmethod
    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start loading the K/V this step's metadata names into the device pool, before the forward."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s K/V is loaded (a layer-by-layer connector's hook)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Start saving ``layer_name``'s K/V once the layer wrote it (a layer-by-layer hook)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done (or handed off), after the forward."""

    def get_finished(
        self, finished_req_ids: set[Hashable]
    ) -> tuple[set[Hashable] | None, set[Hashable] | None]:
        """The requests whose sends and receives finished since the last call (``None``: none)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The device blocks a load failed to fill since the last call: the scheduler recomputes them."""
        return set()

    # ---------------------------------------------------------------- the scheduler's half

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(tokens, load_kv_async)``: how many tokens past ``num_computed_tokens`` (the device's
        prefix hit) the connector can supply (``None``: ask again at a later step), and whether
        they load asynchronously (the request then waits for them)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """The request's blocks, those of its ``num_external_tokens`` included, are allocated."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Everything the worker must do for this step (and forget it here: it is handed over)."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """Take what the worker finished this step. Nothing by default."""

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """The request finished: ``(delay_free_blocks, kv_transfer_params)``; by default its blocks
        are freed at once and nothing is returned to the client."""
        return False, None

    def take_events(self) -> Iterable[Any]:
        """The connector's KV-cache events since the last call (vLLM publishes them with the pool's)."""
        return ()

    def reset_cache(self) -> bool | None:
        """Drop the connector's cache (``reset_prefix_cache(reset_connector=True)``); ``None``: it has
        none."""
        return None

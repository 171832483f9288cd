"""KV-cache events: what the pool stored and evicted, published on ZMQ in vLLM's wire format (lessons 08, 16).

A KV-aware router (llm-d, NVIDIA Dynamo) sends a request to the instance that already holds its
prefix. It learns what each instance holds from the instance's *KV-cache events*: vLLM 0.33.0's
block pool queues a ``BlockStored`` when it caches full blocks, a ``BlockRemoved`` when it evicts
one and an ``AllBlocksCleared`` when its prefix cache is reset (``vllm/v1/core/block_pool.py``,
``take_events``); the scheduler takes them once per step and publishes them as one
``KVEventBatch`` (``vllm/distributed/kv_events.py``). This module is that, for the course's pool:

* **the events**, msgspec structs with vLLM's names, fields and options, so a consumer decoding
  with vLLM's own classes reads ours: a batch is an array ``[ts, events, data_parallel_rank]``,
  each event a map tagged ``"type": "BlockStored"`` (``"BlockRemoved"``, ``"AllBlocksCleared"``)
  with its fields by name; fields left at their default are not sent (``omit_defaults``).
  vLLM's later optional fields (``kv_cache_spec_kind``, ``locality``, ``session_id``...) are
  left out: the course sets none of them, and a decoder of either side skips what it lacks;
* **block hashes** as vLLM publishes them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``,
  ``ExternalBlockHash = bytes | int``): an unsigned 64-bit int. The course's hashes are Python
  ints of 64 signed bits (``hash()`` of a tuple), sent as ``hash & (2**64 - 1)``
  (:func:`to_external_block_hash`): one to one, so a router can chain them;
* :class:`KVCacheEvents`, a :class:`~paged_kv.core.block_pool.BlockPoolListener` that makes the
  events as the pool's store, eviction and reset happen, and queues them until
  :meth:`KVCacheEvents.take_events` (vLLM's ``kv_event_queue``). The blocks one request caches in a
  step are one ``BlockStored``, their hashes in chain order after ``parent_block_hash`` (vLLM's
  ``cache_full_blocks`` makes one per call); every eviction is its own ``BlockRemoved``;
* **the publishers**: :class:`NullEventPublisher` (events off) and :class:`ZmqEventPublisher`,
  vLLM's: a PUB socket and a thread that sends each batch as three frames, the topic, an 8-byte
  big-endian sequence number (0, 1, 2... per publisher) and the batch in msgpack; an optional
  ROUTER socket that sends the batches from a sequence number on again, from a buffer of the last
  ``buffer_steps``. :class:`EventPublisherFactory` makes one from a
  :class:`~paged_kv.distributed.config.KVEventsConfig`.

**Bind or connect.** vLLM binds an endpoint with a wildcard host (``tcp://*:5557``) or an ``ipc``
or ``inproc`` one, and connects to any other (a proxy that gathers several instances' events).
The course's default is ``tcp://127.0.0.1:5557``: so a loopback host (``127.x.x.x``,
``localhost``, ``[::1]``) is bound too; any other host is connected to. Port 0 binds a port the
system picks; :attr:`ZmqEventPublisher.endpoint` is the one bound. The replay endpoint is always
bound.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import asdict, replace
from itertools import count
from typing import Any, ClassVar

import msgspec
import zmq

from paged_kv.core.prefix_cache import CachedBlock, ExtraKeys
from paged_kv.distributed.config import KVEventsConfig, split_zmq_path

_LOGGER = logging.getLogger(__name__)  # under the package's logger, silent unless configured

MEDIUM_GPU = "GPU"
"""The medium of the device pool's events (vLLM's ``BlockPool`` default, on any device)."""
MEDIUM_CPU = "CPU"
"""The medium of a host tier's events (vLLM's CPU offloading)."""

_UINT64 = (1 << 64) - 1
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")
_LOOPBACK_HOSTS = ("localhost", "[::1]")


def to_external_block_hash(block_hash: int) -> int:
    """A course block hash (a signed 64-bit int) as vLLM's integer ``ExternalBlockHash``: unsigned,
    the same 64 bits."""
    return block_hash & _UINT64


# ------------------------------------------------------------------------------ the wire format


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A step's events at ``ts`` (seconds since the epoch), from one data-parallel rank: on the wire
    an array, ``[ts, events, data_parallel_rank]`` (vLLM: ``EventBatch``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event of the KV cache: on the wire a map of its fields, tagged with its class's name."""


class BlockStored(KVCacheEvent):
    """Full blocks cached: ``block_hashes`` in chain order, the first after ``parent_block_hash``
    (``None``: a prompt's first block), holding ``token_ids`` (``block_size`` per block), of
    KV-cache group ``group_idx``. ``lora_id`` is vLLM's adapter id (the course has none: ``None``),
    ``lora_name`` the request's; ``extra_keys`` one entry per block, its hash's extra keys
    untagged (the LoRA name, then the salt on a first block) or ``None`` (vLLM:
    ``to_event_extra_keys``)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """A cached block evicted: its hash is no longer found (vLLM makes one per hash)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every hash forgotten at once: the prefix cache was reset (or the pool went away)."""


class KVEventBatch(EventBatch):
    """A step's KV-cache events (vLLM: ``KVEventBatch``): decode with
    ``msgspec.msgpack.Decoder(KVEventBatch)``."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ------------------------------------------------------------------------------ making them


def _lora_name(extra_keys: ExtraKeys) -> str | None:
    return next((key[1] for key in extra_keys or () if key[0] == "lora"), None)


def _event_extra_keys(extra_keys: ExtraKeys) -> tuple[Any, ...] | None:
    """A block's extra keys as vLLM publishes them: the values without their tags."""
    return None if extra_keys is None else tuple(key[1] for key in extra_keys)


class KVCacheEvents:
    """The pool's stores, evictions and resets as vLLM's events, queued until :meth:`take_events`
    (a :class:`~paged_kv.core.block_pool.BlockPoolListener`: ``pool.add_listener(events)``).

    ``medium`` is every event's (:data:`MEDIUM_GPU` for the device pool). A block stored right after
    the block its chain follows, with nothing queued between them, joins that block's
    ``BlockStored`` (one event per request per step, as vLLM's); anything else starts a new event.

    Invariant: the queue holds the events since the last :meth:`take_events`, in the order the pool
    made the changes, and a ``BlockStored``'s hashes chain: each after the one before it.
    """

    def __init__(self, medium: str = MEDIUM_GPU) -> None:
        self.medium = medium
        self._queue: list[KVCacheEvent] = []
        self._chain_end: CachedBlock | None = None  # the last block of the queue's last BlockStored

    def block_stored(self, entry: CachedBlock) -> None:
        last, parent = self._queue[-1] if self._queue else None, entry.parent
        block_hash = to_external_block_hash(entry.block_hash)
        lora_name = _lora_name(entry.extra_keys)
        if (
            parent is not None
            and parent is self._chain_end
            and isinstance(last, BlockStored)
            and last.group_idx == entry.group
            and last.lora_name == lora_name
        ):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(entry.token_ids)
            last.extra_keys.append(_event_extra_keys(entry.extra_keys))
        else:
            self._queue.append(
                BlockStored(
                    block_hashes=[block_hash],
                    parent_block_hash=None if parent is None else to_external_block_hash(parent.block_hash),
                    token_ids=list(entry.token_ids),
                    block_size=len(entry.token_ids),
                    lora_id=None,
                    medium=self.medium,
                    lora_name=lora_name,
                    extra_keys=[_event_extra_keys(entry.extra_keys)],
                    group_idx=entry.group,
                )
            )
        self._chain_end = entry

    def block_removed(self, entry: CachedBlock) -> None:
        self._queue.append(
            BlockRemoved(
                block_hashes=[to_external_block_hash(entry.block_hash)],
                medium=self.medium,
                group_idx=entry.group,
            )
        )
        self._chain_end = None

    def all_blocks_cleared(self) -> None:
        self._queue.append(AllBlocksCleared())
        self._chain_end = None

    def take_events(self) -> list[KVCacheEvent]:
        """Every event queued since the last call, oldest first; the queue is left empty (vLLM:
        ``BlockPool.take_events``)."""
        events, self._queue, self._chain_end = self._queue, [], None
        return events


# ------------------------------------------------------------------------------ publishing them


class EventPublisher(ABC):
    """Publishes event batches in order, each stamped with ``data_parallel_rank`` (vLLM's)."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self._data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Send ``events`` after every batch published before it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop publishing and release what the publisher holds."""

    def get_publisher_config(self) -> KVEventsConfig | None:
        """The config the publisher runs with, its endpoints as bound (``None``: none)."""
        return None


class NullEventPublisher(EventPublisher):
    """Publishes nothing: events off."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """vLLM's ZMQ publisher (see the module): the sockets are set up here, so a bad address fails
    before anything runs; a daemon thread ``zmq-publisher`` encodes and sends each batch.

    Invariant: batch ``n`` published goes out with sequence number ``n``, in order; the replay
    buffer holds the last ``buffer_steps`` batches sent. After :meth:`shutdown` the thread has
    ended and both sockets are closed.

    Raises:
        ValueError: an endpoint that cannot be bound or connected to (nothing is left open).
    """

    SHUTDOWN_TIMEOUT = 1.0
    """Seconds :meth:`shutdown` waits for the queue to be sent and the thread to end."""
    LINGER_MS = 1000
    """How long a closed socket may still send what it holds (the context's I/O thread sends it)."""
    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    """The sequence number of the replay's last message: it is over."""

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = KVEventsConfig.endpoint,
        replay_endpoint: str | None = None,
        buffer_steps: int = KVEventsConfig.buffer_steps,
        hwm: int = KVEventsConfig.hwm,
        max_queue_size: int = KVEventsConfig.max_queue_size,
        topic: str = KVEventsConfig.topic,
    ) -> None:
        super().__init__(data_parallel_rank)
        config = KVEventsConfig(  # checks every argument
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            buffer_steps=buffer_steps,
            hwm=hwm,
            max_queue_size=max_queue_size,
            topic=topic,
        )
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode()
        context = zmq.Context.instance()
        self._pub: zmq.Socket = context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = self._open(self._pub, "endpoint", endpoint, bind=_binds(endpoint))
            """The PUB socket's address, as bound (a port 0 replaced by the port the system picked)."""
            self.replay_endpoint = None
            """The ROUTER socket's address, as bound, or ``None``."""
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its end
                self.replay_endpoint = self._open(self._replay, "replay_endpoint", replay_endpoint, bind=True)
        except BaseException:
            self._close_sockets(linger=0)
            raise
        self._config = replace(config, endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)
        self._running = True
        _LOGGER.info("Starting ZMQ publisher thread")
        self._thread = threading.Thread(target=self._publisher_thread, name="zmq-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket: zmq.Socket, name: str, endpoint: str, *, bind: bool) -> str:
        try:
            if split_zmq_path(name, endpoint)[1].startswith("["):
                socket.setsockopt(zmq.IPV6, 1)
            if not bind:
                socket.connect(endpoint)
                return endpoint
            socket.bind(endpoint)
        except zmq.ZMQError as error:
            way = "bound" if bind else "connected to"
            raise ValueError(f"{name} {endpoint!r} cannot be {way}: {error}") from None
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def get_publisher_config(self) -> KVEventsConfig:
        return self._config

    @property
    def is_running(self) -> bool:
        """Whether batches are taken (until :meth:`shutdown`)."""
        return self._running

    def publish(self, events: EventBatch) -> None:
        """Queue ``events`` for the thread, stamped with the publisher's rank when it has none.

        Raises:
            RuntimeError: the publisher was shut down (vLLM's message).
        """
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._queue.put(events)

    def shutdown(self) -> None:
        """Send what is queued (at most :attr:`SHUTDOWN_TIMEOUT` seconds), end the thread, close the
        sockets (the context is shared, as vLLM's, and left open). Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT)  # after every batch queued
        except queue.Full:
            _LOGGER.warning("the event queue is still full after %s seconds", self.SHUTDOWN_TIMEOUT)
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            _LOGGER.warning("the ZMQ publisher thread did not end within %s seconds", self.SHUTDOWN_TIMEOUT)
            return  # it still uses the sockets: a daemon thread, ended with the process
        self._close_sockets(linger=self.LINGER_MS)

    def _close_sockets(self, linger: int) -> None:
        self._pub.close(linger=linger)
        if self._replay is not None:
            self._replay.close(linger=linger)

    def _publisher_thread(self) -> None:
        """Send each queued batch as (topic, sequence number, payload) until the end mark; serve
        replay requests between batches."""
        encode = msgspec.msgpack.Encoder().encode
        sequence = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._service_replay()
                except zmq.ZMQError as error:  # a replay is best effort: the live stream goes on
                    _LOGGER.warning("replay failed: %s", error)
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(sequence)
            payload = encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _service_replay(self) -> None:
        """Answer one replay request, ``(client, b"", start)`` with ``start`` an 8-byte big-endian
        sequence number: every buffered batch from ``start`` on, then :attr:`END_SEQ`."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            _LOGGER.warning("invalid replay request: %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (see the module) rather than connect to it."""
    scheme, host, _ = split_zmq_path("endpoint", endpoint)
    return scheme != "tcp" or host in _WILDCARD_HOSTS + _LOOPBACK_HOSTS or host.startswith("127.")


class EventPublisherFactory:
    """Makes the publisher a :class:`~paged_kv.distributed.config.KVEventsConfig` names (vLLM's)."""

    _registry: ClassVar[dict[str, type[EventPublisher]]] = {
        "null": NullEventPublisher,
        "zmq": ZmqEventPublisher,
    }

    @classmethod
    def create(cls, config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        """A :class:`NullEventPublisher` when ``config`` is ``None``, disabled or ``"null"``; else its
        publisher, started.

        Raises:
            ValueError: an endpoint that cannot be bound or connected to.
        """
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher(data_parallel_rank)
        settings = asdict(config)
        kind = settings.pop("publisher")
        del settings["enable_kv_cache_events"]
        return cls._registry[kind](data_parallel_rank, **settings)

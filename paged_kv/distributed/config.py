"""Where the pool's KV-cache events go: :class:`KVEventsConfig` and ZMQ addresses (lesson 16).

vLLM keeps this section of its config in ``vllm/config/kv_events.py``, apart from the publishers
(``vllm/distributed/kv_events.py``); the course keeps it here, below the engine's config, which
holds one (``VllmConfig.kv_events_config``), and beside the publishers of
:mod:`paged_kv.distributed.kv_events`, which read it. Nothing here imports ZMQ or msgspec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paged_kv.validate import check_count

KV_EVENT_PUBLISHERS = ("null", "zmq")
"""vLLM's publishers of KV-cache events (``EventPublisherFactory``'s registry): none, or ZMQ."""
ZMQ_SCHEMES = ("tcp", "ipc", "inproc")
DEFAULT_KV_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"
"""Where the events are published unless told: vLLM's port, on loopback (vLLM binds ``tcp://*:5557``,
every interface: anyone who reaches the host reads which prompts it caches; loopback keeps them on
this machine until ``endpoint`` says otherwise)."""


@dataclass(frozen=True)
class KVEventsConfig:
    """Whether the pool's KV-cache events are published, and where (vLLM: ``KVEventsConfig``, with its
    fields and defaults but :data:`DEFAULT_KV_EVENTS_ENDPOINT`).

    ``publisher`` ``None`` becomes ``"zmq"`` when ``enable_kv_cache_events`` is on, else ``"null"``
    (vLLM's ``__post_init__``). ``endpoint`` is the PUB socket's ZMQ address, ``replay_endpoint``
    the ROUTER socket's that serves the last ``buffer_steps`` batches again (``None``: none);
    ``hwm`` is the PUB socket's high-water mark, ``max_queue_size`` the batches waiting for the
    publisher's thread, ``topic`` the first frame of every message.

    Invariant: a config that exists is well formed (a known publisher, endpoints of the form
    ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME``, counts of at least 1); nothing is
    bound until a publisher is made from it.

    Raises:
        ValueError: a bad field, named.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = DEFAULT_KV_EVENTS_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"enable_kv_cache_events must be True or False, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"publisher must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}")
        split_zmq_path("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            split_zmq_path("replay_endpoint", self.replay_endpoint)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            check_count(name, getattr(self, name), minimum=1)
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a str, got {self.topic!r}")


def split_zmq_path(name: str, endpoint: object) -> tuple[str, str, int | None]:
    """``endpoint``, a ZMQ address, as ``(scheme, host or path, port)`` (vLLM: ``split_zmq_path``):
    ``tcp://HOST:PORT`` (``HOST`` a name, an IPv4 address, ``[IPv6]`` or ``*``; ``PORT`` 0 to 65535, 0
    for one the system picks), ``ipc://PATH`` or ``inproc://NAME`` (port ``None``).

    Raises:
        ValueError: anything else, naming ``name``.
    """
    scheme, sep, rest = endpoint.partition("://") if isinstance(endpoint, str) else ("", "", "")
    if not sep or scheme not in ZMQ_SCHEMES or not rest:
        raise ValueError(
            f"{name} must be a ZMQ address, tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r}"
        )
    if scheme != "tcp":
        return scheme, rest, None
    host, colon, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    if not colon or not host or not port.isdigit() or int(port) > 65535 or (":" in host and not bracketed):
        raise ValueError(f"{name} must be tcp://HOST:PORT with a port of 0 to 65535, got {endpoint!r}")
    return scheme, host, int(port)

"""The engine's settings in one object, split as vLLM splits them (lessons 09-11, 14, 15).

vLLM builds every engine from one ``VllmConfig`` (``vllm/config/vllm.py``), a section per concern:
``ModelConfig`` (``vllm/config/model.py``: ``max_model_len``), ``CacheConfig``
(``vllm/config/cache.py``: ``block_size``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
``num_gpu_blocks_override``, ``enable_prefix_caching``, ``cache_dtype``, ``calculate_kv_scales``),
``SchedulerConfig`` (``vllm/config/scheduler.py``: ``max_num_seqs``, ``max_num_batched_tokens``,
``scheduler_reserve_full_isl``, ``watermark``), ``ParallelConfig`` (``tensor_parallel_size``),
``DeviceConfig``, ``AttentionConfig`` (``backend``) and ``KVEventsConfig``
(``vllm/config/kv_events.py``: the KV-cache events a router reads). :class:`VllmConfig` here has the
same sections with the same names, and every later section (speculative decoding, KV transfer) is
one more field beside them. Users rarely build one by hand: the offline
:class:`~paged_kv.serving.engine.Engine`'s keywords and ``paged-kv serve``'s flags are
:class:`~paged_kv.serving.engine_args.EngineArgs`, which checks them and makes the config. The course
adds the settings of its own comparisons: the contiguous baseline (``CacheConfig.mode``) and
preemption by swapping (``SchedulerConfig.preemption``), which vLLM v1 does not have.

Every section is frozen: a config, once made, describes one engine for its whole life.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from paged_kv.validate import check_count


@dataclass(frozen=True)
class ModelConfig:
    """What the engine knows of its model (vLLM: ``ModelConfig``): ``max_model_len``, the longest
    prompt plus output a request may have, and the model's vocabulary and dtype."""

    max_model_len: int
    vocab_size: int
    dtype: torch.dtype = torch.float32
    max_logprobs: int = 20
    """The most log-probabilities a request may ask for per token (vLLM's ``--max-logprobs``, 20;
    -1: the whole vocabulary)."""


@dataclass(frozen=True)
class CacheConfig:
    """How big the KV cache is and how its blocks are used (vLLM: ``CacheConfig``).

    The size is given one of three ways: ``num_gpu_blocks_override``, ``kv_cache_memory_bytes`` or
    ``gpu_memory_utilization``; ``num_gpu_blocks`` is what the engine settled on once it sized the
    cache (vLLM sets ``cache_config.num_gpu_blocks`` after its profile run), ``None`` before.
    ``cache_dtype`` is the K/V's format by vLLM's name (``"auto"``, the model's dtype, or ``"fp8"``,
    ``"fp8_e4m3"``, ``"fp8_e5m2"``), and ``calculate_kv_scales`` whether an fp8 cache measures each
    layer's scales from its first write (else 1.0). ``mode`` is the course's: ``"paged"`` blocks,
    or the ``"contiguous"`` baseline of one reservation of ``max_model_len`` per request.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = False
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    mode: str = "paged"


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may run in a step, and how it makes room (vLLM: ``SchedulerConfig``).

    ``max_num_seqs`` and ``max_num_batched_tokens`` are ``None`` for no limit (vLLM always has
    both); ``watermark`` is the share of the blocks an admission keeps free;
    ``scheduler_reserve_full_isl`` admits a request only when its whole prompt fits; ``preemption``
    is ``"recompute"`` (vLLM v1's only way) or ``"swap"`` (the paper's other way, and vLLM V0's
    ``preemption_mode``).
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    preemption: str = "recompute"
    policy: str = "fcfs"
    """``"fcfs"``, first come first served, or ``"priority"``: waiting requests by (priority,
    arrival time), the victim the running one with the largest (vLLM's ``--scheduling-policy``)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices (vLLM: ``ParallelConfig``): ``tensor_parallel_size`` ranks
    each holding ``1 / tensor_parallel_size`` of the attention heads. The course's engine runs one
    rank; lesson 14 sizes a cache for several."""

    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model, the K/V storage and the step's tensors live (vLLM: ``DeviceConfig``)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention backend reads the paged cache (vLLM: ``AttentionConfig.backend``, the
    ``--attention-backend`` flag): a registry name, or ``None`` for the platform's choice."""

    backend: str | None = None


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


@dataclass(frozen=True)
class VllmConfig:
    """Every setting of one engine, a section per concern (vLLM: ``VllmConfig``; see the module)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = ParallelConfig()
    device_config: DeviceConfig = DeviceConfig()
    attention_config: AttentionConfig = AttentionConfig()
    kv_events_config: KVEventsConfig | None = None
    """``None`` or a disabled config: no events (vLLM's default)."""

    @property
    def max_in_flight_tokens(self) -> int | None:
        """The most tokens scheduled and not yet settled (vLLM's property of that name): one batch of
        ``max_num_batched_tokens``, the course's engine running one step at a time; ``None`` without a
        budget. A sliding-window group holds its window and these at once."""
        return self.scheduler_config.max_num_batched_tokens

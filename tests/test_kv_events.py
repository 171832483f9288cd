"""KV-cache events on ZMQ, as vLLM 0.33.0 publishes them (issue 33, item 3).

Every publisher here binds a free port of 127.0.0.1 (``tcp://127.0.0.1:0``), a real ZMQ SUB socket
subscribes to it (:class:`Subscriber`) and decodes each message with msgspec: the frames are the
topic, an 8-byte big-endian sequence number and the msgpack batch. Each test shuts its publisher
down and checks that no publisher thread is left.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.cli import build_parser, main
from paged_kv.core.prefix_cache import chain_hashes, full_blocks
from paged_kv.distributed.config import DEFAULT_KV_EVENTS_ENDPOINT, KVEventsConfig
from paged_kv.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVCacheEvents,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
    _binds,
    to_external_block_hash,
)
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.sampling_params import SamplingParams

from . import helpers

pytestmark = pytest.mark.lesson16

BLOCK_SIZE = 4
LOOPBACK_ANY_PORT = "tcp://127.0.0.1:0"
EVENTS = {"enable_kv_cache_events": True, "endpoint": LOOPBACK_ANY_PORT}
QUIET_MS = 100  # a subscriber has all of a burst once nothing came for this long
VLLM_KV_EVENTS = Path("/work/vllm-0.33.0/vllm/distributed/kv_events.py")  # tools/check_vllm_refs.py's tree


def publisher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zmq-publisher"]


@pytest.fixture(autouse=True)
def no_publisher_left():
    """Every test leaves no publisher thread behind (nor finds one)."""
    assert publisher_threads() == []
    yield
    assert publisher_threads() == []


class Subscriber:
    """A ZMQ SUB socket on ``publisher``'s endpoint, the way a KV-aware router listens.

    ZMQ's slow joiner: a message published before the subscription reaches the PUB socket is
    dropped, so the constructor publishes empty batches until one arrives, then drains them; the
    batches after that are all received, and their sequence numbers are checked to follow on.
    """

    def __init__(self, publisher: ZmqEventPublisher, topic: bytes = b"") -> None:
        self.topic = topic
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(publisher.endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        deadline = time.monotonic() + 10
        while not self.socket.poll(10):
            assert time.monotonic() < deadline, "the subscription never reached the publisher"
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        self.next_seq = None
        self.receive()  # the probes
        self.probes_end = self.next_seq

    def receive(self) -> list[tuple[int, KVEventBatch]]:
        """Every batch until none comes for :data:`QUIET_MS`, with its sequence number."""
        batches = []
        while self.socket.poll(QUIET_MS):
            topic, seq_bytes, payload = self.socket.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            assert self.next_seq is None or seq == self.next_seq, "a batch was lost or out of order"
            self.next_seq = seq + 1
            batches.append((seq, self.decoder.decode(payload)))
        return batches

    def events(self) -> list:
        """The events of every batch until quiet, in order."""
        return [event for _, batch in self.receive() for event in batch.events]

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128), seed=1)


@pytest.fixture
def engine(model):
    """An online engine of 6 blocks of 4 tokens (5 to give out), prefix caching and events on, and
    its subscriber; both shut down after the test."""
    llm = LLMEngine.from_engine_args(
        model,
        helpers.engine_args(6, block_size=BLOCK_SIZE, enable_prefix_caching=True, kv_events_config=EVENTS),
    )
    subscriber = Subscriber(llm.engine_core.scheduler.kv_event_publisher)
    yield llm, subscriber
    llm.shutdown()
    subscriber.close()


def serve(llm: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    llm.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens = []
    while llm.has_unfinished_requests():
        tokens = next((o.outputs[0].token_ids for o in llm.step() if o.finished), tokens)
    return list(tokens)


def hashes(tokens: list[int]) -> list[int]:
    """The published hashes of ``tokens``' full blocks, in chain order."""
    return [to_external_block_hash(h) for h in chain_hashes(full_blocks(tokens, BLOCK_SIZE))]


def pool_index(llm: LLMEngine) -> set[int]:
    """The hashes the pool holds now, as published."""
    pool = llm.engine_core.memory.block_pool
    entries = (pool.prefix_cache.entry(b) for b in range(pool.num_blocks))
    return {to_external_block_hash(e.block_hash) for e in entries if e is not None}


# ------------------------------------------------------------------------------ the wire format


def test_a_batch_is_vllms_array_of_tagged_maps():
    """msgpack of [ts, events, rank]; each event a map with vLLM's field names in vLLM's order,
    tagged by its class; defaults left out, the fields without one always sent."""
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([7, 8], None, [1, 2, 3, 4], 2, None, MEDIUM_GPU, None, [None, None], 0),
            BlockRemoved([7], MEDIUM_GPU, group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    ts, events, rank = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert (ts, rank) == (1.5, 0)
    stored, removed, cleared = events
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [7, 8]
    assert stored["parent_block_hash"] is None and stored["lora_id"] is None  # sent: no default
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=2.0, events=[]))) == [2.0, [], None]


@pytest.mark.skipif(not VLLM_KV_EVENTS.exists(), reason="vLLM 0.33.0's sources are not on this machine")
def test_vllms_own_classes_read_our_batches_and_ours_read_theirs():
    """vLLM's event classes, taken from its source (imports stubbed), decode what we encode, and the
    other way round: extra fields of vLLM's are skipped by our decoder."""
    source = VLLM_KV_EVENTS.read_text()
    classes = source[source.index("class EventBatch(") : source.index("class KVEventAggregator")]
    import sys
    import types
    from typing import Any

    module = types.ModuleType("vllm_kv_events_under_test")
    module.__dict__.update(msgspec=msgspec, Any=Any, ExternalBlockHash=bytes | int)
    sys.modules[module.__name__] = module
    try:
        exec(compile(classes, str(VLLM_KV_EVENTS), "exec"), module.__dict__)
        ours = KVEventBatch(
            ts=1.0,
            events=[
                BlockStored([2**64 - 1], 5, [1, 2], 2, None, MEDIUM_GPU, "lora", [("lora", "salt")], 0),
                BlockRemoved([3], MEDIUM_GPU, group_idx=1),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
        theirs = msgspec.msgpack.Decoder(module.KVEventBatch).decode(msgspec.msgpack.encode(ours))
        stored, removed, cleared = theirs.events
        assert type(stored).__name__ == "BlockStored" and stored.block_hashes == [2**64 - 1]
        assert (stored.parent_block_hash, stored.token_ids, stored.lora_name) == (5, [1, 2], "lora")
        assert stored.extra_keys == [("lora", "salt")] and stored.group_idx == 0
        assert (removed.block_hashes, removed.group_idx, type(cleared).__name__) == (
            [3],
            1,
            "AllBlocksCleared",
        )
        vllms = module.KVEventBatch(
            ts=2.0,
            events=[module.BlockStored([1], None, [9], 1, None, "GPU", None, session_id="s")],
            data_parallel_rank=0,
        )
        (read,) = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(vllms)).events
        assert read == BlockStored([1], None, [9], 1, None, "GPU", None)
    finally:
        del sys.modules[module.__name__]


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_a_course_hash_is_sent_as_the_unsigned_int_of_its_64_bits(block_hash):
    external = to_external_block_hash(block_hash)
    assert 0 <= external < 2**64
    assert (external - 2**64 if external >= 2**63 else external) == block_hash  # one to one


# ------------------------------------------------------------------------------ from the pool


def test_a_request_of_two_full_blocks_stores_their_hashes_in_chain_order(engine):
    llm, subscriber = engine
    prompt = list(range(10, 19))  # 9 tokens: two full blocks, and one token more
    serve(llm, "a", prompt, max_tokens=1)  # the 9th token's block never fills
    (stored,) = subscriber.events()
    assert stored == BlockStored(
        block_hashes=hashes(prompt),
        parent_block_hash=None,
        token_ids=prompt[:8],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=[None, None],
        group_idx=0,
    )
    assert set(stored.block_hashes) == pool_index(llm)


def test_the_events_of_a_request_are_the_same_on_every_device(device):
    """The hashes are the tokens', whatever device holds the K/V: medium ``"GPU"`` names the device
    pool, as vLLM's default does on every platform."""
    model = TinyGPT(GPTConfig(num_layers=1, num_heads=2, head_dim=8, max_len=32), seed=2).to(device)
    llm = LLMEngine.from_engine_args(
        model,
        helpers.engine_args(6, block_size=BLOCK_SIZE, enable_prefix_caching=True, kv_events_config=EVENTS),
    )
    subscriber = Subscriber(llm.engine_core.scheduler.kv_event_publisher)
    try:
        prompt = list(range(30, 43))
        tokens = serve(llm, "a", prompt, max_tokens=4)
        prefill, decode = subscriber.events()  # three blocks in the prefill's step, one in a decode's
        assert prefill.block_hashes + decode.block_hashes == hashes(prompt + tokens[:3])  # 16 tokens
        assert decode.parent_block_hash == prefill.block_hashes[-1]
        assert prefill.medium == decode.medium == MEDIUM_GPU
    finally:
        llm.shutdown()
        subscriber.close()


def test_a_request_after_a_hit_stores_its_new_blocks_after_the_hit(engine):
    llm, subscriber = engine
    first = list(range(10, 19))
    serve(llm, "a", first, max_tokens=1)
    subscriber.events()
    second = [*first[:8], 50, 51, 52, 53, 54]  # the two blocks hit, then one block of its own
    serve(llm, "b", second, max_tokens=1)
    (stored,) = subscriber.events()
    assert stored.block_hashes == hashes(second)[2:]
    assert stored.parent_block_hash == hashes(first)[1]
    assert stored.token_ids == [50, 51, 52, 53]


def test_decode_blocks_are_stored_and_evictions_removed_and_the_events_rebuild_the_pool(engine):
    """A subscriber that only reads the events knows exactly which hashes the pool holds, through
    decodes that fill blocks and requests that evict the cached ones."""
    llm, subscriber = engine
    index: set[int] = set()
    removed = 0
    for i, (prompt_len, max_tokens) in enumerate([(9, 4), (13, 6), (6, 3), (11, 5)]):
        prompt = [20 + 7 * i + t for t in range(prompt_len)]
        tokens = serve(llm, f"r{i}", prompt, max_tokens)
        for event in subscriber.events():
            if isinstance(event, BlockStored):
                assert not index & set(event.block_hashes)
                index |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= index
                index -= set(event.block_hashes)
                removed += 1
        assert index == pool_index(llm)
        assert len(tokens) == max_tokens
    assert removed > 0  # 5 blocks to give out: the later requests evicted earlier ones


def test_the_listener_merges_a_chain_only_while_nothing_comes_between():
    from paged_kv.core.block_pool import BlockPool

    pool = BlockPool(8, enable_caching=True)
    events = KVCacheEvents()
    pool.add_listener(events)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    first = pool.cache_block(None, (1, 2), a)
    second = pool.cache_block(first, (3, 4), b)
    pool.evict(b)
    pool.cache_block(first, (5, 6), c)
    stored, removed, again = events.take_events()
    assert stored.block_hashes == [
        to_external_block_hash(first.block_hash),
        to_external_block_hash(second.block_hash),
    ]
    assert stored.token_ids == [1, 2, 3, 4] and stored.extra_keys == [None, None]
    assert removed.block_hashes == [to_external_block_hash(second.block_hash)]
    assert again.parent_block_hash == to_external_block_hash(first.block_hash) and again.token_ids == [5, 6]
    assert events.take_events() == []


def test_a_salted_lora_request_publishes_its_extra_keys_untagged(engine):
    llm, subscriber = engine
    prompt = list(range(60, 69))
    llm.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=1), cache_salt="t", lora_name="l")
    while llm.has_unfinished_requests():
        llm.step()
    (stored,) = subscriber.events()
    assert stored.lora_name == "l" and stored.lora_id is None
    assert stored.extra_keys == [("l", "t"), ("l",)]  # the LoRA name on each block, the salt on the first


def test_reset_publishes_all_blocks_cleared_at_once(engine):
    llm, subscriber = engine
    serve(llm, "a", list(range(10, 19)), max_tokens=1)
    subscriber.events()
    assert llm.reset_prefix_cache()
    assert subscriber.events() == [AllBlocksCleared()]


def test_shutdown_publishes_the_pools_end_and_joins_the_thread(model):
    llm = LLMEngine.from_engine_args(
        model,
        helpers.engine_args(6, block_size=BLOCK_SIZE, enable_prefix_caching=True, kv_events_config=EVENTS),
    )
    publisher = llm.engine_core.scheduler.kv_event_publisher
    subscriber = Subscriber(publisher)
    try:
        serve(llm, "a", list(range(10, 19)), max_tokens=1)
        llm.shutdown()
        assert [type(e) for e in subscriber.events()] == [BlockStored, AllBlocksCleared]
        assert not publisher.is_running and publisher._pub.closed
        assert publisher_threads() == []
        llm.shutdown()  # idempotent
        serve(llm, "b", list(range(10, 19)), max_tokens=1)  # publishes nothing, fails nothing
        assert subscriber.events() == []
        with pytest.raises(RuntimeError, match="Publisher is closed"):
            publisher.publish(KVEventBatch(ts=0.0, events=[]))
    finally:
        subscriber.close()


def test_the_offline_engine_shares_one_publisher_across_its_runs(model):
    requests = [EngineRequest("a", list(range(10, 19)), 2)]
    with Engine(
        model, num_blocks=6, block_size=BLOCK_SIZE, enable_prefix_caching=True, kv_events_config=EVENTS
    ) as engine:
        subscriber = Subscriber(engine.kv_event_publisher)
        try:
            first = engine.run(requests)
            events = subscriber.events()
            assert [type(e) for e in events] == [BlockStored, AllBlocksCleared]  # the run's pool goes
            assert engine.run(requests).tokens == first.tokens
            assert subscriber.events() == events  # a new pool: the same blocks stored again
        finally:
            subscriber.close()
    assert not engine.kv_event_publisher.is_running


# ------------------------------------------------------------------------------ the publisher


def test_sequence_numbers_replay_and_topic():
    publisher = ZmqEventPublisher(
        endpoint=LOOPBACK_ANY_PORT, replay_endpoint=LOOPBACK_ANY_PORT, buffer_steps=3, topic="kv@0"
    )
    subscriber = Subscriber(publisher, topic=b"kv@0")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        start = subscriber.probes_end
        for i in range(4):
            publisher.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        received = subscriber.receive()
        assert [seq for seq, _ in received] == list(range(start, start + 4))
        assert all(batch.data_parallel_rank == 0 for _, batch in received)  # stamped by the publisher
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (start + 2).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "no answer from the replay socket"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                break
            assert topic == b"kv@0"
            replayed.append(
                (int.from_bytes(seq, "big"), msgspec.msgpack.Decoder(KVEventBatch).decode(payload).ts)
            )
        assert replayed == [(start + 2, 2.0), (start + 3, 3.0)]  # the buffer keeps the last 3
    finally:
        dealer.close(linger=0)
        subscriber.close()
        publisher.shutdown()


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://*:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv-events", True),
        ("inproc://kv-events", True),
        ("tcp://10.1.2.3:5557", False),  # another host: a proxy gathering events, connected to
        ("tcp://router.example:5557", False),
    ],
)
def test_loopback_and_wildcards_bind_other_hosts_are_connected_to(endpoint, binds):
    assert _binds(endpoint) is binds


def test_the_default_endpoint_is_vllms_port_on_loopback():
    config = KVEventsConfig(enable_kv_cache_events=True)
    assert (config.endpoint, config.publisher) == (DEFAULT_KV_EVENTS_ENDPOINT, "zmq")
    assert DEFAULT_KV_EVENTS_ENDPOINT == "tcp://127.0.0.1:5557"
    assert (config.buffer_steps, config.hwm, config.max_queue_size, config.topic) == (
        10_000,
        100_000,
        100_000,
        "",
    )
    assert KVEventsConfig().publisher == "null"
    assert isinstance(EventPublisherFactory.create(KVEventsConfig()), NullEventPublisher)
    assert isinstance(EventPublisherFactory.create(None), NullEventPublisher)


# ------------------------------------------------------------------------------ bad settings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"publisher": "kafka"}, "publisher must be one of"),
        ({"endpoint": "127.0.0.1:5557"}, "endpoint must be a ZMQ address"),
        ({"endpoint": "tcp://127.0.0.1"}, "endpoint must be tcp://HOST:PORT"),
        ({"endpoint": "tcp://127.0.0.1:70000"}, "endpoint must be tcp://HOST:PORT"),
        ({"endpoint": "tcp://::1:5557"}, "endpoint must be tcp://HOST:PORT"),
        ({"replay_endpoint": "udp://x:1"}, "replay_endpoint must be a ZMQ address"),
        ({"buffer_steps": 0}, "buffer_steps must be at least 1"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be True or False"),
        ({"topics": "x"}, "kv_events_config has no field 'topics'"),
    ],
)
def test_a_bad_config_is_refused_by_name_and_nothing_starts(model, settings, message):
    with pytest.raises(ValueError, match=message):
        Engine(model, num_blocks=6, enable_prefix_caching=True, kv_events_config={**EVENTS, **settings})


@pytest.mark.parametrize("text", ["{", "[1]", '"zmq"'])
def test_kv_events_config_text_must_be_a_json_object(model, text):
    with pytest.raises(ValueError, match="kv_events_config must be"):
        Engine(model, num_blocks=6, kv_events_config=text)


def test_an_endpoint_in_use_is_refused_and_leaves_nothing_open(model):
    taken = ZmqEventPublisher(endpoint=LOOPBACK_ANY_PORT)
    try:
        for settings in ({"endpoint": taken.endpoint}, {"replay_endpoint": taken.endpoint}):
            with pytest.raises(ValueError, match="cannot be bound"):
                Engine(
                    model, num_blocks=6, enable_prefix_caching=True, kv_events_config={**EVENTS, **settings}
                )
            assert publisher_threads() == [taken._thread]
    finally:
        taken.shutdown()


def test_events_off_or_without_a_pool_make_no_listener(model):
    off = LLMEngine.from_engine_args(model, helpers.engine_args(6, enable_prefix_caching=True))
    assert off.engine_core.kv_cache_events is None
    assert isinstance(off.engine_core.scheduler.kv_event_publisher, NullEventPublisher)
    contiguous = LLMEngine.from_engine_args(
        model, helpers.engine_args(6, mode="contiguous", kv_events_config=EVENTS, max_model_len=16)
    )
    try:
        assert contiguous.engine_core.kv_cache_events is None
    finally:
        contiguous.shutdown()


def test_events_without_prefix_caching_warn_as_vllm(model, caplog):
    engine = Engine(model, num_blocks=6, kv_events_config=EVENTS)
    engine.shutdown()
    assert "KV cache events are on, but prefix caching is not enabled" in caplog.text
    Engine(model, num_blocks=6, kv_events_config={"publisher": "zmq"}).shutdown()
    assert "KV cache events are disabled, but the scheduler is configured to publish them" in caplog.text


# ------------------------------------------------------------------------------ the command line


def test_serve_takes_vllms_kv_events_config_flag():
    args = build_parser().parse_args(
        ["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']
    )
    assert args.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    assert build_parser().parse_args(["serve"]).kv_events_config is None


def test_serve_refuses_a_bad_kv_events_config_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "serve",
                "--tiny",
                "--kv-events-config",
                '{"enable_kv_cache_events": true, "publisher": "kafka"}',
            ]
        )
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "publisher must be one of ('null', 'zmq'), got 'kafka'" in err


def test_serve_prints_where_the_events_are_published():
    from paged_kv.cli import build_serve_app

    args = build_parser().parse_args(["serve", "--tiny", "--kv-events-config", json.dumps(EVENTS)])
    app, lines = build_serve_app(args)
    try:
        publisher = app.state.async_llm.llm_engine.engine_core.scheduler.kv_event_publisher
        assert f"KV-cache events published on {publisher.endpoint} (topic '')" in lines
    finally:
        helpers.run_async(app.state.async_llm.shutdown())

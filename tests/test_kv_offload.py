"""The CPU offload tier (paged_kv.kv_offload): the manager's LRU against a plain reference, the
worker's batched copies bit for bit on every device, vLLM's sizing from ``kv_offloading_size``, and
the tokens the tier adds to the device's prefix hit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch.overrides import TorchFunctionMode

from paged_kv.kv.storage import KVStorage
from paged_kv.kv_offload.base import GPULoadStoreSpec, LookupResult, Medium, OffloadingEvent
from paged_kv.kv_offload.cpu.common import CPULoadStoreSpec
from paged_kv.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from paged_kv.kv_offload.cpu.manager import CPUOffloadingManager, HeldBlock
from paged_kv.kv_offload.cpu.spec import BLOCK_SIZE_ALIGNMENT, CPUOffloadingSpec, cpu_bytes_to_use
from paged_kv.kv_offload.matching import get_num_new_matched_tokens, maximal_prefix_lookup

GIB = 1 << 30

# ------------------------------------------------------------------------------------ the manager


def stored(manager: CPUOffloadingManager, keys) -> None:
    """Store ``keys`` to completion (there must be room)."""
    output = manager.prepare_store(keys)
    assert output is not None
    manager.complete_store(output.keys_to_store)


def test_a_block_is_pending_while_stored_then_a_hit_and_announced_once():
    manager = CPUOffloadingManager(4, enable_events=True)
    output = manager.prepare_store(["a", "b"])
    assert output.keys_to_store == ["a", "b"] and output.store_spec.block_ids == (0, 1)
    assert output.evicted_keys == []
    assert manager.lookup("a") is LookupResult.HIT_PENDING and manager.lookup("z") is LookupResult.MISS
    with pytest.raises(ValueError, match="still being stored"):
        manager.prepare_load(["a"])
    assert manager.num_evictable_blocks == 0
    manager.complete_store(["a", "b", "never offered"])
    assert manager.lookup("a") is LookupResult.HIT and manager.num_evictable_blocks == 2
    again = manager.prepare_store(["a", "b", "c"])  # held keys are not stored twice
    assert again.keys_to_store == ["c"] and again.store_spec.block_ids == (2,)
    manager.complete_store(["a", "b", "c"])
    assert list(manager.take_events()) == [
        OffloadingEvent(["a", "b"], Medium.CPU, removed=False),
        OffloadingEvent(["c"], Medium.CPU, removed=False),
    ]
    assert list(manager.take_events()) == []
    assert Medium.CPU.value == "CPU"


def test_eviction_takes_the_least_recent_idle_blocks_and_spares_the_offer_and_the_loading():
    manager = CPUOffloadingManager(4, enable_events=True)
    stored(manager, ["a", "b", "c", "d"])  # one store: "a" most recent, "d" least
    assert [b.key for b in manager.lru_blocks()] == ["d", "c", "b", "a"]
    manager.take_events()
    spec = manager.prepare_load(["d"])  # pinned while loading
    assert spec.block_ids == (3,)
    output = manager.prepare_store(["c", "x", "y"])  # "c" is offered: protected
    assert output.keys_to_store == ["x", "y"] and output.evicted_keys == ["b", "a"]
    assert output.store_spec.block_ids == (0, 1)  # the freed ids, the last freed first
    assert list(manager.take_events()) == [OffloadingEvent(["b", "a"], Medium.CPU, removed=True)]
    before = manager.lru_blocks()
    assert manager.prepare_store(["c", "z"]) is None  # "x", "y" pending, "d" loading, "c" offered
    manager.complete_load(["d"])
    assert manager.lru_blocks() == [HeldBlock("d", 3, 0), *before[1:]]


def test_a_full_tier_of_busy_blocks_refuses_a_store_and_changes_nothing():
    manager = CPUOffloadingManager(2, enable_events=True)
    manager.prepare_store(["a"])
    stored(manager, ["b"])
    manager.prepare_load(["b"])
    manager.take_events()
    before = manager.lru_blocks()
    assert manager.prepare_store(["c"]) is None
    assert manager.prepare_store(["c", "d", "e"]) is None  # more than the tier holds
    assert manager.lru_blocks() == before and list(manager.take_events()) == []


def test_touch_makes_the_first_key_the_most_recent_and_ignores_unknown_keys():
    manager = CPUOffloadingManager(4)
    stored(manager, ["a", "b", "c", "d"])
    manager.touch(["c", "d", "not held"])
    assert [b.key for b in manager.lru_blocks()] == ["b", "a", "d", "c"]
    assert manager.prepare_store(["e"]).evicted_keys == ["b"]


def test_a_failed_store_frees_its_blocks_and_announces_nothing():
    manager = CPUOffloadingManager(2, enable_events=True)
    output = manager.prepare_store(["a", "b"])
    manager.complete_store(["a"], success=False)
    manager.complete_store(["b"])
    assert "a" not in manager and manager.lookup("b") is LookupResult.HIT
    assert manager.num_free_blocks == 1 and len(manager) == 1
    assert list(manager.take_events()) == [OffloadingEvent(["b"], Medium.CPU, removed=False)]
    assert manager.prepare_store(["c"]).store_spec.block_ids == output.store_spec.block_ids[:1]


def test_loads_pin_once_per_key_named_and_bad_calls_change_nothing():
    manager = CPUOffloadingManager(3)
    stored(manager, ["a", "b"])
    manager.prepare_store(["p"])
    assert manager.prepare_load(["a", "a"]).block_ids == (0, 0)
    before = manager.lru_blocks()
    for keys, message in (
        (["b", "missing"], "not in the CPU offloading cache"),
        (["b", "p"], "still being stored"),
        (["b", ["unhashable"]], "key must be hashable"),
    ):
        with pytest.raises(ValueError, match=message):
            manager.prepare_load(keys)
        assert manager.lru_blocks() == before
    with pytest.raises(ValueError, match="not being loaded"):
        manager.complete_load(["a", "a", "a"])
    with pytest.raises(ValueError, match="not being loaded"):
        manager.complete_load(["a", "b"])
    assert manager.lru_blocks() == before
    manager.complete_load(["a", "a"])
    assert manager.num_evictable_blocks == 2
    with pytest.raises(ValueError, match="key must be hashable"):
        manager.prepare_store([{}])
    with pytest.raises(ValueError, match="num_blocks"):
        CPUOffloadingManager(0)


def test_reset_drops_every_block_but_not_while_one_is_busy():
    manager = CPUOffloadingManager(3, enable_events=True)
    stored(manager, ["a", "b"])
    manager.take_events()
    manager.prepare_load(["a"])
    with pytest.raises(RuntimeError, match="1 blocks are being loaded or stored"):
        manager.reset_cache()
    assert len(manager) == 2
    manager.complete_load(["a"])
    manager.reset_cache()
    assert len(manager) == 0 and manager.num_free_blocks == 3 and list(manager.take_events()) == []
    assert manager.prepare_store(["c"]).store_spec.block_ids == (0,)


class ReferenceLRU:
    """The manager's rules, plainly: a list of keys, least recently used first, and dicts."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.order: list[object] = []
        self.ref_cnt: dict[object, int] = {}
        self.block_id: dict[object, int] = {}
        self.fresh = list(range(num_blocks))
        self.freed: list[int] = []
        self.events: list[OffloadingEvent] = []

    def prepare_store(self, keys):
        new = []
        for key in keys:
            if key not in self.ref_cnt and key not in new:
                new.append(key)
        need = len(new) - (self.num_blocks - len(self.order))
        idle = [k for k in self.order if self.ref_cnt[k] == 0 and k not in keys]
        if need > len(idle):
            return None
        evicted = idle[: max(need, 0)]
        for key in evicted:
            self.order.remove(key)
            del self.ref_cnt[key]
            self.freed.append(self.block_id.pop(key))
        if evicted:
            self.events.append(OffloadingEvent(evicted, Medium.CPU, True))
        ids = [self.fresh.pop(0) if self.fresh else self.freed.pop() for _ in new]
        for key, block_id in zip(new, ids, strict=True):
            self.ref_cnt[key], self.block_id[key] = -1, block_id
        self.order += list(reversed(new))
        return new, ids, evicted

    def complete_store(self, keys, success):
        done = []
        for key in keys:
            if self.ref_cnt.get(key) != -1:
                continue
            done.append(key)
            if success:
                self.ref_cnt[key] = 0
            else:
                self.order.remove(key)
                del self.ref_cnt[key]
                self.freed.append(self.block_id.pop(key))
        if success and done:
            self.events.append(OffloadingEvent(done, Medium.CPU, False))

    def touch(self, keys):
        for key in reversed(keys):
            if key in self.ref_cnt:
                self.order.remove(key)
                self.order.append(key)


KEYS = st.lists(st.integers(0, 11), max_size=5)


class ManagerMachine(RuleBasedStateMachine):
    """CPUOffloadingManager against ReferenceLRU: stores, loads, touches, in any order."""

    NUM_BLOCKS = 5

    def __init__(self) -> None:
        super().__init__()
        self.manager = CPUOffloadingManager(self.NUM_BLOCKS, enable_events=True)
        self.reference = ReferenceLRU(self.NUM_BLOCKS)
        self.loads: list[list[int]] = []  # the keys of each load in flight

    @rule(keys=KEYS)
    def prepare_store(self, keys):
        output = self.manager.prepare_store(keys)
        expected = self.reference.prepare_store(keys)
        if expected is None:
            assert output is None
        else:
            assert (output.keys_to_store, list(output.store_spec.block_ids), output.evicted_keys) == expected

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        keys = data.draw(st.lists(st.sampled_from(sorted(self.reference.ref_cnt) or [0]), max_size=4))
        self.manager.complete_store(keys, success)
        self.reference.complete_store(keys, success)

    @rule(data=st.data())
    def prepare_load(self, data):
        ready = sorted(k for k, r in self.reference.ref_cnt.items() if r >= 0)
        keys = data.draw(st.lists(st.sampled_from(ready or [0]), max_size=3))
        if any(k not in ready for k in keys):
            with pytest.raises(ValueError):
                self.manager.prepare_load(keys)
            return
        spec = self.manager.prepare_load(keys)
        assert list(spec.block_ids) == [self.reference.block_id[k] for k in keys]
        for key in keys:
            self.reference.ref_cnt[key] += 1
        self.loads.append(keys)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data):
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.manager.complete_load(keys)
        for key in keys:
            self.reference.ref_cnt[key] -= 1

    @rule(keys=KEYS)
    def touch(self, keys):
        self.manager.touch(keys)
        self.reference.touch(keys)

    @rule(keys=KEYS)
    def lookup(self, keys):
        for key in keys:
            expected = self.reference.ref_cnt.get(key)
            result = self.manager.lookup(key)
            if expected is None:
                assert result is LookupResult.MISS
            else:
                assert result is (LookupResult.HIT if expected >= 0 else LookupResult.HIT_PENDING)

    @invariant()
    def matches_the_reference(self):
        ref = self.reference
        assert self.manager.lru_blocks() == [HeldBlock(k, ref.block_id[k], ref.ref_cnt[k]) for k in ref.order]
        ids = [b.block_id for b in self.manager.lru_blocks()]
        assert len(set(ids)) == len(ids) and all(0 <= i < self.NUM_BLOCKS for i in ids)
        assert self.manager.num_free_blocks == self.NUM_BLOCKS - len(ids)
        assert self.manager.num_evictable_blocks == sum(r == 0 for r in ref.ref_cnt.values())
        assert list(self.manager.take_events()) == ref.events
        ref.events = []


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


# ------------------------------------------------------------------------------------- the worker


def random_storage(device, dtype=torch.float32, layer_tensors=None, num_blocks=12) -> KVStorage:
    """A storage of 3 layers whose every byte is random."""
    storage = KVStorage(3, num_blocks, 4, 2, 8, dtype=dtype, device=device, layer_tensors=layer_tensors)
    generator = torch.Generator(device="cpu").manual_seed(0)
    for caches in (storage.k_caches, storage.v_caches):
        for cache in caches:
            noise = torch.randint(
                0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8, generator=generator
            )
            cache.view(torch.uint8).copy_(noise)
    return storage


def layer_bytes(caches, layer, block_ids) -> torch.Tensor:
    return caches[layer].view(torch.uint8)[list(block_ids)].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("layer_tensors", [None, [0, 1, 0]])
def test_blocks_go_to_the_host_and_back_bit_for_bit(device, dtype, layer_tensors):
    storage = random_storage(device, dtype, layer_tensors)
    worker = CPUOffloadingWorker(storage, 6)
    assert worker.k_caches[0].device.type == "cpu" and worker.k_caches[0].dtype == dtype
    assert worker.k_caches[0].is_pinned() == (device.type == "cuda")
    assert worker.k_caches[0].shape == (6, 2, 4, 8)
    assert worker.nbytes == 6 * storage.bytes_per_block
    sources, host = [7, 2, 9, 0], [5, 0, 3, 1]
    originals = [
        layer_bytes(c, layer, sources) for c in (storage.k_caches, storage.v_caches) for layer in range(3)
    ]
    assert worker.submit_store(11, GPULoadStoreSpec(sources), CPULoadStoreSpec(host))
    for caches in (storage.k_caches, storage.v_caches):  # the device blocks are reused meanwhile
        for cache in caches:
            cache[sources] = 0
    targets = [10, 4, 1, 8]
    assert worker.submit_load(12, CPULoadStoreSpec(host), GPULoadStoreSpec(targets))
    loaded = [
        layer_bytes(c, layer, targets) for c in (storage.k_caches, storage.v_caches) for layer in range(3)
    ]
    for before, after in zip(originals, loaded, strict=True):
        assert torch.equal(before, after)
    size = 4 * storage.bytes_per_block
    finished = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in finished] == [(11, True, size), (12, True, size)]
    assert all(r.transfer_time >= 0 for r in finished) and worker.get_finished() == []


class CountCalls(TorchFunctionMode):
    """Counts the torch functions called inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_a_transfer_costs_the_same_calls_for_one_block_as_for_many(device):
    storage = random_storage(device, layer_tensors=[0, 1, 1], num_blocks=20)  # two device tensors
    worker = CPUOffloadingWorker(storage, 16)
    moves = ("index_select", "index_copy_", "copy_")
    calls = []
    for n in (1, 9):
        with CountCalls() as store:
            worker.submit_store(0, GPULoadStoreSpec(range(n)), CPULoadStoreSpec(range(n)))
        with CountCalls() as load:
            worker.submit_load(1, CPULoadStoreSpec(range(n)), GPULoadStoreSpec(range(n, 2 * n)))
        calls.append([{name: c.counts.get(name, 0) for name in moves} for c in (store, load)])
    assert calls[0] == calls[1]
    copies = int(device.type == "cuda")  # the one move across the bus
    (store, load) = calls[0]
    assert store == {"index_select": 4, "index_copy_": 1, "copy_": copies}  # K and V of 2 tensors
    assert load == {"index_select": 1, "index_copy_": 4, "copy_": copies}


def test_a_bad_transfer_is_refused_by_name_and_copies_nothing(device):
    storage = random_storage(device)
    worker = CPUOffloadingWorker(storage, 4)
    device_before = [layer_bytes(storage.k_caches, layer, range(12)) for layer in range(3)]
    for src, dst, message in (
        (CPULoadStoreSpec([0]), CPULoadStoreSpec([0]), "src_spec must be a GPULoadStoreSpec"),
        (GPULoadStoreSpec([0]), GPULoadStoreSpec([0]), "dst_spec must be a CPULoadStoreSpec"),
        (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0]), "src_spec names 2 blocks but dst_spec 1"),
        (GPULoadStoreSpec([12]), CPULoadStoreSpec([0]), "src_spec names block 12, past the 12 blocks"),
        (GPULoadStoreSpec([0]), CPULoadStoreSpec([4]), "dst_spec names block 4, past the 4 blocks"),
        (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([2, 2]), "dst_spec names a block twice"),
    ):
        with pytest.raises(ValueError, match=message):
            worker.submit_store(0, src, dst)
    with pytest.raises(ValueError, match="dst_spec names a block twice"):
        worker.submit_load(0, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 3]))
    with pytest.raises(ValueError, match="job_id"):
        worker.submit_load(-1, CPULoadStoreSpec([0]), GPULoadStoreSpec([3]))
    with pytest.raises(ValueError, match=r"block_ids\[1\]"):
        GPULoadStoreSpec([0, -1])
    assert torch.count_nonzero(worker.k_caches[0]) == 0 and worker.get_finished() == []
    for layer in range(3):
        assert torch.equal(layer_bytes(storage.k_caches, layer, range(12)), device_before[layer])
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        CPUOffloadingWorker(storage, 0)
    with pytest.raises(ValueError, match="storage must be a KVStorage"):
        CPUOffloadingWorker("storage", 4)
    assert worker.submit_store(5, GPULoadStoreSpec([]), CPULoadStoreSpec([]))  # nothing to copy: done
    assert worker.get_finished()[0].transfer_size == 0


# ------------------------------------------------------------------------------------- the sizing


def test_the_size_in_gib_becomes_host_blocks_as_vllm_counts_them():
    llama_block = 2 * 32 * 8 * 128 * 2 * 16  # K and V, 32 layers, 8 heads of 128, bf16, 16 tokens: 2 MiB
    spec = CPUOffloadingSpec(4, llama_block)
    assert spec.cpu_bytes_to_use == 4 * GIB and spec.kv_bytes_per_block == llama_block
    assert spec.num_blocks == 2048
    two_ranks = CPUOffloadingSpec(4, llama_block // 2, world_size=2)  # TP 2: half the heads each
    assert (two_ranks.kv_bytes_per_block, two_ranks.num_blocks) == (llama_block, 2048)
    assert CPUOffloadingSpec(0.5, 3 * llama_block).num_blocks == GIB // 2 // (3 * llama_block)
    tiny = CPUOffloadingSpec(1 / 1024, 1000)  # 1 MiB of blocks of 1,000 bytes, each padded to a page
    assert BLOCK_SIZE_ALIGNMENT == 4096 and tiny.kv_bytes_per_block == 4096 and tiny.num_blocks == 256
    odd = CPUOffloadingSpec(1, 4097, world_size=3)
    assert odd.kv_bytes_per_block == 4 * 4096 and odd.num_blocks == GIB // (4 * 4096)
    assert cpu_bytes_to_use(1.5) == 3 * GIB // 2


@pytest.mark.parametrize("bad", [-1, 0, 0.0, -0.5, math.nan, math.inf, "4", None, True, [4]])
def test_a_size_that_is_not_a_positive_number_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        CPUOffloadingSpec(bad, 4096)


def test_a_size_too_small_for_one_block_says_the_least_size():
    with pytest.raises(
        ValueError, match=r"cannot hold one block of 2,097,152 bytes; .* at least 0.00195 GiB"
    ):
        CPUOffloadingSpec(0.001, 2 * 1024 * 1024)
    for name, kwargs in (("worker_kv_bytes_per_block", {"worker_kv_bytes_per_block": 0}),
                         ("world_size", {"world_size": 0})):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            CPUOffloadingSpec(**{"kv_offloading_size": 1, "worker_kv_bytes_per_block": 4096, **kwargs})


def test_the_spec_builds_one_manager_and_a_worker_for_its_storage(device):
    storage = random_storage(device)
    spec = CPUOffloadingSpec.for_storage(1 / 1024, storage, enable_events=True)
    assert spec.worker_kv_bytes_per_block == storage.bytes_per_block
    assert spec.num_blocks == (1 << 20) // BLOCK_SIZE_ALIGNMENT
    manager = spec.get_manager()
    assert manager is spec.get_manager() and manager.num_blocks == spec.num_blocks
    worker = spec.get_worker(storage)
    assert worker.num_cpu_blocks == spec.num_blocks
    other = KVStorage(1, 4, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match="worker_kv_bytes_per_block"):
        spec.get_worker(other)


# ---------------------------------------------------------------- what the tier adds to a hit


def test_the_tier_supplies_its_consecutive_hits_past_the_devices():
    manager = CPUOffloadingManager(8)
    hashes = [10, 11, 12, 13, 14]
    stored(manager, [11, 12, 14])  # 13 is missing: the hit stops there
    assert maximal_prefix_lookup(manager, hashes[1:]) == 2
    # 5 full blocks of 4 in 22 tokens; the device hit block 10 (4 tokens)
    assert get_num_new_matched_tokens(manager, hashes, 4, 22, 4) == 8
    assert get_num_new_matched_tokens(manager, hashes, 0, 22, 4) == 0  # block 10 is not in the tier
    assert get_num_new_matched_tokens(manager, hashes, 4, 22, 4, max_num_new_tokens=6) == 6
    assert get_num_new_matched_tokens(manager, hashes, 4, 22, 4, max_num_new_tokens=3) == 0
    assert get_num_new_matched_tokens(manager, hashes, 20, 22, 4) == 0  # nothing past the device's
    stored(manager, [13])
    assert get_num_new_matched_tokens(manager, hashes[:4], 4, 16, 4) == 12  # a full hit: every token
    manager.prepare_store([10])
    assert maximal_prefix_lookup(manager, hashes) is None  # block 10 is still being stored
    assert get_num_new_matched_tokens(manager, hashes, 0, 22, 4) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 22, 4), "num_computed_tokens must be whole blocks of 4"),
        ((24, 22, 4), "num_computed_tokens must be whole blocks"),
        ((0, 19, 4), "5 block_hashes of 4 tokens are more than 19 tokens hold"),
        ((0, 22, 0), "block_size"),
        ((-4, 22, 4), "num_computed_tokens"),
    ],
)
def test_bad_counts_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        get_num_new_matched_tokens(CPUOffloadingManager(2), [1, 2, 3, 4, 5], *args)


def test_evicted_blocks_come_back_from_the_host_through_both_halves(device):
    """The wiring in miniature: a request's blocks are stored after their step, the device reuses
    them, and a later request with the same prefix loads them back instead of recomputing."""
    storage = random_storage(device)
    spec = CPUOffloadingSpec.for_storage(1 / 1024, storage, enable_events=True)
    manager, worker = spec.get_manager(), spec.get_worker(storage)
    hashes, device_blocks = [101, 102, 103], [5, 6, 7]
    expected = [layer_bytes(storage.v_caches, layer, device_blocks) for layer in range(3)]
    output = manager.prepare_store(hashes)  # the scheduler, building the step
    worker.submit_store(0, GPULoadStoreSpec(device_blocks), output.store_spec)  # the runner
    (result,) = worker.get_finished()
    manager.complete_store(output.keys_to_store, result.success)  # the scheduler, next step
    storage.v_caches[1][device_blocks] = 0  # evicted from the device and reused
    hit = get_num_new_matched_tokens(manager, hashes, 0, 14, storage.block_size)
    assert hit == 12
    keys = hashes[: hit // storage.block_size]
    worker.submit_load(1, manager.prepare_load(keys), GPULoadStoreSpec([1, 2, 3]))
    manager.complete_load(keys)
    manager.touch(keys)
    for layer in range(3):
        assert torch.equal(layer_bytes(storage.v_caches, layer, [1, 2, 3]), expected[layer])
    assert [e.removed for e in manager.take_events()] == [False]

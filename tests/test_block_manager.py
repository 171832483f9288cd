"""The block manager (no tensors), its events and the K/V storage it is paired with."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import (
    BlockChange,
    BlockManager,
    GPTConfig,
    KVStorage,
    OutOfBlocksError,
    PagedKVCache,
    PagedKVCacheAllocator,
    Recorder,
    TinyGPT,
    UnknownSequenceError,
    blocks_for_tokens,
    generate,
)
from paged_kv.core.prefix_cache import chain_hashes, full_blocks


def events_of(manager: BlockManager) -> list[BlockChange]:
    """A list that receives every event ``manager`` emits from now on."""
    seen: list[BlockChange] = []
    manager.subscribe(seen.append)
    return seen


# ------------------------------------------------------------------------------- examples


def test_the_manager_holds_no_tensors_and_returns_the_copies_to_make() -> None:
    manager = BlockManager(6, 4)
    assert not any(isinstance(value, torch.Tensor) for value in vars(manager).values())
    assert manager.allocate("a", 6).block_ids == [0, 1]
    manager.fork("a", "b")
    taken, copies = manager.append_tokens("b", 3)  # token 7 lands in shared block 1; token 9 opens a block
    assert copies == [(1, 2)] and taken == [2, 3]
    assert manager.table("b").block_ids == [0, 2, 3] and manager.table("a").block_ids == [0, 1]
    assert [manager.ref_count(b) for b in range(4)] == [2, 1, 1, 1]


def test_prepare_write_copies_shared_blocks_and_refuses_positions_past_the_sequence() -> None:
    manager = BlockManager(4, 4)
    manager.allocate("a", 5)
    manager.fork("a", "b")
    before = manager.snapshot()
    with pytest.raises(ValueError, match=r"positions 2 .. 5 run past the 5 tokens"):
        manager.prepare_write("b", 2, 6)
    assert manager.snapshot() == before
    assert manager.prepare_write("b", 2, 5) == [(0, 2), (1, 3)]
    assert manager.prepare_write("b", 0, 5) == []  # its own blocks now


def test_a_decode_batch_that_does_not_fit_changes_nothing() -> None:
    manager = BlockManager(3, 2)
    manager.allocate("a", 2)
    manager.allocate("b", 2)  # both full: the next step needs 2 blocks, 1 is free
    before = manager.snapshot()
    with pytest.raises(
        OutOfBlocksError, match=r"a decode step of 2 sequences needs 2 free blocks but only 1"
    ):
        manager.append_batch(["a", "b"])
    with pytest.raises(UnknownSequenceError):
        manager.append_batch(["a", "nobody"])
    with pytest.raises(ValueError, match="'a' appears more than once"):
        manager.append_batch(["a", "a"])
    assert manager.snapshot() == before


def test_subscribe_refuses_what_cannot_be_called() -> None:
    with pytest.raises(ValueError, match="observer must be callable"):
        BlockManager(2, 2).subscribe("print")


# ----------------------------------------------------------------- the batch is the sequence of appends


@st.composite
def pools(draw):
    """A manager with sequences of random lengths, some forked (so some blocks are shared)."""
    block_size = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
    num_blocks = sum(-(-n // block_size) for n in lengths) + draw(st.integers(0, 6))
    forks = draw(st.lists(st.integers(0, len(lengths) - 1), max_size=3))
    return block_size, max(1, num_blocks), lengths, forks


def build(block_size: int, num_blocks: int, lengths: list[int], forks: list[int], observe: bool):
    manager = BlockManager(num_blocks, block_size)
    seen = events_of(manager) if observe else None
    for seq_id, length in enumerate(lengths):
        manager.allocate(seq_id, length)
    for child, parent in enumerate(forks):
        manager.fork(parent, f"fork-{child}")
    return manager, seen


@given(pools(), st.booleans(), st.booleans())
def test_append_batch_equals_one_append_per_sequence_or_changes_nothing(pool, observe_batch, observe_one):
    batch_manager, batch_events = build(*pool, observe=observe_batch)
    one_manager, one_events = build(*pool, observe=observe_one)
    seq_ids = list(batch_manager.seq_ids)[::-1]
    before = batch_manager.snapshot()
    try:
        copies = batch_manager.append_batch(seq_ids)
    except OutOfBlocksError as error:
        assert batch_manager.snapshot() == before  # all or none
        needed = sum(one_manager.needs_new_block(seq_id) for seq_id in seq_ids)
        assert needed > one_manager.num_free_blocks and error.needed == needed
        return
    expected = []
    for seq_id in seq_ids:
        expected += one_manager.append_tokens(seq_id, 1)[1]
    assert copies == expected
    assert batch_manager.snapshot() == one_manager.snapshot()
    if observe_batch and observe_one:
        assert batch_events == one_events


@given(pools(), st.integers(0, 9))
def test_append_tokens_takes_the_same_blocks_observed_or_not(pool, n):
    quiet, _ = build(*pool, observe=False)
    watched, _ = build(*pool, observe=True)
    for seq_id in list(quiet.seq_ids):
        outcomes = []
        for manager in (quiet, watched):
            try:
                outcomes.append(manager.append_tokens(seq_id, n))
            except OutOfBlocksError as error:
                outcomes.append(str(error))
        assert outcomes[0] == outcomes[1]
        assert quiet.snapshot() == watched.snapshot()


# --------------------------------------------------------------- decode blocks cached as prompt blocks


@st.composite
def conversations(draw):
    """Prompts over a small alphabet (so equal blocks are common), some forks, and decode steps."""
    block_size = draw(st.integers(1, 4))
    prompts = draw(st.lists(st.lists(st.integers(0, 1), max_size=9), min_size=1, max_size=4))
    forks = draw(st.lists(st.integers(0, len(prompts) - 1), max_size=2))
    steps = draw(st.lists(st.lists(st.integers(0, 1), min_size=len(prompts) + len(forks),
                                   max_size=len(prompts) + len(forks)), max_size=10))  # fmt: skip
    return block_size, prompts, forks, steps


def hashes_held(manager: BlockManager) -> set[int]:
    pool = manager.allocator.prefix_cache
    return {pool.entry(block_id).block_hash for block_id in manager.cached_blocks()}


@given(conversations())
def test_decode_blocks_are_cached_by_their_chained_hashes_batched_or_one_by_one(conversation):
    block_size, prompts, forks, steps = conversation
    sequences = [*prompts, *(prompts[parent] for parent in forks)]  # each may copy one shared block
    num_blocks = sum(blocks_for_tokens(len(p) + len(steps), block_size) + 1 for p in sequences)
    managers = [BlockManager(num_blocks, block_size, enable_prefix_caching=True) for _ in range(2)]
    events_of(managers[1])  # observed: append_batch takes its loop, not its shortcut
    tokens: dict[object, list[int]] = {}
    for manager in managers:
        for seq_id, prompt in enumerate(prompts):
            manager.allocate(seq_id, len(prompt), prompt)
            tokens[seq_id] = list(prompt)
        for child, parent in enumerate(forks):
            manager.fork(parent, f"fork-{child}")
            tokens[f"fork-{child}"] = list(tokens[parent])
    seq_ids = list(managers[0].seq_ids)
    for step in steps:
        managers[0].append_batch(seq_ids, step)
        for seq_id, token in zip(seq_ids, step, strict=True):
            managers[1].append_tokens(seq_id, 1, [token])
            tokens[seq_id].append(token)
    assert managers[0].snapshot() == managers[1].snapshot()
    assert managers[0].cached_blocks() == managers[1].cached_blocks()
    # Nothing was evicted: the cache holds the chained hash of every full block of every
    # sequence, whether it filled in prefill or in decode, and nothing else.
    expected = {h for t in tokens.values() for h in chain_hashes(full_blocks(t, block_size))}
    assert hashes_held(managers[0]) == expected
    for block_id, held in managers[0].cached_blocks().items():  # each under the hash of its tokens
        entry = managers[0].allocator.prefix_cache.entry(block_id)
        assert entry.token_ids == held and len(held) == block_size


# ----------------------------------------------------------------------------- events


def test_every_change_is_an_event_and_a_failure_is_none() -> None:
    manager = BlockManager(6, 2, enable_prefix_caching=True)
    seen = events_of(manager)
    manager.allocate("a", 4, token_ids=[1, 2, 3, 4])
    manager.append_tokens("a", 3)  # tokens 5-6 in a new block, token 7 in another
    manager.fork("a", "b")
    manager.prepare_write("b", 6, 7)  # b writes into the shared last block: a copy
    with pytest.raises(OutOfBlocksError):
        manager.append_tokens("b", 9)
    manager.free("a")
    manager.free("b")
    manager.allocate("c", 5, token_ids=[1, 2, 3, 4, 9])  # finds a's two full blocks cached
    assert seen == [
        BlockChange("allocate", "a", (0, 1), tokens=(1, 4)),
        BlockChange("new_block", "a", (2,), tokens=(5, 6)),
        BlockChange("new_block", "a", (3,), tokens=(7, 7)),
        BlockChange("fork", "b", (0, 1, 2, 3), parent="a"),
        BlockChange("copy_on_write", "b", (3, 4), copies=((3, 4),)),
        BlockChange("free", "a", (0, 1, 2, 3), freed=(3,)),
        BlockChange("free", "b", (0, 1, 2, 4), freed=(4, 2, 1, 0)),  # reverse order: a prefix ends last
        BlockChange("cache_hit", "c", (0, 1), tokens=(1, 4)),
        BlockChange("allocate", "c", (0, 1, 2), tokens=(1, 5)),  # block 2 held no hash: nothing evicted
    ]


def test_an_eviction_is_an_event() -> None:
    manager = BlockManager(2, 2, enable_prefix_caching=True)
    seen = events_of(manager)
    manager.allocate("a", 3, token_ids=[1, 2, 3])  # block 0 cached: (1, 2)
    manager.free("a")
    manager.allocate("b", 4)  # takes both blocks, evicting the cached one
    assert [(e.kind, e.blocks) for e in seen if e.kind == "evict"] == [("evict", (0,))]
    assert manager.cached_blocks() == {}


def test_the_recorder_is_the_trace_of_the_one_layer_cache() -> None:
    cache = PagedKVCacheAllocator(6, 2, 1, 1, record=True)
    manager = BlockManager(6, 2)
    recorder = Recorder(manager)
    for target in (cache, manager):
        allocate = target.allocate_for_sequence if target is cache else target.allocate
        allocate("a", 3)
        target.fork("a", "b")
        target.append_tokens("b", 4)
        (target.free_sequence if target is cache else target.free)("a")
    assert [(f.event, f.caption, f.highlight, f.snapshot) for f in cache.trace] == [
        (f.event, f.caption, f.highlight, f.snapshot) for f in recorder.frames
    ]
    lengths = [f.snapshot.tables["b"].num_tokens for f in recorder.frames if f.seq_id == "b"][1:]
    assert lengths == [4, 5, 6, 7]  # one frame per token appended


# ---------------------------------------------------------------- one manager for every layer


def test_a_model_cache_allocates_each_block_once_whatever_the_number_of_layers() -> None:
    config = GPTConfig(num_layers=4, num_heads=2, head_dim=8, max_len=64)
    model = TinyGPT(config, seed=0)
    cache = PagedKVCache(config, num_blocks=12, block_size=4, record=True)
    result = generate(model, [[1, 2, 3, 4, 5], [6, 7]], max_new_tokens=6, cache=cache)
    assert result.tokens == generate(model, [[1, 2, 3, 4, 5], [6, 7]], 6, cache="contiguous").tokens
    assert cache.storage.num_layers == 4 and len(cache.storage.k_caches) == 4
    frames = cache.trace
    assert [f.event for f in frames].count("allocate") == 2  # not 2 per layer
    # Each block is taken once: the sequences end holding 5 + 6 - 1 and 2 + 6 - 1 tokens.
    taken = sum(len(f.highlight) for f in frames if f.event == "allocate")
    taken += sum(1 for f in frames if f.event == "new_block")
    assert taken == blocks_for_tokens(10, 4) + blocks_for_tokens(7, 4)


# ---------------------------------------------------------------------------- the storage


def test_storage_copies_a_block_in_every_layer(device) -> None:
    storage = KVStorage(3, 4, 2, 2, 3, device=device)
    for layer in range(3):
        storage.k_caches[layer][1] = layer + 1.0
        storage.v_caches[layer][1] = -(layer + 1.0)
    storage.copy_blocks([(1, 3)])
    for layer in range(3):
        assert torch.equal(storage.k_caches[layer][3], storage.k_caches[layer][1])
        assert torch.equal(storage.v_caches[layer][3], storage.v_caches[layer][1])
        assert torch.count_nonzero(storage.k_caches[layer][[0, 2]]) == 0
    assert storage.bytes_per_block == 2 * 3 * 2 * 2 * 3 * 4


def test_storage_writes_and_reads_through_a_block_table(device) -> None:
    storage = KVStorage(2, 5, 2, 1, 2, device=device)
    block_ids = torch.tensor([4, 0, 2], device=device)
    k = torch.arange(10.0, device=device).view(5, 1, 2)
    storage.write(1, block_ids, k, -k, start=0)
    read_k, read_v = storage.read(1, block_ids, 5)
    assert torch.equal(read_k, k) and torch.equal(read_v, -k)
    assert torch.count_nonzero(storage.k_caches[0]) == 0  # the other layer is untouched
    storage.write_slots(0, torch.tensor([9], device=device), k[:1], k[:1])
    assert torch.equal(storage.k_caches[0][4, :, 1], k[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"num_layers": 0}, "num_layers"), ({"dtype": torch.int32}, "dtype"), ({"device": "nowhere"}, "device")],
)
def test_storage_refuses_bad_arguments(kwargs, match) -> None:
    arguments = {"num_layers": 1, "num_blocks": 2, "block_size": 2, "num_kv_heads": 1, "head_dim": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        KVStorage(**arguments)


def test_an_empty_decode_batch_changes_nothing() -> None:
    manager = BlockManager(2, 2)
    manager.allocate("a", 2)
    before = manager.snapshot()
    assert manager.append_batch([]) == [] and manager.snapshot() == before
    cache = PagedKVCache(GPTConfig(num_layers=2), num_blocks=2, block_size=2)
    assert cache.append([]).tolist() == []

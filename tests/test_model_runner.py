"""The model runner and a step's inputs (lessons 09, 10): the persistent block table, the attention
metadata built once, one forward, and outputs it refuses to apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.kv.storage import KVStorage
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.step import PAD, AttentionMetadata, BlockTables, prepare_attention
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.model_runner import ModelRunner
from paged_kv.serving.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler, run_steps
from tests.helpers import max_examples

pytestmark = pytest.mark.lesson09

CONFIG = GPTConfig(num_layers=2, num_heads=4, head_dim=8, num_kv_heads=2, max_len=64)


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=7)


# ------------------------------------------------------------------------------ BlockTables


def test_block_tables_keep_rows_between_steps(device):
    tables = BlockTables(2, 4, device)
    assert tables.table.dtype == torch.int32 and tables.table.device.type == device.type
    tables.add_row("a", ([5, 2],))
    tables.add_row("b", ([7],))
    tables.append("a", ([3],))
    tables.commit()
    assert tables.table[0, tables.row("a")].tolist() == [5, 2, 3, PAD]
    assert tables.block_ids("b") == ([7],)
    tables.remove("a")
    tables.add_row("c", ([1, 1, 1, 1],))  # takes a's row: its old entries are overwritten or padding
    tables.commit()
    assert tables.table[0, tables.row("c")].tolist() == [1, 1, 1, 1]
    tables.add_row("d", ([0],))  # every row is taken: the table doubles its rows
    assert tables.max_num_reqs == 4 and tables.block_ids("d") == ([0],)
    tables.sync("c", ([1, 9],))  # an entry changed: the row is written again, the rest padded
    tables.commit()
    assert tables.table[0, tables.row("c")].tolist() == [1, 9, PAD, PAD]


def test_block_tables_refuse_bad_rows_and_change_nothing():
    tables = BlockTables(2, 3)
    tables.add_row("a", ([1],))
    for call, match in (
        (lambda: tables.add_row("a", ([2],)), "has a row already"),
        (lambda: tables.add_row("b", ([1, 2, 3, 4],)), "more than max_blocks_per_req"),
        (lambda: tables.append("zz", ([1],)), "no row"),
        (lambda: tables.append("a", ([1, 2, 3],)), "more than max_blocks_per_req"),
        (lambda: BlockTables(0, 3), "max_num_reqs"),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    assert tables.block_ids("a") == ([1],) and list(tables.rows) == ["a"]


# ---------------------------------------------------------------------- the attention metadata


def reference_metadata(rows: dict, computed: list[int], query_lens: list[int], block_size: int):
    """The step's inputs, one token at a time, in plain Python."""
    positions, slots, starts = [], [], [0]
    for blocks, c, n in zip(rows.values(), computed, query_lens, strict=True):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + n)
    return positions, slots, starts


@settings(max_examples=max_examples(30), deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    requests=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=0, max_size=6),
    seed=st.integers(0, 1000),
)
def test_prepare_attention_equals_a_token_by_token_reference(block_size, requests, seed):
    rng = torch.Generator().manual_seed(seed)
    tables = BlockTables(2, 32)  # fewer rows than requests, at times: it grows
    rows = {}
    for i, (c, n) in enumerate(requests):
        blocks = torch.randperm(100, generator=rng)[: -(-(c + n) // block_size)].tolist()
        rows[i] = blocks
        tables.add_row(i, (blocks,))
    computed, query_lens = [c for c, _ in requests], [n for _, n in requests]
    metadata = prepare_attention(tables, list(rows), computed, query_lens, block_size)
    positions, slots, starts = reference_metadata(rows, computed, query_lens, block_size)
    assert metadata.positions.tolist() == positions
    assert metadata.slot_mapping.tolist() == slots and metadata.slot_mapping.dtype == torch.long
    assert metadata.query_start_loc.tolist() == starts and metadata.query_start_loc.dtype == torch.int32
    assert metadata.seq_lens.tolist() == [c + n for c, n in requests]
    assert metadata.logits_indices.tolist() == [s - 1 for s in starts[1:]]
    assert metadata.num_reqs == len(requests) and metadata.max_query_len == max(query_lens, default=0)
    for b, blocks in enumerate(rows.values()):  # each row holds the request's blocks for its tokens
        assert metadata.block_table[b, : len(blocks)].tolist() == blocks


def test_the_metadata_is_frozen_and_refuses_what_does_not_fit():
    tables = BlockTables(4, 4)
    tables.add_row("a", ([3],))
    metadata = prepare_attention(tables, ["a"], [2], [2], 4)
    assert isinstance(metadata, AttentionMetadata)
    with pytest.raises(dataclasses.FrozenInstanceError):
        metadata.num_reqs = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="need 2 blocks, its row holds 1"):
        prepare_attention(tables, ["a"], [3], [2], 4)
    with pytest.raises(ValueError, match="as many"):
        prepare_attention(tables, ["a"], [0, 1], [1], 4)
    with pytest.raises(ValueError, match="no row"):
        prepare_attention(tables, ["b"], [0], [1], 4)


# ------------------------------------------------------------------------------ the runner


def make_runner(model: TinyGPT, num_blocks: int = 16, block_size: int = 4):
    storage = KVStorage(CONFIG.num_layers, num_blocks, block_size, CONFIG.num_kv_heads, CONFIG.head_dim)
    return ModelRunner(model, storage, max_num_reqs=4, max_blocks_per_req=16)


def test_the_runner_gives_the_tokens_of_generate_and_never_touches_the_blocks(model):
    # The scheduler over a manager; the runner over the storage. The manager's state is the
    # scheduler's doing alone: across each step's execute_model it does not change.
    manager = KVCacheManager(16, 4)
    scheduler = Scheduler(manager, max_num_batched_tokens=6)
    runner = make_runner(model)
    execute = runner.execute_model

    def watched(output):
        before = manager.snapshot()
        result = execute(output)
        assert manager.snapshot() == before
        return result

    runner.execute_model = watched
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8, 7]}
    arrivals = [(0, EngineCoreRequest(r, len(p), 5, tuple(p))) for r, p in prompts.items()]
    tokens = {r: list(t) for _, step in run_steps(scheduler, runner, arrivals) for r, t in step.finished}
    expected = generate(model, list(prompts.values()), 5, cache="contiguous").tokens
    assert tokens == dict(zip(prompts, expected, strict=True))


def test_an_output_the_runner_cannot_apply_raises_and_changes_nothing(model):
    runner = make_runner(model)
    first = SchedulerOutput(
        0,
        {"a": 3},
        3,
        (NewRequestData("a", (1, 2, 3), ((5,),), 0),),
    )
    runner.execute_model(first)
    state = (
        dict(runner.block_tables.rows),
        runner.num_computed_tokens("a"),
        runner.block_tables.block_ids("a"),
    )
    bad = [
        (SchedulerOutput(1, {"zz": 1}, 1, (), CachedRequestData(("zz",), (((),),), (0,))), "no row"),
        (
            SchedulerOutput(1, {"a": 1}, 1, (), CachedRequestData(("a",), (((99,),),), (3,))),
            "outside 0 .. 15",
        ),
        (SchedulerOutput(1, {"a": 1}, 1, (), CachedRequestData(("a",), (((),),), (2,))), "counts 2 computed"),
        (SchedulerOutput(1, {"a": 3}, 3, (), CachedRequestData(("a",), (((),),), (3,))), "do not fit"),
        (
            SchedulerOutput(1, {"a": 2}, 2, (), CachedRequestData(("a",), (((6,),),), (3,))),
            "past the 4 tokens",
        ),
        (SchedulerOutput(1, {"b": 3}, 3, (NewRequestData("b", (1, 2), ((7,),), 0),)), "past the 2 tokens"),
        (SchedulerOutput(1, {"a": 1}, 1, (NewRequestData("a", (1,), ((2,),), 0),)), "running already"),
        (SchedulerOutput(1, {"b": 1}, 1), "neither new nor running"),
        (
            SchedulerOutput(1, {}, 0, (), CachedRequestData(), blocks_to_swap_in={"c": ((1,),)}),
            "never swapped out",
        ),
        ("step 1", "must be a SchedulerOutput"),
    ]
    for output, match in bad:
        with pytest.raises(ValueError, match=match):
            runner.execute_model(output)  # type: ignore[arg-type]
        assert state == (
            dict(runner.block_tables.rows),
            runner.num_computed_tokens("a"),
            runner.block_tables.block_ids("a"),
        )
    good = SchedulerOutput(1, {"a": 1}, 1, (), CachedRequestData(("a",), (((6,),),), (3,)))
    assert set(runner.execute_model(good).sampled_token_ids) == {"a"}
    assert runner.block_tables.block_ids("a") == ([5, 6],)


def test_one_forward_runs_every_request_of_a_step(model, monkeypatch):
    calls = []
    forward = model.forward_step

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward_step", counted)
    scheduler = Scheduler(KVCacheManager(16, 4), max_num_batched_tokens=5)
    runner = make_runner(model)
    arrivals = [(0, EngineCoreRequest("a", 2, 4, (1, 2))), (1, EngineCoreRequest("b", 7, 2, tuple(range(7))))]
    steps = list(run_steps(scheduler, runner, arrivals))
    assert calls == [output.total_num_scheduled_tokens for output, _ in steps]  # one per step
    mixed = [dict(output.num_scheduled_tokens) for output, _ in steps[1:3]]
    assert mixed == [{"a": 1, "b": 4}, {"a": 1, "b": 3}]  # a decode and a chunk in one forward


def test_the_runner_keeps_each_steps_metadata_and_inputs_in_its_request_state(model, monkeypatch):
    # A decode and a chunk in one step: the decode's input is the token it sampled last, the
    # chunk's the prompt tokens from its computed count on; last_metadata is what the layers read.
    inputs = []
    forward = model.forward_step

    def recorded(input_ids, *args, **kwargs):
        inputs.append(input_ids.tolist())
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward_step", recorded)
    scheduler = Scheduler(KVCacheManager(16, 4), max_num_batched_tokens=5)
    runner = make_runner(model)
    prompts = {"a": (1, 2), "b": (11, 12, 13, 14, 15, 16, 17)}
    arrivals = [
        (0, EngineCoreRequest("a", 2, 4, prompts["a"])),
        (1, EngineCoreRequest("b", 7, 2, prompts["b"])),
    ]
    steps = run_steps(scheduler, runner, arrivals)
    _, first = next(steps)
    output, _ = next(steps)
    assert dict(output.num_scheduled_tokens) == {"a": 1, "b": 4}
    assert inputs[-1] == [first.new_tokens["a"], 11, 12, 13, 14]
    metadata = runner.last_metadata
    assert metadata.positions.tolist() == [2, 0, 1, 2, 3]
    assert metadata.query_start_loc_cpu.tolist() == metadata.query_start_loc.tolist() == [0, 1, 5]
    rebuilt = prepare_attention(runner.block_tables, ["a", "b"], [2, 0], [1, 4], 4)
    assert metadata.slot_mapping.tolist() == rebuilt.slot_mapping.tolist()
    assert runner.num_computed_tokens("a") == 3 and runner.num_computed_tokens("b") == 4
    next(steps)
    assert inputs[-1][1:] == [15, 16, 17]  # b's last chunk
    list(steps)


def test_more_requests_than_rows_grow_the_table_and_the_state(model):
    scheduler = Scheduler(KVCacheManager(64, 4))
    storage = KVStorage(CONFIG.num_layers, 64, 4, CONFIG.num_kv_heads, CONFIG.head_dim)
    runner = ModelRunner(model, storage, max_num_reqs=2, max_blocks_per_req=8)
    prompts = [[i + 1, i + 2, i + 3] for i in range(7)]
    arrivals = [(0, EngineCoreRequest(i, 3, 4, tuple(p))) for i, p in enumerate(prompts)]
    tokens = {r: list(t) for _, step in run_steps(scheduler, runner, arrivals) for r, t in step.finished}
    assert runner.block_tables.max_num_reqs == 8 and len(runner.state.num_tokens) == 8
    expected = generate(model, prompts, 4, cache="contiguous").tokens
    assert [tokens[i] for i in range(7)] == expected

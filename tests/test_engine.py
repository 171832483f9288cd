"""The continuous-batching engine: same text as generating alone, paged beats contiguous, metrics."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from paged_kv.attention.registry import ATTENTION_BACKENDS, BACKENDS
from paged_kv.core.kv_cache_manager import watermark_blocks
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.pictures.plots import plot_metrics
from paged_kv.serving.engine import (
    Engine,
    EngineRequest,
    EngineResult,
    min_num_blocks,
    sweep_budgets,
)

from .helpers import alone, built, max_examples

pytestmark = pytest.mark.lesson09

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128)


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=1)


def random_requests(
    n: int, seed: int, max_prompt: int = 12, max_new: int = 10, spread: int = 6
) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [
        EngineRequest(
            f"r{i}",
            [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))],
            rng.randint(1, max_new),
            arrival_step=rng.randrange(spread),
        )
        for i in range(n)
    ]


def all_free(made: list) -> bool:
    """After a run: the memory holds no block, the scheduler no request, the runner no swapped K/V
    (its rows of the last step's requests go when it is next told who finished, as vLLM's do)."""
    (llm,) = made
    core = llm.engine_core
    return (
        core.memory.reserved_tokens == 0  # every block free (the null block aside), or every seat
        and not core.scheduler.has_unfinished_requests
        and not core.scheduler.requests
        and not core.model_runner.swapped
    )


def check_invariants(engine: Engine, result: EngineResult, requests: list[EngineRequest]) -> None:
    assert list(result.tokens) == [r.request_id for r in requests]
    assert set(result.finished_step) == {r.request_id for r in requests}
    for series in (
        result.waiting,
        result.swapped,
        result.used_blocks,
        result.held_tokens,
        result.reserved_tokens,
    ):
        assert len(series) == result.steps
    assert all(0.0 <= u <= 1.0 for u in result.utilization)
    assert all(
        h <= r <= engine.budget_tokens
        for h, r in zip(result.held_tokens, result.reserved_tokens, strict=True)
    )
    assert all(u <= engine.num_blocks for u in result.used_blocks)
    assert result.peak_running == max(result.running)
    assert result.mean_running == pytest.approx(sum(result.running) / result.steps)
    assert result.preemptions == sum(result.preemptions_by_reason.values())
    assert result.blocks_swapped_in == result.blocks_swapped_out  # all that went out came back
    assert result.swapped[-1] == 0
    assert engine.preemption == "swap" or result.preemptions_by_reason["swap"] == 0
    if engine.preemption == "swap" and engine.max_num_batched_tokens is None:
        # Whole prefills: every victim has its K/V to move. (Under a budget a victim still partly
        # prefilled is requeued instead, as recompute.)
        assert result.recomputed_tokens == 0 == result.preemptions_by_reason["recompute"]
        assert len(result.admitted_step) == len(requests)  # admitted once, never again
    if engine.preemption == "recompute":
        assert result.blocks_swapped_out == 0 and not any(result.swapped)


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_engine_generates_what_each_prompt_generates_alone(
    model: TinyGPT, mode: str, device: torch.device
) -> None:
    model = model.to(device)
    try:
        requests = random_requests(8, seed=3)
        engine = Engine(model, num_blocks=12, block_size=4, mode=mode, max_model_len=24)
        result = engine.run(requests)
        check_invariants(engine, result, requests)
        for request in requests:
            assert result.tokens[request.request_id] == alone(model, request), request.request_id
        assert result.peak_running > 1  # the test means something: sequences were batched
    finally:
        model.to("cpu")


@pytest.mark.lesson11
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_keeps_the_text_and_frees_all_memory(
    model: TinyGPT, preemption: str, device: torch.device
) -> None:
    # Each sequence ends at 3 + 14 - 1 = 16 tokens, 4 blocks: three admitted at once outgrow 6 blocks.
    requests = [EngineRequest(i, [7 * i + 1, 2, 3], 14) for i in range(8)]
    model = model.to(device)
    try:
        engine = Engine(model, num_blocks=6, block_size=4, preemption=preemption)
        made = built(engine)
        result = engine.run(requests)
        assert result.preemptions_by_reason[preemption] >= 5  # many
        check_invariants(engine, result, requests)
        assert all_free(made)
        for request in requests:
            assert result.tokens[request.request_id] == alone(model, request)
    finally:
        model.to("cpu")
    if preemption == "swap":
        assert result.blocks_swapped_out > 0
    else:
        assert result.recomputed_tokens > 0


def test_paged_runs_more_sequences_than_contiguous_on_the_same_budget(model: TinyGPT) -> None:
    requests = random_requests(12, seed=5, max_prompt=6, max_new=6, spread=1)
    kwargs = {"num_blocks": 32, "block_size": 8, "max_model_len": 128}  # 256 slots: two contiguous slots
    paged = Engine(model, mode="paged", **kwargs).run(requests)
    contiguous = Engine(model, mode="contiguous", **kwargs).run(requests)
    assert contiguous.peak_running == 2
    assert paged.peak_running > 2 * contiguous.peak_running
    assert paged.steps < contiguous.steps
    assert paged.mean_utilization > contiguous.mean_utilization
    assert paged.tokens == contiguous.tokens


def test_a_finished_sequence_frees_its_blocks_and_the_next_request_is_admitted_at_the_next_step(
    model: TinyGPT,
) -> None:
    # 2 blocks of 4, and the pool's null block. A's prompt takes 1; at step 1 its 5th token takes the
    # other, so B (1 block, arriving at step 1) finds none free and waits until A has finished.
    a = EngineRequest("a", [1, 2, 3, 4], max_tokens=3)  # ends holding 4 + 3 - 1 = 6 tokens: 2 blocks
    b = EngineRequest("b", [5, 6], max_tokens=2, arrival_step=1)
    engine = Engine(model, num_blocks=3, block_size=4)
    result = engine.run([a, b])
    # A prefills at step 0 (token 1) and decodes at steps 1 and 2, then frees; B comes in at step 3.
    assert result.admitted_step == {"a": 0, "b": 3}
    assert result.finished_step == {"a": 2, "b": 4}
    assert result.running == [1, 1, 1, 1, 1]
    assert result.waiting == [0, 1, 1, 0, 0]
    assert result.used_blocks == [1, 2, 2, 1, 1]  # at step 3 only B's prompt block is in use
    assert result.held_tokens == [4, 5, 6, 2, 3]
    assert result.utilization == [1.0, 5 / 8, 6 / 8, 2 / 4, 3 / 4]
    assert result.tokens == {"a": alone(model, a), "b": alone(model, b)}


def test_a_request_is_admitted_into_a_full_pool_with_no_headroom(model: TinyGPT) -> None:
    # 3 blocks of 4 (and the null block): at step 1 A takes its second block and B its prompt's, the
    # last free block. vLLM keeps no block back for A's growth (the course's engine once kept one per
    # sequence).
    a = EngineRequest("a", [1, 2, 3, 4], max_tokens=3)
    b = EngineRequest("b", [5, 6], max_tokens=2, arrival_step=1)
    result = Engine(model, num_blocks=4, block_size=4).run([a, b])
    assert result.admitted_step == {"a": 0, "b": 1}
    assert result.used_blocks[1] == 3 and result.preemptions == 0
    assert result.tokens == {"a": alone(model, a), "b": alone(model, b)}


def test_all_memory_is_free_after_a_run(model: TinyGPT) -> None:
    requests = random_requests(6, seed=9)
    engine = Engine(model, num_blocks=10, block_size=4, enable_prefix_caching=True)
    made = built(engine)
    result = engine.run(requests)
    assert result.tokens == Engine(model, num_blocks=10, block_size=4).run(requests).tokens
    assert all_free(made)


def test_contiguous_mode_reserves_one_max_length_slot_per_sequence(model: TinyGPT) -> None:
    requests = [EngineRequest(i, [1, 2], 3) for i in range(3)]
    result = Engine(model, num_blocks=4, block_size=8, mode="contiguous", max_model_len=16).run(requests)
    assert result.peak_running == 2  # 32 slots hold two slots of 16
    assert set(result.reserved_tokens) <= {16, 32}
    assert all(r == 16 * n for r, n in zip(result.reserved_tokens, result.running, strict=True))
    assert result.preemptions == 0


def test_requests_arriving_later_wait_for_their_step(model: TinyGPT) -> None:
    requests = [EngineRequest("late", [3, 4], 2, arrival_step=5)]
    result = Engine(model, num_blocks=4, block_size=4).run(requests)
    assert result.admitted_step == {"late": 5}
    assert result.running[:5] == [0] * 5
    assert result.utilization[:5] == [0.0] * 5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 1}, "null block"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4, "mode": "ring"}, "mode"),
        ({"num_blocks": 4, "max_model_len": 0}, "max_model_len"),
        ({"num_blocks": 4, "max_model_len": 1000}, "max_model_len"),
        ({"num_blocks": 1, "block_size": 4, "mode": "contiguous", "max_model_len": 8}, "max_model_len"),
        ({"num_blocks": 4, "device": "meta"}, "device"),
        ({"num_blocks": 4, "max_num_seqs": 0}, "max_num_seqs"),
        ({"num_blocks": 4, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_blocks": 4, "attention_backend": "magic"}, "attention_backend"),
        (
            {"num_blocks": 4, "mode": "contiguous", "max_model_len": 64, "enable_prefix_caching": True},
            "prefix",
        ),
        ({"num_blocks": 4, "preemption": "drop"}, "preemption"),
        ({"num_blocks": 4, "preemption": None}, "preemption"),
        ({"num_blocks": 4, "watermark": -0.1}, "watermark"),
        ({"num_blocks": 4, "watermark": 1.0}, "watermark"),
        ({"num_blocks": 4, "watermark": float("nan")}, "watermark"),
        ({"num_blocks": 4, "watermark": True}, "watermark"),
        ({"num_blocks": 4, "watermark": "0.1"}, "watermark"),
        ({"num_blocks": 4, "mode": "contiguous", "max_model_len": 64, "preemption": "swap"}, "preemption"),
        ({"num_blocks": 4, "mode": "contiguous", "max_model_len": 64, "watermark": 0.1}, "watermark"),
    ],
)
def test_bad_engine_arguments_raise_value_error_naming_them(model: TinyGPT, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Engine(model, **kwargs)


def test_bad_requests_raise_value_error_naming_them(model: TinyGPT) -> None:
    with pytest.raises(ValueError, match="prompt"):
        EngineRequest("x", [], 3)
    with pytest.raises(ValueError, match="max_tokens"):
        EngineRequest("x", [1], 0)
    with pytest.raises(ValueError, match="arrival_step"):
        EngineRequest("x", [1], 1, arrival_step=-1)
    engine = Engine(model, num_blocks=5, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="request_id"):
        engine.run([EngineRequest("x", [1], 1), EngineRequest("x", [2], 1)])
    with pytest.raises(ValueError, match="prompt"):
        engine.run([EngineRequest("x", [300], 1)])
    with pytest.raises(ValueError, match="maximum model length of 16"):
        engine.run([EngineRequest("x", [1] * 16, 1)])
    with pytest.raises(ValueError, match="num_blocks 3 cannot hold request 'x' alone"):
        Engine(model, num_blocks=3, block_size=4).run([EngineRequest("x", [1] * 6, 8)])
    with pytest.raises(ValueError, match="EngineRequest"):
        engine.run([("x", [1], 1)])
    ok = EngineRequest("ok", [1], 1)
    with pytest.raises(ValueError, match="prompt_token_ids must hold token ids"):  # before anything runs
        engine.run([ok, EngineRequest("late", [999], 1, arrival_step=3)])


def test_a_request_that_would_pass_max_model_len_stops_there(model: TinyGPT) -> None:
    # vLLM caps max_tokens at max_model_len less the prompt: 10 + 7 passes 16, so it stops at 6.
    engine = Engine(model, num_blocks=5, block_size=4, max_model_len=16)
    request = EngineRequest("x", [1] * 10, 7)
    assert engine.run([request]).tokens["x"] == alone(model, request)[:6]


def test_plot_metrics_draws(model: TinyGPT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = Engine(model, num_blocks=8, block_size=4).run(random_requests(4, seed=2), progress=True)
    ax = plot_metrics(result)
    assert ax.get_xlabel() == "step"
    assert len(ax.get_lines()) == 2
    plt.close("all")


# ------------------------------------------------------------------ lesson 11: running out of blocks


def two_growing_requests() -> list[EngineRequest]:
    # Block size 2, 4 blocks and the null block: each ends holding 2 + 4 - 1 = 5 tokens (3 blocks);
    # together they outgrow 4.
    return [EngineRequest("a", [1, 2], 4), EngineRequest("b", [3, 4], 4)]


@pytest.mark.lesson11
def test_swap_brings_the_preempted_sequence_back_where_it_stopped(model: TinyGPT) -> None:
    requests = two_growing_requests()
    engine = Engine(model, num_blocks=5, block_size=2, preemption="swap")
    result = engine.run(requests)
    # Steps 0-2: both hold 2, 3, 4 tokens (4 blocks). Step 3: both need a block, none is free: b goes
    # out with its 4 tokens (2 blocks), a decodes its last token and leaves. Step 4: b comes back,
    # decodes its last token, done: it was admitted once and recomputed nothing.
    assert result.running == [2, 2, 2, 1, 1]
    assert result.swapped == [0, 0, 0, 1, 0]
    assert result.waiting == [0] * 5
    assert result.used_blocks == [2, 4, 4, 3, 3]
    assert result.admitted_step == {"a": 0, "b": 0}
    assert result.finished_step == {"a": 3, "b": 4}
    assert result.preemptions_by_reason == {"recompute": 0, "swap": 1}
    assert result.preemptions == 1
    assert (result.blocks_swapped_out, result.blocks_swapped_in, result.recomputed_tokens) == (2, 2, 0)
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}


@pytest.mark.lesson11
def test_recompute_frees_the_victim_and_resumes_it_by_prefill(model: TinyGPT) -> None:
    requests = two_growing_requests()
    result = Engine(model, num_blocks=5, block_size=2, preemption="recompute").run(requests)
    # The same step 3, but b's K/V is thrown away, not its 3 tokens: it is admitted again at step 4,
    # prefills its prompt and those tokens (5) and samples its last one, finishing at step 4, as swap
    # does, having computed the K/V of its 4 held tokens again.
    assert result.running == [2, 2, 2, 1, 1]
    assert result.waiting == [0, 0, 0, 1, 0]
    assert result.swapped == [0] * 5
    assert result.admitted_step == {"a": 0, "b": 4}
    assert result.finished_step == {"a": 3, "b": 4}
    assert result.preemptions_by_reason == {"recompute": 1, "swap": 0}
    assert (result.blocks_swapped_out, result.blocks_swapped_in, result.recomputed_tokens) == (0, 0, 4)
    assert result.scheduled_tokens[4] == (("b", 5),)
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}


@pytest.mark.lesson11
def test_swapped_sequences_come_back_before_new_requests_are_admitted(model: TinyGPT) -> None:
    # 6 blocks of 2 (and the null block). a (1 + 6 tokens) and b (3 + 6) run; c (1 + 1) arrives at step 4.
    # Step 4: a and b both need a block, none is free: b goes out with its 7 tokens (4 blocks), and
    # nobody is admitted in a step that preempts. Step 5: b (4 blocks and its next token) does not
    # fit beside a: it stays out, and so c, which would fit, is not admitted either. a finishes.
    # Step 6: b comes back, then c is admitted.
    requests = [
        EngineRequest("a", [1], 6),
        EngineRequest("b", [2, 2, 2], 6),
        EngineRequest("c", [3], 1, arrival_step=4),
    ]
    engine = Engine(model, num_blocks=7, block_size=2, preemption="swap")
    result = engine.run(requests)
    assert result.swapped == [0, 0, 0, 0, 1, 1, 0, 0]
    assert result.waiting == [0, 0, 0, 0, 1, 1, 0, 0]
    assert result.running == [2, 2, 2, 2, 1, 1, 2, 1]
    assert result.admitted_step == {"a": 0, "b": 0, "c": 6}
    assert result.finished_step == {"a": 5, "b": 7, "c": 6}
    check_invariants(engine, result, requests)
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}


@pytest.mark.lesson11
def test_swapped_sequences_come_back_oldest_first(model: TinyGPT) -> None:
    # 6 blocks of 2 (and the null block); a, b and c are admitted at step 0. Step 3: c, the newest, goes
    # out; step 5: b goes out too and a finishes. Step 6: both come back, b (the older) first, and finish.
    requests = [EngineRequest("a", [1], 6), EngineRequest("b", [2, 2], 6), EngineRequest("c", [3], 4)]
    engine = Engine(model, num_blocks=7, block_size=2, preemption="swap")
    made = built(engine)
    result = engine.run(requests)
    assert result.swapped == [0, 0, 0, 1, 1, 2, 0]
    assert result.running == [3, 3, 3, 2, 2, 1, 2]
    assert result.finished_step == {"a": 5, "b": 6, "c": 6}
    assert (result.preemptions, result.blocks_swapped_out, result.blocks_swapped_in) == (2, 5, 5)
    check_invariants(engine, result, requests)
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}
    assert all_free(made)


@pytest.mark.lesson11
@pytest.mark.parametrize(
    ("watermark", "kept_free", "admitted_at_once"), [(0.0, 0, 4), (0.2, 2, 3), (0.4, 4, 2)]
)
def test_the_watermark_keeps_blocks_free_at_admission(
    model: TinyGPT, watermark: float, kept_free: int, admitted_at_once: int
) -> None:
    # 9 blocks of 4, the null block among them; each prompt takes 2 blocks. The watermark keeps
    # ceil(watermark * 9) blocks. The first is admitted alone (no watermark alone); each next one
    # while others run needs its 2 blocks + the watermark free: of 6, 4 and 2 free, 4 fit with none
    # kept, 3 when 2 are kept, 2 when 4 are kept.
    requests = [EngineRequest(i, [i + 1] * 8, 1) for i in range(4)]
    engine = Engine(model, num_blocks=9, block_size=4, watermark=watermark)
    assert engine.watermark_blocks == kept_free
    result = engine.run(requests)
    assert result.running[0] == admitted_at_once
    assert sorted(result.admitted_step.values()).count(0) == admitted_at_once
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}


@pytest.mark.lesson11
def test_a_high_watermark_trades_concurrency_for_no_preemptions(model: TinyGPT) -> None:
    requests = [EngineRequest(i, [7 * i + 1, 2, 3], 10) for i in range(5)]
    low = Engine(model, num_blocks=6, block_size=4).run(requests)
    high = Engine(model, num_blocks=6, block_size=4, watermark=0.7).run(requests)  # keeps 5 of 6
    assert low.preemptions > 0 and high.preemptions == 0
    assert high.peak_running == 1 < low.peak_running
    assert high.tokens == low.tokens


@pytest.mark.lesson11
@pytest.mark.parametrize(
    ("watermark", "num_blocks", "expected"),
    [(0.0, 8, 0), (0.1, 8, 1), (0.25, 8, 2), (0.3, 10, 3), (0.99, 5, 5)],
)
def test_watermark_blocks_rounds_up(model: TinyGPT, watermark: float, num_blocks: int, expected: int) -> None:
    assert Engine(model, num_blocks=num_blocks, watermark=watermark).watermark_blocks == expected


@pytest.mark.lesson11
def test_a_request_alone_needs_no_watermark(model: TinyGPT) -> None:
    request = EngineRequest("x", [1] * 12, 1)  # 3 blocks of 4: all of the pool but its null block
    result = Engine(model, num_blocks=4, block_size=4, watermark=0.5).run([request])
    assert result.tokens["x"] == alone(model, request)


@st.composite
def workloads(draw) -> list[EngineRequest]:
    n = draw(st.integers(2, 7))  # several at once, so that tight budgets preempt
    return [
        EngineRequest(
            i,
            draw(st.lists(st.integers(0, 255), min_size=1, max_size=8)),
            draw(st.integers(1, 12)),
            arrival_step=draw(st.integers(0, 2)),
        )
        for i in range(n)
    ]


# Each example runs the model through the engine, and its cost is the model's: 125 examples per
# preemption under ci, 25 in the dev profile. The scheduling space is also covered step by step
# without a model (tests/test_scheduler.py and tests/test_chunked_prefill.py's state machines), and
# the cache's by tests/test_stateful.py.
@pytest.mark.lesson11
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@settings(max_examples=max_examples(25))
@given(
    requests=workloads(),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 4),
    watermark=st.sampled_from([0.0, 0.2, 0.5]),
    budget=st.sampled_from([None, 3, 16]),
)
def test_any_workload_on_any_budget_gets_the_text_of_each_prompt_alone(
    model: TinyGPT, requests, block_size: int, extra_blocks: int, preemption: str, watermark: float, budget
) -> None:
    smallest = min_num_blocks(requests, block_size)
    num_blocks = smallest + extra_blocks
    engine = Engine(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        preemption=preemption,
        watermark=watermark,
        max_num_batched_tokens=budget,
    )
    made = built(engine)
    result = engine.run(requests)  # ends: no deadlock, no livelock
    event(f"{preemption}: {'preempted' if result.preemptions else 'no preemption'}")
    target(float(result.preemptions), label="preemptions")  # steer towards tight, busy runs
    check_invariants(engine, result, requests)
    for request in requests:
        assert result.tokens[request.request_id] == alone(model, request), request.request_id
    assert all_free(made)
    if budget is not None:
        assert max(result.tokens_per_step) <= budget
    if smallest > 1:  # one block fewer is refused up front
        with pytest.raises(ValueError, match="num_blocks"):
            Engine(model, num_blocks=smallest - 1, block_size=block_size, watermark=watermark).run(requests)


@pytest.mark.lesson11
def test_a_request_resumed_alone_comes_back_though_its_prompt_and_the_watermark_exceed_the_pool(
    model,
) -> None:
    # Request 2 is preempted after generating most of its 11 tokens; once the others finish it runs
    # alone, and its prompt (1 token and the 9 or so it generated) and a watermark of ceil(0.5 * 11)
    # = 6 blocks exceed the 11 blocks. Alone the watermark does not count: it comes back.
    requests = [EngineRequest(0, [0], 1), EngineRequest(1, [0], 10), EngineRequest(2, [0], 11)]
    requests += [EngineRequest(i, [0], 1) for i in range(3, 7)]
    num_blocks = min_num_blocks(requests, block_size=1)
    result = Engine(model, num_blocks=num_blocks, block_size=1, watermark=0.5).run(requests)
    assert result.preemptions >= 1
    assert all(result.tokens[r.request_id] == alone(model, r) for r in requests)


@pytest.mark.lesson11
def test_min_num_blocks_counts_the_peak() -> None:
    request = EngineRequest("x", [1, 2, 3], 10)  # at its longest 12 tokens: 3 blocks of 4, and the null block
    assert min_num_blocks([request], block_size=4) == 4
    assert min_num_blocks([request], block_size=16) == 2
    long_prompt = EngineRequest("y", [1] * 17, 1)  # 17 tokens: 5 blocks of 4
    assert min_num_blocks([request, long_prompt], block_size=4) == 6
    with pytest.raises(ValueError, match="requests"):
        min_num_blocks([], block_size=4)
    with pytest.raises(ValueError, match="requests"):
        min_num_blocks([("x", [1], 1)], block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        min_num_blocks([request], block_size=0)


@pytest.mark.lesson11
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_sweep_budgets_gives_one_row_per_budget_as_the_engine_measures_it(
    model: TinyGPT, preemption: str
) -> None:
    requests = [EngineRequest(i, [7 * i + 1, 2, 3], 10) for i in range(5)]
    budgets = [min_num_blocks(requests, 4), 6, 9, 20]
    rows = sweep_budgets(model, requests, budgets, block_size=4, preemption=preemption, progress=True)
    assert [row["num_blocks"] for row in rows] == budgets
    for row, num_blocks in zip(rows, budgets, strict=True):
        result = Engine(model, num_blocks=num_blocks, block_size=4, preemption=preemption).run(requests)
        assert row == {
            "num_blocks": num_blocks,
            "budget_tokens": num_blocks * 4,
            "steps": result.steps,
            "preemptions": result.preemptions,
            "recomputed_tokens": result.recomputed_tokens,
            "blocks_swapped_out": result.blocks_swapped_out,
            "peak_running": result.peak_running,
            "mean_running": result.mean_running,
            "mean_utilization": result.mean_utilization,
        }
    # 3 blocks: three prompts fit at once (no headroom is kept), and they outgrow the pool.
    assert rows[0]["preemptions"] > 0 and rows[0]["peak_running"] == 3
    assert rows[1]["preemptions"] > 0  # 6 blocks: all five admitted, and they outgrow the budget
    assert rows[-1]["preemptions"] == 0  # 20 blocks hold all five at their longest (15)
    assert rows[0]["steps"] > rows[1]["steps"] > rows[-1]["steps"]


@pytest.mark.lesson11
def test_sweep_budgets_refuses_bad_arguments(model: TinyGPT) -> None:
    requests = [EngineRequest("x", [1, 2, 3], 10)]
    with pytest.raises(ValueError, match="num_blocks_list"):
        sweep_budgets(model, requests, 8)
    with pytest.raises(ValueError, match="num_blocks"):
        sweep_budgets(model, requests, [8, 0])
    with pytest.raises(ValueError, match="num_blocks 2 cannot hold"):
        sweep_budgets(model, requests, [8, 2], block_size=4)
    with pytest.raises(ValueError, match="preemption"):
        sweep_budgets(model, requests, [8], preemption="drop")


@pytest.mark.lesson11
def test_plot_metrics_shows_the_swapped_sequences_when_there_are_some(model: TinyGPT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = Engine(model, num_blocks=4, block_size=2, preemption="swap").run(two_growing_requests())
    ax = plot_metrics(result)
    assert [line.get_label() for line in ax.get_lines()] == ["running", "waiting", "swapped"]
    assert "1 preemptions (1 by swap)" in ax.get_title()
    plt.close("all")


def test_watermark_blocks_is_public_rounds_up_and_checks_its_arguments() -> None:
    assert [watermark_blocks(w, 22) for w in (0.0, 0.01, 0.1, 0.5)] == [0, 1, 3, 11]
    with pytest.raises(ValueError, match="watermark"):
        watermark_blocks(1.0, 22)
    with pytest.raises(ValueError, match="num_blocks"):
        watermark_blocks(0.1, 0)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_every_attention_backend_serves_the_same_tokens_in_one_forward_per_step(
    model: TinyGPT, backend: str
) -> None:
    # Steps that mix prefill chunks and decodes, in a pool that preempts: the same tokens whatever
    # reads the blocks (TRITON_ATTN runs in triton's interpreter on the CPU; FLEX_ATTENTION unfused).
    if backend == "TRITON_ATTN":
        pytest.importorskip("triton")
    elif why := BACKENDS[backend].unavailable(torch.device("cpu"), torch.float32, torch.float32):
        pytest.skip(why)
    requests = random_requests(5, seed=4, max_prompt=10, max_new=6, spread=3)
    settings = {"num_blocks": 5, "block_size": 4, "max_num_batched_tokens": 6}
    result = Engine(model, attention_backend=backend, **settings).run(requests)
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}
    assert result.preemptions > 0 and max(result.tokens_per_step) <= 6

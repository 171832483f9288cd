"""The continuous-batching engine: same text as generating alone, paged beats contiguous, metrics."""

from __future__ import annotations

import random

import pytest
import torch

from paged_kv.engine import Engine, EngineRequest, EngineResult, plot_metrics
from paged_kv.model import GPTConfig, PagedKVCache, TinyGPT, generate

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


def alone(model: TinyGPT, request: EngineRequest) -> list[int]:
    return generate(model, [request.prompt], request.max_new_tokens, cache="contiguous").tokens[0]


def check_invariants(engine: Engine, result: EngineResult, requests: list[EngineRequest]) -> None:
    assert list(result.tokens) == [r.request_id for r in requests]
    assert set(result.finished_step) == {r.request_id for r in requests}
    for series in (result.waiting, result.used_blocks, result.held_tokens, result.reserved_tokens):
        assert len(series) == result.steps
    assert all(0.0 <= u <= 1.0 for u in result.utilisation)
    assert all(
        h <= r <= engine.budget_tokens
        for h, r in zip(result.held_tokens, result.reserved_tokens, strict=True)
    )
    assert all(u <= engine.num_blocks for u in result.used_blocks)
    assert result.peak_running == max(result.running)
    assert result.mean_running == pytest.approx(sum(result.running) / result.steps)


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


def test_preemption_by_recompute_keeps_the_text(model: TinyGPT) -> None:
    # Each sequence ends at 3 + 10 - 1 = 12 tokens, 3 blocks: three admitted at once outgrow 6 blocks.
    requests = [EngineRequest(i, [7 * i + 1, 2, 3], 10) for i in range(5)]
    engine = Engine(model, num_blocks=6, block_size=4)
    result = engine.run(requests)
    assert result.preemptions > 0
    check_invariants(engine, result, requests)
    for request in requests:
        assert result.tokens[request.request_id] == alone(model, request)


def test_paged_runs_more_sequences_than_contiguous_on_the_same_budget(model: TinyGPT) -> None:
    requests = random_requests(12, seed=5, max_prompt=6, max_new=6, spread=1)
    kwargs = {"num_blocks": 32, "block_size": 8, "max_model_len": 128}  # 256 slots: two contiguous slots
    paged = Engine(model, mode="paged", **kwargs).run(requests)
    contiguous = Engine(model, mode="contiguous", **kwargs).run(requests)
    assert contiguous.peak_running == 2
    assert paged.peak_running > 2 * contiguous.peak_running
    assert paged.steps < contiguous.steps
    assert paged.mean_utilisation > contiguous.mean_utilisation
    assert paged.tokens == contiguous.tokens


def test_a_finished_sequence_frees_its_blocks_and_the_next_request_is_admitted_at_the_next_step(
    model: TinyGPT,
) -> None:
    # A's prompt is 1 block, plus 1 block of headroom; B then needs 1 + 2 blocks but only 2 are free.
    a = EngineRequest("a", [1, 2, 3, 4], max_new_tokens=3)  # ends holding 4 + 3 - 1 = 6 tokens: 2 blocks
    b = EngineRequest("b", [5, 6], max_new_tokens=2, arrival_step=1)
    engine = Engine(model, num_blocks=3, block_size=4)
    result = engine.run([a, b])
    # A prefills at step 0 (token 1) and decodes at steps 1 and 2, then frees; B comes in at step 3.
    assert result.admitted_step == {"a": 0, "b": 3}
    assert result.finished_step == {"a": 2, "b": 4}
    assert result.running == [1, 1, 1, 1, 1]
    assert result.waiting == [0, 1, 1, 0, 0]
    assert result.used_blocks == [1, 2, 2, 1, 1]  # at step 3 only B's prompt block is in use
    assert result.held_tokens == [4, 5, 6, 2, 3]
    assert result.utilisation == [1.0, 5 / 8, 6 / 8, 2 / 4, 3 / 4]
    assert result.tokens == {"a": alone(model, a), "b": alone(model, b)}


def test_all_memory_is_free_after_a_run_with_a_plugged_in_cache(model: TinyGPT) -> None:
    caches: list[PagedKVCache] = []

    def spy(*args) -> PagedKVCache:
        caches.append(PagedKVCache(*args))
        return caches[-1]

    requests = random_requests(6, seed=9)
    engine = Engine(model, num_blocks=10, block_size=4, cache_factory=spy)
    result = engine.run(requests)
    (cache,) = caches
    assert result.tokens == Engine(model, num_blocks=10, block_size=4).run(requests).tokens
    for allocator in cache.allocators:
        assert allocator.num_free_blocks == engine.num_blocks
        assert allocator.seq_ids == ()


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
    assert result.utilisation[:5] == [0.0] * 5


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4, "mode": "ring"}, "mode"),
        ({"num_blocks": 4, "max_model_len": 0}, "max_model_len"),
        ({"num_blocks": 4, "max_model_len": 1000}, "max_model_len"),
        ({"num_blocks": 1, "block_size": 4, "mode": "contiguous", "max_model_len": 8}, "max_model_len"),
        ({"num_blocks": 4, "device": "meta"}, "device"),
        ({"num_blocks": 4, "cache_factory": 3}, "cache_factory"),
        ({"num_blocks": 4, "mode": "contiguous", "cache_factory": PagedKVCache}, "cache_factory"),
    ],
)
def test_bad_engine_arguments_raise_value_error_naming_them(model: TinyGPT, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Engine(model, **kwargs)


def test_bad_requests_raise_value_error_naming_them(model: TinyGPT) -> None:
    with pytest.raises(ValueError, match="prompt"):
        EngineRequest("x", [], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        EngineRequest("x", [1], 0)
    with pytest.raises(ValueError, match="arrival_step"):
        EngineRequest("x", [1], 1, arrival_step=-1)
    engine = Engine(model, num_blocks=4, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="request_id"):
        engine.run([EngineRequest("x", [1], 1), EngineRequest("x", [2], 1)])
    with pytest.raises(ValueError, match="prompt"):
        engine.run([EngineRequest("x", [300], 1)])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.run([EngineRequest("x", [1] * 10, 7)])
    with pytest.raises(ValueError, match="num_blocks"):
        Engine(model, num_blocks=2, block_size=4).run([EngineRequest("x", [1] * 6, 8)])
    with pytest.raises(ValueError, match="EngineRequest"):
        engine.run([("x", [1], 1)])


def test_plot_metrics_draws(model: TinyGPT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = Engine(model, num_blocks=8, block_size=4).run(random_requests(4, seed=2), progress=True)
    ax = plot_metrics(result)
    assert ax.get_xlabel() == "step"
    assert len(ax.get_lines()) == 2
    plt.close("all")

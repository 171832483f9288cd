"""The KV connector and the host tier in the engine (``kv_offloading_size``, vLLM's native offloading).

A block evicted from the device pool is still in the host tier: a returning prompt loads it from
there (fewer prefill tokens, counted as external hits) instead of computing it again, and the
tokens never change, under eviction, either preemption and a token budget, and when a load fails
(its tokens recomputed). The tier's stores and evictions are KV-cache events with medium ``"CPU"``.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paged_kv.cli import build_parser
from paged_kv.distributed.kv_events import BlockRemoved, BlockStored
from paged_kv.kv_offload.base import TransferResult
from paged_kv.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.async_llm import AsyncLLM
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.sampling_params import SamplingParams

from . import helpers
from .helpers import alone, built, max_examples, run_async
from .test_server import MAX_MODEL_LEN, MODEL, GatedGPT, Served

pytestmark = pytest.mark.lesson11

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128)
BLOCK_SIZE = 4
TIER = 0.001  # GiB: a few hundred host blocks, far more than the device's 12


@pytest.fixture
def model(device: torch.device) -> TinyGPT:
    return TinyGPT(CONFIG, seed=1).to(device)


def chats(num_turns: int = 3, num_users: int = 5, seed: int = 0) -> list[EngineRequest]:
    """Users who come back: each turn's prompt is the user's previous prompt plus a few new tokens,
    so the working set (every user's prefix) is larger than the device pool."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(60) for _ in range(rng.randrange(9, 18))] for _ in range(num_users)]
    requests = []
    for turn in range(num_turns):
        for user, prompt in enumerate(prompts):
            prompt.extend(rng.randrange(60) for _ in range(3))
            step = (turn * num_users + user) * 3
            requests.append(EngineRequest(f"u{user}t{turn}", list(prompt), 4, arrival_step=step))
    return requests


def served(model: TinyGPT, requests: list[EngineRequest], **settings):
    """The run's result and its engine core."""
    engine = Engine(model, block_size=BLOCK_SIZE, enable_prefix_caching=True, **settings)
    made = built(engine)
    result = engine.run(requests)
    return result, made[0].engine_core


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [None, 6])
def test_the_same_tokens_with_and_without_the_tier(model, preemption, budget):
    requests = chats()
    settings = {"num_blocks": 12, "preemption": preemption, "max_num_batched_tokens": budget}
    without, _ = served(model, requests, **settings)
    with_tier, core = served(model, requests, kv_offloading_size=TIER, **settings)
    assert with_tier.tokens == without.tokens
    preempted = sum(without.preemptions_by_reason.values()) + sum(with_tier.preemptions_by_reason.values())
    assert preempted, "the pool is too large to preempt"
    assert core.scheduler.connector.stats.hits > 0


def test_a_returning_prompt_evicted_from_the_device_hits_in_the_tier(model):
    requests = chats()
    without, _ = served(model, requests, num_blocks=12)
    with_tier, core = served(model, requests, num_blocks=12, kv_offloading_size=TIER)
    stats = core.scheduler.connector.stats
    assert with_tier.tokens == without.tokens
    assert stats.hits >= BLOCK_SIZE and stats.num_loads > 0 and stats.num_failed_loads == 0
    assert stats.requests == len(requests)
    assert with_tier.prefill_tokens_computed < without.prefill_tokens_computed
    # every hit token is one the device did not compute
    assert without.prefill_tokens_computed - with_tier.prefill_tokens_computed <= stats.hits
    assert not core.scheduler.waiting_for_remote_kvs and not core.memory.request_ids
    external = with_tier.metrics().external_prefix_cache_stats  # vLLM's external counters
    assert (external.queries, external.hits) == (stats.queries, stats.hits)
    assert without.metrics().external_prefix_cache_stats.queries == 0
    text = with_tier.metrics().prometheus_text()
    labels = '{engine="0",model_name="paged_kv"}'
    assert f"vllm:external_prefix_cache_hits_total{labels} {float(stats.hits)}" in text


def test_a_failed_load_is_recomputed_with_the_same_tokens(model, monkeypatch):
    requests = chats()
    without, _ = served(model, requests, num_blocks=12)
    monkeypatch.setattr(CPUOffloadingWorker, "submit_load", _failing_load)
    failed, core = served(model, requests, num_blocks=12, kv_offloading_size=TIER)
    stats = core.scheduler.connector.stats
    assert failed.tokens == without.tokens
    assert stats.num_failed_loads == stats.num_loads > 0
    assert stats.requests == len(requests)  # a retry after a failed load is not counted again
    assert failed.prefill_tokens_computed == without.prefill_tokens_computed


@settings(
    max_examples=max_examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10**6),
    num_blocks=st.integers(10, 16),
    preemption=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    budget=st.sampled_from([None, 5, 9]),
    fail_loads=st.booleans(),
)
# Loaded requests holding blocks none of them could run on, with nothing running: a deadlock once.
@example(seed=55585, num_blocks=10, preemption="recompute", policy="fcfs", budget=None, fail_loads=False)
def test_any_workload_gives_each_request_its_tokens_alone(
    model, monkeypatch, seed, num_blocks, preemption, policy, budget, fail_loads
):
    """Under any pool, preemption, policy and budget, with loads that succeed or all fail, every
    request gets the tokens of its prompt generated alone, and the run leaves nothing held."""
    rng = random.Random(seed)
    requests = [
        EngineRequest(
            r.request_id,
            r.prompt,
            r.max_tokens,
            rng.randrange(20),
            priority=rng.randrange(3) if policy == "priority" else 0,
        )
        for r in chats(num_turns=2, num_users=4, seed=seed)
    ]
    with monkeypatch.context() as patch:
        if fail_loads:
            patch.setattr(CPUOffloadingWorker, "submit_load", _failing_load)
        result, core = served(
            model,
            requests,
            num_blocks=num_blocks,
            kv_offloading_size=TIER,
            preemption=preemption,
            scheduling_policy=policy,
            max_num_batched_tokens=budget,
        )
    for request in requests:
        assert result.tokens[request.request_id] == alone(model, request), request.request_id
    stats = core.scheduler.connector.stats
    assert stats.num_failed_loads == (stats.num_loads if fail_loads else 0)
    assert not core.memory.request_ids and core.memory.num_free_blocks == core.memory.num_blocks - 1


def _failing_load(self, job_id, src_spec, dst_spec):
    """A load that copies nothing and reports its failure (vLLM's ``TransferResult(success=False)``)."""
    self._finished.append(TransferResult(job_id, False))
    return True


def test_off_by_default_nothing_changes(model):
    engine = Engine(model, num_blocks=12, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    made = built(engine)
    engine.run(chats(num_turns=1))
    core = made[0].engine_core
    assert core.scheduler.connector is None and core.model_runner.kv_connector is None
    assert core.offloading_spec is None


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        ({"kv_offloading_size": -1}, "kv_offloading_size"),
        ({"kv_offloading_size": 0}, "kv_offloading_size"),
        ({"kv_offloading_size": "2"}, "kv_offloading_size"),
        ({"kv_offloading_size": float("nan")}, "kv_offloading_size"),
        ({"kv_offloading_size": 1e-9}, "kv_offloading_size"),
        ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"}, "kv_offloading_backend"),
        ({"kv_offloading_size": 1, "mode": "contiguous", "max_model_len": 32}, "kv_offloading_size"),
    ],
)
def test_bad_config_is_a_value_error_naming_it(settings, name):
    model = TinyGPT(CONFIG, seed=1)
    with pytest.raises(ValueError, match=name):
        Engine(model, num_blocks=12, block_size=BLOCK_SIZE, **settings)


def test_a_sliding_window_model_has_no_tier():
    config = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128, sliding_windows=(8, None))
    model = TinyGPT(config, seed=1)
    with pytest.raises(ValueError, match="kv_offloading_size needs a model of one full-attention"):
        Engine(model, num_blocks=12, block_size=BLOCK_SIZE, kv_offloading_size=TIER)


def test_serve_takes_the_offloading_flags(capsys):
    args = build_parser().parse_args(["serve", "--kv-offloading-size", "0.5"])
    assert args.kv_offloading_size == 0.5 and args.kv_offloading_backend == "native"
    assert build_parser().parse_args(["serve"]).kv_offloading_size is None
    for bad in (
        ["--kv-offloading-size", "-1"],
        ["--kv-offloading-size", "lots"],
        ["--kv-offloading-backend", "x"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
        assert "kv-offloading" in capsys.readouterr().err


def test_the_tiers_events_carry_medium_cpu_and_a_reset_empties_it(model):
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    llm = LLMEngine.from_engine_args(
        model,
        helpers.engine_args(
            12,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            kv_events_config=events,
            kv_offloading_size=TIER,
        ),
    )
    batches = []
    llm.engine_core.scheduler.kv_event_publisher.publish = batches.append
    params = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        for request in chats(num_turns=2):
            llm.add_request(request.request_id, request.prompt, params)
            while llm.has_unfinished_requests():
                llm.step()
        published = [event for batch in batches for event in batch.events]
        cpu = [e for e in published if isinstance(e, BlockStored) and e.medium == "CPU"]
        gpu = [e for e in published if isinstance(e, BlockStored) and e.medium == "GPU"]
        assert cpu and gpu
        assert {h for e in cpu for h in e.block_hashes} <= {h for e in gpu for h in e.block_hashes}
        assert all(e.medium == "GPU" for e in published if isinstance(e, BlockRemoved))  # the tier is large
        manager = llm.engine_core.scheduler.connector.manager
        assert len(manager) == len({h for e in cpu for h in e.block_hashes})
        assert llm.reset_prefix_cache(reset_connector=False) and len(manager)
        assert llm.reset_prefix_cache(reset_connector=True) and not len(manager)
    finally:
        llm.shutdown()


def test_the_log_line_shows_the_external_hit_rate_with_the_tier_only(model, caplog):
    requests = chats(num_turns=2)
    with caplog.at_level("INFO", logger="paged_kv.engine"):
        served(model, requests, num_blocks=12, log_stats_interval=1000)
        plain = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
        caplog.clear()
        _, core = served(model, requests, num_blocks=12, kv_offloading_size=TIER, log_stats_interval=1000)
        tiered = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert plain and not any("External" in line for line in plain)
    stats = core.scheduler.connector.stats
    rate = f"External prefix cache hit rate: {100 * stats.hits / stats.queries:.1f}%"
    assert tiered and tiered[-1].endswith(rate), tiered


def test_a_request_aborted_with_its_external_tokens_loaded_gives_its_blocks_back(model):
    llm = LLMEngine.from_engine_args(
        model,
        helpers.engine_args(12, block_size=BLOCK_SIZE, enable_prefix_caching=True, kv_offloading_size=TIER),
    )
    params = SamplingParams(temperature=0.0, max_tokens=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(60) for _ in range(16)] for _ in range(4)]
    try:
        for index, prompt in enumerate(prompts):  # the last three evict the first from the device
            llm.add_request(f"p{index}", prompt, params)
            while llm.has_unfinished_requests():
                llm.step()
        scheduler = llm.engine_core.scheduler
        llm.add_request("again", prompts[0] + [1, 2], params)
        llm.step()  # admitted: its blocks allocated, its tokens loaded from the tier
        assert "again" in scheduler._loaded and llm.engine_core.memory.request_ids == ("again",)
        llm.abort_request(["again"])
        assert not llm.engine_core.memory.request_ids and not scheduler._loaded
        assert "again" not in scheduler.connector._reqs and not scheduler.has_unfinished_requests
    finally:
        llm.shutdown()


def test_the_served_engine_reports_the_tiers_hits_as_cached_tokens(model):
    """Through AsyncLLM (what ``paged-kv serve --kv-offloading-size`` runs): a returning prompt the
    device evicted is served from the tier, with the same tokens, its hit in ``num_cached_tokens``."""
    rng = random.Random(5)
    prompts = [[rng.randrange(60) for _ in range(16)] for _ in range(4)]
    returning = [*prompts[0], 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=3)

    async def main():
        llm = AsyncLLM.from_engine_args(
            model,
            helpers.engine_args(
                12, block_size=BLOCK_SIZE, enable_prefix_caching=True, kv_offloading_size=TIER
            ),
        )
        try:
            for prompt in prompts:
                [out async for out in llm.generate(prompt, params)]
            return [out async for out in llm.generate(returning, params)][-1], llm
        finally:
            await llm.shutdown()

    final, llm = run_async(main())
    assert final.outputs[0].token_ids == alone(model, EngineRequest("x", returning, 3))
    assert final.num_cached_tokens == 16  # four blocks: the device had none of them, the tier all
    assert llm.llm_engine.engine_core.scheduler.connector.stats.num_loads == 1


def test_the_server_serves_a_returning_prompt_from_the_tier_to_the_openai_client():
    served = Served(GatedGPT(), num_blocks=8, max_model_len=MAX_MODEL_LEN, kv_offloading_size=TIER)
    try:
        prompt = "The host tier keeps the blocks the device evicts. " * 2  # 5 full blocks of 16 bytes

        def complete(text: str) -> str:
            answer = served.client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0)
            return answer.choices[0].text

        first = complete(prompt)
        for other in (
            "Another prompt takes the pool's blocks for itself. " * 2,
            "And a third evicts the rest. " * 3,
        ):
            complete(other)  # 7 blocks to give out: the first prompt's are evicted from the device
        assert complete(prompt) == first
        samples = served.metrics()
        assert samples["vllm:external_prefix_cache_hits_total{}"] >= 16  # at least a block from the tier
        assert (
            samples["vllm:external_prefix_cache_queries_total{}"]
            >= samples["vllm:external_prefix_cache_hits_total{}"]
        )
    finally:
        served.stop()

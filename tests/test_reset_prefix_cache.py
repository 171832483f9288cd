"""The prefix cache's reset, as vLLM 0.33.0's ``reset_prefix_cache`` (issue 33, item 5).

vLLM's rules: the reset forgets every hash only when no request holds a block, and answers
``False`` otherwise, changing nothing; with ``reset_running_requests=True`` every running request
is preempted first (by recompute) and the reset succeeds, the requests then finishing with the
same tokens. The engine, ``AsyncLLM`` and the server's development endpoint (``POST
/reset_prefix_cache``, there only with ``VLLM_SERVER_DEV_MODE=1``) all follow them, and a
subscriber to the KV-cache events reads ``AllBlocksCleared`` after every reset that succeeded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode
from paged_kv.serving.engine import EngineRequest
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.metrics import ENGINE_LOGGER
from paged_kv.serving.sampling_params import SamplingParams

from . import helpers
from .test_kv_events import EVENTS, AllBlocksCleared, BlockStored, Subscriber, pool_index, publisher_threads

pytestmark = pytest.mark.lesson16

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)
PROMPTS = [list(range(10, 19)), [*range(10, 17), 40, 41], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=1)


def online(model, *, events: bool = False, num_blocks: int = 24, **kwargs) -> LLMEngine:
    """An online engine of blocks of 4 tokens, prefix caching on (and its events, with ``events``)."""
    args = {"block_size": 4, "enable_prefix_caching": True, **kwargs}
    if events:
        args["kv_events_config"] = EVENTS
    return LLMEngine.from_engine_args(model, helpers.engine_args(num_blocks, **args))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def alone(model, prompt: list[int], max_tokens: int) -> list[int]:
    return helpers.alone(model, EngineRequest("x", prompt, max_tokens))


def finish(llm: LLMEngine) -> dict[str, list[int]]:
    tokens = {}
    while llm.has_unfinished_requests():
        tokens |= {o.request_id: list(o.outputs[0].token_ids) for o in llm.step() if o.finished}
    return tokens


def test_reset_is_refused_while_a_request_holds_blocks_and_changes_nothing(model, caplog):
    caplog.set_level(logging.INFO, logger=ENGINE_LOGGER)
    llm = online(model, events=True)
    subscriber = Subscriber(llm.engine_core.scheduler.kv_event_publisher)
    try:
        llm.add_request("a", PROMPTS[0], greedy(8))
        llm.step()
        llm.step()
        subscriber.events()
        held, stats = pool_index(llm), llm.engine_core.memory.prefix_cache_stats
        assert held and llm.reset_prefix_cache() is False
        assert pool_index(llm) == held and llm.engine_core.memory.prefix_cache_stats == stats
        assert subscriber.events() == []  # nothing cleared, nothing published
        assert "Failed to reset prefix cache because some blocks (3) are not freed yet" in caplog.text
        assert finish(llm)["a"] == alone(model, PROMPTS[0], 8)
        subscriber.events()
        counted = llm.engine_core.memory.prefix_cache_stats
        assert llm.reset_prefix_cache() is True  # nothing runs: the reset goes through
        assert pool_index(llm) == set() and len(llm.engine_core.memory.block_pool.prefix_cache) == 0
        assert llm.engine_core.memory.prefix_cache_stats == counted  # counters never go back (vLLM's)
        assert "Successfully reset prefix cache" in caplog.text
        assert subscriber.events() == [AllBlocksCleared()]
        llm.add_request("b", PROMPTS[0], greedy(2))
        llm.step()
        assert llm.last_step[0].scheduled_new_reqs[0].num_computed_tokens == 0  # no hit after the reset
        step_stats = llm.last_stats.prefix_cache_stats
        assert (step_stats.requests, step_stats.queries, step_stats.hits) == (1, len(PROMPTS[0]), 0)
        assert [type(e) for e in subscriber.events()] == [BlockStored]
    finally:
        llm.shutdown()
        subscriber.close()
    assert publisher_threads() == []


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("reset_connector", [False, True])
def test_reset_running_requests_preempts_them_and_they_finish_with_the_same_tokens(
    model, preemption, reset_connector
):
    llm = online(model, preemption=preemption)
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(f"r{i}", prompt, greedy(10))
    for _ in range(3):
        llm.step()
    running = [r.request_id for r in llm.engine_core.scheduler.running]
    assert len(running) == 3
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=reset_connector) is True
    scheduler = llm.engine_core.scheduler
    assert scheduler.running == [] and [r.request_id for r in scheduler.waiting] == running  # oldest first
    assert len(llm.engine_core.memory.block_pool.prefix_cache) == 0
    assert llm.engine_core.memory.num_free_blocks == llm.engine_core.memory.block_pool.num_usable_blocks
    llm.step()
    preemptions = llm.last_step[0].preemptions
    assert [p.request_id for p in preemptions] == running[::-1]  # newest first, as they were popped
    assert {p.way for p in preemptions} == {"recompute"}  # vLLM's _preempt_request, whatever the mode
    assert llm.num_preemptions == 3
    tokens = finish(llm)
    assert tokens == {f"r{i}": alone(model, prompt, 10) for i, prompt in enumerate(PROMPTS)}


def test_reset_is_refused_in_the_middle_of_a_step(model):
    llm = online(model)
    llm.add_request("a", PROMPTS[0], greedy(4))
    scheduler = llm.engine_core.scheduler
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="reset the prefix cache between steps"):
        scheduler.reset_prefix_cache(reset_running_requests=True)
    assert [r.request_id for r in scheduler.running] == ["a"]


@settings(max_examples=helpers.max_examples(10), deadline=None)
@given(
    reset_at=st.integers(min_value=0, max_value=12),
    num_blocks=st.sampled_from([8, 24]),
    budget=st.sampled_from([None, 5]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_a_reset_at_any_step_leaves_every_request_its_tokens(model, reset_at, num_blocks, budget, policy):
    """A reset of running requests at any step, under preemptions (8 blocks), a token budget or the
    priority policy: every request still gets the tokens of its prompt alone."""
    llm = online(model, num_blocks=num_blocks, max_num_batched_tokens=budget, scheduling_policy=policy)
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(f"r{i}", prompt, greedy(8), priority=i % 2 if policy == "priority" else 0)
    tokens = {}
    for _ in range(reset_at):
        tokens |= {o.request_id: list(o.outputs[0].token_ids) for o in llm.step() if o.finished}
    assert llm.reset_prefix_cache(reset_running_requests=True)
    tokens |= finish(llm)
    assert tokens == {f"r{i}": alone(model, prompt, 8) for i, prompt in enumerate(PROMPTS)}


# ------------------------------------------------------------------------------ AsyncLLM


def test_async_llm_resets_between_steps_and_its_clients_get_their_tokens(model):
    from paged_kv.serving.async_llm import AsyncLLM

    async def scenario():
        llm = AsyncLLM(online(model))
        first_outputs = asyncio.Event()

        async def client(i: int) -> list[int]:
            last = None
            async for out in llm.generate(PROMPTS[i], greedy(30), request_id=f"c{i}"):
                first_outputs.set()
                last = out
            return list(last.outputs[0].token_ids)

        try:
            clients = [asyncio.ensure_future(client(i)) for i in range(2)]
            await asyncio.wait_for(first_outputs.wait(), 10)
            refused = await llm.reset_prefix_cache()
            reset = await llm.reset_prefix_cache(reset_running_requests=True)
            return refused, reset, await asyncio.gather(*clients)
        finally:
            await llm.shutdown()

    refused, reset, tokens = helpers.run_async(scenario())
    assert (refused, reset) == (False, True)
    assert tokens == [alone(model, PROMPTS[i], 30) for i in range(2)]


# ------------------------------------------------------------------------------ the endpoint

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from paged_kv.entrypoints.openai.api_server import DEV_MODE_VARIABLE, ServerThread, build_app  # noqa: E402
from paged_kv.serving.async_llm import AsyncLLM  # noqa: E402

STEP_S = 0.01  # each forward of the served model sleeps this long: a request runs for a while


class SlowGPT(TinyGPT):
    """The course's TinyGPT (byte tokens) with a forward that takes :data:`STEP_S` longer."""

    def forward_step(self, *args, **kwargs):
        time.sleep(STEP_S)
        return super().forward_step(*args, **kwargs)


@pytest.fixture(scope="module")
def slow_model() -> SlowGPT:
    return SlowGPT()


def serve_app(model, dev_mode: str | None, monkeypatch, **engine_args):
    if dev_mode is None:
        monkeypatch.delenv(DEV_MODE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(DEV_MODE_VARIABLE, dev_mode)
    args = helpers.engine_args(32, block_size=16, enable_prefix_caching=True, **engine_args)
    async_llm = AsyncLLM.from_engine_args(model, args, decode=decode)
    return ServerThread(build_app(async_llm, model_name="tiny", encode=encode), graceful_seconds=2.0)


@pytest.mark.parametrize("dev_mode", [None, "0"])
def test_the_endpoint_is_not_there_without_dev_mode(slow_model, monkeypatch, dev_mode):
    with serve_app(slow_model, dev_mode, monkeypatch) as server:
        response = httpx.post(f"{server.url}/reset_prefix_cache")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == 404  # the error format


def test_dev_mode_must_be_an_integer(slow_model, monkeypatch):
    monkeypatch.setenv(DEV_MODE_VARIABLE, "yes")
    llm = AsyncLLM.from_engine_args(slow_model, helpers.engine_args(8), decode=decode)
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE must be 0 or 1, got 'yes'"):
        build_app(llm, model_name="tiny", encode=encode)
    assert llm.stat_loggers == []  # refused before it touched the engine


def test_the_dev_endpoint_resets_with_vllms_rules_under_the_openai_clients_load(slow_model, monkeypatch):
    with serve_app(slow_model, "1", monkeypatch, kv_events_config=EVENTS) as server:
        engine = server.async_llm.llm_engine
        subscriber = Subscriber(engine.engine_core.scheduler.kv_event_publisher)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
        http = httpx.Client(base_url=server.url, timeout=30)
        try:
            prompt = "the same prompt, twice over"
            assert http.post("/reset_prefix_cache").json() == {"success": True}  # idle: it goes through
            assert subscriber.events() == [AllBlocksCleared()]
            text = []
            got_first = threading.Event()

            def stream() -> None:
                chunks = client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=60, temperature=0.0, stream=True
                )
                for chunk in chunks:
                    text.append(chunk.choices[0].text)
                    got_first.set()

            streaming = threading.Thread(target=stream)
            streaming.start()
            assert got_first.wait(30)
            refused = http.post("/reset_prefix_cache")
            assert (refused.status_code, refused.json()) == (200, {"success": False})  # a request runs
            stored = subscriber.events()
            assert stored and AllBlocksCleared() not in stored
            assert stored[0].token_ids == encode(prompt)[:16]  # the prompt's first full block
            reset = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            assert reset.json() == {"success": True}
            streaming.join(30)
            assert AllBlocksCleared() in subscriber.events()
            expected = generate(slow_model, [encode(prompt)], 60).tokens[0]
            assert "".join(text) == decode(expected)  # preempted and resumed: the same text
            bad = http.post("/reset_prefix_cache", params={"reset_running_requests": "perhaps"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.reset_running_requests"
        finally:
            client.close()
            http.close()
            subscriber.close()
    assert publisher_threads() == []

"""The live KV-cache page's routes (paged_kv/entrypoints/kv_page.py), without a browser (lesson 15).

A TinyGPT engine is served by an :class:`AsyncLLM` on the test's own event loop, and a minimal
FastAPI app holding only :func:`kv_routes` is queried through httpx's ASGI transport: ``/kv``,
``/kv/state``, ``/kv/frame`` and ``/kv/events`` must show a request's blocks while it streams, and
every block free once it finished, was aborted, or its client stopped iterating.

A :class:`Gate` (a stat logger, so it runs in the engine's thread after each step) holds the
engine while the test reads the page, so what the test sees cannot move under it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from paged_kv.entrypoints.kv_page import LEGEND, NO_POOL, PAGE_TITLE, kv_routes, kv_state
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT, decode
from paged_kv.serving.async_llm import AsyncLLM
from paged_kv.serving.sampling_params import SamplingParams

from . import helpers
from .helpers import run_async

NUM_BLOCKS, BLOCK_SIZE = 32, 4
PROMPT = list(range(40, 50))  # 10 tokens: 3 blocks
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)  # 40 tokens in all: 10 blocks


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig()).eval()


def new_async_llm(model: TinyGPT, **engine_args) -> AsyncLLM:
    """An AsyncLLM over a fresh engine: 32 blocks of 4 slots, prefix caching on (unless overridden)."""
    args = {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "enable_prefix_caching": True, **engine_args}
    return AsyncLLM.from_engine_args(model, helpers.engine_args(**args), decode=decode)


def app_for(async_llm: AsyncLLM, **route_args) -> FastAPI:
    app = FastAPI()
    app.include_router(kv_routes(async_llm, **route_args))
    return app


class Gate:
    """A stat logger that holds the engine's thread after each step while the gate is closed.

    The engine sets ``kv_view`` after its loggers return, so while the gate is closed the view
    stays the one of the last step that passed.
    """

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()

    def __call__(self, _stats, _iteration) -> None:
        assert self.opened.wait(10), "the test left the gate closed"


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def run(
    scenario: Callable[[AsyncLLM, httpx.AsyncClient], Awaitable[None]], async_llm: AsyncLLM, **route_args
):
    """Run ``scenario(async_llm, client)`` on a fresh event loop; shut the engine down after it."""

    async def main() -> None:
        transport = httpx.ASGITransport(app=app_for(async_llm, **route_args))
        async with httpx.AsyncClient(transport=transport, base_url="http://kv.test") as client:
            try:
                await scenario(async_llm, client)
            finally:
                await async_llm.shutdown()

    run_async(asyncio.wait_for(main(), 60))


async def all_free(client: httpx.AsyncClient) -> bool:
    state = (await client.get("/kv/state")).json()
    return state["num_free_blocks"] == NUM_BLOCKS - 1 and not state["requests"]


def check_invariant(state: dict) -> None:
    """Free blocks plus the distinct blocks the tables hold make the pool."""
    held = {b for r in state["requests"] for b in r["block_ids"]}
    assert state["num_free_blocks"] + len(held) + 1 == state["num_blocks"]  # and the null block
    assert held.isdisjoint(state["free_block_ids"])


# ------------------------------------------------------------------------------ the page


def test_the_page_is_self_contained_and_shows_the_idle_pool(model):
    with TestClient(app_for(new_async_llm(model))) as client:
        reply = client.get("/kv")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/html")
    page = reply.text
    assert f"<title>{PAGE_TITLE}</title>" in page
    assert "<svg" in page and "kv_cache_usage_perc" in page and LEGEND in page
    assert "No request is running" in page
    # Nothing loaded from elsewhere: no external script, style sheet, image or font.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page loads a resource"
    links = re.findall(r"<link[^>]*>", page)
    assert all('href="data:' in link for link in links), links  # the icon is inline too
    assert "@import" not in page and "url(" not in page.replace("url(#", "")


def test_state_and_frame_follow_a_streaming_request_and_free_its_blocks_when_it_finishes(model):
    gate = Gate()

    async def scenario(async_llm: AsyncLLM, client: httpx.AsyncClient) -> None:
        async_llm.stat_loggers.append(gate)
        outputs = async_llm.generate(PROMPT, LONG, request_id="req-0")
        await anext(outputs)
        gate.opened.clear()  # the engine stops after its step in flight, the view before it stays
        try:
            await asyncio.sleep(0.05)
            await check_while_held(client)
        finally:
            gate.opened.set()
        async for output in outputs:
            last = output
        assert last.finished
        await until(lambda: all_free(client), "every block free after the request finished")
        state = (await client.get("/kv/state")).json()
        assert state["kv_cache_usage_perc"] == 0 and state["num_running"] == 0
        assert "No request is running" in (await client.get("/kv/frame")).text

    async def check_while_held(client: httpx.AsyncClient) -> None:
        state = (await client.get("/kv/state")).json()
        assert state["paged"] and state["num_blocks"] == NUM_BLOCKS and state["block_size"] == BLOCK_SIZE
        assert state["num_running"] == 1 and state["num_waiting"] == 0
        assert state["step"] >= 1
        [request] = state["requests"]
        assert request["request_id"] == "req-0"
        assert request["num_tokens"] >= len(PROMPT) + 1
        assert len(request["block_ids"]) == -(-request["num_cached_tokens"] // BLOCK_SIZE) >= 3
        assert state["num_free_blocks"] == NUM_BLOCKS - 1 - len(request["block_ids"])
        assert state["kv_cache_usage_perc"] == pytest.approx(len(request["block_ids"]) / (NUM_BLOCKS - 1))
        check_invariant(state)
        frame = (await client.get("/kv/frame")).text
        assert f'data-step="{state["step"]}"' in frame and "<svg" in frame and "req-0" in frame
        assert f"{100 * state['kv_cache_usage_perc']:.1f}%" in frame

    run(scenario, new_async_llm(model))


def test_the_prefix_cache_hit_rate_counts_a_shared_prompt(model):
    async def scenario(async_llm: AsyncLLM, client: httpx.AsyncClient) -> None:
        short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for request_id in ("first", "second"):
            async for _ in async_llm.generate(PROMPT, short, request_id=request_id):
                pass
        state = (await client.get("/kv/state")).json()
        assert state["prefix_cache_queries"] > 0 and state["prefix_cache_hits"] > 0
        assert state["prefix_cache_hit_rate"] == state["prefix_cache_hits"] / state["prefix_cache_queries"]
        assert f"{100 * state['prefix_cache_hit_rate']:.0f}%" in (await client.get("/kv/frame")).text

    run(scenario, new_async_llm(model))


@pytest.mark.parametrize("how", ["close the iterator", "AsyncLLM.abort"])
def test_an_aborted_request_leaves_every_block_free(model, how):
    async def scenario(async_llm: AsyncLLM, client: httpx.AsyncClient) -> None:
        outputs = async_llm.generate(PROMPT, LONG, request_id="req-9")
        await anext(outputs)
        state = (await client.get("/kv/state")).json()
        assert [r["request_id"] for r in state["requests"]] == ["req-9"]
        assert state["num_free_blocks"] < NUM_BLOCKS
        if how == "close the iterator":
            await outputs.aclose()
        else:
            async_llm.abort("req-9")
        await until(lambda: all_free(client), f"every block free after {how}")
        state = (await client.get("/kv/state")).json()
        check_invariant(state)
        assert state["kv_cache_usage_perc"] == 0
        if how == "AsyncLLM.abort":
            rest = [output async for output in outputs]  # the client hears of it: it ends on the abort
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

    run(scenario, new_async_llm(model))


# ------------------------------------------------------------------------------ the events


def parse_events(body: str) -> list[tuple[str, dict]]:
    """The ``(id, data)`` of each event of a text/event-stream body (the ``retry:`` block has none)."""
    events = []
    for block in body.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            events.append((fields["id"], json.loads(fields["data"])))
    return events


def test_events_stream_one_frame_per_change_of_the_view_while_a_request_streams(model):
    async def scenario(async_llm: AsyncLLM, client: httpx.AsyncClient) -> None:
        async def consume() -> None:
            async for _ in async_llm.generate(PROMPT, LONG, request_id="req-0"):
                await asyncio.sleep(0.02)  # a slow client: the engine does not wait for it

        async_llm.stat_loggers.append(lambda _s, _i: time.sleep(0.01))  # about 50 steps a second
        task = asyncio.create_task(consume())
        reply = await client.get("/kv/events")  # the stream ends after stream_s
        await task
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.text.startswith("retry: ")
        events = parse_events(reply.text)
        ids = [event_id for event_id, _ in events]
        assert len(events) >= 3, f"only {len(events)} events in {len(reply.text)} characters"
        assert all(a != b for a, b in itertools.pairwise(ids)), "the same frame sent twice in a row"
        steps = [data["state"]["step"] for _, data in events]
        assert steps == sorted(steps) and steps[-1] > steps[0]
        for event_id, data in events:
            assert event_id.startswith(f"{data['state']['step']}-")
            assert f'data-step="{data["state"]["step"]}"' in data["html"]
        assert any("req-0" in data["html"] and "<svg" in data["html"] for _, data in events)

    run(scenario, new_async_llm(model), stream_s=0.6, interval_s=0.05)


def test_an_idle_stream_sends_one_event_and_none_after_a_reconnect(model):
    async def scenario(async_llm: AsyncLLM, client: httpx.AsyncClient) -> None:
        [(event_id, data)] = parse_events((await client.get("/kv/events")).text)
        assert data["state"] == (await client.get("/kv/state")).json() == kv_state(async_llm.kv_view)
        again = await client.get("/kv/events", headers={"Last-Event-ID": event_id})
        assert parse_events(again.text) == []

    run(scenario, new_async_llm(model), stream_s=0.3, interval_s=0.05)


# ------------------------------------------------------------------------------ other memories


def test_a_memory_without_a_pool_says_so_and_keeps_the_numbers(model):
    async def scenario(async_llm: AsyncLLM, client: httpx.AsyncClient) -> None:
        async for _ in async_llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True)):
            pass
        state = (await client.get("/kv/state")).json()
        assert state["paged"] is False and state["num_blocks"] is None and state["free_block_ids"] is None
        assert state["step"] >= 3
        page = (await client.get("/kv")).text
        assert NO_POOL in page and "<svg" not in page
        assert f'id="kv-step">{state["step"]}<' in (await client.get("/kv/frame")).text

    run(scenario, new_async_llm(model, mode="contiguous", enable_prefix_caching=False, max_model_len=64))


def test_kv_routes_refuses_a_non_positive_interval():
    with pytest.raises(ValueError, match="positive"):
        kv_routes(object(), interval_s=0)


def test_the_module_examples_hold():
    import doctest

    from paged_kv.entrypoints import kv_page

    assert doctest.testmod(kv_page).failed == 0

"""Bounded state (issue 30): a server that runs for weeks keeps only what its live requests need.

vLLM refuses a request id only while it is live, and every record kept per request leaves with it.
Here 20,000 requests go through :class:`~paged_kv.serving.async_llm.AsyncLLM`, and 1,300 through
the OpenAI-compatible server, in the mix a long-running server meets: greedy and seeded sampled
requests, ``n`` children, shared prefixes (prefix caching), preemptions (a small pool), clients that
hang up mid-stream, requests refused at the door, ids used again once finished. The Python heap,
traced by :mod:`tracemalloc` after a warm-up, must stay flat (a leak of a dozen bytes a request
would show), and at the end every block is free and no per-request record is left anywhere.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import random
import tracemalloc
from collections.abc import Awaitable, Callable

import httpx
import pytest

from paged_kv.entrypoints.openai.api_server import build_app
from paged_kv.entrypoints.openai.launcher import ServerThread
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode
from paged_kv.serving.async_llm import AsyncLLM
from paged_kv.serving.sampling_params import SamplingParams

from .helpers import engine_args, run_async

pytestmark = pytest.mark.lesson16

CONFIG = GPTConfig(num_layers=1, num_heads=1, head_dim=8, max_len=32)
NUM_BLOCKS, BLOCK_SIZE = 48, 4  # 47 blocks of 4 tokens for up to 96 clients at once: preemptions
CONCURRENCY = 96


def soak_request(i: int) -> tuple[list[int], SamplingParams, bool]:
    """Request ``i`` of the mix: its prompt, its sampling parameters and whether its client hangs up
    after the first output. Every 97th prompt is longer than the model's context: refused."""
    rng = random.Random(i)
    prompt = [rng.randrange(3) for _ in range(rng.randint(1, 12))]  # three tokens: shared prefixes
    if i % 97 == 0:
        prompt = [1] * (CONFIG.max_len + 1)
    sampled = i % 5 == 0
    params = SamplingParams(
        max_tokens=rng.randint(1, 4),
        temperature=1.0 if sampled else 0.0,
        seed=i if sampled else None,
        n=2 if sampled and i % 2 == 0 else 1,  # children sample (vLLM: n > 1 is not greedy)
    )
    return prompt, params, i % 11 == 0


def heap_growth(
    run: Callable[[int, int], Awaitable[None]],
    warmup: int,
    settle: int,
    end: int,
    quiet_s: float = 0.0,
    windows: int = 2,
):
    """Run requests ``0 .. warmup - 1`` untraced, trace the heap from there, and return the bytes it
    grew by over the quietest of ``windows`` equal windows between request ``settle`` and ``end``,
    each measured after ``quiet_s`` seconds of quiet (a server closing its connections) and a full
    collection. A leak grows the heap in every window; a table resized once to the peak of
    requests in flight (a dict, a set of tasks), in one."""

    async def quiet_heap() -> int:
        await asyncio.sleep(quiet_s)
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    async def measure() -> int:
        await run(0, warmup)
        tracemalloc.start()
        try:
            await run(warmup, settle)
            bounds = [settle + (end - settle) * k // windows for k in range(windows + 1)]
            growth, before = [], await quiet_heap()
            for start, stop in itertools.pairwise(bounds):
                await run(start, stop)
                after = await quiet_heap()
                growth.append(after - before)
                before = after
            return min(growth)
        finally:
            tracemalloc.stop()

    return measure()


def gated(one: Callable[[int], Awaitable[None]]) -> Callable[[int, int], Awaitable[None]]:
    """Requests ``start .. end - 1`` through ``one``, by :data:`CONCURRENCY` clients that each take
    the next request when theirs is done (no task kept per request: the harness stays flat too)."""

    async def run(start: int, end: int) -> None:
        requests = iter(range(start, end))

        async def client() -> None:
            for i in requests:
                await one(i)

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))

    return run


def assert_nothing_left(llm: AsyncLLM) -> None:
    """Every block free, and no per-request record anywhere in the engine, once the runner heard of
    the requests the shutdown aborted (in the next step's ``finished_req_ids``, as vLLM's workers)."""
    engine = llm.llm_engine
    engine.step()
    core = engine.engine_core
    memory = core.scheduler.memory
    assert memory.num_free_blocks == NUM_BLOCKS - 1  # all but the null block
    assert not core.scheduler.requests and not core.scheduler.has_unfinished_requests
    assert not engine.output_processor.request_ids() and not engine.has_unfinished_requests()
    assert not core.model_runner.block_tables.rows and not core.model_runner.sampling
    assert not memory.request_ids
    assert llm.num_unfinished_requests == 0


def new_async_llm() -> AsyncLLM:
    model = TinyGPT(CONFIG, seed=0)
    args = engine_args(NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    return AsyncLLM.from_engine_args(model, args, decode=decode)


def test_20000_requests_through_async_llm_leave_the_heap_flat_and_every_block_free():
    outcomes = {"finished": 0, "hung up": 0, "refused": 0}

    async def soak() -> int:
        llm = new_async_llm()

        async def one(i: int) -> None:
            prompt, params, hang_up = soak_request(i)
            try:
                complete = False
                async for output in llm.generate(prompt, params, request_id=i % 1_000):  # ids come again
                    if hang_up:
                        outcomes["hung up"] += 1
                        break
                    complete = output.finished and len(output.outputs) == params.n
                else:
                    assert complete
                    outcomes["finished"] += 1
            except ValueError:
                outcomes["refused"] += 1

        try:
            return await heap_growth(gated(one), warmup=2_000, settle=8_000, end=20_000)
        finally:
            await llm.shutdown()
            assert_nothing_left(llm)

    growth = run_async(soak())
    assert sum(outcomes.values()) == 20_000 and min(outcomes.values()) > 100
    assert growth < 64 * 1024, (
        f"the heap grew by {growth:,} bytes over 6,000 requests (the quieter half of 12,000)"
    )


def test_1300_requests_through_the_server_leave_the_heap_flat_and_every_block_free(caplog):
    # httpx logs every request at INFO, and pytest keeps each record: the harness's growth, not the
    # server's.
    caplog.set_level(logging.WARNING, logger="httpx")
    llm = new_async_llm()
    statuses: dict[int, int] = {}
    with ServerThread(build_app(llm, model_name="tiny-gpt", encode=encode)) as server:

        async def soak() -> int:
            # A connection per request: a client that hangs up mid-stream closes its own, and none
            # is reused after the server closed it.
            limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

                async def one(i: int) -> None:
                    prompt, params, hang_up = soak_request(i)
                    body = {"model": "tiny-gpt", "prompt": prompt, "max_tokens": params.max_tokens,
                            "temperature": params.temperature, "seed": params.seed, "n": params.n,
                            "stream": hang_up}  # fmt: skip
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                        if hang_up:  # read the first event, then hang up
                            async for _ in response.aiter_lines():
                                break
                        else:
                            await response.aread()

                return await heap_growth(
                    gated(one), warmup=200, settle=400, end=1_300, quiet_s=0.5, windows=3
                )

        growth = run_async(soak())
        run_async(_until_idle(llm))
    assert statuses.get(200, 0) > 900 and statuses.get(400, 0) > 5 and set(statuses) == {200, 400}
    assert growth < 64 * 1024, (
        f"the heap grew by {growth:,} bytes over 300 requests (the quietest third of 900)"
    )
    assert_nothing_left(llm)


async def _until_idle(llm: AsyncLLM, seconds: float = 10.0) -> None:
    """Wait until the engine has no request left (a hung-up stream's abort lands between steps)."""
    for _ in range(int(seconds / 0.01)):
        if not llm.llm_engine.has_unfinished_requests() and llm.num_unfinished_requests == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests were left in the engine")

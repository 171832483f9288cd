"""The live KV-cache page (``/kv``, lesson 15) updates in Chromium while requests stream.

A minimal FastAPI app holding :func:`~paged_kv.entrypoints.kv_page.kv_routes` over a TinyGPT
engine runs under uvicorn in a background thread, on a free loopback port. The page is opened in
headless Chromium, then a test-only route starts three streaming requests that share a prompt
prefix (two blocks of it, from the prefix cache), each started ``STAGGER`` tokens after the one
before. The engine is paced (a stat logger sleeps after each step) so that the page, which the
server updates by server-sent events, sees several steps go by; once all three requests run, the
logger holds the engine on one step while the test looks at the page in a light and a dark
colour scheme.

The test asserts that the step number and the drawn blocks change while the requests stream,
that the held step shows the three requests, legibly in both schemes, and that the pool is drawn
empty once they finish, with no failed request and no console error on the way. The mid-stream
screenshot goes where the ``screenshot`` fixture puts screenshots; with ``PAGED_KV_DOCS_IMAGES``
set (``PAGED_KV_DOCS_IMAGES=1 pytest tests/browser/test_kv_page.py``) it also replaces
``docs/images/kv_page.png``, the still of the page that lesson 15 shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.browser import harness

pytestmark = [pytest.mark.browser]

NUM_BLOCKS, BLOCK_SIZE = 32, 4
GIVEN_OUT = NUM_BLOCKS - 1  # the pool's block 0 is the null block: the page counts the others
SHARED = [ord(c) for c in "You are a"]  # 9 tokens: the first two blocks are full, and shared
PROMPTS = {f"req-{i}": [*SHARED, *(ord(c) for c in tail)] for i, tail in enumerate((" cat", " dog", " owl"))}
MAX_TOKENS = 40
STAGGER = 8  # each request starts once the one before it has this many output tokens
PACE_S = 0.03  # the engine sleeps this long after each step: about 30 steps a second
HOLD_AT_TOKENS = len(SHARED) + 4 + 8  # hold once the last request has this many tokens
DOCS_IMAGE = harness.ROOT / "docs" / "images" / "kv_page.png"
VIEWPORT = {"width": 960, "height": 900}
WAIT_MS = 10_000


@dataclass
class Pacer:
    """A stat logger (it runs in the engine's thread, after each step, before ``kv_view`` is set).

    It sleeps ``PACE_S`` after every step; the first time every prompt runs and the last has
    ``HOLD_AT_TOKENS`` tokens, it waits for ``release``, the view left as the step before set it:
    ``held_step`` is that view's step.
    """

    async_llm: object
    release: threading.Event = field(default_factory=threading.Event)
    held_step: int | None = None

    def __call__(self, _stats, _iteration) -> None:
        time.sleep(PACE_S)
        running = {
            r.request_id: r.num_tokens for r in self.async_llm.llm_engine.engine_core.scheduler.running
        }
        if (
            self.held_step is None
            and set(running) == set(PROMPTS)
            and min(running.values()) >= HOLD_AT_TOKENS
        ):
            self.held_step = self.async_llm.kv_view.step
            self.release.wait(20)


@dataclass
class Served:
    url: str
    pacer: Pacer
    tasks: list = field(default_factory=list)
    open_streams: int = 0  # the /kv/events responses in flight

    def wait_for_streams(self, count: int, what: str) -> None:
        deadline = time.monotonic() + 5
        while self.open_streams != count:
            assert time.monotonic() < deadline, f"{self.open_streams} event streams open {what}, not {count}"
            time.sleep(0.02)


@pytest.fixture
def kv_server(browser) -> Iterator[Served]:
    """The app under uvicorn on a free loopback port, in a thread; stopped (and joined) after the test.

    It depends on ``browser`` so that nothing starts on a machine where the test is skipped.
    """
    import torch
    import uvicorn
    from fastapi import FastAPI

    from paged_kv.entrypoints.kv_page import kv_routes
    from paged_kv.model.config import GPTConfig
    from paged_kv.model.tiny_gpt import TinyGPT, decode
    from paged_kv.serving.async_llm import AsyncLLM
    from paged_kv.serving.engine_args import EngineArgs
    from paged_kv.serving.sampling_params import SamplingParams

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig()).eval()
    settings = EngineArgs(
        num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=True
    )
    async_llm = AsyncLLM.from_engine_args(model, settings, decode=decode)
    pacer = Pacer(async_llm)
    async_llm.stat_loggers.append(pacer)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    app = FastAPI()
    app.include_router(kv_routes(async_llm))
    port = harness.free_port()
    served = Served(f"http://127.0.0.1:{port}", pacer)

    async def stream(index: int) -> None:
        """Serve request ``index``; start the next one once this one has ``STAGGER`` outputs."""
        request_id = f"req-{index}"
        async for output in async_llm.generate(PROMPTS[request_id], params, request_id=request_id):
            if len(output.outputs[0].token_ids) == STAGGER and f"req-{index + 1}" in PROMPTS:
                served.tasks.append(asyncio.create_task(stream(index + 1)))

    @app.post("/test/start", status_code=202)
    async def start() -> dict[str, str]:
        """Test only: start the requests in the background, each ``STAGGER`` tokens after the last."""
        served.tasks.append(asyncio.create_task(stream(0)))
        return {"started": "req-0"}

    async def counting(scope, receive, send) -> None:
        """The app, counting the event streams in flight (each must end when its client goes)."""
        streams = scope["type"] == "http" and scope["path"] == "/kv/events"
        served.open_streams += streams
        try:
            await app(scope, receive, send)
        finally:
            served.open_streams -= streams

    config = uvicorn.Config(
        counting,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="kv-page-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield served
    finally:
        pacer.release.set()
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "uvicorn did not stop"


def frame_facts(page) -> dict:
    """What the page shows now: the step, the counts, the pool picture's summary and the requests."""
    return page.evaluate(
        """() => {
            const text = id => (document.getElementById(id) || {}).textContent;
            const svg = document.querySelector('#kv-frame svg');
            return {step: Number(text('kv-step')), running: text('kv-running'), usage: text('kv-usage'),
                    pool: svg ? svg.getAttribute('aria-label') : null,
                    requests: [...document.querySelectorAll('.kv-requests tbody tr')]
                        .map(row => row.cells[0].textContent),
                    status: text('kv-status')};
        }"""
    )


def test_the_kv_page_follows_streaming_requests_step_by_step(browser, kv_server, screenshot):
    problems: list[str] = []
    with harness.new_page(browser, VIEWPORT) as page:
        page.set_default_timeout(WAIT_MS)
        page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
        page.goto(f"{kv_server.url}/kv")
        assert page.title() == "paged_kv — the KV cache, live"
        harness.wait_until(page, lambda: "live" in frame_facts(page)["status"], "the event stream", WAIT_MS)
        idle = frame_facts(page)
        assert idle["step"] == 0 and idle["requests"] == []
        assert idle["pool"].startswith(f"KV cache pool: 0 of {GIVEN_OUT} blocks used")

        assert httpx.post(f"{kv_server.url}/test/start", timeout=10).status_code == 202
        seen: list[dict] = []

        def held_and_shown() -> bool:
            seen.append(frame_facts(page))
            return kv_server.pacer.held_step is not None and seen[-1]["step"] == kv_server.pacer.held_step

        harness.wait_until(page, held_and_shown, "the page to show the held step", WAIT_MS)
        steps = [facts["step"] for facts in seen]
        assert steps == sorted(steps), f"the step went back: {steps}"
        assert len(set(steps)) >= 4, f"the page showed too few steps while the requests streamed: {steps}"
        assert len({facts["pool"] for facts in seen}) >= 3, "the drawn pool did not change"

        held = seen[-1]
        assert held["requests"] == list(PROMPTS) and held["running"] == "3"
        assert page.locator("#kv-frame svg rect[stroke-dasharray]").count() > 0, "no shared block drawn"
        shot = screenshot(page, "mid-stream")
        if os.environ.get("PAGED_KV_DOCS_IMAGES"):
            from tools.screenshots import shrink

            DOCS_IMAGE.write_bytes(shrink(page.locator("main").screenshot(animations="disabled")))
        check_legible(page, "light")
        with dark_page(browser, f"{kv_server.url}/kv") as dark:
            check_legible(dark, "dark")
            screenshot(dark, "mid-stream-dark")
            assert kv_server.open_streams == 2
        kv_server.wait_for_streams(1, "after the dark page closed")

        kv_server.pacer.release.set()
        harness.wait_until(
            page, lambda: frame_facts(page)["requests"] == [], "the requests to finish on the page", WAIT_MS
        )
        done = frame_facts(page)
        assert done["pool"].startswith(f"KV cache pool: 0 of {GIVEN_OUT} blocks used"), done["pool"]
        assert done["usage"] == "0.0%" and done["step"] > held["step"]
        errors = [line for line in page.console_lines if line.startswith(("error", "pageerror"))]
    kv_server.wait_for_streams(0, "after the page closed")
    assert not problems, problems
    assert not errors, f"console errors: {errors} (screenshot: {shot})"


@contextlib.contextmanager
def dark_page(browser, url: str) -> Iterator:
    """The page at ``url`` in a context that prefers a dark colour scheme, its stream live."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1, color_scheme="dark")
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(url)
        harness.wait_until(
            page, lambda: "live" in frame_facts(page)["status"], "the dark page's stream", WAIT_MS
        )
        yield page
    finally:
        context.close()


def check_legible(page, scheme: str) -> None:
    """Every text reads at 4.5:1 or more, every request's colour at 3:1 or more against the page."""
    root = page.locator("main")
    failures, checked = harness.low_contrast(root)
    assert checked > 20, f"only {checked} texts checked in the {scheme} scheme"
    assert not failures, f"texts below 4.5:1 in the {scheme} scheme: {failures[:5]}"
    faint, colours, pages = harness.faint_sequence_fills(root)
    assert len(colours) >= 3, f"fewer than three request colours drawn in the {scheme} scheme: {colours}"
    assert not faint, f"request colours below 3:1 on {pages} in the {scheme} scheme: {faint}"

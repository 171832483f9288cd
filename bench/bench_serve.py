"""Serving over HTTP: ``vllm bench serve``'s figures, paged against contiguous, prefix caching on and off.

``paged-kv serve``'s app (:func:`~paged_kv.entrypoints.openai.api_server.build_app`) runs a tiny
:class:`~paged_kv.model.tiny_gpt.TinyGPT` in a background thread on 127.0.0.1 (a free port), and an
asyncio client sends it ``num_requests`` ShareGPT-shaped requests (lengths a quarter of ShareGPT's,
seeded) as streamed ``/v1/completions``: each prompt is a shared system prompt of
``system_tokens`` tokens and the request's own tokens, sent as token ids, greedy, ``ignore_eos``, its
output length as ``max_tokens``. Requests start at Poisson arrival times of ``rate`` requests per
second, at most ``max_concurrency`` at once (vLLM's ``--request-rate`` and ``--max-concurrency``).

Three servers, one at a time, on the same memory budget (``num_blocks`` of ``block_size`` tokens):
the paged cache with prefix caching (vLLM v1's default), without it, and the contiguous baseline
that reserves ``max_model_len`` tokens per request. Each run reports, as ``vllm bench serve`` does,
the request throughput, the output tokens per second, and the time to first token and the
inter-token latency (mean, median, p99, in milliseconds), from the client's side: a token is
counted when its chunk arrives. After each run the server is stopped and every block must be free
with no request left; a run is bounded by ``time_limit`` seconds and stops by itself.

    .venv/bin/python bench/bench_serve.py
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx
import torch
from _timing import Row, text_table

from paged_kv.entrypoints.openai.api_server import build_app
from paged_kv.entrypoints.openai.launcher import ServerThread
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode
from paged_kv.serving.async_llm import AsyncLLM
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.simulation.workload import LengthDistribution, sample_requests

QUARTER_SHAREGPT = LengthDistribution(
    "sharegpt/4", mean_prompt=40, mean_output=85, max_prompt=256, max_output=256
)
MODEL_NAME = "tiny-gpt"
SETUPS = {  # name: the engine's settings besides the budget
    "paged, prefix caching": dict(mode="paged", enable_prefix_caching=True),
    "paged, no prefix caching": dict(mode="paged", enable_prefix_caching=False),
    "contiguous": dict(mode="contiguous"),
}


@dataclass
class RunStats:
    """One server's run, from the client's side: per request its time to first token, its
    inter-token latencies and its output tokens, in seconds; the run's wall-clock seconds."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    completed: int = 0
    seconds: float = 0.0
    leftover_blocks: int = 0
    leftover_requests: int = 0

    @property
    def request_throughput(self) -> float:
        return self.completed / self.seconds

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation, as numpy's default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def workload(
    num_requests: int, system_tokens: int, rate: float, seed: int
) -> list[tuple[float, list[int], int]]:
    """``(arrival second, prompt token ids, max_tokens)`` per request: a shared system prompt, then
    the request's own bytes; Poisson arrivals of ``rate`` per second."""
    rng = random.Random(seed)
    system = list(encode("You are a helpful assistant. Answer briefly. " * 8))[:system_tokens]
    arrivals, now = [], 0.0
    for request in sample_requests(QUARTER_SHAREGPT, num_requests, seed=seed):
        now += rng.expovariate(rate)
        own = [rng.randrange(256) for _ in range(request.prompt_tokens)]
        arrivals.append((now, system + own, request.output_tokens))
    return arrivals


async def send(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stats: RunStats, start_at: float
) -> None:
    """One streamed completion: the time to its first token, the gaps between the next ones."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    last = start_at
    first = True
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            now = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                (stats.ttft if first else stats.itl).append(now - last)
                first, last = False, now
            if chunk.get("usage"):
                stats.output_tokens += chunk["usage"]["completion_tokens"]
    stats.completed += 1


async def drive(url: str, requests: list[tuple[float, list[int], int]], max_concurrency: int) -> RunStats:
    """Send every request at its arrival time, at most ``max_concurrency`` at once."""
    stats = RunStats()
    gate = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        begin = time.perf_counter()

        async def one(arrival: float, prompt: list[int], max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, begin + arrival - time.perf_counter()))
            async with gate:
                await send(client, prompt, max_tokens, stats, time.perf_counter())

        await asyncio.gather(*(one(*r) for r in requests))
        stats.seconds = time.perf_counter() - begin
    return stats


def serve_one(
    settings: dict,
    requests: list[tuple[float, list[int], int]],
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_concurrency: int,
    time_limit: float,
) -> RunStats:
    """Start a server with ``settings``, drive it, stop it; check every block came back."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(max_len=max_model_len), seed=0).eval()
    engine_args = EngineArgs(
        num_gpu_blocks_override=num_blocks, block_size=block_size, max_model_len=max_model_len, **settings
    )
    async_llm = AsyncLLM.from_engine_args(model, engine_args, decode=decode)
    app = build_app(async_llm, model_name=MODEL_NAME, encode=encode)
    with ServerThread(app) as server, ThreadPoolExecutor(1) as pool:  # a loop of its own, whatever runs here
        run = asyncio.wait_for(drive(server.url, requests, max_concurrency), time_limit)
        stats = pool.submit(asyncio.run, run).result()
    llm = async_llm.llm_engine
    stats.leftover_requests = llm.get_num_unfinished_requests() + int(llm.has_unfinished_requests())
    memory = llm.engine_core.scheduler.memory
    stats.leftover_blocks = round(memory.usage * memory.num_blocks)
    return stats


def run(
    num_requests: int = 48,
    rate: float = 16.0,
    max_concurrency: int = 16,
    system_tokens: int = 96,
    num_blocks: int = 256,
    block_size: int = 16,
    max_model_len: int = 512,
    time_limit: float = 300.0,
    seed: int = 0,
) -> list[Row]:
    """Serve the same requests with each setup; one row per setup and measure, ratios to the contiguous."""
    requests = workload(num_requests, system_tokens, rate, seed)
    results = {
        name: serve_one(
            settings,
            requests,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            max_concurrency=max_concurrency,
            time_limit=time_limit,
        )
        for name, settings in SETUPS.items()
    }
    for name, stats in results.items():
        if stats.leftover_blocks or stats.leftover_requests or stats.completed != num_requests:
            raise RuntimeError(
                f"{name}: {stats.completed} of {num_requests} completed, {stats.leftover_blocks} blocks "
                f"and {stats.leftover_requests} requests left after the server stopped"
            )
    print(f"{num_requests} requests at {rate}/s, at most {max_concurrency} at once,", end=" ")
    print(f"{num_blocks} blocks of {block_size}")
    print(f"{'setup':26} {'req/s':>6} {'out tok/s':>9}  TTFT ms mean/median/p99   ITL ms mean/median/p99")
    for name, s in results.items():
        ttft, itl = [1e3 * x for x in s.ttft], [1e3 * x for x in s.itl]
        print(
            f"{name:26} {s.request_throughput:6.2f} {s.output_throughput:9.1f}  "
            f"{statistics.mean(ttft):6.1f} {statistics.median(ttft):6.1f} {percentile(ttft, 99):7.1f}   "
            f"{statistics.mean(itl):6.1f} {statistics.median(itl):6.1f} {percentile(itl, 99):7.1f}"
        )
    base = results["contiguous"]
    rows = []
    for name in ("paged, prefix caching", "paged, no prefix caching"):
        s = results[name]
        rows.append(
            Row(
                f"serve: output tokens/s, {name} / contiguous",
                s.output_throughput,
                base.output_throughput,
                s.output_throughput / base.output_throughput,
                "(info)",
                None,
                unit="tok/s",
            )
        )
        rows.append(
            Row(
                f"serve: median TTFT, contiguous / {name}",
                1e3 * statistics.median(s.ttft),
                1e3 * statistics.median(base.ttft),
                statistics.median(base.ttft) / statistics.median(s.ttft),
                "(info)",
                None,
                unit="ms",
            )
        )
    return rows


QUICK = dict(num_requests=6, rate=50.0, max_concurrency=4, system_tokens=32, num_blocks=64, time_limit=60.0)


if __name__ == "__main__":
    print(text_table(run()))

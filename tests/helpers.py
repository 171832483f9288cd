"""Helpers shared by the tests: building allocators, proving a failed call changed nothing,
skipping lesson 12's notebooks and tasks where triton cannot be imported, and the example count of
the costliest property tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
from hypothesis import settings

from paged_kv import PagedKVCacheAllocator
from paged_kv.attention.triton_decode import triton_available
from paged_kv.model.generation import generate
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.llm_engine import LLMEngine

NUM_HEADS, HEAD_DIM = 2, 4
KERNEL_LESSONS = ("12",)  # lessons whose exercise is a Triton kernel
NO_TRITON = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (it publishes Linux wheels only)"
)


def lesson_marks(lesson: str) -> list[pytest.MarkDecorator]:
    """The marks of a test of lesson ``lesson``'s notebooks or tasks: a Triton lesson skips without triton."""
    return [NO_TRITON] if lesson in KERNEL_LESSONS else []


def by_lesson(paths, lesson_of=lambda path: path.name[:2]) -> list:
    """``paths`` (notebooks or files, each of lesson ``lesson_of(path)``) as parameters with its marks."""
    return [pytest.param(path, marks=lesson_marks(lesson_of(path))) for path in paths]


def max_examples(dev: int) -> int:
    """A test's own example count: ``dev`` under the dev profile, and as many times more under
    another profile as that profile's ``max_examples`` is larger (2.5 times under ci, 150 / 60).

    For a property test whose every example is costly (it runs the model through the engine) and
    whose space other tests also cover step by step (the scheduler's and the cache's state
    machines): ``@settings(max_examples=max_examples(25))`` runs 25 examples in the edit-test
    loop and 62 in CI.
    """
    scale = settings.default.max_examples / settings.get_profile("dev").max_examples
    return max(1, round(dev * scale))


def engine_args(num_blocks: int | None = None, **kwargs) -> EngineArgs:
    """:class:`EngineArgs` with the offline engine's name for the pool's size, ``num_blocks``
    (vLLM's ``num_gpu_blocks_override``)."""
    return EngineArgs(num_gpu_blocks_override=num_blocks, **kwargs)


def built(engine: Engine, watch: Callable[[LLMEngine], None] | None = None) -> list[LLMEngine]:
    """The online engines ``engine``'s runs build, one per run, to look at after it; ``watch`` is
    called on each as it is built (to wrap its parts and see each step)."""
    made: list[LLMEngine] = []
    build = engine.new_llm_engine

    def new_llm_engine() -> LLMEngine:
        made.append(build())
        if watch is not None:
            watch(made[-1])
        return made[-1]

    engine.new_llm_engine = new_llm_engine  # type: ignore[method-assign]
    return made


def make_cache(num_blocks: int = 8, block_size: int = 4, device: str | torch.device = "cpu", **kw):
    """A small allocator: two heads of dimension four."""
    return PagedKVCacheAllocator(num_blocks, block_size, NUM_HEADS, HEAD_DIM, device=device, **kw)


def alone(model: TinyGPT, request: EngineRequest) -> list[int]:
    """The tokens ``generate`` gives the request's prompt on its own, with a contiguous cache: what
    the engine must produce for it, whatever the batch, the budget or the cache's settings."""
    return _generated_alone(model, tuple(request.prompt), request.max_tokens)


@functools.cache  # the property tests ask for the same prompts many times
def _generated_alone(model: TinyGPT, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    return generate(model, [list(prompt)], max_new_tokens, cache="contiguous").tokens[0]


def kv_for(num_tokens: int, first: int = 0, device: str | torch.device = "cpu", dtype=torch.float32):
    """K and V whose every element is distinct, so any misplaced value shows.

    Element ``(t, h, d)`` of K is ``first*100 + t*100 + h*10 + d`` (scaled), and V is its negative.
    """
    t = torch.arange(first, first + num_tokens, dtype=torch.float64).view(-1, 1, 1) * 100
    h = torch.arange(NUM_HEADS, dtype=torch.float64).view(1, -1, 1) * 10
    d = torch.arange(HEAD_DIM, dtype=torch.float64).view(1, 1, -1)
    k = (t + h + d + 1).to(dtype=dtype, device=device)
    return k, -k


def kv_of(tokens, device="cpu"):
    """K and V of a sequence whose K/V at position ``p`` depend on ``tokens[: p + 1]``, as in a model.

    A rolling hash of the prefix below 2**20, spread over heads and dims: every value is an exact
    float32 integer, and two positions share values only when their prefixes hash alike. Prefix
    caching is correct exactly when a block is shared by prompts with the same prefix up to it.

    The state machines ask for the same sequences' K/V after every step, so the values are computed
    once per tokens and device; each call returns new tensors, which the caller may change.
    """
    k = _k_of(tuple(int(token) for token in tokens), str(device))
    return k.clone(), -k


@functools.lru_cache(maxsize=4096)
def _k_of(tokens: tuple[int, ...], device: str) -> torch.Tensor:
    rows, rolling = [], 0
    for token in tokens:
        rolling = (rolling * 1_000_003 + token + 1) % 1_048_573
        rows.append(rolling * 8)
    base = torch.tensor(rows, dtype=torch.float64).view(-1, 1, 1)
    offsets = torch.arange(NUM_HEADS * HEAD_DIM, dtype=torch.float64).view(1, NUM_HEADS, HEAD_DIM) + 1
    return (base + offsets).to(dtype=torch.float32, device=device)


@contextmanager
def unchanged(cache: PagedKVCacheAllocator):
    """Assert that the block ends with the cache exactly as it started: bookkeeping and K/V data."""
    before = cache.snapshot()
    k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()
    yield
    assert cache.snapshot() == before
    assert torch.equal(cache.k_cache, k_before)
    assert torch.equal(cache.v_cache, v_before)


def fails_cleanly(
    cache: PagedKVCacheAllocator, error: type[Exception], call: Callable[[], object], match=None
) -> Exception:
    """``call`` raises ``error`` (matching ``match``) and leaves ``cache`` untouched; return the error."""
    with unchanged(cache), pytest.raises(error, match=match) as caught:
        call()
    return caught.value


def run_async(coroutine):
    """``asyncio.run(coroutine)`` in a thread of its own: a session's Playwright (the browser tests)
    keeps an event loop running in the main thread, where ``asyncio.run`` refuses to start another."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()

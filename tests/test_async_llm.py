"""The engine behind a server (lesson 15): ``AsyncLLM`` serves concurrent clients from one background loop.

Each test runs its own event loop (``asyncio.run``). Concurrent clients get exactly the greedy
tokens of :func:`~paged_kv.model.generate`; a client that stops iterating, an ``abort``, and
``shutdown`` all leave every block free; a bad request fails in ``generate`` before anything is
queued; and an engine that fails surfaces as ``EngineDeadError`` to every client.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest

from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.async_llm import AsyncLLM, EngineDeadError, KVCacheView
from paged_kv.serving.engine import EngineRequest
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

from .helpers import alone, engine_args, run_async

pytestmark = pytest.mark.lesson16

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)
NUM_BLOCKS = 24
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def cpu_model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=1)


def letters(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def serving(model: TinyGPT, num_blocks: int = NUM_BLOCKS, **kwargs) -> AsyncLLM:
    return AsyncLLM.from_engine_args(model, engine_args(num_blocks, block_size=4, **kwargs), decode=letters)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def free_blocks(llm: AsyncLLM) -> int:
    return llm.llm_engine.engine_core.scheduler.memory.num_free_blocks


async def until(condition, seconds: float = 5.0) -> None:
    """Let the loop turn until ``condition()`` holds (a bounded wait)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def collect(llm: AsyncLLM, prompt, params, request_id=None) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_concurrent_clients_get_the_greedy_tokens_of_generate(cpu_model, device):
    model = cpu_model.to(device)
    lengths = [6, 9, 4, 7]

    async def main():
        llm = serving(model)
        views = []
        llm.stat_loggers.append(
            lambda stats, it: views.append((stats.num_running_reqs, it.num_generation_tokens))
        )
        results = await asyncio.gather(
            *(collect(llm, p, greedy(n)) for p, n in zip(PROMPTS, lengths, strict=True)),
            collect(llm, PROMPTS[0], greedy(5, output_kind=RequestOutputKind.DELTA), request_id="delta"),
        )
        await llm.shutdown()
        return llm, results, views

    llm, results, views = run_async(main())
    for outputs, prompt, n in zip(results[:-1], PROMPTS, lengths, strict=True):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        (completion,) = outputs[-1].outputs
        assert completion.token_ids == alone(model, EngineRequest("x", prompt, n))
        assert completion.text == letters(completion.token_ids) and completion.finish_reason == "length"
        assert len({o.request_id for o in outputs}) == 1
    delta = results[-1]
    assert [t for o in delta for t in o.outputs[0].token_ids] == results[0][-1].outputs[0].token_ids[:5]
    assert {o.request_id for o in delta} == {"delta"}
    assert max(running for running, _ in views) > 1  # they were served together
    assert sum(tokens for _, tokens in views) == sum(lengths) + 5
    assert free_blocks(llm) == NUM_BLOCKS - 1 and not llm.llm_engine.has_unfinished_requests()
    assert llm.num_unfinished_requests == 0
    assert isinstance(llm.kv_view, KVCacheView) and llm.kv_view.step == llm.llm_engine.num_steps
    assert llm.kv_view.kv_cache_usage == 0.0 and llm.kv_view.num_running == 0


def test_a_client_that_stops_iterating_aborts_its_request(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model)
        steps = []  # each step's scheduled requests (the stat loggers run after every step)
        llm.stat_loggers.append(
            lambda *_: steps.append(set(llm.llm_engine.last_step[0].num_scheduled_tokens))
        )
        other = asyncio.create_task(collect(llm, PROMPTS[1], greedy(30)))
        seen = []
        async with contextlib.aclosing(llm.generate(PROMPTS[0], greedy(50), request_id="quits")) as stream:
            async for out in stream:
                seen.append(out)
                if len(seen) == 3:
                    assert "quits" in llm.llm_engine.engine_core.scheduler.memory
                    break
        closed_at = len(steps)
        # The abort is applied before the loop's next step: the blocks come back.
        await until(lambda: "quits" not in llm.llm_engine.output_processor)
        assert "quits" not in llm.llm_engine.engine_core.scheduler.memory  # its blocks are back
        assert "quits" not in [r.request_id for r in llm.llm_engine.engine_core.scheduler.running]
        assert sum("quits" in ids for ids in steps[closed_at:]) <= 1  # at most the step then in flight
        rest = await other
        await until(lambda: free_blocks(llm) == NUM_BLOCKS - 1)
        await llm.shutdown()
        return seen, rest

    seen, rest = run_async(main())
    assert [o.outputs[0].finish_reason for o in seen] == [None] * 3
    assert rest[-1].outputs[0].token_ids == alone(model, EngineRequest("x", PROMPTS[1], 30))


def test_abort_by_request_id_ends_the_clients_stream_and_frees_the_blocks(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model)
        outputs = []

        async def client():
            async for out in llm.generate(PROMPTS[1], greedy(40), request_id="a"):
                outputs.append(out)
                if len(outputs) == 2:
                    llm.abort("a")
                    llm.abort("nobody")  # unknown: ignored

        await asyncio.wait_for(client(), 5)  # the stream ends: it does not wait for ever
        await until(lambda: not llm.llm_engine.has_unfinished_requests())
        blocks = free_blocks(llm)
        await llm.shutdown()
        return outputs, blocks

    outputs, blocks = run_async(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert 2 <= len(outputs[-1].outputs[0].token_ids) < 40 and blocks == NUM_BLOCKS - 1


def test_an_abort_before_the_loop_takes_the_request_ends_it_too(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model)
        stream = llm.generate(PROMPTS[0], greedy(10), request_id="early")
        first = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)  # generate has queued it; the worker thread has not taken it yet
        llm.abort("early")
        out = await asyncio.wait_for(first, 5)
        await llm.shutdown()
        return out, free_blocks(llm)

    out, blocks = run_async(main())
    assert out.finished and out.outputs[0].finish_reason == "abort" and blocks == NUM_BLOCKS - 1


def test_shutdown_aborts_what_is_left_and_frees_every_block(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model)
        streams = [llm.generate(p, greedy(40)) for p in PROMPTS[:3]]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))

        async def rest(stream):
            return [out async for out in stream]

        rests = asyncio.gather(*map(rest, streams))
        await llm.shutdown()
        ends = await asyncio.wait_for(rests, 5)
        return llm, firsts, ends

    llm, firsts, ends = run_async(main())
    assert all(not o.finished for o in firsts)
    for end in ends:
        assert end[-1].finished and end[-1].outputs[0].finish_reason == "abort"
    assert free_blocks(llm) == NUM_BLOCKS - 1 and llm.llm_engine.get_num_unfinished_requests() == 0
    assert not llm.llm_engine.has_unfinished_requests() and llm.num_unfinished_requests == 0
    assert llm.kv_view.kv_cache_usage == 0.0


@pytest.mark.parametrize("max_tokens", [1, 20], ids=["finishing", "running"])
def test_shutdown_waits_for_a_step_still_running_in_the_worker_thread(cpu_model, max_tokens):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model)
        engine = llm.llm_engine
        step, in_step, overlaps = engine.step, threading.Event(), []

        def slow_step():
            in_step.set()
            time.sleep(0.2)
            try:
                return step()
            finally:
                in_step.clear()

        engine.step = slow_step
        abort_request = engine.abort_request

        def checked_abort(ids):
            overlaps.append(in_step.is_set())
            return abort_request(ids)

        engine.abort_request = checked_abort
        client = asyncio.create_task(collect(llm, PROMPTS[0], greedy(max_tokens)))
        await until(in_step.is_set)
        await llm.shutdown()  # while the step sleeps in the worker thread
        outputs = await asyncio.wait_for(client, 5)  # its output came, then the abort's
        return llm, outputs, overlaps

    llm, outputs, overlaps = run_async(main())
    assert overlaps == [False]  # the abort waited for the step
    assert free_blocks(llm) == NUM_BLOCKS - 1 and not llm.llm_engine.has_unfinished_requests()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 1
    assert outputs[-1].outputs[0].finish_reason == ("length" if max_tokens == 1 else "abort")


@pytest.mark.parametrize(
    ("prompt", "params", "request_id", "message"),
    [
        ([], None, None, "prompt_token_ids"),
        ([1, 300], None, None, "prompt_token_ids"),
        ([1] * 64, None, None, r"plus the number of requested output tokens \(at least 1\)"),
        ([1] * 70, None, None, r"is longer than the maximum model length of 64"),
        ([1, 2], "greedy", None, "sampling_params must be a SamplingParams"),
        ([1, 2], None, ["unhashable"], "request_id"),
        ([1] * 50, greedy(13), None, "cannot hold request"),
    ],
)
def test_a_bad_request_fails_in_generate_before_anything_is_queued(
    cpu_model, prompt, params, request_id, message
):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model, num_blocks=12)
        await collect(llm, [5], greedy(1), request_id="taken")
        steps = llm.llm_engine.num_steps
        with pytest.raises(ValueError, match=message):
            await collect(llm, prompt, params, request_id)
        assert not llm._ops and llm.num_unfinished_requests == 0
        assert llm.llm_engine.num_steps == steps and not llm.llm_engine.has_unfinished_requests()
        await llm.shutdown()

    run_async(main())


def test_an_id_is_in_use_only_while_its_client_listens(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model, num_blocks=12)
        first = llm.generate([5], greedy(20, output_kind=RequestOutputKind.DELTA), request_id="taken")
        await anext(first)  # running: its client listens
        with pytest.raises(ValueError, match="request_id 'taken' is in use"):
            await collect(llm, [1, 2], None, "taken")
        await first.aclose()  # the client leaves: its request is aborted, its id free
        again = await collect(llm, [5], greedy(2), request_id="taken")
        assert again[-1].finished and again[-1].outputs[0].token_ids == alone(
            model, EngineRequest("x", [5], 2)
        )
        await llm.shutdown()

    run_async(main())


def test_a_request_the_input_processor_made_is_served_as_it_is(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model, num_blocks=12)
        request = llm.check("made", [3, 4], greedy(4))
        with pytest.raises(ValueError, match="carries its own sampling_params and request_id"):
            await anext(llm.generate(request, greedy(4)))
        outputs = [out async for out in llm.generate(request)]
        first = llm.generate([5], greedy(20, output_kind=RequestOutputKind.DELTA), request_id="taken")
        await anext(first)
        with pytest.raises(ValueError, match="request_id 'taken' is in use"):
            await anext(llm.generate(replace(llm.check("other", [1], greedy(2)), request_id="taken")))
        await first.aclose()
        await llm.shutdown()
        assert free_blocks(llm) == 11
        return outputs

    outputs = run_async(main())
    assert outputs[-1].request_id == "made" and outputs[-1].finished
    assert outputs[-1].outputs[0].token_ids == alone(model, EngineRequest("x", [3, 4], 4))


def test_stop_strings_without_a_decode_fail_before_anything_is_queued(cpu_model):
    model = cpu_model.to("cpu")

    async def main():
        llm = AsyncLLM.from_engine_args(model, engine_args(12, block_size=4))
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            await collect(llm, [1, 2], greedy(3, stop="x"))
        assert llm._task is None and not llm._ops  # the loop was not even started
        outputs = await collect(llm, [1, 2], greedy(3))
        await llm.shutdown()
        return outputs

    assert len(run_async(main())[-1].outputs[0].token_ids) == 3


@pytest.mark.parametrize("error", [RuntimeError("the device fell over"), ValueError("a bad tensor")])
def test_an_engine_error_surfaces_as_engine_dead_error(cpu_model, error):
    model = cpu_model.to("cpu")

    async def main():
        llm = serving(model)
        runner = llm.llm_engine.engine_core.model_runner
        execute = runner.execute_model
        calls = []

        def failing(output):
            calls.append(output)
            if len(calls) == 3:
                raise error
            return execute(output)

        runner.execute_model = failing
        results = await asyncio.gather(
            collect(llm, PROMPTS[0], greedy(10)), collect(llm, PROMPTS[1], greedy(10)), return_exceptions=True
        )
        with pytest.raises(EngineDeadError):
            await collect(llm, [1], greedy(1))
        await llm.shutdown()  # does not raise; the running requests' blocks are freed
        return llm, results

    llm, results = run_async(main())
    for result in results:
        assert isinstance(result, EngineDeadError) and result.__cause__ is error
    assert llm.errored is error
    assert free_blocks(llm) == NUM_BLOCKS - 1

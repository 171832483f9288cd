"""``paged-kv serve``: the OpenAI-compatible server over the engine, driven by the real ``openai``
client and by raw HTTP (lesson 15).

Every server here serves the tiny GPT on a small pool, binds a free port of 127.0.0.1 in a
background thread (:class:`~paged_kv.entrypoints.openai.launcher.ServerThread`), and is stopped by
its fixture, which then checks that every block is free. Nothing here measures time: a wait is
bounded, never asserted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from paged_kv.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from paged_kv.entrypoints.openai.protocol import ChatMessageParam  # noqa: E402
from paged_kv.entrypoints.openai.serving_chat import apply_chat_template  # noqa: E402
from paged_kv.model.generation import generate  # noqa: E402
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode  # noqa: E402
from paged_kv.serving.async_llm import AsyncLLM  # noqa: E402
from paged_kv.serving.input_processor import InputProcessor  # noqa: E402
from paged_kv.serving.metrics import FINISH_REASONS, METRICS, REQUEST_SUCCESS, REQUEST_SUCCESS_METRIC  # noqa: E402

from . import helpers  # noqa: E402

pytestmark = pytest.mark.lesson16

MODEL = "tiny"
MAX_MODEL_LEN = 128
WAIT_S = 30.0  # the bound of every wait; never reached when things work


class GatedGPT(TinyGPT):
    """The tiny GPT whose forward waits while :attr:`gate` is closed: a test can hold the engine in the
    middle of a step, hang up a client, and know the abort came first."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def forward_step(self, *args, **kwargs):
        assert self.gate.wait(WAIT_S), "the gate stayed closed"
        return super().forward_step(*args, **kwargs)


@pytest.fixture(scope="module")
def model() -> GatedGPT:
    return GatedGPT()


class Served:
    """A running server and what it serves."""

    def __init__(self, model: GatedGPT, **engine_args) -> None:
        self.model = model
        args = helpers.engine_args(block_size=16, enable_prefix_caching=True, **engine_args)
        self.async_llm = AsyncLLM.from_engine_args(model, args, decode=decode)
        self.app = build_app(self.async_llm, model_name=MODEL, encode=encode)
        self.thread = ServerThread(self.app, graceful_seconds=2.0)
        self.url = self.thread.url
        # one client for the raw requests: httpx sets up TLS for each client it makes, and that is slow
        self.http = httpx.Client(base_url=self.url, timeout=WAIT_S)
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="not-needed", max_retries=0, timeout=WAIT_S
        )

    @property
    def memory(self):
        return self.async_llm.llm_engine.engine_core.scheduler.memory

    def idle(self) -> bool:
        """No client waits, and the engine holds no request (every abort applied)."""
        llm = self.async_llm
        return llm.num_unfinished_requests == 0 and not llm.llm_engine.has_unfinished_requests()

    def wait_idle(self) -> None:
        wait_until(self.idle, "the engine to finish or abort every request")

    def assert_pool_free(self) -> None:
        assert self.idle()
        assert self.memory.usage == 0.0
        assert self.memory.num_free_blocks == self.memory.num_blocks - 1  # all but the null block
        assert len(self.async_llm.llm_engine.output_processor) == 0

    def metrics(self) -> dict[str, float]:
        """The samples of ``/metrics``, by name and labels: ``{'vllm:x_total{...}': value}``."""
        text = self.http.get("/metrics").text
        samples = {}
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in LABELS)
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    def stop(self) -> None:
        self.client.close()
        self.http.close()
        self.thread.stop()
        assert not self.thread.thread.is_alive()
        self.assert_pool_free()


LABELS = {"model_name", "engine"}


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def server(model):
    """A pool of 48 blocks of 16 tokens, 8 requests at once at most."""
    served = Served(model, num_blocks=48, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def small(model):
    """A pool of 12 blocks (192 token slots), 4 requests at once at most: it queues, and may preempt."""
    served = Served(model, num_blocks=12, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    yield served
    served.stop()


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens :func:`paged_kv.generate` gives ``prompt`` alone (the tiny GPT has no end token)."""
    return generate(model, [prompt], max_tokens).tokens[0]


def post(served: Served, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return served.http.post(path, content=content, headers={"content-type": "application/json"})


# ------------------------------------------------------------------------------ the routes


def test_health_and_models(server):
    assert server.url == f"http://127.0.0.1:{server.thread.port}" and server.thread.port > 0
    health = server.http.get("/health")
    assert health.status_code == 200 and health.content == b""
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert models.data[0].object == "model"


def test_a_greedy_completion_is_paged_kv_generate(server):
    prompt = "The KV cache"
    expected = greedy(server.model, encode(prompt), 12)
    completion = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"return_token_ids": True}
    )
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
    assert completion.model == MODEL and isinstance(completion.created, int)
    (choice,) = completion.choices
    assert choice.token_ids == expected
    assert choice.text == decode(expected)
    assert choice.finish_reason == "length" and choice.index == 0
    assert choice.prompt_token_ids == encode(prompt)
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(prompt),
        12,
        len(prompt) + 12,
    )
    by_ids = server.client.completions.create(
        model=MODEL, prompt=encode(prompt), max_tokens=12, temperature=0.0
    )
    assert by_ids.choices[0].text == choice.text  # a prompt of token ids is the same prompt
    listed = server.client.completions.create(model=MODEL, prompt=[prompt], max_tokens=12, temperature=0.0)
    assert listed.choices[0].text == choice.text  # and so is a list of one prompt
    server.assert_pool_free()


def test_a_streamed_completion_sends_the_same_text_in_chunks(server):
    prompt = "Blocks are taken on demand"
    whole = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.0)
    chunks = list(
        server.client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=20,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *text_chunks, usage_chunk = chunks
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == len(prompt)
    server.assert_pool_free()


def test_a_request_is_checked_once_on_its_way_to_the_engine(server, monkeypatch):
    """One HTTP request, one run of the input processor: the server's check makes the request the
    engine core takes, streamed or not (vLLM checks in ``InputProcessor.process_inputs`` once)."""
    calls = []
    check = InputProcessor.process_inputs

    def counted(self, request_id, *args, **kwargs):
        calls.append(request_id)
        return check(self, request_id, *args, **kwargs)

    monkeypatch.setattr(InputProcessor, "process_inputs", counted)
    server.client.completions.create(model=MODEL, prompt="once", max_tokens=3, temperature=0.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "once"}], "max_tokens": 3}
    with server.http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200 and response.read().decode().endswith("data: [DONE]\n\n")
    assert len(calls) == 2 and calls[0].startswith("cmpl-") and calls[1].startswith("chatcmpl-")
    server.assert_pool_free()


def test_the_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": MODEL, "prompt": "SSE", "max_tokens": 5, "temperature": 0.0, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        chunk = json.loads(event.removeprefix("data: "))
        assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1


def test_a_chat_completion_is_the_templated_prompt_completed(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}]
    prompt = encode(apply_chat_template([ChatMessageParam(**m) for m in messages]))
    assert decode(prompt) == "<|system|>\nBe brief.\n<|user|>\nWhat is a block?\n<|assistant|>\n"
    expected = greedy(server.model, prompt, 10)
    chat = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0.0, extra_body={"return_token_ids": True}
    )
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    (choice,) = chat.choices
    assert choice.message.role == "assistant"
    assert choice.token_ids == expected and choice.message.content == decode(expected)
    assert choice.finish_reason == "length"
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 10
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0.0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    server.assert_pool_free()


def test_a_chat_without_max_tokens_may_fill_the_context(server):
    """vLLM's ``get_max_tokens``: no ``max_tokens``, as many as ``max_model_len`` leaves."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    ]
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0)
    prompt = encode("<|user|>\nHi\nthere\n<|assistant|>\n")
    assert chat.usage.prompt_tokens == len(prompt)
    assert chat.usage.completion_tokens == MAX_MODEL_LEN - len(prompt)
    assert chat.choices[0].finish_reason == "length"
    capped = server.client.completions.create(model=MODEL, prompt="x" * 100, max_tokens=1000, temperature=0.0)
    assert capped.usage.completion_tokens == MAX_MODEL_LEN - 100  # max_tokens is capped, as vLLM caps it


# ------------------------------------------------------------------------------ sampling


def test_n_completions_share_the_prompts_blocks(server):
    prompt = "n children of one prompt share its full blocks! "  # 48 bytes: 3 full blocks of 16
    before = server.metrics()
    completion = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        n=4,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    after = server.metrics()
    assert sorted(c.index for c in completion.choices) == [0, 1, 2, 3]
    assert completion.usage.completion_tokens == 4 * 6 and completion.usage.prompt_tokens == len(prompt)
    hits = after["vllm:prefix_cache_hits_total{}"] - before["vllm:prefix_cache_hits_total{}"]
    assert hits >= 3 * 32  # children 1 to 3 found child 0's blocks (the last one is computed again)
    # child i is a request of its own with seed + i (vLLM's ParentRequest)
    single = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=1.0,
        seed=13,
        extra_body={"return_token_ids": True},
    )
    assert completion.choices[2].token_ids == single.choices[0].token_ids
    server.assert_pool_free()


def test_a_stop_string_ends_the_text_before_it(server):
    prompt = "Stop strings"
    tokens = greedy(server.model, encode(prompt), 40)
    text = decode(tokens)
    at = next(i for i in range(3, len(text) - 1) if text[i].isascii() and text[i + 1].isascii())
    stop = text[at : at + 2]
    completion = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0, stop=[stop, "never there"]
    )
    (choice,) = completion.choices
    assert choice.text == text[: text.find(stop)]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    streamed = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == choice.text  # never half a stop string sent
    assert chunks[-1].choices[0].finish_reason == "stop"
    server.assert_pool_free()


def test_a_stop_token_id_is_kept_and_named(server):
    prompt = "Stop token ids"
    tokens = greedy(server.model, encode(prompt), 20)
    stop_id = tokens[5]
    completion = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        temperature=0.0,
        extra_body={"stop_token_ids": [stop_id], "return_token_ids": True},
    )
    (choice,) = completion.choices
    assert choice.token_ids == tokens[: tokens.index(stop_id) + 1]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop_id


def test_a_seed_gives_the_same_text_alone_and_in_a_crowd(server):
    def seeded() -> str:
        return (
            server.client.completions.create(
                model=MODEL, prompt="A seeded request", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234
            )
            .choices[0]
            .text
        )

    def other(i: int) -> str:
        return (
            server.client.completions.create(
                model=MODEL,
                prompt=f"another request {i}",
                max_tokens=24,
                temperature=1.0,
                extra_body={"top_k": 20},
            )
            .choices[0]
            .text
        )

    alone = seeded()
    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(other, i) for i in range(5)]
        crowd = pool.submit(seeded)
        assert crowd.result() == alone
        for future in others:
            future.result()
    assert seeded() == alone
    server.assert_pool_free()


# ------------------------------------------------------------------------------ /metrics


def test_metrics_have_vllms_names_and_move(server):
    text = server.http.get("/metrics").text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    for spec in (*METRICS, REQUEST_SUCCESS_METRIC):  # each family as serving.metrics declares it
        family = families[spec.name]
        assert family.type == spec.type and family.documentation == spec.documentation
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
            assert set(sample.labels) - {"le"} == set(spec.labelnames)
        if spec.type == "histogram":
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*spec.buckets, float("inf")]
    success = families[REQUEST_SUCCESS].samples
    assert {s.labels["finished_reason"] for s in success if s.name.endswith("_total")} == set(FINISH_REASONS)
    before = server.metrics()
    prompt = "metrics move"
    server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0.0)
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("vllm:generation_tokens_total{}") == 7
    assert moved("vllm:prompt_tokens_total{}") == len(prompt)
    assert moved("vllm:prefix_cache_queries_total{}") == len(prompt)
    assert moved("vllm:request_success_total{finished_reason=length}") == 1
    assert moved("vllm:e2e_request_latency_seconds_count{}") == 1
    assert moved("vllm:time_to_first_token_seconds_count{}") == 1
    assert moved("vllm:inter_token_latency_seconds_count{}") == 6
    assert after["vllm:num_requests_running{}"] == 0 and after["vllm:kv_cache_usage_perc{}"] == 0


def test_two_servers_in_one_process_keep_their_own_metrics(server, small):
    small.client.completions.create(model=MODEL, prompt="only on the small one", max_tokens=3)
    assert (
        small.metrics()["vllm:generation_tokens_total{}"]
        != server.metrics()["vllm:generation_tokens_total{}"]
    )
    assert small.app.state.stat_logger.registry is not server.app.state.stat_logger.registry


# ------------------------------------------------------------------------------ errors


TOO_LONG = (  # the input processor's words: the course checks a request once (vLLM's renderer words it too)
    "The decoder prompt (length 200) is longer than the maximum model length of 128. Make sure that "
    "`max_model_len` is no smaller than the number of text tokens."
)
BAD_REQUESTS = [
    # (path, body, status, type, message fragment, param)
    pytest.param(
        "/v1/completions", '{"model": "tiny", "prompt": "x"', 400, "Bad Request", "JSON decode error", None
    ),
    pytest.param("/v1/completions", "[1, 2]", 400, "Bad Request", "validation error", None),
    pytest.param("/v1/completions", {"model": MODEL}, 400, "Bad Request", "Field required", "body.prompt"),
    pytest.param(
        "/v1/completions", {"prompt": {"a": 1}}, 400, "Bad Request", "validation error", "body.prompt"
    ),
    pytest.param(
        "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "Bad Request", "valid integer", None
    ),
    pytest.param("/v1/completions", {"prompt": "x" * 200}, 400, "BadRequestError", TOO_LONG, None),
    pytest.param(
        "/v1/completions", {"prompt": "x" * 128}, 400, "BadRequestError", "(at least 1) is longer than", None
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 0},
        400,
        "BadRequestError",
        "max_tokens must be at least 1, got 0.",
        None,
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "max_tokens": -3},
        400,
        "BadRequestError",
        "max_tokens must be at least 1, got -3.",
        None,
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "temperature": -0.5},
        400,
        "BadRequestError",
        "temperature must be non-negative, got -0.5.",
        None,
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "top_p": 0},
        400,
        "BadRequestError",
        "top_p must be in (0, 1], got 0.0.",
        None,
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "top_p": 1.5},
        400,
        "BadRequestError",
        "top_p must be in (0, 1], got 1.5.",
        None,
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "n": 17},
        400,
        "BadRequestError",
        "n must be at most 16, got 17.",
        None,
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "n": 2, "temperature": 0},
        400,
        "BadRequestError",
        "n must be 1 when using greedy sampling, got 2.",
        None,
    ),
    pytest.param(
        "/v1/completions", {"prompt": [300, 1]}, 400, "BadRequestError", "token ids in [0, 256)", None
    ),
    pytest.param("/v1/completions", {"prompt": ""}, 400, "BadRequestError", "non-empty", None),
    pytest.param(  # one bad prompt of a list refuses them all: the good one never runs
        "/v1/completions", {"prompt": ["fine", "x" * 200]}, 400, "BadRequestError", TOO_LONG, None
    ),
    pytest.param(
        "/v1/completions",
        {"model": "gpt-4", "prompt": "x"},
        404,
        "NotFoundError",
        "The model `gpt-4` does not exist.",
        "model",
    ),
    pytest.param(
        "/v1/completions",
        {"prompt": "x", "temperature": -1, "stream": True},
        400,
        "BadRequestError",
        "temperature",
        None,
    ),
    pytest.param(
        "/v1/chat/completions", {"messages": []}, 400, "BadRequestError", "at least one message", "messages"
    ),
    pytest.param(
        "/v1/chat/completions",
        {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
        404,
        "NotFoundError",
        "The model `gpt-4` does not exist.",
        "model",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "BadRequestError",
        "text only",
        "messages",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "BadRequestError",
        "max_tokens must be at least 1",
        None,
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "n": 99, "stream": True},
        400,
        "BadRequestError",
        "n must be at most 16, got 99.",
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "err_type", "message", "param"), BAD_REQUESTS)
def test_a_bad_request_is_refused_in_openais_format_and_changes_nothing(
    server, path, body, status, err_type, message, param
):
    llm = server.async_llm
    view, steps, metrics = llm.kv_view, llm.llm_engine.num_steps, server.http.get("/metrics").text
    response = post(server, path, body)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and set(response.json()) == {"error"}
    assert error["code"] == status and error["type"] == err_type
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert llm.kv_view is view and llm.llm_engine.num_steps == steps  # not one step ran
    assert server.http.get("/metrics").text == metrics
    server.assert_pool_free()


def test_the_openai_client_raises_on_errors(server):
    with pytest.raises(openai.NotFoundError) as error:
        server.client.completions.create(model="gpt-4", prompt="x")
    assert error.value.body["message"] == "The model `gpt-4` does not exist."
    with pytest.raises(openai.BadRequestError) as error:
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2.0
        )
    assert error.value.body["message"] == "top_p must be in (0, 1], got 2.0."


def test_unknown_routes_and_methods_answer_in_the_error_format(server):
    missing = server.http.get("/v1/nothing")
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}
    }
    wrong = server.http.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405


def test_build_app_needs_an_engine_that_detokenizes(model):
    args = helpers.engine_args(8, block_size=16, max_model_len=64)
    with pytest.raises(ValueError, match="decode"):
        build_app(AsyncLLM.from_engine_args(model, args), model_name=MODEL, encode=encode)
    app = build_app(AsyncLLM.from_engine_args(model, args, decode=decode), model_name=MODEL, encode=encode)
    assert app.state.max_model_len == 64  # the engine's, the one the input processor checks


# ------------------------------------------------------------------------------ load and hang-ups


def test_load_queues_rather_than_fails(small):
    """12 requests at once on a pool that runs three or four at most: the rest wait (and running ones
    may be preempted), and all are served, each with the tokens it gets alone."""
    prompts = [f"request {i:02d} asks for its tokens, queued" for i in range(12)]  # 40 tokens each

    def ask(prompt: str) -> list[int]:
        completion = small.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0, extra_body={"return_token_ids": True}
        )
        assert completion.choices[0].finish_reason == "length"
        return completion.choices[0].token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(ask, prompts))
    assert served == generate(small.model, [encode(p) for p in prompts], 24).tokens
    small.wait_idle()
    small.assert_pool_free()


def hang_up_on(served: Served, body: dict) -> str:
    """Send ``body`` on a raw connection, while the engine is held mid-step; wait until the server took
    the request (and, streamed, answered its headers); hang up. Returns the aborted request's id."""
    aborted: list[str] = []
    original = served.async_llm.abort

    def recording(request_id: str) -> None:
        aborted.append(request_id)
        original(request_id)

    served.async_llm.abort = recording
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {served.thread.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    served.model.gate.clear()
    try:
        with socket.create_connection((served.thread.host, served.thread.port), timeout=WAIT_S) as conn:
            conn.sendall(head + payload)
            wait_until(
                lambda: served.async_llm.num_unfinished_requests == 1, "the request to reach the engine"
            )
            if body.get("stream"):  # the stream has started (its headers came): Starlette watches it
                assert conn.makefile("rb").readline().startswith(b"HTTP/1.1 200")
        wait_until(lambda: aborted, "the hang-up to abort the request")
    finally:
        served.model.gate.set()
        del served.async_llm.abort
    served.wait_idle()
    served.assert_pool_free()
    return aborted[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_hangs_up_aborts_its_request(small, stream):
    before = small.metrics()
    request_id = hang_up_on(
        small, {"model": MODEL, "prompt": "hang up " * 4, "max_tokens": 60, "stream": stream}
    )
    assert request_id.startswith("cmpl-")
    after = small.metrics()  # the abort is recorded at once: the gauges show the blocks back
    assert after["vllm:num_requests_running{}"] == 0 and after["vllm:kv_cache_usage_perc{}"] == 0
    # as vLLM's front end, an abort records no finished request: no reason of vllm:request_success moved
    success = [name for name in after if name.startswith("vllm:request_success_total")]
    assert success and all(after[name] == before.get(name, 0) for name in success)
    after = small.client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert after.usage.completion_tokens == 3


def test_fifty_streams_that_hang_up_at_random_points_free_every_block(small):
    rng = random.Random(15)
    plans = [(rng.randrange(8, 60), rng.randrange(0, 30), rng.random() < 0.8) for _ in range(50)]

    async def one(http, i: int, prompt_len: int, hang_up_after: int, stream: bool) -> None:
        body = {"model": MODEL, "prompt": "x" * prompt_len, "max_tokens": 24, "stream": stream, "seed": i}
        if not stream:  # hang up after a moment (the request may or may not be done by then)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(http.post("/v1/completions", json=body), timeout=0.002 * hang_up_after)
            return
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = 0
            async for _ in response.aiter_lines():
                lines += 1
                if lines > hang_up_after:
                    break  # leaving the block closes the connection mid-stream

    async def all_of_them() -> None:
        limits = httpx.Limits(max_connections=len(plans))
        async with httpx.AsyncClient(base_url=small.url, timeout=WAIT_S, limits=limits) as http:
            requests = (one(http, i, *plan) for i, plan in enumerate(plans))
            await asyncio.wait_for(asyncio.gather(*requests), WAIT_S)

    asyncio.run(all_of_them())
    small.wait_idle()
    small.assert_pool_free()
    assert small.async_llm.kv_view.num_running == 0 and small.async_llm.errored is None
    done = small.client.completions.create(
        model=MODEL, prompt="after the storm", max_tokens=4, temperature=0.0
    )
    assert done.choices[0].text == decode(greedy(small.model, encode("after the storm"), 4))


def test_stopping_the_server_mid_stream_frees_every_block(model):
    served = Served(model, num_blocks=16, max_model_len=MAX_MODEL_LEN)
    body = {"model": MODEL, "prompt": "stopped while streaming", "max_tokens": 100, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())  # one chunk arrived: the request runs
        served.stop()  # the stream is cut (or finishes) within the grace period; then the engine stops
    assert served.async_llm.kv_view.num_running == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health", timeout=WAIT_S)

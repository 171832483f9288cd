"""The server's request surface (lesson 16): every field of OpenAI's and vLLM's requests served, a
no-op or refused, log-probabilities in OpenAI's shapes, a list of prompts, the tokenizer's endpoints.

Driven by the real ``openai`` client (and raw HTTP for what the client cannot send) against servers
on free ports of 127.0.0.1, one per policy for the module (``fcfs`` and ``priority``). Each fixture
checks at the end that every block is free; each refusal, that not one step ran.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("httpx")

from paged_kv import __version__  # noqa: E402
from paged_kv.cli import build_parser, build_serve_app  # noqa: E402
from paged_kv.entrypoints.openai.fields import FIELDS, MODELS, NO_OP, REFUSED, SERVED, render_markdown  # noqa: E402
from paged_kv.entrypoints.openai.protocol import ChatMessageParam  # noqa: E402
from paged_kv.entrypoints.openai.serving_chat import apply_chat_template  # noqa: E402
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode  # noqa: E402
from paged_kv.serving.input_processor import InputProcessor  # noqa: E402
from paged_kv.serving.llm_engine import LLMEngine  # noqa: E402
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

from . import helpers  # noqa: E402
from .test_server import MAX_MODEL_LEN, MODEL, GatedGPT, Served, post  # noqa: E402

pytestmark = pytest.mark.lesson16

DOC = Path(__file__).resolve().parents[1] / "docs" / "server_fields.md"
MAX_LOGPROBS = 5
MESSAGES = [{"role": "user", "content": "What is a block?"}]

# vLLM 0.33.0's request fields (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py), by name
VLLM_COMPLETION_FIELDS = [
    "model",
    "prompt",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "prompt_embeds",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "return_weight_versions",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
]
VLLM_CHAT_FIELDS = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "thinking_token_budget",
    "include_reasoning",
    "parallel_tool_calls",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "return_weight_versions",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
]


@pytest.fixture(scope="module")
def model() -> GatedGPT:
    return GatedGPT()


@pytest.fixture(scope="module")
def server(model):
    served = Served(model, num_blocks=48, max_model_len=MAX_MODEL_LEN, max_logprobs=MAX_LOGPROBS)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def by_priority(model):
    served = Served(model, num_blocks=24, max_model_len=MAX_MODEL_LEN, scheduling_policy="priority")
    yield served
    served.stop()


@pytest.fixture
def captured(monkeypatch):
    """The engine requests the input processor makes, as the engine core takes them."""
    made = []
    process = InputProcessor.process_inputs

    def recording(self, *args, **kwargs):
        made.append(process(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(InputProcessor, "process_inputs", recording)
    return made


def engine_run(model, prompt: list[int], **params) -> object:
    """The offline engine's final output for ``prompt``: what the server's logprobs must equal."""
    engine = LLMEngine.from_engine_args(
        model, helpers.engine_args(32, block_size=16, max_model_len=MAX_MODEL_LEN), decode=decode
    )
    engine.add_request("r", prompt, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1]


def refused_nothing_changed(served: Served, path: str, body: dict, param: str, message: str) -> dict:
    """Post ``body``: a 400 whose ``param`` is ``param`` and whose message holds ``message``; not one
    step ran and every block is free."""
    llm = served.async_llm
    steps, view = llm.llm_engine.num_steps, llm.kv_view
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert llm.llm_engine.num_steps == steps and llm.kv_view is view
    served.assert_pool_free()
    return error


# ------------------------------------------------------------------------------ the table


def test_every_field_is_in_the_table_the_doc_and_vllms_and_openais_lists():
    for api, rules in FIELDS.items():
        assert set(rules) == set(MODELS[api].model_fields), api
        assert {rule.status for rule in rules.values()} <= {SERVED, NO_OP, REFUSED}
    assert DOC.read_text(encoding="utf-8") == render_markdown(), (
        "docs/server_fields.md is stale: python -m paged_kv.entrypoints.openai.fields > docs/server_fields.md"
    )
    assert set(VLLM_COMPLETION_FIELDS) <= set(FIELDS["completions"])
    assert set(VLLM_CHAT_FIELDS) <= set(FIELDS["chat"])
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    assert set(completion_create_params.CompletionCreateParamsBase.__annotations__) <= set(
        FIELDS["completions"]
    )
    assert set(chat_create_params.CompletionCreateParamsBase.__annotations__) <= set(FIELDS["chat"])


REFUSED_BODIES = [
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logprob_token_ids": [1], "logprobs": 1}, "logprob_token_ids"),
    ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"store": True}, "store"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED_BODIES)
def test_a_field_the_server_does_not_implement_is_refused_by_name(server, path, extra, param):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    error = refused_nothing_changed(server, path, body | extra, param, f"does not implement `{param}`")
    assert error["type"] == "BadRequestError"


def test_defaults_and_no_ops_are_served_and_unknown_fields_logged(server, caplog):
    same = {"response_format": {"type": "text"}, "best_of": 1, "user": "u", "length_penalty": 2.0}
    plain = server.client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="paged_kv.entrypoints.openai"):
        extra = server.client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, temperature=0.0, extra_body=same | {"frobnicate": 1}
        )
    assert extra.choices[0].text == plain.choices[0].text
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == ["The following fields were present in the request but ignored: {'frobnicate'}"]
    chat = server.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=3,
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="none",  # tools the model may not call change nothing
        extra_body={"safety_identifier": "s"},
    )
    assert chat.usage.completion_tokens == 3


# ------------------------------------------------------------------------------ log-probabilities


def test_completion_logprobs_with_echo_are_a_log_softmax_of_the_models_logits(server, device):
    prompt = "The KV cache"
    completion = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0.0,
        logprobs=3,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    (choice,) = completion.choices
    ids = encode(prompt) + choice.token_ids
    assert choice.text == decode(choice.token_ids)  # with token ids vLLM leaves the echoed prompt's text out
    lp = choice.logprobs
    assert lp.tokens == [decode([t]) for t in ids]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = TinyGPT().to(device)  # the served model's weights (the same seed), on the device
    with torch.no_grad():
        logits = reference.forward(torch.tensor([ids], device=device))[0].float().cpu()
    expected = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=1e-4)
        top = lp.top_logprobs[i]
        assert len(top) <= 4 and lp.tokens[i] in top  # logprobs + 1 of them, the chosen one among them
        assert decode([int(expected[i - 1].argmax())]) in top  # the likeliest token is there
        for text, value in top.items():  # tokens of one text share a key (vLLM's dict by text, too)
            assert any(
                abs(expected[i - 1, t].item() - value) < 1e-4 for t in range(256) if decode([t]) == text
            )
    streamed = list(
        server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=3, echo=True, stream=True
        )
    )
    parts = [c.choices[0].logprobs for c in streamed]
    assert "".join(c.choices[0].text for c in streamed) == prompt + choice.text
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [t for p in parts for t in p.text_offset] == lp.text_offset
    flat = [x for p in parts for x in p.token_logprobs]
    assert flat[0] is None and flat[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    only = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].text == prompt and len(only.choices[0].logprobs.tokens) == len(prompt)
    server.assert_pool_free()


def test_chat_logprobs_are_the_engines_whole_and_streamed(server):
    prompt = encode(apply_chat_template([ChatMessageParam(**m) for m in MESSAGES]))
    engine = engine_run(server.model, prompt, max_tokens=5, temperature=0.0, logprobs=2)
    (out,) = engine.outputs
    chat = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry, token, position in zip(content, out.token_ids, out.logprobs, strict=True):
        chosen = position[token]
        assert entry.token == chosen.decoded_token and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(chosen.logprob, abs=1e-6)
        assert [t.token for t in entry.top_logprobs] == [
            lp.decoded_token for lp in list(position.values())[:2]
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp.logprob for lp in list(position.values())[:2]], abs=1e-6
        )
    streamed = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            temperature=0.0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    tokens = [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]
    as_ids = server.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        temperature=0.0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert [e.token for e in as_ids.choices[0].logprobs.content] == [
        f"token_id:{t}" for t in out.token_ids[:2]
    ]
    server.assert_pool_free()


def test_the_logprob_limit_and_the_penalties_are_refused_in_vllms_words(server):
    refused_nothing_changed(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 6},
        "logprobs",
        f"Requested sample logprobs of 6, which is greater than max allowed: {MAX_LOGPROBS}",
    )
    refused_nothing_changed(
        server,
        "/v1/chat/completions",
        {"messages": MESSAGES, "top_logprobs": 2},
        "top_logprobs",
        "when using `top_logprobs`, `logprobs` must be set to true.",
    )
    refused_nothing_changed(
        server, "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"
    )
    refused_nothing_changed(
        server,
        "/v1/completions",
        {"prompt": "x", "repetition_penalty": 0},
        "repetition_penalty",
        "greater than zero",
    )
    refused_nothing_changed(
        server,
        "/v1/completions",
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        "prompt_logprobs",
        "`prompt_logprobs` are not available when `stream=True`.",
    )


# ------------------------------------------------------------------------------ what reaches the engine


def test_sampling_fields_priority_and_cache_salt_reach_the_engine(by_priority, captured):
    body = {
        "model": MODEL,
        "prompt": "bad words are banned",
        "max_tokens": 4,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "min_tokens": 2,
        "logit_bias": {"65": 3.0},
        "bad_words": ["ban"],
        "seed": 7,
        "priority": 3,
        "cache_salt": "tenant-a",
    }
    response = post(by_priority, "/v1/completions", body)
    assert response.status_code == 200, response.text
    (request,) = captured
    params = request.sampling_params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (params.min_p, params.min_tokens, params.logit_bias, params.seed) == (0.1, 2, {65: 3.0}, 7)
    assert params.bad_words_token_ids == (tuple(encode("ban")),)  # " ban" is a token longer: not added
    assert (request.priority, request.cache_salt) == (3, "tenant-a")
    headers = {"X-Vllm-Priority": "-2", "X-Request-Id": "mine"}
    by_header = by_priority.http.post("/v1/completions", json=body | {"stream": False}, headers=headers)
    assert by_header.json()["id"] == "cmpl-mine" and captured[-1].priority == -2
    assert captured[-1].request_id == "cmpl-mine-0"
    forced = by_priority.client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, temperature=0.0, logit_bias={"66": 100}
    )
    assert forced.choices[0].text == "BBBBB"  # a bias of 100 makes token 66 the argmax
    by_priority.assert_pool_free()


def test_priority_and_cache_salt_are_checked_as_vllm_checks_them(server, by_priority):
    refused_nothing_changed(
        server,
        "/v1/completions",
        {"prompt": "x", "priority": 1},
        "priority",
        "Priority scheduling is not enabled",
    )
    refused_nothing_changed(
        by_priority, "/v1/completions", {"prompt": "x", "priority": 1.5}, "body.priority", "integer"
    )
    refused_nothing_changed(
        by_priority,
        "/v1/completions",
        {"prompt": "x", "cache_salt": "a/b"},
        "cache_salt",
        "must not contain '@'",
    )
    refused_nothing_changed(
        by_priority, "/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt", "non-empty string"
    )


# ------------------------------------------------------------------------------ many prompts, endpoints


def test_a_list_of_prompts_is_answered_each_indexed_whole_and_streamed(server):
    prompts = ["first prompt", "the second", encode("third, as ids")]
    alone = [
        server.client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0.0).choices[0].text
        for p in prompts
    ]
    listed = [prompts[0], prompts[1], decode(prompts[2])]
    many = server.client.completions.create(model=MODEL, prompt=listed, max_tokens=5, temperature=0.0)
    assert [c.index for c in many.choices] == [0, 1, 2] and [c.text for c in many.choices] == alone
    assert (
        many.usage.prompt_tokens == sum(len(encode(p)) for p in listed) and many.usage.completion_tokens == 15
    )
    sampled = server.client.completions.create(
        model=MODEL,
        prompt=[[1, 2, 3], [4, 5, 6]],
        max_tokens=3,
        n=2,
        seed=5,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]  # prompt * n + j, as vLLM
    assert [c.prompt_token_ids for c in sampled.choices] == [[1, 2, 3]] * 2 + [[4, 5, 6]] * 2
    chunks = list(
        server.client.completions.create(
            model=MODEL,
            prompt=listed,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert [texts[i] for i in range(3)] == alone and chunks[-1].usage.completion_tokens == 15
    server.assert_pool_free()


def test_tokenize_detokenize_version_and_one_model(server):
    http = server.http
    tokens = http.post("/tokenize", json={"prompt": "héllo", "return_token_strs": True}).json()
    assert tokens == {
        "count": 6,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": encode("héllo"),
        "token_strs": [decode([t]) for t in encode("héllo")],
    }
    chat = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    asked = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == asked.usage.prompt_tokens and chat["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": encode("héllo")}).json() == {"prompt": "héllo"}
    assert http.post("/detokenize", json={"tokens": [300]}).json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    assert http.get("/version").json() == {"version": __version__}
    card = server.client.models.retrieve(MODEL)
    assert card.id == MODEL and card.max_model_len == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as missing:
        server.client.models.retrieve("gpt-4")
    assert missing.value.body == {
        "message": "The model `gpt-4` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_chat_echo_and_an_open_final_message(server):
    messages = [*MESSAGES, {"role": "assistant", "content": "A block is"}]
    answer = server.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        temperature=0.0,
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False},
    )
    prompt = encode(apply_chat_template([ChatMessageParam(**m) for m in messages], False, True))
    assert decode(prompt).endswith("<|assistant|>\nA block is")
    assert answer.choices[0].message.content.startswith("A block is") and answer.usage.prompt_tokens == len(
        prompt
    )
    refused_nothing_changed(
        server,
        "/v1/chat/completions",
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
        "continue_final_message",
        "Cannot set both",
    )


def test_serve_passes_the_scheduling_policy_and_the_logprob_limit():
    args = build_parser().parse_args(
        [
            "serve",
            "--tiny",
            "--num-gpu-blocks-override",
            "8",
            "--scheduling-policy",
            "priority",
            "--max-logprobs",
            "-1",
        ]
    )
    app, _ = build_serve_app(args)
    config = app.state.async_llm.vllm_config
    assert config.scheduler_config.policy == "priority" and config.model_config.max_logprobs == -1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--scheduling-policy", "lottery"])

"""What the server does with every field of a request: one table, its check, and its page (lesson 16).

A client written for OpenAI or vLLM may send any field of their APIs; the server never drops one in
silence. :data:`FIELDS` gives each field of each request model of
:mod:`~paged_kv.entrypoints.openai.protocol` one of three statuses:

* ``served``: the field does what OpenAI's or vLLM's documentation says;
* ``no-op``: accepted, and whatever its value it changes nothing for this server (``user``, an id
  OpenAI keeps for abuse reports; ``length_penalty``, read by beam search only, which is refused);
* ``refused``: not implemented here; any value but the default (or one the note names as equal to
  it) is a 400 ``BadRequestError`` whose ``param`` is the field, before the engine sees anything.

A field no model declares is an *extra*: kept, ignored and logged, as vLLM logs it ("The following
fields were present in the request but ignored: {...}"). ``docs/server_fields.md`` is
:func:`render_markdown`'s output (``python -m paged_kv.entrypoints.openai.fields >
docs/server_fields.md`` writes it), and a test checks that the page, the table and the models agree.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from paged_kv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from paged_kv.errors import ValidationError

SERVED, NO_OP, REFUSED = "served", "no-op", "refused"
OPENAI, VLLM, OPENAI_ONLY = "OpenAI", "vLLM", "OpenAI (not in vLLM)"


@dataclass(frozen=True)
class FieldRule:
    """What the server does with one field (see the module). ``origin`` is the API that defines
    it; for a ``refused`` field, ``allowed(value, request)`` says whether a value other than the
    model's default is served all the same (``response_format`` ``{"type": "text"}``, say)."""

    status: str
    origin: str
    note: str
    allowed: Callable[[object, BaseModel], bool] | None = None


def _served(origin: str, note: str) -> FieldRule:
    return FieldRule(SERVED, origin, note)


def _no_op(origin: str, note: str) -> FieldRule:
    return FieldRule(NO_OP, origin, note)


def _refused(origin: str, note: str, allowed: Callable[[object, BaseModel], bool] | None = None) -> FieldRule:
    return FieldRule(REFUSED, origin, note, allowed)


# ------------------------------------------------------------------------------ the rules

_SHARED: dict[str, FieldRule] = {
    "model": _served(OPENAI, "the served name, or left out; another name is a 404 NotFoundError"),
    "frequency_penalty": _served(OPENAI, "SamplingParams.frequency_penalty, in [-2, 2] (vLLM's check)"),
    "logit_bias": _served(
        OPENAI,
        "SamplingParams.logit_bias: token id (a JSON string) to a bias, clamped to [-100, 100]; ids outside "
        "the vocabulary refused",
    ),
    "n": _served(
        OPENAI,
        "completions per prompt (at most 16; n > 1 needs temperature > 0), sharing the prompt's cached "
        "blocks",
    ),
    "presence_penalty": _served(OPENAI, "SamplingParams.presence_penalty, in [-2, 2]"),
    "seed": _served(
        OPENAI,
        "a generator of the request's own: the same tokens whatever runs beside it (child i of n gets seed +"
        " i)",
    ),
    "stop": _served(
        OPENAI,
        "stop strings: the text ends before the first one found (finish_reason stop, stop_reason the string)",
    ),
    "stream": _served(OPENAI, "server-sent events, DELTA outputs, then data: [DONE]"),
    "stream_options": _served(
        OPENAI,
        "include_usage: a last chunk with the usage; continuous_usage_stats (vLLM): usage in every chunk; "
        "only with stream",
    ),
    "temperature": _served(OPENAI, "in [0, 2], 1.0 left out; 0 is greedy"),
    "top_p": _served(OPENAI, "in (0, 1], 1.0 left out"),
    "user": _no_op(OPENAI, "an end-user id OpenAI keeps for abuse monitoring; vLLM ignores it too"),
    "use_beam_search": _refused(VLLM, "beam search is not implemented: only false"),
    "top_k": _served(VLLM, "SamplingParams.top_k (0 or -1: every token)"),
    "min_p": _served(VLLM, "SamplingParams.min_p, in [0, 1]"),
    "repetition_penalty": _served(
        VLLM, "SamplingParams.repetition_penalty (> 0, 1 off), prompt and output tokens"
    ),
    "watermarking": _refused(
        VLLM, "no watermarking logits processor: only null or false", lambda v, _: not v
    ),
    "length_penalty": _no_op(VLLM, "read by beam search only, which is refused"),
    "stop_token_ids": _served(
        VLLM, "token ids that stop the request (kept in token_ids; stop_reason the id)"
    ),
    "include_stop_str_in_output": _refused(
        VLLM, "the stop string is always left out of the text: only false"
    ),
    "ignore_eos": _served(VLLM, "generate past the model's end-of-sequence tokens"),
    "min_tokens": _served(
        VLLM, "SamplingParams.min_tokens: stop tokens masked and stop strings unseen until then"
    ),
    "skip_special_tokens": _no_op(
        VLLM, "the served decode is fixed (the course's byte tokenizer has no special tokens)"
    ),
    "spaces_between_special_tokens": _no_op(VLLM, "the served decode is fixed (no special tokens to space)"),
    "truncate_prompt_tokens": _refused(VLLM, "prompts are never truncated: a prompt too long is refused"),
    "truncation_side": _no_op(VLLM, "read with truncate_prompt_tokens only, which is refused"),
    "allowed_token_ids": _refused(VLLM, "no allowed-token mask in the sampler: only null"),
    "prompt_logprobs": _served(
        VLLM,
        "SamplingParams.prompt_logprobs: each prompt token's log-probability and the top k (None first); at "
        "most --max-logprobs; not with stream",
    ),
    "logprob_token_ids": _refused(
        VLLM, "log-probabilities of chosen token ids are not implemented: only null or []", lambda v, _: not v
    ),
    "bad_words": _served(
        VLLM, "SamplingParams.bad_words, tokenized with the served tokenizer (update_from_tokenizer)"
    ),
    "response_format": _refused(
        VLLM, 'no structured outputs: only null or {"type": "text"}', lambda v, _: v == {"type": "text"}
    ),
    "structured_outputs": _refused(VLLM, "no structured outputs (json, regex, choice, grammar): only null"),
    "priority": _served(
        VLLM,
        "the request's priority (lower first) under --scheduling-policy priority; a header X-Vllm-Priority "
        "with an integer wins, as in vLLM; other than 0 refused under fcfs",
    ),
    "request_id": _served(
        VLLM,
        "the response's id is cmpl- (chatcmpl-) then it, a header X-Request-Id winning; refused while"
        " a request of that id runs",
    ),
    "session_id": _no_op(VLLM, "vLLM routes by it across engines; one engine here"),
    "return_tokens_as_token_ids": _served(VLLM, "log-probabilities' tokens as 'token_id:' and the id"),
    "return_token_ids": _served(VLLM, "token_ids in each choice, prompt_token_ids once"),
    "return_weight_versions": _refused(VLLM, "weights never change while serving: only false"),
    "routed_experts_prompt_start": _no_op(
        VLLM, "read with routed experts' data only, which no served model has"
    ),
    "return_token_offsets": _no_op(VLLM, "vLLM reads it on its /render endpoints only and ignores it here"),
    "mm_payload": _no_op(VLLM, "vLLM reads it on its /render endpoints only and ignores it here"),
    "return_mm_kwargs": _no_op(VLLM, "mm_payload's deprecated alias, ignored here likewise"),
    "cache_salt": _served(
        VLLM,
        "enters the first block's hash as vLLM's extra keys do: two salts never share a block (at most 128 "
        "characters, no @ / \\ or NUL)",
    ),
    "kv_transfer_params": _refused(VLLM, "no disaggregated prefill (KV connector): only null"),
    "ec_transfer_params": _refused(VLLM, "no encoder-cache transfer: only null"),
    "vllm_xargs": _refused(VLLM, "no custom extension reads them: only null or {}", lambda v, _: not v),
    "repetition_detection": _refused(VLLM, "no repetition detection: only null"),
    "thinking_token_budget": _refused(
        VLLM, "no reasoning models: only null or -1 (unlimited)", lambda v, _: v == -1
    ),
    "stream_interval": _refused(VLLM, "every step's tokens are sent: only null or 1", lambda v, _: v == 1),
}

_COMPLETION_ONLY: dict[str, FieldRule] = {
    "prompt": _served(
        OPENAI,
        "a string, a list of token ids, or a list of either: each prompt a request, index = prompt * n + j, "
        "usage summed",
    ),
    "best_of": _refused(OPENAI_ONLY, "no best-of ranking: only null or equal to n", lambda v, r: v == r.n),
    "echo": _served(
        OPENAI,
        "the prompt's text before each choice's; with logprobs, the prompt's log-probabilities first (vLLM's"
        " prompt_logprobs = logprobs), the first None; with max_tokens 0 only the prompt",
    ),
    "logprobs": _served(
        OPENAI,
        "the top k: logprobs {text_offset, token_logprobs, tokens, top_logprobs} with k + 1 entries each "
        "(the chosen first); at most --max-logprobs",
    ),
    "max_tokens": _served(
        OPENAI, "16 left out or null; capped at what max_model_len leaves; 0 only with echo"
    ),
    "suffix": _refused(OPENAI, "no fill-in-the-middle: only null"),
    "prompt_embeds": _refused(VLLM, "prompts are token ids or text: only null"),
    "add_special_tokens": _refused(VLLM, "the served encode is fixed: only true (the default)"),
}

_CHAT_TEMPLATE: dict[str, FieldRule] = {
    "add_generation_prompt": _served(
        VLLM,
        "the prompt ends with the assistant's marker and a newline (the answer's role assistant); false: it "
        "ends with the last message (the answer's role that message's)",
    ),
    "continue_final_message": _served(
        VLLM,
        "the last message is left open (no newline, no generation prompt): the model continues it; not with "
        "add_generation_prompt",
    ),
    "add_special_tokens": _refused(VLLM, "the served encode is fixed: only false (the default)"),
    "chat_template": _refused(VLLM, "the course's one template serves every model: only null"),
    "chat_template_kwargs": _refused(
        VLLM, "the course's template reads no variables: only null or {}", lambda v, _: not v
    ),
    "media_io_kwargs": _no_op(VLLM, "read for images, audio and video only, which are refused"),
    "mm_processor_kwargs": _no_op(VLLM, "read for images, audio and video only, which are refused"),
}

_CHAT_ONLY: dict[str, FieldRule] = {
    **_CHAT_TEMPLATE,
    "messages": _served(
        OPENAI,
        "text content (a string or text parts joined by newlines) in the course's template; other parts "
        "refused",
    ),
    "logprobs": _served(
        OPENAI, "true: choices[i].logprobs.content, one {token, logprob, bytes, top_logprobs} per token"
    ),
    "top_logprobs": _served(
        OPENAI,
        "the k likeliest tokens at each position (the chosen first), only with logprobs; at most "
        "--max-logprobs",
    ),
    "max_tokens": _served(OPENAI, "deprecated name of max_completion_tokens"),
    "max_completion_tokens": _served(
        OPENAI, "wins over max_tokens; both left out, what max_model_len leaves"
    ),
    "tools": _refused(
        OPENAI,
        "no tool calling: only null, or tools with tool_choice none",
        lambda v, r: r.tool_choice == "none",
    ),
    "tool_choice": _refused(
        OPENAI, "no tool calling: only none (or null without tools)", lambda v, r: v is None and not r.tools
    ),
    "reasoning_effort": _refused(OPENAI, "no reasoning models: only null"),
    "include_reasoning": _no_op(VLLM, "no reasoning parser: the text has no reasoning to leave out"),
    "parallel_tool_calls": _no_op(OPENAI, "read with tools only, which are refused"),
    "echo": _served(
        VLLM,
        "the last message's content before each answer when its role is the answer's (vLLM); prompt_logprobs"
        " = top_logprobs",
    ),
    "documents": _refused(VLLM, "the course's template takes no documents: only null"),
    "return_prompt_text": _served(VLLM, "prompt_text: the templated prompt (the first chunk when streamed)"),
    "audio": _refused(OPENAI_ONLY, "text out only: only null"),
    "function_call": _refused(
        OPENAI_ONLY, "no function calling (deprecated for tools): only null or none", lambda v, _: v == "none"
    ),
    "functions": _refused(OPENAI_ONLY, "no function calling (deprecated for tools): only null"),
    "metadata": _no_op(OPENAI_ONLY, "tags for stored completions: nothing is stored"),
    "modalities": _refused(OPENAI_ONLY, 'text out only: only null or ["text"]', lambda v, _: v == ["text"]),
    "moderation": _refused(OPENAI_ONLY, "no moderation: only null"),
    "prediction": _refused(OPENAI_ONLY, "no predicted outputs (speculative decoding): only null"),
    "prompt_cache_key": _no_op(
        OPENAI_ONLY,
        "OpenAI routes by it to a cache; the one prefix cache here serves every request (cache_salt keeps "
        "tenants apart)",
    ),
    "prompt_cache_options": _no_op(
        OPENAI_ONLY, "OpenAI's cache lifetime; blocks here stay until the pool needs them"
    ),
    "prompt_cache_retention": _no_op(
        OPENAI_ONLY, "OpenAI's cache lifetime (deprecated); blocks here stay until the pool needs them"
    ),
    "safety_identifier": _no_op(OPENAI_ONLY, "an end-user id for abuse monitoring, as user"),
    "service_tier": _refused(
        OPENAI_ONLY, "one tier: only null, auto or default", lambda v, _: v in ("auto", "default")
    ),
    "store": _refused(OPENAI_ONLY, "nothing is stored: only null or false", lambda v, _: v is False),
    "verbosity": _refused(OPENAI_ONLY, "no verbosity control: only null"),
    "web_search_options": _refused(OPENAI_ONLY, "no web search: only null"),
}

_TOKENIZE: dict[str, FieldRule] = {
    "model": _SHARED["model"],
    "return_token_strs": _served(VLLM, "token_strs: each token's text"),
}

FIELDS: dict[str, dict[str, FieldRule]] = {
    "completions": {**_SHARED, **_COMPLETION_ONLY},
    "chat": {**_SHARED, **_CHAT_ONLY},
    "tokenize": {
        **_TOKENIZE,
        "prompt": _served(VLLM, "its token ids, as a completion's prompt"),
        "add_special_tokens": _COMPLETION_ONLY["add_special_tokens"],
    },
    "tokenize (chat)": {
        **_TOKENIZE,
        **_CHAT_TEMPLATE,
        "messages": _served(VLLM, "the token ids of the prompt a chat completion of them would run"),
        "tools": _refused(
            VLLM, "the course's template renders no tools: only null or []", lambda v, _: not v
        ),
    },
    "detokenize": {
        "model": _SHARED["model"],
        "tokens": _served(VLLM, "their text, by the tokenizer's decode"),
    },
}
"""API name -> field -> :class:`FieldRule`, for every field the API's request model declares."""

MODELS: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
    "tokenize": TokenizeCompletionRequest,
    "tokenize (chat)": TokenizeChatRequest,
    "detokenize": DetokenizeRequest,
}
"""The request model of each API of :data:`FIELDS`."""
ROUTES = {
    "completions": "POST /v1/completions",
    "chat": "POST /v1/chat/completions",
    "tokenize": "POST /tokenize (a prompt)",
    "tokenize (chat)": "POST /tokenize (messages)",
    "detokenize": "POST /detokenize",
}


def check_fields(request: BaseModel, api: str) -> None:
    """Refuse a request that sets a ``refused`` field of ``api`` to a value the server does not serve.

    Raises:
        ValidationError: naming the first such field, in the table's words; nothing is changed.
    """
    defaults = type(request).model_fields
    for name, rule in FIELDS[api].items():
        if rule.status != REFUSED:
            continue
        value = getattr(request, name)
        if value == defaults[name].get_default(call_default_factory=True):
            continue
        if rule.allowed is not None and rule.allowed(value, request):
            continue
        raise ValidationError(
            f"paged_kv's server does not implement `{name}` ({rule.note}); got {value!r}", parameter=name
        )


def render_markdown() -> str:
    """``docs/server_fields.md``: one table per API of :data:`FIELDS`, in the models' field order."""
    lines = [
        "# What the server does with each request field",
        "",
        "Generated by `python -m paged_kv.entrypoints.openai.fields > docs/server_fields.md` from the",
        "table in `paged_kv/entrypoints/openai/fields.py` (a test checks that they agree). Every field of",
        "OpenAI's completions and chat APIs and every extra field of vLLM 0.33.0 is here, with what",
        "`paged-kv serve` does with it:",
        "",
        f"* **{SERVED}**: the field does what OpenAI's or vLLM's documentation says;",
        f"* **{NO_OP}**: accepted, and whatever its value it changes nothing for this server;",
        f"* **{REFUSED}**: not implemented; any value but the default (or one the note allows) is a 400",
        "  `BadRequestError` whose `param` names the field, and nothing reaches the engine.",
        "",
        "A field that no API below declares is kept, ignored and logged as vLLM logs it (a warning here):",
        '"The following fields were present in the request but ignored: {...}".',
    ]
    for api, rules in FIELDS.items():
        lines += ["", f"## {ROUTES[api]}", "", "| field | defined by | status | what the server does |"]
        lines.append("|---|---|---|---|")
        for name in MODELS[api].model_fields:
            rule = rules[name]
            lines.append(f"| `{name}` | {rule.origin} | {rule.status} | {rule.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the page's generator: python -m paged_kv.entrypoints.openai.fields > docs/...
    sys.stdout.write(render_markdown())

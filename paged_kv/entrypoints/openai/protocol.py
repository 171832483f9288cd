"""The shapes of OpenAI's API as vLLM serves them: requests, responses, stream chunks, errors (lesson 16).

Pydantic models with vLLM 0.33.0's names and fields, the subset the course serves (vLLM:
``vllm/entrypoints/openai/completion/protocol.py``, ``chat_completion/protocol.py``,
``models/protocol.py`` and ``vllm/entrypoints/serve/engine/protocol.py``):

* a request accepts fields it does not know and ignores them (``extra="allow"``, vLLM's
  ``OpenAIBaseModel``): a client written for OpenAI may send ``user`` or ``logit_bias``;
* ``temperature`` and ``top_p`` left out are OpenAI's defaults, 1.0; ``top_k`` (0 or -1: every
  token), ``stop_token_ids``, ``ignore_eos`` and ``return_token_ids`` are vLLM's extra fields;
* ``max_tokens`` left out is 16 for a completion (OpenAI's and vLLM's default) and, for a chat
  completion, whatever room the context leaves (``max_model_len`` less the prompt, vLLM's
  ``get_max_tokens``);
* every error is an :class:`ErrorResponse`, ``{"error": {"message", "type", "param", "code"}}``,
  whose ``code`` is the HTTP status.

A response's ``id`` is ``cmpl-...`` or ``chatcmpl-...``, its ``created`` the Unix time in seconds.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def random_uuid() -> str:
    """32 hex digits (vLLM: ``vllm.utils.random_uuid``), the tail of a response's id."""
    return uuid.uuid4().hex


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    """OpenAI's API allows fields a server does not know: they are kept and ignored (vLLM's base)."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------ errors


class ErrorInfo(OpenAIBaseModel):
    """What went wrong: ``type`` is ``"BadRequestError"``, ``"NotFoundError"``... and ``code`` the
    HTTP status; ``param`` names the field at fault when it is known."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """The body of every error response (vLLM: ``ErrorResponse``)."""

    error: ErrorInfo


# ------------------------------------------------------------------------------ models


class ModelCard(OpenAIBaseModel):
    """One served model in ``GET /v1/models``, with vLLM's extra ``max_model_len``."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "paged_kv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ------------------------------------------------------------------------------ shared pieces


class UsageInfo(OpenAIBaseModel):
    """Tokens a request used: its prompt's, those it generated (all ``n`` completions) and their sum."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: a last chunk, before ``[DONE]``, with no choices and the ``usage``;
    ``continuous_usage_stats`` (vLLM's): every chunk carries the usage so far."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """The fields both APIs turn into a :class:`~paged_kv.serving.sampling_params.SamplingParams`."""

    model: str | None = None
    n: int = 1
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool | None = None


# ------------------------------------------------------------------------------ completions


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or as token ids (a list of one prompt is taken
    as that prompt; several prompts in one request are refused)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM's: the stop string or stop token id that ended the completion; None for an end of
    sequence or ``length``."""
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)


# ------------------------------------------------------------------------------ chat completions


class ContentPart(OpenAIBaseModel):
    """A part of a message's content: only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class ChatMessageParam(OpenAIBaseModel):
    """A message of a chat request: ``role`` (``"system"``, ``"user"``, ``"assistant"``...) and
    ``content``, a string or a list of text parts (joined by newlines, as vLLM joins them)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (OpenAI's newer name) wins over
    ``max_tokens``, as in vLLM; both left out: as many as the context leaves."""

    messages: list[ChatMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class DeltaMessage(OpenAIBaseModel):
    """What a stream chunk adds to a message: the role in each choice's first chunk, then text."""

    role: str | None = None
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)

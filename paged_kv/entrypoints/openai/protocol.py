"""The shapes of OpenAI's API as vLLM serves them: requests, responses, stream chunks, errors (lesson 16).

Pydantic models with vLLM 0.33.0's names and fields (vLLM: ``vllm/entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``, ``models/protocol.py``, ``vllm/entrypoints/serve/engine/protocol.py``
and ``serve/tokenize/protocol.py``):

* a request model declares **every** field of OpenAI's API and of vLLM's extra fields, and
  :data:`~paged_kv.entrypoints.openai.fields.FIELDS` says what the server does with each: serves it,
  accepts it as a no-op, or refuses any value but the default with a 400 naming it;
* a field no model declares is kept and ignored (``extra="allow"``, vLLM's ``OpenAIBaseModel``) and
  logged as vLLM logs it: "The following fields were present in the request but ignored: {...}"
  (a warning here, where vLLM 0.33.0 logs it at debug level: nothing is ignored in silence);
* ``temperature`` and ``top_p`` left out are OpenAI's defaults, 1.0; the penalties left out are off;
* ``max_tokens`` left out is 16 for a completion (OpenAI's and vLLM's default) and, for a chat
  completion, whatever room the context leaves (vLLM's ``get_max_tokens``);
* the checks vLLM makes on the request itself (``check_logprobs``, ``validate_stream_options``,
  ``check_generation_prompt``, ``check_tool_usage``'s first) are model validators with vLLM's
  messages, each raising a :class:`ValidationError` that names the field, which the app's handler puts
  in the error's ``param`` (``cache_salt``, ``priority`` and the sampling parameters are the
  engine's to check: the input processor and
  :class:`~paged_kv.serving.sampling_params.SamplingParams` word them);
* every error is an :class:`ErrorResponse`, ``{"error": {"message", "type", "param", "code"}}``,
  whose ``code`` is the HTTP status.

A response's ``id`` is ``cmpl-...`` or ``chatcmpl-...``, its ``created`` the Unix time in seconds.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paged_kv.errors import ValidationError
from paged_kv.serving.logprobs import Logprob

logger = logging.getLogger("paged_kv.entrypoints.openai")

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
IGNORED_FIELDS_MESSAGE = "The following fields were present in the request but ignored: %s"
"""vLLM's words for the fields of a request that no model declares (``__log_extra_fields__``)."""


def random_uuid() -> str:
    """32 hex digits (vLLM: ``vllm.utils.random_uuid``), the tail of a response's id."""
    return uuid.uuid4().hex


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    """OpenAI's API allows fields a server does not know: they are kept, ignored and logged (vLLM's
    base, ``__log_extra_fields__``)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler):
        result = handler(data)
        if isinstance(data, dict):
            extra = data.keys() - set(cls.model_fields)
            if extra:
                logger.warning(IGNORED_FIELDS_MESSAGE, extra)
        return result


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
    """One served model in ``GET /v1/models`` (and ``GET /v1/models/{id}``), with vLLM's extra
    ``max_model_len``."""

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
    """Tokens a request used: its prompts', those it generated (all completions) and their sum."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: a last chunk, before ``[DONE]``, with no choices and the ``usage``;
    ``continuous_usage_stats`` (vLLM's): every chunk carries the usage so far."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _check_logprob_count(data: dict, name: str) -> None:
    """vLLM's ``check_logprobs`` for one count: an integer, positive or -1."""
    value = data.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"`{name}` must be an integer.", parameter=name)
    if value < 0 and value != -1:
        raise ValidationError(f"`{name}` must be a positive value or -1.", parameter=name)


class SamplingFields(OpenAIBaseModel):
    """The fields both APIs share: what becomes the request's
    :class:`~paged_kv.serving.sampling_params.SamplingParams` and its scheduling (``priority``,
    ``cache_salt``), and vLLM's extra fields; :data:`~paged_kv.entrypoints.openai.fields.FIELDS`
    says what the server does with each."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's sampling parameters
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    # vLLM's extra parameters
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValidationError(
                "Stream options can only be defined when `stream=True`.", parameter="stream_options"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_prompt_logprobs(cls, data: Any) -> Any:
        """vLLM's ``check_logprobs`` for ``prompt_logprobs``: an integer, positive or -1, and never
        asked for in a stream."""
        if not isinstance(data, dict):
            return data
        _check_logprob_count(data, "prompt_logprobs")
        asked = data.get("prompt_logprobs")
        if asked is not None and data.get("stream") and (asked > 0 or asked == -1):
            raise ValidationError(
                "`prompt_logprobs` are not available when `stream=True`.", parameter="prompt_logprobs"
            )
        return data


# ------------------------------------------------------------------------------ completions


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt as text or token ids, or a list of prompts (each served,
    vLLM's ``index = prompt * n + j``)."""

    prompt: list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | str | list[str]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_logprob_count(data, "logprobs")
        return data

    @model_validator(mode="before")
    @classmethod
    def normalize_null_max_tokens(cls, data: Any) -> Any:
        """``"max_tokens": null`` is the default, 16 (vLLM's ``normalize_null_max_tokens``)."""
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": 16}
        return data


class CompletionLogProbs(OpenAIBaseModel):
    """OpenAI's completion log-probabilities: per token (prompt first with ``echo``), its text's
    offset in the choice's text, its log-probability (``None`` for the first prompt token), its text,
    and the likeliest ``logprobs + 1`` tokens' (the chosen one first)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM's: the stop string or stop token id that ended the completion; None for an end of
    sequence or ``length``."""
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
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
    logprobs: CompletionLogProbs | None = None
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


class ChatTemplateFields(OpenAIBaseModel):
    """How a chat's messages become its prompt (vLLM's chat extra fields, shared with ``/tokenize``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("continue_final_message")
            and data.get("add_generation_prompt")
        ):
            raise ValidationError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                parameter="continue_final_message",
            )
        return data


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (OpenAI's newer name) wins over
    ``max_tokens``, as in vLLM; both left out: as many as the context leaves."""

    messages: list[ChatMessageParam]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    documents: list[dict[str, str]] | None = None
    return_prompt_text: bool | None = None
    # OpenAI's fields that vLLM does not declare
    audio: dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    moderation: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        """vLLM's ``check_logprobs``: ``top_logprobs`` an integer, positive or -1, and only with
        ``logprobs``."""
        if not isinstance(data, dict):
            return data
        _check_logprob_count(data, "top_logprobs")
        top = data.get("top_logprobs")
        if top is not None and (top == -1 or top > 0) and not data.get("logprobs"):
            raise ValidationError(
                "when using `top_logprobs`, `logprobs` must be set to true.", parameter="top_logprobs"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_tool_usage(cls, data: Any) -> Any:
        """vLLM's first checks of ``tools`` (the server refuses any tool use after these)."""
        if not isinstance(data, dict):
            return data
        if data.get("tools") == []:
            raise ValidationError(
                "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                "entirely.",
                parameter="tools",
            )
        if "tool_choice" not in data and data.get("tools"):
            data = {**data, "tool_choice": "auto"}  # vLLM's default once tools are given
        return data


class ChatCompletionLogProb(OpenAIBaseModel):
    """One token's log-probability in a chat answer: its text and that text's UTF-8 bytes."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """A generated token's, with the ``top_logprobs`` likeliest tokens' (the chosen one first)."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


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
    logprobs: ChatCompletionLogProbs | None = None
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
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
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


# ------------------------------------------------------------------------------ tokenizer endpoints


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` of a prompt (vLLM: ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    """``POST /tokenize`` of chat messages, the prompt a chat completion would run (vLLM:
    ``TokenizeChatRequest``)."""

    model: str | None = None
    messages: list[ChatMessageParam]
    return_token_strs: bool | None = False
    tools: list[dict[str, Any]] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``: token ids to their text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_INT64_MAX)]]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

"""What the completion and chat endpoints share: checking a request, then serving it (lesson 16).

vLLM's ``OpenAIServing`` (``vllm/entrypoints/serve/engine/serving.py``) is the base of every
endpoint; :class:`OpenAIServing` keeps its order of work, and its rule that **a bad request changes
nothing**: everything is checked before the request reaches the engine, so a refused request takes
no block, no step and no place in any queue.

1. the model name: a name other than the served one is a 404 ``NotFoundError`` ("The model `X`
   does not exist."); no name at all is the served model, as in vLLM;
2. the :class:`~paged_kv.serving.sampling_params.SamplingParams` from the request's fields, whose own
   checks raise vLLM's messages (``temperature``, ``top_p``, ``n``, ``max_tokens``...);
   ``max_tokens`` passes as the client sent it, ``None`` when left out;
3. the request itself, once, by the engine's input processor
   (:meth:`AsyncLLM.check <paged_kv.serving.async_llm.AsyncLLM.check>`): token ids outside the
   vocabulary, a prompt too long for ``max_model_len`` or with no room for one token, a request the
   pool could not hold alone; ``max_tokens`` settled there, ``None`` as many as the context leaves
   (vLLM's ``get_max_tokens``), a larger number capped there. (vLLM's front end measures the prompt
   earlier too, in its renderer, and words that refusal "This model's maximum context length is X
   tokens..."; the course checks a request in one place, so its server answers the input
   processor's words.)

Each failure is a :class:`~paged_kv.entrypoints.openai.protocol.ErrorResponse` (vLLM:
``create_error_response``: a ``ValueError`` is a 400 ``BadRequestError``). Only then is the request
handed to ``AsyncLLM.generate``, streamed as server-sent events by a :class:`ClosingStreamingResponse`,
which closes the stream's generator whatever ends it (so a client that hangs up aborts its request and
frees its blocks), or collected whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from http import HTTPStatus

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from paged_kv.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    UsageInfo,
    random_uuid,
)
from paged_kv.serving.async_llm import AsyncLLM, EngineDeadError
from paged_kv.serving.output_processor import RequestOutput
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("paged_kv.entrypoints.openai")

Encode = Callable[[str], list[int]]
"""A tokenizer's ``encode``: text to token ids."""


class RequestError(ValueError):
    """A request the server refuses, with its HTTP status, error type and the field at fault."""

    def __init__(
        self,
        message: str,
        *,
        err_type: str = "BadRequestError",
        status_code: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.err_type, self.status_code, self.param = err_type, status_code, param


def create_error_response(error: str | BaseException) -> ErrorResponse:
    """The :class:`ErrorResponse` of an error (vLLM: ``create_error_response``): a
    :class:`RequestError` as it says; any other ``ValueError`` or ``TypeError``, a 400
    ``BadRequestError``; :class:`~paged_kv.serving.async_llm.EngineDeadError` and anything else, a
    500 ``InternalServerError``."""
    if isinstance(error, str):
        error = RequestError(error)
    if isinstance(error, RequestError):
        err_type, status, param = error.err_type, error.status_code, error.param
    elif isinstance(error, EngineDeadError):
        err_type, status, param = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR, None
    elif isinstance(error, (ValueError, TypeError)):
        err_type, status, param = "BadRequestError", HTTPStatus.BAD_REQUEST, None
    else:
        err_type, status, param = "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR, None
    return ErrorResponse(error=ErrorInfo(message=str(error), type=err_type, param=param, code=status.value))


def error_json(error: str | BaseException | ErrorResponse) -> JSONResponse:
    """An error as the HTTP response that carries it: the :class:`ErrorResponse`, status its code."""
    response = error if isinstance(error, ErrorResponse) else create_error_response(error)
    return JSONResponse(response.model_dump(), status_code=response.error.code)


def sse(chunk: BaseModel | str, **dump) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` as it is)."""
    data = chunk if isinstance(chunk, str) else chunk.model_dump_json(**dump)
    return f"data: {data}\n\n"


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The ``usage`` of a response: prompt tokens, generated tokens (every completion's) and their sum."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body's generator however the response ends.

    Starlette cancels the sending task when the client disconnects; if the generator was suspended
    at a ``yield`` (its chunk being sent) rather than awaiting the engine, cancelling leaves it
    suspended until the garbage collector finds it, and its request would run on for nobody.
    ``aclose()`` runs its ``finally`` now: ``AsyncLLM.generate`` aborts the request there, and its
    blocks are free before the engine's next step.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class OpenAIServing:
    """The checks and the serving shared by :class:`~.serving_completion.OpenAIServingCompletion`
    and :class:`~.serving_chat.OpenAIServingChat` (see the module)."""

    request_id_prefix = "cmpl"

    def __init__(self, async_llm: AsyncLLM, *, model_name: str, encode: Encode) -> None:
        self.async_llm = async_llm
        self.model_name = model_name
        self.encode = encode

    # ------------------------------------------------------------------------------ the checks

    def check_model(self, model: str | None) -> None:
        """Raises a 404 :class:`RequestError` unless ``model`` is the served name (or left out)."""
        if model and model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist.",
                err_type="NotFoundError",
                status_code=HTTPStatus.NOT_FOUND,
                param="model",
            )

    def sampling_params(self, request: SamplingFields, max_tokens: int | None) -> SamplingParams:
        """The request's :class:`SamplingParams`: OpenAI's defaults for what it leaves out, ``DELTA``
        outputs for a stream and ``FINAL_ONLY`` otherwise.

        Raises:
            ValueError: a parameter out of range, in vLLM's words.
        """
        stop = request.stop if request.stop is not None else ()
        top_k = request.top_k if request.top_k is not None else 0
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if top_k == -1 else top_k,  # vLLM takes -1 for "every token" too
            seed=request.seed,
            stop=stop,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        )

    def prepare(
        self, request: SamplingFields, prompt_token_ids: list[int], max_tokens: int | None
    ) -> EngineCoreRequest:
        """Steps 2 and 3 of the module (the model was checked first): the request under a fresh id,
        checked once by the engine's input processor, as the engine core will take it.

        Raises:
            RequestError, ValueError: the request is refused; nothing changed.
        """
        params = self.sampling_params(request, max_tokens)
        request_id = f"{self.request_id_prefix}-{random_uuid()}"
        return self.async_llm.check(request_id, prompt_token_ids, params)

    # ------------------------------------------------------------------------------ serving

    async def respond(self, request, core_request: EngineCoreRequest):
        """The answer to a checked request: a stream of server-sent events (``stream_chunks``) or the
        whole response (``response``), each endpoint's own."""
        created = int(time.time())
        if request.stream:
            return ClosingStreamingResponse(
                self.stream_chunks(request, core_request, created), media_type="text/event-stream"
            )
        try:
            final = await self.final_output(core_request)
        except (ValueError, EngineDeadError) as error:
            return error_json(error)
        return JSONResponse(self.response(request, core_request.request_id, created, final).model_dump())

    async def final_output(self, core_request: EngineCoreRequest) -> RequestOutput:
        """Serve a ``FINAL_ONLY`` request to its end; its one output. Cancelled (the client hung
        up), the generator is closed and the request aborted."""
        final = None
        generator = self.async_llm.generate(core_request)
        try:
            async for output in generator:
                final = output
        finally:
            await generator.aclose()
        assert final is not None and final.finished
        return final

    @staticmethod
    def stream_error(error: Exception) -> str:
        """The event a stream sends when it fails after it started (vLLM sends the error as data)."""
        if not isinstance(error, (ValueError, EngineDeadError)):
            logger.exception("Error in stream generator.")
        return sse(create_error_response(error))

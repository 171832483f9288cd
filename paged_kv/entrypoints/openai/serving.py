"""What the completion and chat endpoints share: checking a request, then serving it (lesson 16).

vLLM's ``OpenAIServing`` (``vllm/entrypoints/serve/engine/serving.py``) is the base of every
endpoint; :class:`OpenAIServing` keeps its order of work, and its rule that **a bad request changes
nothing**: everything is checked before the request reaches the engine, so a refused request takes
no block, no step and no place in any queue.

1. the model name: a name other than the served one is a 404 ``NotFoundError`` ("The model `X`
   does not exist."); no name at all is the served model, as in vLLM;
2. every field the server does not implement is at its default
   (:func:`~paged_kv.entrypoints.openai.fields.check_fields`: else a 400 naming it);
3. the :class:`~paged_kv.serving.sampling_params.SamplingParams` from the request's fields, whose own
   checks raise vLLM's messages (``temperature``, ``top_p``, ``n``, ``max_tokens``, the penalties,
   ``min_p``, ``logit_bias``...), ``bad_words`` tokenized with the served ``encode``;
   ``max_tokens`` passes as the client sent it, ``None`` when left out;
4. each prompt's request, once, by the engine's input processor
   (:meth:`AsyncLLM.check <paged_kv.serving.async_llm.AsyncLLM.check>`): token ids outside the
   vocabulary, a prompt too long for ``max_model_len`` or with no room for one token, a request the
   pool could not hold alone, ``logprobs`` above ``max_logprobs``, a ``priority`` without the
   priority policy, a bad ``cache_salt``; ``max_tokens`` settled there, ``None`` as many as the
   context leaves (vLLM's ``get_max_tokens``), a larger number capped there. (vLLM's front end
   measures the prompt earlier too, in its renderer, and words that refusal "This model's maximum
   context length is X tokens..."; the course checks a request in one place, so its server answers
   the input processor's words.) The ``priority`` is the body's unless an ``X-Vllm-Priority``
   header holds an integer, and the id the body's ``request_id`` unless an ``X-Request-Id``
   header is there, as in vLLM.

Each failure is a :class:`~paged_kv.entrypoints.openai.protocol.ErrorResponse` (vLLM:
``create_error_response``: a ``ValueError`` is a 400 ``BadRequestError``), whose ``param`` is the
field the refusal names (a :class:`~paged_kv.errors.ValidationError`'s ``parameter``). Only then
are the requests handed to ``AsyncLLM.generate``, merged (:func:`merge_async_iterators`: a
completion's several prompts run together), streamed as server-sent events by a
:class:`ClosingStreamingResponse`, which closes the stream's generators whatever ends it (so a
client that hangs up aborts its requests and frees their blocks), or collected whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from paged_kv.entrypoints.openai.fields import check_fields
from paged_kv.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    UsageInfo,
    random_uuid,
)
from paged_kv.errors import ValidationError
from paged_kv.serving.async_llm import AsyncLLM, EngineDeadError
from paged_kv.serving.logprobs import Logprob, PromptLogprobs
from paged_kv.serving.output_processor import RequestOutput
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("paged_kv.entrypoints.openai")

Encode = Callable[[str], list[int]]
"""A tokenizer's ``encode``: text to token ids."""
PRIORITY_HEADER = "X-Vllm-Priority"
"""A request's priority in a header, which wins over the body's when it is an integer (vLLM's)."""
REQUEST_ID_HEADER = "X-Request-Id"
"""A request's id in a header, which wins over the body's ``request_id`` (vLLM's)."""
MIN_LOGPROB = -9999.0
"""The least log-probability a response carries (vLLM's, OpenAI's stand-in for ``-inf``)."""


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


def check_model(model: str | None, served: str) -> None:
    """Raises a 404 :class:`RequestError` unless ``model`` is the ``served`` name (or left out), in
    vLLM's words ("The model `X` does not exist.")."""
    if model and model != served:
        raise RequestError(
            f"The model `{model}` does not exist.",
            err_type="NotFoundError",
            status_code=HTTPStatus.NOT_FOUND,
            param="model",
        )


def create_error_response(error: str | BaseException) -> ErrorResponse:
    """The :class:`ErrorResponse` of an error (vLLM: ``create_error_response``): a
    :class:`RequestError` as it says; a :class:`~paged_kv.errors.ValidationError` a 400 naming its field; any
    other ``ValueError`` or ``TypeError``, a 400 ``BadRequestError``;
    :class:`~paged_kv.serving.async_llm.EngineDeadError` and anything else, a 500
    ``InternalServerError``."""
    if isinstance(error, str):
        error = RequestError(error)
    if isinstance(error, RequestError):
        err_type, status, param = error.err_type, error.status_code, error.param
    elif isinstance(error, ValidationError):
        err_type, status, param = "BadRequestError", HTTPStatus.BAD_REQUEST, error.parameter
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


def clamp_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobs | None:
    """The prompt's log-probabilities with ``-inf`` as :data:`MIN_LOGPROB` (vLLM's
    ``clamp_prompt_logprobs``: JSON has no infinity)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            t: Logprob(max(lp.logprob, MIN_LOGPROB), lp.rank, lp.decoded_token) for t, lp in position.items()
        }
        for position in prompt_logprobs
    ]


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """``(i, item)`` for each item of each iterator ``i``, as they come (vLLM's
    ``merge_async_iterators``). Closed early or failed, it closes every iterator: each request
    still running is aborted."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


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
    and :class:`~.serving_chat.OpenAIServingChat` (see the module). ``api`` names the endpoint's
    rows of :data:`~paged_kv.entrypoints.openai.fields.FIELDS`."""

    request_id_prefix = "cmpl"
    api = "completions"

    def __init__(self, async_llm: AsyncLLM, *, model_name: str, encode: Encode) -> None:
        self.async_llm = async_llm
        self.model_name = model_name
        self.encode = encode
        self.decode = async_llm.llm_engine.output_processor.decode

    # ------------------------------------------------------------------------------ the checks

    def check_request(self, request: BaseModel) -> None:
        """Steps 1 and 2 of the module's list: the model's name, then every field the server does
        not implement left at its default (:func:`~.fields.check_fields`)."""
        check_model(request.model, self.model_name)
        check_fields(request, self.api)

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`: OpenAI's and vLLM's defaults for what it leaves out
        (``_DEFAULT_SAMPLING_PARAMS``), ``DELTA`` outputs for a stream and ``FINAL_ONLY`` otherwise,
        ``bad_words`` tokenized with the served ``encode``.

        Raises:
            ValueError: a parameter out of range, in vLLM's words.
        """
        top_k = request.top_k if request.top_k is not None else 0

        def given(value: float | None, default: float) -> float:
            return default if value is None else value

        params = SamplingParams(
            n=request.n,
            temperature=given(request.temperature, 1.0),
            top_p=given(request.top_p, 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM takes -1 for "every token" too
            seed=request.seed,
            stop=request.stop if request.stop is not None else (),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            presence_penalty=given(request.presence_penalty, 0.0),
            frequency_penalty=given(request.frequency_penalty, 0.0),
            repetition_penalty=given(request.repetition_penalty, 1.0),
            min_p=given(request.min_p, 0.0),
            min_tokens=request.min_tokens,
            logit_bias=request.logit_bias,
            bad_words=tuple(request.bad_words),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        return params.update_from_tokenizer(self.encode)

    def prepare(
        self,
        request: SamplingFields,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | None,
        raw_request: Request | None = None,
        *,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> tuple[str, list[EngineCoreRequest]]:
        """Steps 3 and 4 of the module (the request was checked first): the response's id
        (``X-Request-Id``, else the body's ``request_id``, else a fresh one, after the prefix) and
        one request per prompt, each checked by the engine's input processor, as the engine core
        will take them; none is queued. A completion's requests are ``f"{id}-{i}"``, as vLLM names
        them; a chat's is the id.

        Raises:
            RequestError, ValueError: the request is refused; nothing changed.
        """
        params = self.sampling_params(request, max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        headers = raw_request.headers if raw_request is not None else {}
        base = headers.get(REQUEST_ID_HEADER) or request.request_id or random_uuid()
        response_id = f"{self.request_id_prefix}-{base}"
        priority = request.priority
        header = headers.get(PRIORITY_HEADER)
        if header is not None:
            with contextlib.suppress(ValueError):  # not an integer: vLLM falls back on the body's
                priority = int(header)
        ids = (
            [f"{response_id}-{i}" for i in range(len(prompts))]
            if self.api == "completions"
            else [response_id]
        )
        core_requests = [
            self.async_llm.check(request_id, prompt, params, priority=priority, cache_salt=request.cache_salt)
            for request_id, prompt in zip(ids, prompts, strict=True)
        ]
        return response_id, core_requests

    @staticmethod
    def named(error: ValueError, request: BaseModel) -> ValueError:
        """``error`` as a 400 whose ``param`` is the field at fault: a
        :class:`~paged_kv.errors.ValidationError`'s ``parameter`` when the request has a field of that
        name (the engine's ``prompt_token_ids`` is no field of a chat request), else none."""
        if isinstance(error, RequestError):
            return error
        parameter = error.parameter if isinstance(error, ValidationError) else None
        return RequestError(str(error), param=parameter if parameter in type(request).model_fields else None)

    # ------------------------------------------------------------------------------ serving

    async def respond(self, request, response_id: str, core_requests: list[EngineCoreRequest], context):
        """The answer to a checked request: a stream of server-sent events (``stream_chunks``) or the
        whole response (``response``), each endpoint's own, given the endpoint's ``context`` (a
        completion's prompts, a chat's role and echo)."""
        created = int(time.time())
        if request.stream:
            return ClosingStreamingResponse(
                self.stream_chunks(request, response_id, core_requests, created, context),
                media_type="text/event-stream",
            )
        try:
            finals = await self.final_outputs(core_requests)
        except (ValueError, EngineDeadError) as error:
            return error_json(error)
        return JSONResponse(self.response(request, response_id, created, finals, context).model_dump())

    async def final_outputs(self, core_requests: list[EngineCoreRequest]) -> list[RequestOutput]:
        """Serve ``FINAL_ONLY`` requests to their end, together; each one's output, in order.
        Cancelled (the client hung up), every generator is closed and every request aborted."""
        finals: list[RequestOutput | None] = [None] * len(core_requests)
        async for i, output in merge_async_iterators(*map(self.async_llm.generate, core_requests)):
            finals[i] = output
        assert all(final is not None and final.finished for final in finals)
        return finals

    def token_text(self, token_id: int, logprob: Logprob | None = None, as_id: bool | None = False) -> str:
        """A token's text in log-probabilities (vLLM's ``_get_decoded_token``): ``token_id:<id>``
        when asked for, else the text the engine decoded, else the tokenizer's."""
        if as_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.decode([token_id])

    @staticmethod
    def stream_error(error: Exception) -> str:
        """The event a stream sends when it fails after it started (vLLM sends the error as data)."""
        if not isinstance(error, (ValueError, EngineDeadError)):
            logger.exception("Error in stream generator.")
        return sse(create_error_response(error))

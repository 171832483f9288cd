"""The OpenAI-compatible app: its routes and its error format, over one ``AsyncLLM`` (lesson 16).

vLLM builds its FastAPI app in ``vllm/entrypoints/launchers/app.py`` (``build_app``) from the routers
of ``vllm/entrypoints/openai/`` (``completion/``, ``chat_completion/``, ``models/``) and
``vllm/entrypoints/serve/`` (health, metrics, the exception handlers). :func:`build_app` builds the
same routes over an :class:`~paged_kv.serving.async_llm.AsyncLLM`:

=========================  ===========================================================================
``GET /health``            200 and an empty body while the engine loop is alive, else 503
``GET /v1/models``         the served model, OpenAI's list format, with ``max_model_len``
``GET /v1/models/{id}``    the served model's card; another id, a 404 in the error format
``POST /v1/completions``   :mod:`~paged_kv.entrypoints.openai.serving_completion`
``POST /v1/chat/...``      ``/v1/chat/completions``: :mod:`~paged_kv.entrypoints.openai.serving_chat`
``POST /tokenize``         ``/tokenize`` and ``/detokenize``: :mod:`~.serving_tokenization`
``GET /version``           ``{"version": paged_kv.__version__}`` (vLLM answers its own version)
``GET /metrics``           vLLM's Prometheus metrics (:mod:`~paged_kv.entrypoints.openai.metrics`)
``GET /kv``                the live page of the pool, when :mod:`paged_kv.entrypoints.kv_page` exists
``POST /reset_prefix_...``  ``/reset_prefix_cache``, with ``VLLM_SERVER_DEV_MODE=1`` only (see below)
=========================  ===========================================================================

**The development endpoint** (vLLM's ``vllm/entrypoints/serve/dev/cache/api_router.py``, mounted
only when the environment has ``VLLM_SERVER_DEV_MODE=1``, read when the app is built; without it
the route does not exist, a 404): ``POST /reset_prefix_cache?reset_running_requests=false&
reset_external=false`` calls :meth:`AsyncLLM.reset_prefix_cache
<paged_kv.serving.async_llm.AsyncLLM.reset_prefix_cache>` (``reset_external`` is its
``reset_connector``) and answers 200 with ``{"success": bool}``: ``false`` while a request holds
blocks, unless ``reset_running_requests=true`` preempts the running ones first. A router of KV
events then reads ``AllBlocksCleared``.

Invariants the app keeps:

* **every error is OpenAI's format**, ``{"error": {"message", "type", "param", "code"}}``, and a
  refused request changes nothing (no block, no step). A request the endpoints refuse is a
  ``BadRequestError`` 400 or, for an unknown model, a ``NotFoundError`` 404. A body FastAPI cannot
  read (malformed JSON, a field of the wrong type) is a 400 too, not FastAPI's 422: the handler
  replaces FastAPI's, as vLLM's does (``serve/exception_handling/handlers/validation.py``), with
  vLLM's type, ``"Bad Request"``, and the field at fault as ``param`` (the one a model validator's
  :class:`~paged_kv.errors.ValidationError` names, else the error's location);
* **no field is dropped in silence**: each is served, a no-op, or refused when set
  (:mod:`~paged_kv.entrypoints.openai.fields`), and one no model declares is logged;
* **a client that hangs up aborts its request**, whose blocks are free before the engine's next
  step. A stream's generator is closed when Starlette stops sending it (see
  :class:`~paged_kv.entrypoints.openai.serving.ClosingStreamingResponse`); a request that is not
  streamed is served in a task raced against the client's disconnect message, cancelled when the
  message comes first (vLLM's ``with_cancellation``, ``serve/utils/api_utils.py``, which waits
  for ``http.disconnect`` rather than polling ``request.is_disconnected()``);
* **load queues, it does not fail**: every request goes to the scheduler, which runs what the pool
  and ``max_num_seqs`` allow and keeps the rest waiting;
* the app owns its metrics registry, and its shutdown (the ASGI lifespan's end) shuts the
  ``AsyncLLM`` down: the engine loop stops, every request left is aborted, every block is free.

:class:`~paged_kv.entrypoints.openai.launcher.ServerThread` serves an app in a background thread;
``paged-kv serve`` (:mod:`paged_kv.cli`) in the foreground.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

import paged_kv
from paged_kv.entrypoints.openai.launcher import ServerThread
from paged_kv.entrypoints.openai.metrics import PrometheusStatLogger
from paged_kv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from paged_kv.entrypoints.openai.serving import check_model, error_json
from paged_kv.entrypoints.openai.serving_chat import OpenAIServingChat
from paged_kv.entrypoints.openai.serving_completion import OpenAIServingCompletion
from paged_kv.entrypoints.openai.serving_tokenization import ServingTokenization
from paged_kv.errors import ValidationError
from paged_kv.serving.async_llm import AsyncLLM

__all__ = ["ServerThread", "build_app"]

KV_PAGE_MODULE = "paged_kv.entrypoints.kv_page"
DEV_MODE_VARIABLE = "VLLM_SERVER_DEV_MODE"
"""vLLM's switch of its development endpoints: ``1`` mounts them, ``0`` (the default) does not."""

_LOGGER = logging.getLogger(__name__)


def server_dev_mode() -> bool:
    """Whether ``VLLM_SERVER_DEV_MODE`` asks for the development endpoints (vLLM reads it as
    ``bool(int(value))``, ``"0"`` when unset).

    Raises:
        ValueError: the variable is set to something other than an integer, named.
    """
    value = os.environ.get(DEV_MODE_VARIABLE, "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{DEV_MODE_VARIABLE} must be 0 or 1, got {value!r}") from None


def build_app(
    async_llm: AsyncLLM,
    *,
    model_name: str,
    encode: Callable[[str], list[int]],
) -> FastAPI:
    """The OpenAI-compatible app over ``async_llm`` (see the module), serving ``model_name``.

    ``encode`` is the tokenizer's (text to token ids: prompts and chat messages). The text of the
    outputs comes from the engine's output processor, built with the tokenizer's ``decode``
    (``AsyncLLM.from_engine_args(..., decode=...)``); the model's ``max_model_len`` is the engine's.
    The app appends a
    :class:`~paged_kv.entrypoints.openai.metrics.PrometheusStatLogger` to ``async_llm.stat_loggers``
    and keeps it, the ``AsyncLLM`` and the settings in ``app.state``.

    Raises:
        ValueError: the engine has no ``decode``, or ``VLLM_SERVER_DEV_MODE`` is not an integer.
    """
    dev_mode = server_dev_mode()
    max_model_len = async_llm.vllm_config.model_config.max_model_len
    if async_llm.llm_engine.output_processor.decode is None:
        raise ValueError("the server needs the tokenizer's decode: build the engine with decode=...")
    stat_logger = PrometheusStatLogger(model_name)
    async_llm.stat_loggers.append(stat_logger)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await async_llm.shutdown()

    app = FastAPI(title="paged_kv", summary="An OpenAI-compatible server (lesson 16)", lifespan=lifespan)
    app.state.async_llm = async_llm
    app.state.model_name = model_name
    app.state.max_model_len = max_model_len
    app.state.stat_logger = stat_logger
    settings = {"model_name": model_name, "encode": encode}
    completions = OpenAIServingCompletion(async_llm, **settings)
    chat = OpenAIServingChat(async_llm, **settings)
    tokenization = ServingTokenization(
        **settings,
        decode=async_llm.llm_engine.output_processor.decode,
        max_model_len=max_model_len,
        vocab_size=async_llm.vllm_config.model_config.vocab_size,
    )
    card = ModelCard(id=model_name, root=model_name, max_model_len=max_model_len)

    @app.get("/health")
    async def health() -> Response:
        ok = async_llm.errored is None
        return Response(status_code=HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/v1/models")
    async def show_available_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        try:
            check_model(model_id, model_name)
        except ValueError as error:
            return error_json(error)
        return JSONResponse(card.model_dump())

    @app.get("/version")
    async def show_version() -> JSONResponse:
        return JSONResponse({"version": paged_kv.__version__})

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await until_disconnected(raw_request, completions.create_completion(request, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await until_disconnected(raw_request, chat.create_chat_completion(request, raw_request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return await tokenization.create_tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return await tokenization.create_detokenize(request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=stat_logger.content_type)

    if dev_mode:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(
            reset_running_requests: bool = Query(default=False),
            reset_external: bool = Query(default=False),
        ) -> JSONResponse:
            _LOGGER.info("Resetting prefix cache...")
            success = await async_llm.reset_prefix_cache(reset_running_requests, reset_external)
            return JSONResponse({"success": bool(success)})

    init_exception_handlers(app)
    if importlib.util.find_spec(KV_PAGE_MODULE) is not None:  # the live page, once it is written
        app.include_router(importlib.import_module(KV_PAGE_MODULE).kv_routes(async_llm))
    return app


# ------------------------------------------------------------------------------ hanging up


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client's ``http.disconnect`` comes (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, unless the client hangs up first: then ``work`` is cancelled (its
    request aborted, its blocks freed) and an empty response goes to nobody (vLLM:
    ``with_cancellation``). A stream is returned at once; its response watches the client itself."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((handler, listener), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not handler.done():  # the client went away, or this task was cancelled
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)  # its generator closed, its request aborted
    if handler.cancelled():
        return Response()
    return handler.result()


# ------------------------------------------------------------------------------ errors

_INTERNAL_LOC = {"str", "int", "float", "bool", "list", "dict", "none", "union", "function-wrap", "json"}


def _param(loc: Sequence[object]) -> str:
    """A validation error's ``loc`` as a dotted field path, pydantic's union branches left out."""
    parts = [str(p) for p in loc if not (set("[](){}") & set(str(p)) or str(p).lower() in _INTERNAL_LOC)]
    return ".".join(parts or map(str, loc))


def _short(value: object) -> object:
    """A value echoed in an error, bounded (a long prompt is not sent back whole)."""
    if isinstance(value, (list, tuple, dict, set, bytes)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


async def validation_exception_handler(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body FastAPI could not read (malformed JSON, a missing field, a wrong type): 400, not 422,
    in OpenAI's error format, with vLLM's wording ("N validation errors:" and one line each)."""
    errors = list(exc.errors())
    lines = []
    for err in errors[:10]:
        shown = {"type": err.get("type"), "loc": _param(err.get("loc", ())), "msg": err.get("msg")}
        if "input" in err:
            shown["input"] = _short(err["input"])
        lines.append(f"  {shown}")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines) if errors else "Validation error"
    named = (err.get("ctx", {}).get("error") for err in errors)
    param = next((error.parameter for error in named if isinstance(error, ValidationError)), None)
    if param is None and errors and errors[0].get("loc"):
        param = _param(errors[0]["loc"])
    error = ErrorInfo(
        message=message, type=HTTPStatus.BAD_REQUEST.phrase, param=param, code=HTTPStatus.BAD_REQUEST
    )
    return JSONResponse(ErrorResponse(error=error).model_dump(), status_code=HTTPStatus.BAD_REQUEST)


async def http_exception_handler(_request: Request, exc: HTTPException) -> JSONResponse:
    """A route that does not exist (404), a method it does not take (405)...: the error format,
    the status's phrase as the type (vLLM's ``http_exception_handler``)."""
    error = ErrorInfo(message=str(exc.detail), type=HTTPStatus(exc.status_code).phrase, code=exc.status_code)
    return JSONResponse(ErrorResponse(error=error).model_dump(), status_code=exc.status_code)


async def exception_handler(_request: Request, exc: Exception) -> JSONResponse:
    """Anything else: a ``ValueError`` is the client's (400), the rest the server's (500)."""
    return error_json(exc)


def init_exception_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's format (vLLM: ``init_exception_handler``)."""
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(HTTPException, http_exception_handler)
    app.add_exception_handler(ValueError, exception_handler)
    app.add_exception_handler(Exception, exception_handler)

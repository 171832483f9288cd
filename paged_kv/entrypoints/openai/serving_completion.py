"""``POST /v1/completions``: a prompt in, its completions out, whole or streamed (lesson 16).

vLLM: ``vllm/entrypoints/openai/completion/serving.py`` (``OpenAIServingCompletion``). The prompt is
text (tokenized with the served tokenizer's ``encode``) or token ids; vLLM takes a list of prompts
too and serves each as a request, the course takes one (a list holding one prompt is that prompt).

* Not streaming, the request runs with ``FINAL_ONLY`` outputs and the answer is one
  :class:`~.protocol.CompletionResponse`: a choice per completion (``n``), each with its text, its
  ``finish_reason`` (``"stop"``, ``"length"``) and vLLM's ``stop_reason``, and the ``usage``.
* Streaming (``"stream": true``), the request runs with ``DELTA`` outputs: each step's new text of
  each completion is one server-sent event ``data: {...}`` (a
  :class:`~.protocol.CompletionStreamResponse`, one choice, its ``index`` saying which), the last
  one of a completion carrying its ``finish_reason``; with ``stream_options.include_usage`` a last
  chunk with no choices carries the ``usage``; then ``data: [DONE]``. A step that adds nothing to a
  completion sends nothing for it.

With ``return_token_ids`` (vLLM's extra field) each choice carries its ``token_ids`` and, whole or in
its first chunk, the ``prompt_token_ids``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import Response

from paged_kv.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from paged_kv.entrypoints.openai.serving import (
    OpenAIServing,
    RequestError,
    error_json,
    sse,
    usage_info,
)
from paged_kv.serving.output_processor import RequestOutput
from paged_kv.serving.request import EngineCoreRequest


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint over an :class:`~paged_kv.serving.async_llm.AsyncLLM` (see the module)."""

    request_id_prefix = "cmpl"

    def prompt_token_ids(self, prompt: str | list) -> list[int]:
        """The one prompt's token ids.

        Raises:
            RequestError: no prompt, or several.
        """
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(
                    f"paged_kv serves one prompt per request, got a list of {len(prompt)} prompts: "
                    "send one request per prompt",
                    param="prompt",
                )
            prompt = prompt[0]
        return self.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def create_completion(self, request: CompletionRequest) -> Response:
        """The response to ``request``: an error (nothing changed), the whole completion, or a stream."""
        try:
            self.check_model(request.model)
            prompt = self.prompt_token_ids(request.prompt)
            core_request = self.prepare(request, prompt, request.max_tokens)
        except ValueError as error:
            return error_json(error)
        return await self.respond(request, core_request)

    def response(
        self, request: CompletionRequest, request_id: str, created: int, final: RequestOutput
    ) -> CompletionResponse:
        """The whole answer: a choice per completion, in ``index`` order, and the usage."""
        with_ids = bool(request.return_token_ids)
        choices = [
            CompletionResponseChoice(
                index=out.index,
                text=out.text,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=list(out.token_ids) if with_ids else None,
                prompt_token_ids=final.prompt_token_ids if with_ids else None,
            )
            for out in sorted(final.outputs, key=lambda out: out.index)
        ]
        num_prompt = len(final.prompt_token_ids)
        num_generated = sum(len(out.token_ids) for out in final.outputs)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage_info(num_prompt, num_generated),
        )

    async def stream_chunks(
        self, request: CompletionRequest, core_request: EngineCoreRequest, created: int
    ) -> AsyncIterator[str]:
        """The events of a streamed completion (see the module). Closed early (the client hung up),
        it closes the engine's generator, which aborts the request."""
        request_id, prompt = core_request.request_id, core_request.prompt_token_ids
        params = core_request.sampling_params
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        with_ids = bool(request.return_token_ids)
        generated = [0] * params.n
        prompt_sent = [False] * params.n
        generator = self.async_llm.generate(core_request)
        try:
            async for res in generator:
                for out in res.outputs:
                    generated[out.index] += len(out.token_ids)
                    if not out.text and not out.token_ids and out.finish_reason is None:
                        continue
                    choice = CompletionResponseStreamChoice(
                        index=out.index,
                        text=out.text,
                        logprobs=None,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                    if with_ids:
                        choice.token_ids = list(out.token_ids)
                        if not prompt_sent[out.index]:
                            choice.prompt_token_ids, prompt_sent[out.index] = list(prompt), True
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        object="text_completion",
                        created=created,
                        model=self.model_name,
                        choices=[choice],
                    )
                    if continuous:
                        chunk.usage = usage_info(len(prompt), generated[out.index])
                    yield sse(chunk, exclude_unset=True)
            if include_usage:
                last = CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage_info(len(prompt), sum(generated)),
                )
                yield sse(last, exclude_none=True)
        except Exception as error:
            yield self.stream_error(error)
        finally:
            await generator.aclose()
        yield sse("[DONE]")

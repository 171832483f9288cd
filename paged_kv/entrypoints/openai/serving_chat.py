"""``POST /v1/chat/completions``: messages in, the assistant's answer out, whole or streamed (lesson 16).

vLLM: ``vllm/entrypoints/openai/chat_completion/serving.py`` (``OpenAIServingChat``). A chat request
is a completion of one prompt made from its messages. vLLM makes that prompt with the
tokenizer's *chat template* (``tokenizer.apply_chat_template``, a Jinja template shipped with the
model, ``vllm/entrypoints/chat_utils.py``), so each model reads the markers it was trained on. The
course serves models with no template (the byte-token stand-ins), so it uses one plain template,
:data:`CHAT_TEMPLATE`, for every model: each message as ``<|role|>``, a newline, its content and a
newline, then ``<|assistant|>`` and a newline, where the answer starts. A message's content is a
string or a list of text parts, joined by newlines.

The answer's shapes follow OpenAI's: not streaming, a :class:`~.protocol.ChatCompletionResponse`
whose choices hold a ``message`` (``role`` ``"assistant"``, ``content``); streaming, each
completion's first chunk carries ``delta`` ``{"role": "assistant", "content": ""}``, the next
chunks the new text, and its last one its ``finish_reason``; ``stream_options.include_usage`` adds
a chunk with the usage; then ``data: [DONE]``. ``max_completion_tokens`` wins over ``max_tokens``;
both left out, the answer may take the rest of the context.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi.responses import Response

from paged_kv.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    DeltaMessage,
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

CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""How one message is written into the prompt (the course's template; vLLM uses the model's)."""
GENERATION_PROMPT = "<|assistant|>\n"
"""What ends the prompt: the assistant's turn, which the model continues."""
ASSISTANT = "assistant"


def message_text(message: ChatMessageParam) -> str:
    """A message's content as text: the string, or its text parts joined by newlines.

    Raises:
        RequestError: a part that is not text (an image, audio...).
    """
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise RequestError(
                f"paged_kv serves text only: content parts of type 'text', got {part.type!r}",
                param="messages",
            )
        texts.append(part.text)
    return "\n".join(texts)


def apply_chat_template(messages: Sequence[ChatMessageParam]) -> str:
    """The prompt of ``messages`` in the course's template (see the module).

    >>> apply_chat_template([ChatMessageParam(role="user", content="Hi")])
    '<|user|>\\nHi\\n<|assistant|>\\n'

    Raises:
        RequestError: no message, or a content part that is not text.
    """
    if not messages:
        raise RequestError("messages must hold at least one message", param="messages")
    body = "".join(CHAT_TEMPLATE.format(role=m.role, content=message_text(m)) for m in messages)
    return body + GENERATION_PROMPT


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint over an :class:`~paged_kv.serving.async_llm.AsyncLLM` (see the module)."""

    request_id_prefix = "chatcmpl"

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """The response to ``request``: an error (nothing changed), the whole answer, or a stream."""
        try:
            self.check_model(request.model)
            prompt = self.encode(apply_chat_template(request.messages))
            max_tokens = request.max_completion_tokens
            if max_tokens is None:
                max_tokens = request.max_tokens
            core_request = self.prepare(request, prompt, max_tokens)
        except ValueError as error:
            return error_json(error)
        return await self.respond(request, core_request)

    def response(
        self, request: ChatCompletionRequest, request_id: str, created: int, final: RequestOutput
    ) -> ChatCompletionResponse:
        """The whole answer: a choice per completion, in ``index`` order, and the usage."""
        with_ids = bool(request.return_token_ids)
        choices = [
            ChatCompletionResponseChoice(
                index=out.index,
                message=ChatMessage(role=ASSISTANT, content=out.text),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=list(out.token_ids) if with_ids else None,
            )
            for out in sorted(final.outputs, key=lambda out: out.index)
        ]
        num_generated = sum(len(out.token_ids) for out in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage_info(len(final.prompt_token_ids), num_generated),
            prompt_token_ids=final.prompt_token_ids if with_ids else None,
        )

    async def stream_chunks(
        self, request: ChatCompletionRequest, core_request: EngineCoreRequest, created: int
    ) -> AsyncIterator[str]:
        """The events of a streamed answer (see the module). Closed early (the client hung up), it
        closes the engine's generator, which aborts the request."""
        request_id, prompt = core_request.request_id, core_request.prompt_token_ids
        params = core_request.sampling_params
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        with_ids = bool(request.return_token_ids)
        generated = [0] * params.n

        def chunk(choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=[choice],
            )

        generator = self.async_llm.generate(core_request)
        try:
            for index in range(params.n):  # the role first, before any step (vLLM sends it first too)
                role = DeltaMessage(role=ASSISTANT, content="")
                first = ChatCompletionResponseStreamChoice(
                    index=index, delta=role, logprobs=None, finish_reason=None
                )
                yield sse(chunk(first), exclude_unset=True)
            async for res in generator:
                for out in res.outputs:
                    generated[out.index] += len(out.token_ids)
                    if not out.text and out.finish_reason is None and not (with_ids and out.token_ids):
                        continue  # no new text yet (vLLM sends no empty delta)
                    choice = ChatCompletionResponseStreamChoice(
                        index=out.index, delta=DeltaMessage(content=out.text), logprobs=None
                    )
                    choice.finish_reason = out.finish_reason
                    if out.finish_reason is not None:
                        choice.stop_reason = out.stop_reason
                    if with_ids:
                        choice.token_ids = list(out.token_ids)
                    event = chunk(choice)
                    if continuous:
                        event.usage = usage_info(len(prompt), generated[out.index])
                    yield sse(event, exclude_unset=True)
            if include_usage:
                last = ChatCompletionStreamResponse(
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

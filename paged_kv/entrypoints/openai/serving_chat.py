"""``POST /v1/chat/completions``: messages in, the assistant's answer out, whole or streamed (lesson 16).

vLLM: ``vllm/entrypoints/openai/chat_completion/serving.py`` (``OpenAIServingChat``). A chat request
is a completion of one prompt made from its messages. vLLM makes that prompt with the
tokenizer's *chat template* (``tokenizer.apply_chat_template``, a Jinja template shipped with the
model, ``vllm/entrypoints/chat_utils.py``), so each model reads the markers it was trained on. The
course serves models with no template (the byte-token stand-ins), so it uses one plain template,
:data:`CHAT_TEMPLATE`, for every model: each message as ``<|role|>``, a newline, its content and a
newline, then ``<|assistant|>`` and a newline, where the answer starts (``add_generation_prompt``,
on by default; with ``continue_final_message`` the last message is left open instead, without its
newline, and the model continues it). A message's content is a string or a list of text parts,
joined by newlines.

The answer's shapes follow OpenAI's: not streaming, a :class:`~.protocol.ChatCompletionResponse`
whose choices hold a ``message`` (``role`` ``"assistant"``, or the last message's without a
generation prompt, and ``content``); streaming, each completion's first chunk carries ``delta``
``{"role": ..., "content": ""}``, the next chunks the new text, and its last one its
``finish_reason``; ``stream_options.include_usage`` adds a chunk with the usage; then
``data: [DONE]``. ``max_completion_tokens`` wins over ``max_tokens``; both left out, the answer may
take the rest of the context.

``logprobs: true`` gives each choice ``logprobs.content``: per generated token ``{token, logprob,
bytes, top_logprobs}``, ``top_logprobs`` the ``top_logprobs`` likeliest tokens (the engine's order:
the chosen one first), ``bytes`` a token's text in UTF-8 (vLLM's ``_create_chat_logprobs``).
vLLM's ``echo`` puts the last message's content before each answer when its role is the answer's.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from paged_kv.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
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
    MIN_LOGPROB,
    OpenAIServing,
    RequestError,
    clamp_prompt_logprobs,
    error_json,
    merge_async_iterators,
    sse,
    usage_info,
)
from paged_kv.serving.logprobs import PositionLogprobs
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


def apply_chat_template(
    messages: Sequence[ChatMessageParam],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt of ``messages`` in the course's template (see the module).

    >>> apply_chat_template([ChatMessageParam(role="user", content="Hi")])
    '<|user|>\\nHi\\n<|assistant|>\\n'
    >>> apply_chat_template([ChatMessageParam(role="assistant", content="Hi")], continue_final_message=True)
    '<|assistant|>\\nHi'

    Raises:
        RequestError: no message, or a content part that is not text.
    """
    if not messages:
        raise RequestError("messages must hold at least one message", param="messages")
    body = "".join(CHAT_TEMPLATE.format(role=m.role, content=message_text(m)) for m in messages)
    if continue_final_message:
        return body.removesuffix("\n")
    return body + GENERATION_PROMPT if add_generation_prompt else body


@dataclass(frozen=True)
class ChatContext:
    """What a chat's answer carries besides the engine's outputs: its role, the text ``echo``
    puts before it, and the templated prompt (``return_prompt_text``)."""

    role: str
    echo_text: str
    prompt_text: str


class OpenAIServingChat(OpenAIServing):
    """The chat endpoint over an :class:`~paged_kv.serving.async_llm.AsyncLLM` (see the module)."""

    request_id_prefix = "chatcmpl"
    api = "chat"

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request | None = None
    ) -> Response:
        """The response to ``request``: an error (nothing changed), the whole answer, or a stream."""
        try:
            self.check_request(request)
            text = apply_chat_template(
                request.messages, request.add_generation_prompt, request.continue_final_message
            )
            max_tokens = request.max_completion_tokens
            if max_tokens is None:
                max_tokens = request.max_tokens
            top_logprobs = request.top_logprobs or 0
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is None and request.echo:
                prompt_logprobs = top_logprobs
            response_id, core_requests = self.prepare(
                request,
                [self.encode(text)],
                max_tokens,
                raw_request,
                logprobs=top_logprobs if request.logprobs else None,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as error:
            return error_json(self.named(error, request))
        return await self.respond(request, response_id, core_requests, self.context(request, text))

    @staticmethod
    def context(request: ChatCompletionRequest, prompt_text: str) -> ChatContext:
        """The answer's role (vLLM's ``get_chat_request_role``: the assistant's after a generation
        prompt, else the last message's) and what ``echo`` puts before it: the last message's
        content when its role is the answer's."""
        last = request.messages[-1]
        role = ASSISTANT if request.add_generation_prompt else last.role
        echo = message_text(last) if request.echo and last.role == role else ""
        return ChatContext(role, echo, prompt_text)

    def create_chat_logprobs(
        self,
        token_ids: Sequence[int],
        top_logprobs: Sequence[PositionLogprobs | None],
        num_output_top_logprobs: int | None,
        as_id: bool | None = False,
    ) -> ChatCompletionLogProbs:
        """OpenAI's log-probabilities of an answer's tokens (vLLM's ``_create_chat_logprobs``): each
        with its text, its log-probability (-9999 for ``-inf``) and UTF-8 bytes, and the
        ``top_logprobs`` first tokens of its dict (all of them for -1)."""
        limit = None if num_output_top_logprobs == -1 else num_output_top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, top_logprobs, strict=True):
            chosen = None if position is None else position.get(token_id)
            if chosen is None:
                token = self.token_text(token_id, as_id=as_id)
                content.append(
                    ChatCompletionLogProbsContent(token=token, logprob=MIN_LOGPROB, bytes=list(_utf8(token)))
                )
                continue
            top = []
            for t, lp in itertools.islice(position.items(), limit):
                text = self.token_text(t, lp, as_id)
                top.append(
                    ChatCompletionLogProb(
                        token=text, logprob=max(lp.logprob, MIN_LOGPROB), bytes=list(_utf8(text))
                    )
                )
            decoded = chosen.decoded_token
            content.append(
                ChatCompletionLogProbsContent(
                    token=self.token_text(token_id, chosen, as_id),
                    logprob=max(chosen.logprob, MIN_LOGPROB),
                    bytes=None if decoded is None else list(_utf8(decoded)),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)

    def response(
        self,
        request: ChatCompletionRequest,
        response_id: str,
        created: int,
        finals: list[RequestOutput],
        context: ChatContext,
    ) -> ChatCompletionResponse:
        """The whole answer: a choice per completion, in ``index`` order, and the usage."""
        (final,) = finals
        with_ids = bool(request.return_token_ids)
        choices = []
        for out in sorted(final.outputs, key=lambda out: out.index):
            logprobs = None
            if request.logprobs:
                logprobs = self.create_chat_logprobs(
                    out.token_ids, out.logprobs, request.top_logprobs, request.return_tokens_as_token_ids
                )
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=ChatMessage(role=context.role, content=context.echo_text + out.text),
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    token_ids=list(out.token_ids) if with_ids else None,
                )
            )
        num_generated = sum(len(out.token_ids) for out in final.outputs)
        return ChatCompletionResponse(
            id=response_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage_info(len(final.prompt_token_ids), num_generated),
            prompt_logprobs=clamp_prompt_logprobs(final.prompt_logprobs),
            prompt_token_ids=final.prompt_token_ids if with_ids else None,
            prompt_text=context.prompt_text if request.return_prompt_text else None,
        )

    async def stream_chunks(
        self,
        request: ChatCompletionRequest,
        response_id: str,
        core_requests: list[EngineCoreRequest],
        created: int,
        context: ChatContext,
    ) -> AsyncIterator[str]:
        """The events of a streamed answer (see the module). Closed early (the client hung up), it
        closes the engine's generator, which aborts the request."""
        (core_request,) = core_requests
        prompt, params = core_request.prompt_token_ids, core_request.sampling_params
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        with_ids = bool(request.return_token_ids)
        generated = [0] * params.n

        def chunk(choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=response_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=[choice],
            )

        results = merge_async_iterators(self.async_llm.generate(core_request))
        try:
            for index in range(params.n):  # the role first, before any step (vLLM sends it first too)
                role = DeltaMessage(role=context.role, content="")
                first = chunk(
                    ChatCompletionResponseStreamChoice(
                        index=index, delta=role, logprobs=None, finish_reason=None
                    )
                )
                if with_ids:
                    first.prompt_token_ids = list(prompt)
                if request.return_prompt_text:
                    first.prompt_text = context.prompt_text
                yield sse(first, exclude_unset=True)
            for index in range(params.n) if context.echo_text else ():
                echoed = ChatCompletionResponseStreamChoice(
                    index=index, delta=DeltaMessage(content=context.echo_text)
                )
                yield sse(chunk(echoed), exclude_unset=True)
            async for _, res in results:
                for out in res.outputs:
                    generated[out.index] += len(out.token_ids)
                    shows_tokens = (with_ids or request.logprobs) and out.token_ids
                    if not out.text and out.finish_reason is None and not shows_tokens:
                        continue  # no new text yet (vLLM sends no empty delta)
                    choice = ChatCompletionResponseStreamChoice(
                        index=out.index, delta=DeltaMessage(content=out.text), logprobs=None
                    )
                    if request.logprobs:
                        choice.logprobs = self.create_chat_logprobs(
                            out.token_ids,
                            out.logprobs,
                            request.top_logprobs,
                            request.return_tokens_as_token_ids,
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
                    id=response_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage_info(len(prompt), sum(generated)),
                )
                yield sse(last, exclude_none=True)
        except Exception as error:
            yield self.stream_error(error)
        finally:
            await results.aclose()
        yield sse("[DONE]")


def _utf8(text: str) -> bytes:
    """A token's text as OpenAI's ``bytes`` list it (vLLM: ``errors="replace"``)."""
    return text.encode("utf-8", errors="replace")

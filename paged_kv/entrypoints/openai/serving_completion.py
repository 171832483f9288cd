"""``POST /v1/completions``: prompts in, their completions out, whole or streamed (lesson 16).

vLLM: ``vllm/entrypoints/openai/completion/serving.py`` (``OpenAIServingCompletion``). The prompt is
text (tokenized with the served tokenizer's ``encode``), token ids, or a list of either: each
prompt is a request of its own (``f"{id}-{i}"``), all checked before any is queued, served together,
and answered in one response whose choice ``index`` is ``prompt * n + j`` and whose usage sums them.

* Not streaming, the requests run with ``FINAL_ONLY`` outputs and the answer is one
  :class:`~.protocol.CompletionResponse`: a choice per completion, each with its text, its
  ``finish_reason`` (``"stop"``, ``"length"``) and vLLM's ``stop_reason``, and the ``usage``.
* Streaming (``"stream": true``), they run with ``DELTA`` outputs: each step's new text of each
  completion is one server-sent event ``data: {...}`` (a :class:`~.protocol.CompletionStreamResponse`,
  one choice, its ``index`` saying which), the last one of a completion carrying its
  ``finish_reason``; with ``stream_options.include_usage`` a last chunk with no choices carries the
  ``usage``; then ``data: [DONE]``. A step that adds nothing to a completion sends nothing for it.

``logprobs`` (k) gives each choice OpenAI's ``{text_offset, token_logprobs, tokens, top_logprobs}``:
per token its text's offset in the choice's text, its log-probability, its text, and the ``k + 1``
likeliest tokens' (the engine's order: the chosen token first). ``echo`` puts the prompt's text
before each choice's; with ``logprobs`` the prompt's tokens come first in them (vLLM asks the engine
for ``prompt_logprobs = logprobs``), the first one's log-probability ``None``; with ``max_tokens``
0 the choice is the prompt alone (one token is generated and left out, as vLLM does). With
``return_token_ids`` (vLLM's extra field) each choice carries its ``token_ids`` and, whole or in its
first chunk, the ``prompt_token_ids`` (and, as in vLLM, an echoed prompt's text is then left out).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from paged_kv.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from paged_kv.entrypoints.openai.serving import (
    MIN_LOGPROB,
    OpenAIServing,
    clamp_prompt_logprobs,
    error_json,
    merge_async_iterators,
    sse,
    usage_info,
)
from paged_kv.serving.logprobs import PositionLogprobs
from paged_kv.serving.output_processor import CompletionOutput, RequestOutput
from paged_kv.serving.request import EngineCoreRequest


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids and its text as sent (None: sent as ids)."""

    token_ids: list[int]
    text: str | None


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint over an :class:`~paged_kv.serving.async_llm.AsyncLLM` (see the module)."""

    request_id_prefix = "cmpl"
    api = "completions"

    def prompts(self, prompt: str | list) -> list[Prompt]:
        """The request's prompts: a string, a list of token ids, or a list of either."""
        many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        return [self._prompt(one) for one in (prompt if many else [prompt])]

    def _prompt(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(self.encode(prompt), prompt)
        return Prompt(list(prompt), None)

    async def create_completion(
        self, request: CompletionRequest, raw_request: Request | None = None
    ) -> Response:
        """The response to ``request``: an error (nothing changed), the whole completion, or a stream."""
        try:
            self.check_request(request)
            prompts = self.prompts(request.prompt)
            echo_only = bool(request.echo) and request.max_tokens == 0
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is None and request.echo:
                prompt_logprobs = request.logprobs
            response_id, core_requests = self.prepare(
                request,
                [p.token_ids for p in prompts],
                1 if echo_only else request.max_tokens,
                raw_request,
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as error:
            return error_json(self.named(error, request))
        return await self.respond(request, response_id, core_requests, prompts)

    # ------------------------------------------------------------------------------ one choice

    def echoed(
        self,
        request: CompletionRequest,
        prompt: Prompt,
        prompt_logprobs: list[PositionLogprobs | None] | None,
        out: CompletionOutput,
    ) -> tuple[str, list[int], list[PositionLogprobs | None] | None]:
        """A choice's text, token ids and log-probabilities with the prompt before them (``echo``;
        ``max_tokens`` 0: the prompt alone)."""
        text = prompt.text if prompt.text is not None else self.decode(prompt.token_ids)  # ids checked by now
        if request.return_token_ids:
            text = ""  # as vLLM, which detokenizes an echoed prompt only without token ids
        if request.max_tokens == 0:
            return text, prompt.token_ids, prompt_logprobs
        scored = None
        if request.logprobs is not None:
            scored = [*(prompt_logprobs or []), *(out.logprobs or [])]
        return text + out.text, [*prompt.token_ids, *out.token_ids], scored

    def create_completion_logprobs(
        self,
        token_ids: Sequence[int],
        top_logprobs: Sequence[PositionLogprobs | None],
        num_output_top_logprobs: int,
        initial_text_offset: int = 0,
        as_id: bool | None = False,
    ) -> CompletionLogProbs:
        """OpenAI's log-probabilities of ``token_ids`` (vLLM's ``_create_completion_logprobs``): a
        position the engine did not score (the first prompt token) has ``None``; each other keeps
        the ``k + 1`` first tokens of its dict (all of them for -1), ``-inf`` as -9999."""
        limit = None if num_output_top_logprobs == -1 else num_output_top_logprobs + 1
        offsets, token_logprobs, tokens, top_logprobs_out = [], [], [], []
        offset = initial_text_offset
        for token_id, position in zip(token_ids, top_logprobs, strict=True):
            if position is None:
                token = self.token_text(token_id, as_id=as_id)
                token_logprobs.append(None)
                top_logprobs_out.append(None)
            else:
                chosen = position[token_id]
                token = self.token_text(token_id, chosen, as_id)
                token_logprobs.append(max(chosen.logprob, MIN_LOGPROB))
                top = itertools.islice(position.items(), limit)
                top_logprobs_out.append(
                    {self.token_text(t, lp, as_id): max(lp.logprob, MIN_LOGPROB) for t, lp in top}
                )
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        return CompletionLogProbs(  # every field given: a stream's chunk leaves out the unset ones
            text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens, top_logprobs=top_logprobs_out
        )

    # ------------------------------------------------------------------------------ whole

    def response(
        self,
        request: CompletionRequest,
        response_id: str,
        created: int,
        finals: list[RequestOutput],
        prompts: list[Prompt],
    ) -> CompletionResponse:
        """The whole answer: each prompt's choices in ``index`` order (``prompt * n + j``), the usage
        summed."""
        with_ids = bool(request.return_token_ids)
        choices: list[CompletionResponseChoice] = []
        num_prompt = num_generated = 0
        for prompt, final in zip(prompts, finals, strict=True):
            prompt_logprobs = clamp_prompt_logprobs(final.prompt_logprobs)
            for out in sorted(final.outputs, key=lambda out: out.index):
                text, token_ids, scored = out.text, out.token_ids, out.logprobs
                if request.echo:
                    text, token_ids, scored = self.echoed(request, prompt, prompt_logprobs, out)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.create_completion_logprobs(
                        token_ids, scored, request.logprobs, as_id=request.return_tokens_as_token_ids
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=len(choices),
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        token_ids=list(out.token_ids) if with_ids else None,
                        prompt_logprobs=prompt_logprobs,
                        prompt_token_ids=final.prompt_token_ids if with_ids else None,
                    )
                )
                num_generated += len(out.token_ids)
            num_prompt += len(final.prompt_token_ids)
        return CompletionResponse(
            id=response_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage_info(num_prompt, num_generated),
        )

    # ------------------------------------------------------------------------------ streamed

    async def stream_chunks(
        self,
        request: CompletionRequest,
        response_id: str,
        core_requests: list[EngineCoreRequest],
        created: int,
        prompts: list[Prompt],
    ) -> AsyncIterator[str]:
        """The events of a streamed completion (see the module). Closed early (the client hung up),
        it closes the engine's generators, which aborts the requests."""
        n = core_requests[0].sampling_params.n
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        with_ids = bool(request.return_token_ids)
        generated = [0] * (n * len(prompts))
        offsets = [0] * (n * len(prompts))
        started = [False] * (n * len(prompts))
        prompt_logprobs: list[list | None] = [None] * len(prompts)
        results = merge_async_iterators(*map(self.async_llm.generate, core_requests))
        try:
            async for p, res in results:
                if res.prompt_logprobs is not None:
                    known = prompt_logprobs[p]
                    fresh = clamp_prompt_logprobs(res.prompt_logprobs)
                    prompt_logprobs[p] = fresh if known is None else known + fresh[1:]
                for out in res.outputs:
                    i = p * n + out.index
                    generated[i] += len(out.token_ids)
                    text, token_ids, scored = out.text, out.token_ids, out.logprobs
                    first = not started[i]
                    if first and request.echo:
                        text, token_ids, scored = self.echoed(request, prompts[p], prompt_logprobs[p], out)
                    elif not text and not token_ids and out.finish_reason is None:
                        continue
                    started[i] = True
                    choice = CompletionResponseStreamChoice(
                        index=i,
                        text=text,
                        logprobs=None,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                    if request.logprobs is not None:
                        choice.logprobs = self.create_completion_logprobs(
                            token_ids,
                            scored,
                            request.logprobs,
                            offsets[i],
                            request.return_tokens_as_token_ids,
                        )
                        if choice.logprobs.tokens:
                            offsets[i] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                    if with_ids:
                        choice.token_ids = list(out.token_ids)
                        if first:
                            choice.prompt_token_ids = list(prompts[p].token_ids)
                    chunk = CompletionStreamResponse(
                        id=response_id,
                        object="text_completion",
                        created=created,
                        model=self.model_name,
                        choices=[choice],
                    )
                    if continuous:
                        chunk.usage = usage_info(len(prompts[p].token_ids), generated[i])
                    yield sse(chunk, exclude_unset=True)
            if include_usage:
                num_prompt = sum(len(prompt.token_ids) for prompt in prompts)
                last = CompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage_info(num_prompt, sum(generated)),
                )
                yield sse(last, exclude_none=True)
        except Exception as error:
            yield self.stream_error(error)
        finally:
            await results.aclose()
        yield sse("[DONE]")

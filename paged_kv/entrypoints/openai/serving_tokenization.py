"""``POST /tokenize`` and ``POST /detokenize``: the served tokenizer, as vLLM exposes it (lesson 16).

vLLM: ``vllm/entrypoints/serve/tokenize/serving.py`` (``ServingTokenization``). ``/tokenize`` takes
a prompt, or chat messages, which it writes in the chat endpoint's template first (the same
``add_generation_prompt`` and ``continue_final_message``), so the ids it answers are exactly those a
completion of that prompt or that chat would run; it answers ``{count, max_model_len, tokens}``, and
``token_strs`` (each token's text) with ``return_token_strs``. ``/detokenize`` takes ``{tokens}``
and answers ``{prompt}``, their text. Neither touches the engine; a model name other than the
served one is a 404, a field the server does not implement a 400, as for the other endpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastapi.responses import JSONResponse, Response

from paged_kv.entrypoints.openai.fields import check_fields
from paged_kv.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from paged_kv.entrypoints.openai.serving import Encode, RequestError, check_model, error_json
from paged_kv.entrypoints.openai.serving_chat import apply_chat_template


class ServingTokenization:
    """The tokenizer's endpoints for the model ``model_name``: at most ``max_model_len`` tokens of a
    vocabulary of ``vocab_size``."""

    def __init__(
        self,
        *,
        model_name: str,
        encode: Encode,
        decode: Callable[[Sequence[int]], str],
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.model_name, self.encode, self.decode = model_name, encode, decode
        self.max_model_len, self.vocab_size = max_model_len, vocab_size

    def _check(self, request, api: str) -> None:
        check_model(request.model, self.model_name)
        check_fields(request, api)

    async def create_tokenize(self, request: TokenizeRequest) -> Response:
        """The prompt's (or the templated messages') token ids, or an error."""
        try:
            if isinstance(request, TokenizeChatRequest):
                self._check(request, "tokenize (chat)")
                text = apply_chat_template(
                    request.messages, request.add_generation_prompt, request.continue_final_message
                )
            else:
                self._check(request, "tokenize")
                text = request.prompt
        except ValueError as error:
            return error_json(error)
        tokens = self.encode(text)
        strs = [self.decode([t]) for t in tokens] if request.return_token_strs else None
        response = TokenizeResponse(
            count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=strs
        )
        return JSONResponse(response.model_dump())

    async def create_detokenize(self, request: DetokenizeRequest) -> Response:
        """The text of the request's token ids, or an error."""
        try:
            self._check(request, "detokenize")
            if any(t >= self.vocab_size for t in request.tokens):
                raise RequestError(f"tokens must hold token ids in [0, {self.vocab_size})", param="tokens")
        except ValueError as error:
            return error_json(error)
        return JSONResponse(DetokenizeResponse(prompt=self.decode(request.tokens)).model_dump())

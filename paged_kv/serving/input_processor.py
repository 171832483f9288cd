"""The one check of a request, before the engine takes it (lesson 16; vLLM: ``InputProcessor``).

vLLM's ``InputProcessor.process_inputs`` (``vllm/v1/engine/input_processor.py``) turns a client's
prompt and sampling parameters into the ``EngineCoreRequest`` the engine core runs, and refuses what
the core could not serve, in its own words. :class:`InputProcessor` is the course's, and the only
place a request's content is checked: the offline engine, :class:`~paged_kv.serving.llm_engine.LLMEngine`,
:class:`~paged_kv.serving.async_llm.AsyncLLM` (on the event loop, before anything is queued) and the
OpenAI server all go through it, and the scheduler trusts what it made. It checks, in order:

1. the sampling parameters are a :class:`~paged_kv.serving.sampling_params.SamplingParams` (whose
   own checks ran when they were made, in vLLM's words), and the request id can be a dict key;
2. the prompt: non-empty token ids of the model's vocabulary, and shorter than ``max_model_len``
   with room for one output token (vLLM's ``_validate_prompt_len`` messages);
3. stop strings need a tokenizer's ``decode`` to be seen;
4. ``max_tokens`` is settled here and nowhere else: ``None`` is as many as the context leaves
   (vLLM: ``max_model_len`` less the prompt), a larger number is capped there;
5. the memory could hold the request alone at its longest, ``len(prompt) + max_tokens - 1``
   tokens (else it would wait for ever);
6. what the sampler and the prefix cache will read, as vLLM's ``SamplingParams.verify`` and its
   protocol check it: ``logprobs`` and ``prompt_logprobs`` at most ``max_logprobs`` (-1: the
   vocabulary), ``logit_bias`` keys in the vocabulary, ``bad_words`` tokenized
   (:meth:`SamplingParams.update_from_tokenizer`), a ``priority`` other than 0 only under the
   ``"priority"`` policy (vLLM's protocol documents this error, its 0.33.0 code does not raise
   it: the course does, so that no priority is ignored in silence), a ``cache_salt`` that is a
   non-empty string of at most 128 characters without ``@``, ``/``, ``\\`` or NUL.

Whether an id is in use is the engine's state, not the request's: the engine that holds the live
requests checks it (:class:`~paged_kv.serving.output_processor.OutputProcessor`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from paged_kv.errors import ValidationError
from paged_kv.model.generation import is_token
from paged_kv.serving.config import ModelConfig
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.validate import check_hashable

MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
"""vLLM's limits on a ``cache_salt`` (``validate_cache_salt``)."""


class InputProcessor:
    """Checks requests for an engine whose model is ``model_config`` (see the module).

    ``max_tokens_alone(request)`` is the most tokens the engine's memory holds for ``request`` alone
    and ``num_blocks`` its size, for the message; ``eos_token_ids`` are the model's end-of-sequence
    tokens, which stop a request unless it ignores them; ``can_detokenize`` says whether the engine
    has a ``decode`` (stop strings need one).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        max_tokens_alone: Callable[[EngineCoreRequest], int],
        *,
        num_blocks: int,
        eos_token_ids: Sequence[int] = (),
        can_detokenize: bool = False,
        scheduling_policy: str = "fcfs",
    ) -> None:
        self.model_config = model_config
        self.scheduling_policy = scheduling_policy
        self.max_tokens_alone = max_tokens_alone
        self.num_blocks = num_blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.can_detokenize = can_detokenize

    def process_inputs(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> EngineCoreRequest:
        """The :class:`~paged_kv.serving.request.EngineCoreRequest` of a client's request, checked
        (vLLM: ``InputProcessor.process_inputs``); ``params`` default to ``SamplingParams()``
        (vLLM's defaults: 16 tokens, temperature 1.0).

        Raises:
            ValueError: whatever the module lists, in vLLM's words where vLLM has them; nothing is
                changed anywhere.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValidationError(
                f"sampling_params must be a SamplingParams, got {params!r}", parameter="sampling_params"
            )
        check_hashable("request_id", request_id)
        prompt = self._check_prompt(prompt_token_ids)
        if params.stop and not self.can_detokenize:
            raise ValidationError(
                "stop strings need a tokenizer: give the engine a decode function", parameter="stop"
            )
        self._check_sampling(params)
        self._check_scheduling(priority, cache_salt, lora_name)
        room = self.model_config.max_model_len - len(prompt)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request = EngineCoreRequest(
            request_id,
            len(prompt),
            max_tokens,
            tuple(prompt),
            stop,
            params,
            arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )
        longest, most = len(prompt) + max_tokens - 1, self.max_tokens_alone(request)
        if longest > most:
            raise ValueError(
                f"num_blocks {self.num_blocks} cannot hold request {request_id!r} alone: it grows to "
                f"{longest} tokens and at most {most} fit (block 0 is the null block); see min_num_blocks"
            )
        return request

    def _check_sampling(self, params: SamplingParams) -> None:
        """Step 6's sampling checks, in vLLM's words (``SamplingParams._validate_logprobs``,
        ``_validate_logit_bias``)."""
        vocab = self.model_config.vocab_size
        most = vocab if self.model_config.max_logprobs == -1 else self.model_config.max_logprobs
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(params, name)
            asked = vocab if asked == -1 else asked
            if asked and asked > most:
                raise ValidationError(
                    f"Requested {what} logprobs of {asked}, which is greater than max allowed: {most}",
                    parameter=name,
                )
        if params.logit_bias:
            outside = [t for t in params.logit_bias if not 0 <= t < vocab]
            if outside:
                raise ValidationError(
                    f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}",
                    parameter="logit_bias",
                )
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValidationError(
                "bad_words need a tokenizer: call SamplingParams.update_from_tokenizer(encode)",
                parameter="bad_words",
            )
        bad = [t for ids in params.bad_words_token_ids or () for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValidationError(
                f"The model vocabulary size is {vocab}, but the following tokens were specified as "
                f"bad: {bad}. All token id values should be integers satisfying: "
                f"0 <= token_id <= {vocab - 1}.",
                parameter="bad_words",
            )

    def _check_scheduling(self, priority: object, cache_salt: object, lora_name: object) -> None:
        """Step 6's checks of what the scheduler and the prefix cache read."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValidationError(f"priority must be an integer, got {priority!r}", parameter="priority")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValidationError(
                f"Got priority {priority} but Priority scheduling is not enabled: start the engine "
                "with scheduling_policy='priority' (--scheduling-policy priority)",
                parameter="priority",
            )
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValidationError(
                    "Parameter 'cache_salt' must be a non-empty string if provided.", parameter="cache_salt"
                )
            if len(cache_salt) > MAX_CACHE_SALT_LENGTH or not CACHE_SALT_FORBIDDEN.isdisjoint(cache_salt):
                raise ValidationError(
                    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                    "'@', '/', '\\\\', or NUL.",
                    parameter="cache_salt",
                )
        if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
            raise ValidationError(
                f"lora_name must be a non-empty string or None, got {lora_name!r}", parameter="lora_name"
            )

    def _check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """``prompt_token_ids`` as a list of ints, if the model can run it: vLLM's messages."""
        if (
            isinstance(prompt_token_ids, str)
            or not isinstance(prompt_token_ids, Sequence)
            or not prompt_token_ids
        ):
            raise ValidationError(
                "prompt_token_ids must be a non-empty list of token ids", parameter="prompt_token_ids"
            )
        vocab = self.model_config.vocab_size
        if not all(is_token(t, vocab) for t in prompt_token_ids):
            raise ValidationError(
                f"prompt_token_ids must hold token ids in [0, {vocab})", parameter="prompt_token_ids"
            )
        length, limit = len(prompt_token_ids), self.model_config.max_model_len
        if length > limit:
            raise ValidationError(
                f"The decoder prompt (length {length}) is longer than the maximum model length of "
                f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens.",
                parameter="prompt_token_ids",
            )
        if length == limit:
            raise ValidationError(
                f"The decoder prompt (length {length}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                "output tokens).",
                parameter="prompt_token_ids",
            )
        return [int(t) for t in prompt_token_ids]

"""How a request's tokens are chosen and when it stops, as vLLM's ``SamplingParams`` says it (lesson 16).

vLLM 0.33.0 keeps these in ``vllm/sampling_params.py``; the names, the defaults and the error
messages here are its own, for the parameters the course serves:

* ``max_tokens`` (16 by default, as vLLM): the most tokens to generate; ``None``, as many as the
  context leaves (the input processor settles it, capped at ``max_model_len`` less the prompt);
* ``temperature`` (1.0; 0 is greedy, the argmax, exactly the tokens of Hugging Face's
  ``generate``; a positive one below 0.01 is raised to 0.01, as vLLM does), ``top_k`` (0, or -1 as
  vLLM also accepts: every token) and ``top_p`` (1.0: the whole distribution);
* ``seed`` (-1 is None, as in vLLM): a seeded request draws from its own generator, so it gets the
  same tokens whatever else runs in its batch, and whether or not it was preempted;
* ``stop`` strings (the text ends before the first one found, which is left out) and
  ``stop_token_ids`` (kept in the token ids, their text left out, as vLLM does); ``ignore_eos``
  generates past the model's end-of-sequence tokens;
* ``n``: that many completions of one prompt (vLLM's ``ParentRequest``: child ``i`` is request
  ``f"{i}_{request_id}"`` with seed ``seed + i``); with prefix caching the children share the
  prompt's full blocks. ``n > 1`` needs random sampling, as in vLLM.

How the logits become a distribution, in vLLM's order (Model Runner V2's sampler,
``vllm/v1/worker/gpu/sample/``): ``logit_bias`` (a bias per token id, clamped to [-100, 100]) and
``min_tokens`` (the stop tokens masked until that many were generated), then the penalties over the
tokens so far, ``repetition_penalty`` (> 0, 1 off: a seen token's positive logit divided by it, a
negative one multiplied; prompt and output tokens), ``frequency_penalty`` and ``presence_penalty``
(in [-2, 2], 0 off: subtracted once per occurrence, or once, of each output token), then
``bad_words`` (their last token banned where the tokens before it were just generated); then the
temperature, ``min_p`` (in [0, 1]: tokens below ``min_p`` times the likeliest one's probability
dropped), ``top_k`` and ``top_p``. A greedy request takes the argmax of the processed logits.

``logprobs`` (k) returns, for each generated token, its log-probability and rank and the ``k``
likeliest tokens' (vLLM's ``raw_logprobs`` mode: a log-softmax of the model's logits, before any
of the processing above); ``prompt_logprobs`` (k) the same for each prompt token after the first.
-1 asks for the whole vocabulary; the input processor caps both at the engine's ``max_logprobs``.

``output_kind`` says what each output of a request carries (vLLM's ``RequestOutputKind``): all the
tokens and text so far (``CUMULATIVE``), only the new ones (``DELTA``, for streaming), or nothing
until the request finishes (``FINAL_ONLY``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from paged_kv.errors import ValidationError

MAX_N_SEQUENCES = 16
"""The largest ``n`` (vLLM's ``VLLM_MAX_N_SEQUENCES``, 16384 there: a small engine serves fewer)."""

MIN_TEMPERATURE = 1e-2
"""A positive temperature below this is raised to it, as vLLM raises it (its ``_MAX_TEMP``): dividing
the logits by a smaller one could overflow them."""


class RequestOutputKind(Enum):
    """What each :class:`~paged_kv.serving.llm_engine.RequestOutput` of a request carries."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters (see the module); checked when built.

    Raises:
        ValueError: a parameter out of its range, with vLLM's message, which names it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    """The token ids of ``bad_words``, each word as it starts the text and as it follows a space
    (vLLM's ``_bad_words_token_ids``): set by :meth:`update_from_tokenizer`, which a server calls."""

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: normalise the sequences once, here
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValidationError(
                f"stop must be a string or a list of strings, got {self.stop!r}", parameter="stop"
            )
        if not all(stop):
            raise ValidationError("stop cannot contain an empty string.", parameter="stop")
        set_field(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise ValidationError(
                f"stop_token_ids must contain only integers, got {ids!r}.", parameter="stop_token_ids"
            )
        if any(t < 0 for t in ids):
            raise ValidationError(
                f"stop_token_ids must be a list of token ids, got {ids!r}", parameter="stop_token_ids"
            )
        set_field(self, "stop_token_ids", tuple(int(t) for t in ids))
        _check_int("n", self.n)
        if self.n > MAX_N_SEQUENCES:
            raise ValidationError(f"n must be at most {MAX_N_SEQUENCES}, got {self.n}.", parameter="n")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise ValidationError(
                f"temperature must be a number, got {temperature!r}", parameter="temperature"
            )
        if not math.isfinite(temperature):
            raise ValidationError(
                f"temperature must be a finite number, got {temperature}.", parameter="temperature"
            )
        if temperature < 0.0:
            raise ValidationError(
                f"temperature must be non-negative, got {temperature}.", parameter="temperature"
            )
        if temperature > 2.0:
            raise ValidationError(
                f"temperature must be in [0, 2], got {temperature}.", parameter="temperature"
            )
        if 0.0 < temperature < MIN_TEMPERATURE:  # vLLM's _MAX_TEMP: 1 / T must stay finite
            set_field(self, "temperature", MIN_TEMPERATURE)
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:
            raise ValidationError(f"top_p must be in (0, 1], got {top_p}.", parameter="top_p")
        if not _is_int(self.top_k):
            raise ValidationError(
                f"top_k must be an integer, got {type(self.top_k).__name__}", parameter="top_k"
            )
        if self.top_k < -1:  # vLLM quietly accepts -1 as 0 (disabled)
            raise ValidationError(
                f"top_k must be 0 (disable), or at least 1, got {self.top_k}.", parameter="top_k"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValidationError(f"seed must be an integer or None, got {self.seed!r}", parameter="seed")
        if self.seed == -1:  # vLLM's "no seed"
            set_field(self, "seed", None)
        if not isinstance(self.ignore_eos, bool):
            raise ValidationError(
                f"ignore_eos must be True or False, got {self.ignore_eos!r}", parameter="ignore_eos"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValidationError(
                f"max_tokens must be at least 1, got {self.max_tokens}.", parameter="max_tokens"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValidationError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}", parameter="output_kind"
            )
        self._check_processing(set_field)
        if self.greedy and self.n > 1:
            raise ValidationError(f"n must be 1 when using greedy sampling, got {self.n}.", parameter="n")

    def _check_processing(self, set_field: Callable[[object, str, object], None]) -> None:
        """The checks of the logits processing and of the log-probabilities (see the module)."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValidationError(f"{name} must be a number, got {value!r}", parameter=name)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValidationError(
                    f"{name} must be in [-2, 2], got {getattr(self, name)}.", parameter=name
                )
        if not math.isfinite(self.repetition_penalty):
            raise ValidationError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}.",
                parameter="repetition_penalty",
            )
        if self.repetition_penalty <= 0.0:
            raise ValidationError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                parameter="repetition_penalty",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValidationError(f"min_p must be in [0, 1], got {self.min_p}.", parameter="min_p")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValidationError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
                parameter="min_tokens",
            )
        if self.max_tokens is not None and _is_int(self.max_tokens) and self.min_tokens > self.max_tokens:
            raise ValidationError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
                parameter="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or (value < 0 and value != -1)):
                raise ValidationError(f"{name} must be non-negative or -1, got {value}.", parameter=name)
        if self.logit_bias is not None:
            set_field(self, "logit_bias", _logit_bias(self.logit_bias))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise ValidationError(
                f"bad_words must be a list of strings, got {self.bad_words!r}", parameter="bad_words"
            )
        if not all(words):
            raise ValidationError(
                f"bad_words cannot contain an empty string. Got bad_words={list(words)}",
                parameter="bad_words",
            )
        set_field(self, "bad_words", tuple(words))

    def update_from_tokenizer(self, encode: Callable[[str], Sequence[int]]) -> SamplingParams:
        """These parameters with :attr:`bad_words_token_ids` from a tokenizer's ``encode``, as vLLM's
        ``update_from_tokenizer`` makes them: each word as the text's start, and after a space when
        that tokenizes to another first token of the same length.

        Raises:
            ValueError: a bad word that tokenizes to nothing.
        """
        if not self.bad_words:
            return self
        ids: list[tuple[int, ...]] = []
        for word in self.bad_words:
            alone = tuple(encode(word.lstrip()))
            if not alone:
                raise ValidationError(
                    "bad_words entries must tokenize to at least one token.", parameter="bad_words"
                )
            ids.append(alone)
            spaced = tuple(encode(" " + word.lstrip()))
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                ids.append(spaced)
        return replace(self, bad_words_token_ids=tuple(ids))

    @property
    def needs_processing(self) -> bool:
        """Whether anything changes the model's logits before the temperature: a bias, a penalty,
        ``min_tokens`` or bad words (a greedy request then takes the argmax of the processed ones)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bad_words_token_ids
        )

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken: ``temperature`` 0."""
        return self.temperature == 0.0

    @property
    def stop_buffer_length(self) -> int:
        """How many characters of a stream are held back, so a stop string is never half sent."""
        return max(map(len, self.stop), default=1) - 1


def _logit_bias(bias: object) -> dict[int, float]:
    """``logit_bias`` with int keys (OpenAI's JSON sends them as strings) and each bias clamped to
    [-100, 100], as vLLM's ``from_optional`` converts it."""
    if not isinstance(bias, Mapping):
        raise ValidationError(
            f"logit_bias must be a mapping of token ids to biases, got {bias!r}", parameter="logit_bias"
        )
    converted, invalid = {}, []
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            invalid.append(token)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValidationError(
                f"logit_bias must map token ids to finite numbers, got {value!r} for {token!r}",
                parameter="logit_bias",
            )
        converted[token_id] = min(100.0, max(-100.0, float(value)))
    if invalid:
        raise ValidationError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
            parameter="logit_bias",
        )
    return converted


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ValidationError(f"{name} must be an int, but is of type {type(value)}", parameter=name)
    if value < 1:
        raise ValidationError(f"{name} must be at least 1, got {value}.", parameter=name)

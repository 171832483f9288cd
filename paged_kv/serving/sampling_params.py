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

``output_kind`` says what each output of a request carries (vLLM's ``RequestOutputKind``): all the
tokens and text so far (``CUMULATIVE``), only the new ones (``DELTA``, for streaming), or nothing
until the request finishes (``FINAL_ONLY``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from enum import Enum

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

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: normalise the sequences once, here
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(stop):
            raise ValueError("stop cannot contain an empty string.")
        set_field(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {ids!r}.")
        if any(t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        set_field(self, "stop_token_ids", tuple(int(t) for t in ids))
        _check_int("n", self.n)
        if self.n > MAX_N_SEQUENCES:
            raise ValueError(f"n must be at most {MAX_N_SEQUENCES}, got {self.n}.")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise ValueError(f"temperature must be a number, got {temperature!r}")
        if not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number, got {temperature}.")
        if temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        if temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {temperature}.")
        if 0.0 < temperature < MIN_TEMPERATURE:  # vLLM's _MAX_TEMP: 1 / T must stay finite
            set_field(self, "temperature", MIN_TEMPERATURE)
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < -1:  # vLLM quietly accepts -1 as 0 (disabled)
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed == -1:  # vLLM's "no seed"
            set_field(self, "seed", None)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken: ``temperature`` 0."""
        return self.temperature == 0.0

    @property
    def stop_buffer_length(self) -> int:
        """How many characters of a stream are held back, so a stop string is never half sent."""
        return max(map(len, self.stop), default=1) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, but is of type {type(value)}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")

"""Log-probabilities as the engine returns them (lesson 16; vLLM: ``vllm/logprobs.py``).

A request with ``logprobs=k`` gets, for each token it generated, a dict from token id to
:class:`Logprob`: the chosen token first, then the ``k`` likeliest tokens by rank (the chosen one
appears once, where it is also among them); ``prompt_logprobs=k`` the same for each prompt token,
``None`` for the first, which nothing predicts. The numbers are vLLM's default ``raw_logprobs``:
the log-softmax of the model's logits at that position, before any penalty, bias or temperature.

:class:`TokenLogprobs` is the runner's form of one position (vLLM: ``LogprobsLists``' row), which
the output processor turns into that dict with each token's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position, its ``rank`` among the vocabulary (1: the
    likeliest) and its text (vLLM: ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""Token id to :class:`Logprob` at one position, the chosen token first."""
SampleLogprobs = list[PositionLogprobs]
"""One :data:`PositionLogprobs` per generated token."""
PromptLogprobs = list[PositionLogprobs | None]
"""One per prompt token, ``None`` for the first."""


class TokenLogprobs(NamedTuple):
    """The runner's log-probabilities of one position: ``token_ids`` and ``logprobs`` of the chosen
    token first, then of the ``k`` likeliest in rank order; ``rank`` the chosen token's."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    rank: int

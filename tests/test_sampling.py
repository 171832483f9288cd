"""Sampling (lesson 16): vLLM's ``SamplingParams`` (names, defaults, messages) and the per-row sampler.

The sampler is checked against its definition: a greedy row (or ``top_k=1``, or a tiny ``top_p``)
is the argmax; a random row never draws a token that top-k or top-p leave out; a seeded
generator draws the same tokens every time; and over many draws the frequencies match the
softmax of the logits over the temperature, renormalised over what top-k and top-p keep (a
chi-square bound, deterministic through the seed).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.errors import ValidationError
from paged_kv.serving.sampler import SamplingState, new_generator, sample
from paged_kv.serving.sampling_params import (
    MAX_N_SEQUENCES,
    MIN_TEMPERATURE,
    RequestOutputKind,
    SamplingParams,
)

pytestmark = pytest.mark.lesson16

# ------------------------------------------------------------------------------ SamplingParams


def test_the_defaults_are_vllms():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        1,
        1.0,
        1.0,
        0,
        16,
    )
    assert params.seed is None and params.stop == () and params.stop_token_ids == ()
    assert params.ignore_eos is False and params.output_kind is RequestOutputKind.CUMULATIVE
    assert not params.greedy and SamplingParams(temperature=0).greedy
    assert [kind.value for kind in RequestOutputKind] == [0, 1, 2]  # vLLM's values
    assert [kind.name for kind in RequestOutputKind] == ["CUMULATIVE", "DELTA", "FINAL_ONLY"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"n": 2.0}, "n must be an int, but is of type <class 'float'>"),
        ({"n": MAX_N_SEQUENCES + 1}, f"n must be at most {MAX_N_SEQUENCES}, got {MAX_N_SEQUENCES + 1}."),
        ({"n": 2, "temperature": 0.0}, "n must be 1 when using greedy sampling, got 2."),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5."),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
        ({"temperature": math.inf}, "temperature must be a finite number, got inf."),
        ({"temperature": math.nan}, "temperature must be a finite number, got nan."),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"top_k": 1.5}, "top_k must be an integer, got float"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"stop": ""}, "stop cannot contain an empty string."),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string."),
        ({"stop": [3]}, "stop must be a string or a list of strings, got [3]"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must contain only integers, got ['a']."),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be a list of token ids, got [-3]"),
        ({"seed": 1.5}, "seed must be an integer or None, got 1.5"),
        ({"ignore_eos": 1}, "ignore_eos must be True or False, got 1"),
        ({"output_kind": 1}, "output_kind must be a RequestOutputKind, got 1"),
    ],
)
def test_a_bad_parameter_is_refused_with_vllms_message_naming_it(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)) as caught:
        SamplingParams(**kwargs)
    name = message.split()[0]
    assert str(caught.value).startswith(name) and name in kwargs  # the message names the argument
    assert caught.value.parameter == name  # and the error carries it, for a server's answer


def test_stop_sequences_are_normalised_to_tuples_and_the_params_are_frozen():
    assert SamplingParams(stop="end").stop == ("end",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 1]).stop_token_ids == (3, 1)
    assert SamplingParams(stop=("ab", "abcd")).stop_buffer_length == 3  # the longest, less one
    assert SamplingParams().stop_buffer_length == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_vllms_quiet_conventions_are_kept():
    """vLLM accepts ``top_k=-1`` (all), ``seed=-1`` (None), and raises a tiny positive temperature to
    0.01 (its ``_MAX_TEMP``), which keeps the logits finite."""
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=0).seed == 0
    assert SamplingParams(temperature=1e-300).temperature == MIN_TEMPERATURE == 0.01
    assert (
        SamplingParams(temperature=0.0).temperature == 0.0
        and SamplingParams(temperature=0.5).temperature == 0.5
    )


# ------------------------------------------------------------------------------ the sampler


def generator(params: SamplingParams, source_seed: int = 0) -> torch.Generator | None:
    return new_generator(params, torch.Generator().manual_seed(source_seed))


def sample_rows(logits: torch.Tensor, params: list, gens: list) -> torch.Tensor:
    """The sampler's tokens for rows of ``params`` (None: plain greedy) drawing with ``gens``."""
    pairs = zip(params, gens, strict=True)
    states = [None if p is None else SamplingState(p, g, (), frozenset()) for p, g in pairs]
    return sample(logits, states)[0]


def test_greedy_rows_take_the_argmax_and_random_rows_their_own_draw(device):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(device)
    random_params = SamplingParams(seed=1)
    params = [None, SamplingParams(temperature=0), random_params, None, SamplingParams(temperature=0, seed=4)]
    gens = [None, None, generator(random_params), None, None]
    tokens = sample_rows(logits, params, gens)
    assert tokens.device.type == "cpu" and tokens.dtype == torch.long and tokens.shape == (5,)
    argmax = logits.argmax(dim=-1).cpu()
    assert tokens[[0, 1, 3, 4]].tolist() == argmax[[0, 1, 3, 4]].tolist()
    again = sample_rows(logits[2:3], [random_params], [generator(random_params)])
    assert again.tolist() == tokens[2:3].tolist()  # the random row drew with its own generator


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.floats(0.05, 2.0),
    vocab=st.integers(2, 64),
)
def test_top_k_one_and_a_tiny_top_p_are_the_argmax(seed, temperature, vocab):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = [
        SamplingParams(temperature=temperature, top_k=1, seed=seed),
        SamplingParams(temperature=temperature, top_p=1e-6, seed=seed),
        SamplingParams(temperature=temperature, top_k=vocab + 5, top_p=1e-6, seed=seed),
    ]
    tokens = sample_rows(logits, params, [generator(p) for p in params])
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def kept_tokens(logits: torch.Tensor, params: SamplingParams) -> tuple[set[int], set[int]]:
    """The tokens top-k then top-p certainly keep, and those they may keep (ties at the top-p edge
    within float error): a reference in float64, one token at a time."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if params.top_k > 0:
        order = order[: params.top_k]
    mass = sum(probs[t] for t in order)
    certain, maybe, before = set(), set(), 0.0
    for t in order:
        if before / mass < params.top_p - 1e-5 or not certain:
            certain.add(t)
        if before / mass < params.top_p + 1e-5:
            maybe.add(t)
        before += probs[t]
    return certain, maybe


@settings(max_examples=40)
@given(
    values=st.lists(st.integers(-40, 40), min_size=2, max_size=24, unique=True),
    temperature=st.floats(0.1, 2.0),
    top_k=st.integers(-1, 30),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**32),
)
def test_a_random_row_never_draws_a_token_top_k_or_top_p_leave_out(values, temperature, top_k, top_p, seed):
    logits = torch.tensor(values, dtype=torch.float32) / 4  # distinct: no ties in the order
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    _, maybe = kept_tokens(logits, params)
    gen = generator(params)
    drawn = {int(sample_rows(logits[None], [params], [gen])[0]) for _ in range(30)}
    assert drawn <= maybe


def test_top_k_minus_one_keeps_every_token_as_zero_does():
    logits = torch.zeros(1, 4)  # uniform: every token is drawn, the least likely included
    draws = {}
    for top_k in (0, -1):
        params = SamplingParams(top_k=top_k, seed=9)
        gen = generator(params)
        draws[top_k] = [int(sample_rows(logits, [params], [gen])[0]) for _ in range(60)]
    assert draws[-1] == draws[0] and set(draws[0]) == {0, 1, 2, 3}


def test_a_seeded_request_draws_the_same_tokens_and_an_unseeded_one_follows_its_source():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(seed=123, temperature=1.5)

    def draws(gen: torch.Generator, params: SamplingParams = seeded) -> list[int]:
        return [int(sample_rows(logits[i % 4 : i % 4 + 1], [params], [gen])[0]) for i in range(40)]

    first = draws(generator(seeded, source_seed=1))
    assert first == draws(generator(seeded, source_seed=2))  # the seed alone decides
    assert first != draws(generator(SamplingParams(seed=124, temperature=1.5)))
    unseeded = SamplingParams(temperature=1.5)
    assert draws(generator(unseeded, 7), unseeded) == draws(generator(unseeded, 7), unseeded)
    assert draws(generator(unseeded, 7), unseeded) != draws(generator(unseeded, 8), unseeded)
    assert len(set(first)) > 5  # it does draw at random


def chi_square(counts: list[int], expected: list[float]) -> float:
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True) if e > 0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 0, 1.0), (1.0, 4, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.8)],
)
def test_the_draws_follow_the_softmax_over_the_temperature_over_what_is_kept(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=2024)
    certain, maybe = kept_tokens(logits, params)
    assert certain == maybe  # no token on the edge here
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    kept = torch.zeros_like(probs)
    kept[sorted(certain)] = probs[sorted(certain)]
    expected_p = (kept / kept.sum()).tolist()
    gen, draws = generator(params), 2500
    counts = [0] * len(logits)
    for token in sample_rows(logits.expand(draws, -1), [params] * draws, [gen] * draws).tolist():
        counts[token] += 1
    assert all(counts[t] == 0 for t in range(len(logits)) if t not in certain)
    # Degrees of freedom: kept - 1 <= 7; 24.3 is chi-square's 0.999 quantile at 7 (the seed fixes the draws).
    assert chi_square(counts, [p * draws for p in expected_p]) < 24.3
    if temperature != 1.0 and len(certain) == len(logits):  # the temperature matters: untempered is far off
        plain = torch.softmax(logits.double(), dim=-1) * kept.gt(0)
        assert chi_square(counts, (plain / plain.sum() * draws).tolist()) > 50


def test_a_tiny_temperature_is_raised_and_samples_without_overflow(device):
    logits = torch.tensor([[3.0, 1.0, -2.0, 2.0]], device=device)
    params = SamplingParams(temperature=1e-40, seed=0)
    gen = generator(params)
    assert [int(sample_rows(logits, [params], [gen])[0]) for _ in range(20)] == [0] * 20

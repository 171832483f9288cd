"""Choosing each request's next token from its logits (lesson 16; vLLM: Model Runner V2's sampler,
``vllm/v1/worker/gpu/sample/``).

A batch's rows are sampled each by its own :class:`~paged_kv.serving.sampling_params.SamplingParams`,
in vLLM's order:

1. the **log-probabilities** a request asked for are taken first, from the model's logits as they
   are (vLLM's default ``raw_logprobs``: a log-softmax before any processing);
2. the **logits processors**: ``logit_bias`` added, the stop tokens masked while the request has
   fewer than ``min_tokens`` output tokens, the penalties (``repetition_penalty`` over the prompt
   and output tokens, then ``frequency_penalty`` and ``presence_penalty`` over the output tokens),
   then ``bad_words`` (a word's last token banned where its other tokens end the output);
3. a greedy row (``temperature`` 0) takes the argmax of what step 2 left: with nothing to process,
   exactly the token Hugging Face's greedy ``generate`` picks, in one operation for every such row;
   a random row divides by the temperature, drops the tokens below ``min_p`` times the likeliest
   one's probability, keeps the ``top_k`` largest (0 or -1: all), then the smallest set whose
   probabilities reach ``top_p`` (the most likely always kept), and draws from what is left with
   its request's own ``torch.Generator``.

Every step works on the row alone, so a request's tokens depend only on its own logits, tokens and
generator: a seeded request gets the same tokens whatever else runs in its batch, and whether or
not it was preempted (the runner keeps its :class:`SamplingState`, generator and output tokens
included, from its first step to its last). An unseeded request's generator is seeded from the
runner's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paged_kv.serving.logprobs import TokenLogprobs
from paged_kv.serving.sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the runner keeps of a request that is not plain greedy, while it lives: its parameters,
    its generator (``None`` for a greedy one), the tokens the penalties read, and how far its prompt
    log-probabilities have been computed (``next_prompt_logprob``: the next prompt token to score;
    token 0 has none)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: tuple[int, ...]
    stop_token_ids: frozenset[int]
    """The tokens ``min_tokens`` holds back: the request's stop token ids and the model's end of
    sequence (vLLM's ``all_stop_token_ids``)."""
    output_token_ids: list[int] = field(default_factory=list)
    next_prompt_logprob: int = 1


def needs_state(params: SamplingParams | None) -> bool:
    """Whether a request needs a :class:`SamplingState`: random, processed or with log-probabilities."""
    return params is not None and (
        not params.greedy
        or params.needs_processing
        or params.logprobs is not None
        or params.prompt_logprobs is not None
    )


def new_generator(params: SamplingParams, source: torch.Generator) -> torch.Generator | None:
    """The host generator a random request draws with: seeded by ``params.seed``, else from
    ``source``; ``None`` for a greedy request, which draws nothing."""
    if params.greedy:
        return None
    generator = torch.Generator()
    seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=source))
    return generator.manual_seed(seed % 2**64)


def sample(
    logits: torch.Tensor, states: Sequence[SamplingState | None]
) -> tuple[torch.Tensor, dict[int, TokenLogprobs]]:
    """One token per row of ``logits`` (``[rows, vocab]``, any device), on the host, as a long
    tensor; and the :class:`~paged_kv.serving.logprobs.TokenLogprobs` of each row whose request
    asked for them, by row. ``states[i]`` is row ``i``'s (``None``: plain greedy)."""
    tokens = logits.argmax(dim=-1).cpu()
    logprobs: dict[int, TokenLogprobs] = {}
    for row, state in enumerate(states):
        if state is None:
            continue
        params, row_logits = state.params, logits[row].float().cpu()
        processed = process_logits(row_logits, state) if params.needs_processing else row_logits
        token = int(processed.argmax()) if params.greedy else _draw(processed, params, state.generator)
        tokens[row] = token
        if params.logprobs is not None:
            logprobs[row] = token_logprobs(row_logits.log_softmax(dim=-1), token, params.logprobs)
    return tokens, logprobs


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The chosen ``token``'s log-probability and rank in ``logprobs`` (one position's log-softmax,
    host), then the ``k`` likeliest tokens' (-1: all), as vLLM's ``gather_logprobs`` gathers them
    (rank: how many tokens are at least as likely, the token itself included)."""
    k = logprobs.numel() if k == -1 else k
    chosen = logprobs[token]
    rank = int((logprobs >= chosen).sum())
    top, ids = logprobs.topk(k) if k else (logprobs[:0], torch.zeros(0, dtype=torch.long))
    return TokenLogprobs((token, *ids.tolist()), (float(chosen), *top.tolist()), rank)


def process_logits(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """Step 2 of the module on one row's float logits (host), in vLLM's order; a new tensor."""
    params, outputs = state.params, state.output_token_ids
    logits = logits.clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    if len(outputs) < params.min_tokens and state.stop_token_ids:
        logits[torch.tensor(sorted(state.stop_token_ids), dtype=torch.long)] = float("-inf")
    vocab = logits.numel()
    if params.repetition_penalty != 1.0:
        scale = torch.ones_like(logits)
        seen = torch.tensor(state.prompt_token_ids + tuple(outputs), dtype=torch.long)
        scale[seen] = params.repetition_penalty
        logits *= torch.where(logits > 0, 1.0 / scale, scale)
    if outputs and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    for word in params.bad_words_token_ids or ():
        prefix = list(word[:-1])
        if len(prefix) <= len(outputs) and (not prefix or outputs[len(outputs) - len(prefix) :] == prefix):
            logits[word[-1]] = float("-inf")
    return logits


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Temperature, min-p, top-k, top-p, then one draw (see the module)."""
    scaled = logits / params.temperature
    ordered, order = scaled.sort(descending=True)
    keep = ordered.numel()
    if params.top_k > 0:  # 0 and -1 keep every token
        keep = min(keep, params.top_k)
    probs = ordered[:keep].softmax(dim=-1)
    if params.min_p > 0.0:  # the likeliest token is first: its probability is probs[0]
        keep = max(1, int((probs >= params.min_p * probs[0]).sum()))
        probs = probs[:keep] / probs[:keep].sum()  # top-p reads what min-p left, renormalized
    if params.top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs  # the mass of the more likely tokens
        keep = max(1, int((before < params.top_p).sum()))
        probs = probs[:keep]
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(order[choice])

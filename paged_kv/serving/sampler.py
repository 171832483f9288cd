"""Choosing each request's next token from its logits (lesson 16; vLLM: ``vllm/v1/sample/sampler.py``).

A batch's rows are sampled each by its own :class:`~paged_kv.serving.sampling_params.SamplingParams`:

* a greedy row (``temperature`` 0) takes the argmax, in one operation for all of them: exactly
  the token Hugging Face's greedy ``generate`` picks;
* a random row divides its logits by the temperature, keeps the ``top_k`` largest (0 or -1: all), then
  the smallest set of tokens whose probabilities reach ``top_p`` (the most likely always kept), and
  draws from what is left with its request's own ``torch.Generator``.

A seeded request's generator is seeded once, with its seed, and advances one draw per token; the
runner keeps it while the request lives, preempted or not. Its tokens therefore depend only on its
own logits: the same in any batch. An unseeded request's generator is seeded from the runner's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_kv.serving.sampling_params import SamplingParams


def new_generator(params: SamplingParams, source: torch.Generator) -> torch.Generator:
    """The host generator a request draws its tokens with: seeded by ``params.seed``, else from ``source``."""
    generator = torch.Generator()
    seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=source))
    return generator.manual_seed(seed % 2**64)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams | None],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of ``logits`` (``[rows, vocab]``, any device), on the host, as a long tensor.

    ``params[i]`` is row ``i``'s parameters (None: greedy); ``generators[i]`` its generator, needed
    where the row is random.
    """
    tokens = logits.argmax(dim=-1).cpu()
    for row, p in enumerate(params):
        if p is not None and not p.greedy:
            tokens[row] = _sample_row(logits[row].float().cpu(), p, generators[row])
    return tokens


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p, then one draw (see the module)."""
    scaled = logits / params.temperature
    ordered, order = scaled.sort(descending=True)
    keep = ordered.numel()
    if params.top_k > 0:  # 0 and -1 keep every token
        keep = min(keep, params.top_k)
    probs = ordered[:keep].softmax(dim=-1)
    if params.top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs  # the mass of the more likely tokens
        keep = max(1, int((before < params.top_p).sum()))
        probs = probs[:keep]
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(order[choice])

"""Greedy generation for a batch of prompts, on a contiguous or a paged cache (lesson 09).

The model is the tiny GPT or a Hugging Face Llama, Qwen2, Mistral, Gemma 2 or Gemma 3 model, run
through the same :class:`~paged_kv.model.causal_lm.CausalLM` interface; either way every layer's
K/V goes into the one cache. A paged cache may hold its K/V in fp8 (``kv_cache_dtype="fp8"``, lesson 10).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_kv.core.block import blocks_for_tokens
from paged_kv.device import resolve_device
from paged_kv.kv.fp8 import kv_cache_dtype_str_to_dtype
from paged_kv.model.causal_lm import CausalLM, as_causal_lm
from paged_kv.model.kv_cache import ContiguousKVCache, KVCache, PagedKVCache, check_cache_fits
from paged_kv.validate import check_count


@dataclass(frozen=True)
class GenerationResult:
    """``tokens[i]``: the new token ids of prompt ``i``; ``logits[step, i]``: the logits they came from.

    ``logits`` is ``(steps, batch, vocab)``: ``steps`` is ``max_new_tokens`` unless every prompt
    reached an end-of-sequence token before it, and a prompt's tokens end at its first one.
    """

    tokens: list[list[int]]
    logits: torch.Tensor  # (steps, batch, vocab)


def generate(
    model: CausalLM | object,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    cache: str | KVCache = "paged",
    block_size: int = 16,
    num_blocks: int | None = None,
    device: str | torch.device | None = None,
    *,
    kv_cache_dtype: str | torch.dtype = "auto",
    calculate_kv_scales: bool = False,
) -> GenerationResult:
    """Greedy generation for a batch of prompts of any lengths.

    ``model`` is a :class:`~paged_kv.model.tiny_gpt.TinyGPT`, a Hugging Face causal LM of a
    supported architecture (:func:`~paged_kv.model.causal_lm.as_causal_lm`) or any
    :class:`~paged_kv.model.causal_lm.CausalLM`. The prompts are prefilled in one forward, packed
    (each attends only to itself); then every decode step feeds the batch's last tokens at once.
    A model that names end-of-sequence tokens (``eos_token_ids``: a Hugging Face model's
    ``generation_config.eos_token_id``) ends a prompt's tokens at the first of them, and generation
    stops once every prompt has one, as ``model.generate`` does; the tiny GPT has none, so each
    prompt gets ``max_new_tokens`` tokens.

    ``cache`` is ``"contiguous"``, ``"paged"`` (a :class:`PagedKVCache` of ``num_blocks`` blocks
    of ``block_size``, by default just enough for the batch) or a cache you built (then
    ``block_size`` and ``num_blocks`` are not used); the sequences (ids ``"prompt-0"``,
    ``"prompt-1"``...) are freed from it at the end. ``device`` defaults to the model's and must be
    the model's.

    ``kv_cache_dtype`` is the dtype of the ``"paged"`` cache's pools, in vLLM's names: ``"auto"``
    (the model's), ``"fp8"`` (``"fp8_e4m3"``) or ``"fp8_e5m2"``, one byte per number, read back
    dequantized (:class:`PagedKVCache`); its per-layer scales are 1.0 (vLLM's default), or measured
    from each layer's first K/V, the prompts' packed prefill, with ``calculate_kv_scales=True``.
    The other caches take neither: build the cache with them.

    Raises:
        ValueError: a bad argument (the message names it): a model of an unsupported architecture,
            a prompt whose tokens and ``max_new_tokens`` run past the model's ``max_len``, a token id
            outside the vocabulary, a cache built for another model's layers, K/V heads or head
            size, a ``kv_cache_dtype`` vLLM does not name, or an fp8 dtype or ``calculate_kv_scales``
            asked of a cache that is not ``"paged"``. The cache's own errors, such as
            :class:`~paged_kv.errors.OutOfBlocksError`, pass through.
    """
    model = as_causal_lm(model)
    config = model.config
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, minimum=1)
    block_size = check_count("block_size", block_size, minimum=1)
    model_device = resolve_device(model.device)
    device = model_device if device is None else resolve_device(device)
    if device != model_device:
        raise ValueError(f"device {device} differs from the model's {model_device}; call model.to(device)")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of token id lists")
    for i, prompt in enumerate(prompts):
        if not prompt or not all(is_token(t, config.vocab_size) for t in prompt):
            raise ValueError(f"prompts[{i}] must be non-empty token ids in [0, {config.vocab_size})")
        if len(prompt) + max_new_tokens > config.max_len:
            raise ValueError(
                f"prompts[{i}] ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_len {config.max_len}"
            )
    stored = kv_cache_dtype_str_to_dtype(kv_cache_dtype, model.dtype)
    if cache != "paged" and (stored != model.dtype or calculate_kv_scales):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} and calculate_kv_scales are options of cache='paged'; "
            f"build the cache with them instead, got cache={cache!r}"
        )
    if cache == "contiguous":
        cache = ContiguousKVCache(config, device)
    elif cache == "paged":
        needed = sum(blocks_for_tokens(len(p) + max_new_tokens, block_size) for p in prompts)
        num_blocks = needed if num_blocks is None else check_count("num_blocks", num_blocks, minimum=1)
        cache = PagedKVCache(
            config,
            num_blocks,
            block_size,
            device,
            model.dtype,
            kv_cache_dtype=stored,
            calculate_kv_scales=calculate_kv_scales,
        )
    elif not isinstance(cache, KVCache):
        raise ValueError(f"cache must be 'contiguous', 'paged' or a KVCache, got {cache!r}")
    check_cache_fits(cache, config)

    stop = frozenset(model.eos_token_ids)
    seq_ids = [f"prompt-{i}" for i in range(len(prompts))]
    added: list[str] = []  # freed at the end, even after an error
    steps: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for prompt, seq_id in zip(prompts, seq_ids, strict=True):
                cache.add_sequence(seq_id, len(prompt))
                added.append(seq_id)
            tensors = [torch.tensor(prompt, device=device) for prompt in prompts]
            steps.append(model.prefill_batch(tensors, seq_ids, cache))  # every prompt in one forward
            stopped = [False] * len(prompts)
            for _ in range(max_new_tokens - 1):
                last = steps[-1].argmax(dim=-1)
                stopped = [done or token in stop for done, token in zip(stopped, last.tolist(), strict=True)]
                if all(stopped):
                    break
                steps.append(model.decode_step(last, seq_ids, cache))
    finally:
        for seq_id in added:
            cache.free(seq_id)
    logits = torch.stack(steps)
    return GenerationResult(
        tokens=[_until_stop(t, stop) for t in logits.argmax(dim=-1).T.tolist()], logits=logits
    )


def _until_stop(tokens: list[int], stop: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first of ``stop``, or all of them."""
    ends = [i for i, token in enumerate(tokens) if token in stop]
    return tokens[: ends[0] + 1] if ends else tokens


def is_token(value: object, vocab_size: int) -> bool:
    """Whether ``value`` is an integer token id below ``vocab_size`` (booleans are not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < vocab_size

"""Where a model's attention meets its KV cache, for the tiny GPT and Hugging Face models alike (lesson 09).

A model's forward calls ``attend(layer, q, k, v)`` in each layer with the new tokens' queries, keys
and values, all ``(batch, tokens, heads, head_dim)`` (``q`` has ``num_heads`` heads, ``k`` and
``v`` have ``num_kv_heads``), and gets back the attention output, shaped like ``q``. This module
builds that callable for the two phases, so every model meets the cache the same way:

* :func:`prefill_attend`: one prompt. From position 0 the layer stores the prompt's K/V in the cache
  and attends causally over its own (what any forward pass without a cache does); after a prefix
  cache hit it stores only the uncached tail and attends over the cached positions too.
* :func:`packed_prefill_attend`: several prompts in one forward, their tokens packed one after
  another along the token axis (as vLLM flattens a step's tokens); each prompt's slice does what
  :func:`prefill_attend` does for it alone, so packing changes which matrix products run together,
  never what a token attends to.
* :func:`decode_attend`: one new token per sequence of the batch; the layer stores their K/V in the
  slots the cache's ``append`` chose (:func:`append_decode`) and attends over each whole sequence.
* :func:`step_attend`: the engine's step, vLLM's way. The runner prepared the step's
  :class:`~paged_kv.attention.metadata.AttentionMetadata` once; each layer calls its attention
  backend's ``forward``, which writes every new token's K/V at its slot and attends over the
  flattened batch, any number of query tokens per request (causal inside a chunk), whatever mix of
  prefill chunks and decodes the step holds.

The first three serve :func:`~paged_kv.model.generate` and the lessons' caches (the
:class:`~paged_kv.model.kv_cache.KVCache` interface); the engine only uses :func:`step_attend`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.contiguous import causal_attention
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.attention.registry import check_backend_name
from paged_kv.kv.storage import KVStorage
from paged_kv.model.config import FULL_ATTENTION, LayerAttention
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.validate import check_count

if TYPE_CHECKING:
    from paged_kv.model.kv_cache import KVCache

# attend(layer, q, k, v) -> out, all (batch, tokens, heads, head_dim)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: LayerAttention = FULL_ATTENTION
) -> torch.Tensor:
    """:func:`~paged_kv.attention.contiguous.causal_attention` as one layer attends (its window,
    scale and soft cap): ``(batch, tokens, heads, head_dim)`` in and out, ``q`` the last tokens of ``k``."""
    return causal_attention(q, k, v, scale=attention.scale, **attention.window_and_cap())


def check_prefill_start(start: object, num_tokens: int) -> int:
    """``start`` as an int when it is a prefill start for a prompt of ``num_tokens``: ``0 .. num_tokens - 1``.

    Raises:
        ValueError: naming ``start``; the prompt's last token is always computed, for its logits.
    """
    start = check_count("start", start)
    if start >= num_tokens:
        raise ValueError(
            f"start must be below the prompt's {num_tokens} tokens (the last one is always computed), "
            f"got {start}"
        )
    return start


def prefill_attend(
    cache: KVCache, seq_id: Hashable, start: int, layers: Sequence[LayerAttention] | None = None
) -> Attend:
    """The ``attend`` of one prompt's prefill from position ``start`` (a batch of one sequence).

    ``start == 0``: each layer writes the whole prompt's K/V (:meth:`KVCache.write_prompt`) and
    attends causally over them, as ``layers[layer]`` says (its window, scale and soft cap;
    ``None``: full attention). ``start > 0``: positions ``0 .. start - 1`` are cached; each layer
    writes the tail's K/V and attends over the whole prompt (:meth:`KVCache.attend_prefill`, as
    the cache's layers attend).
    """
    if start == 0:

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_prompt(layer, seq_id, k[0], v[0])
            return layer_causal_attention(q, k, v, FULL_ATTENTION if layers is None else layers[layer])

        return attend

    def attend_tail(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cache.attend_prefill(layer, seq_id, q[0], k[0], v[0], start)[None]

    return attend_tail


def packed_prefill_attend(
    cache: KVCache,
    seq_ids: Sequence[Hashable],
    starts: Sequence[int],
    num_new: Sequence[int],
    layers: Sequence[LayerAttention] | None = None,
) -> Attend:
    """The ``attend`` of several prefills in one forward of ``(1, sum(num_new), ...)`` tensors.

    Sequence ``i``'s tokens are positions ``starts[i] ..`` of its prompt, ``num_new[i]`` of them, at
    offset ``sum(num_new[:i])`` of the packed axis. On a :class:`~paged_kv.model.kv_cache.PagedKVCache`
    each layer writes every new token's K/V at its slot and attends with one
    :func:`~paged_kv.attention.paged.paged_prefill_attention` over the batch's block tables, as
    vLLM's prefill reads the paged cache; the tokens may be a **chunk** that ends before the
    sequence does (chunked prefill): it attends over the positions before it, written by the
    prefix cache or by earlier chunks, and its own. On any other cache each slice is stored and attended as
    :func:`prefill_attend` does for that prompt alone, in order. Either way, a prompt whose cached
    prefix another prompt of the same forward computes finds it written, layer by layer.
    """
    if isinstance(cache, PagedKVCache):  # one paged_prefill_attention per layer for the whole batch
        cache.begin_prefill(seq_ids, starts, num_new)

        def attend_paged(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return cache.attend_prefill_batch(layer, seq_ids, q[0], k[0], v[0])[None]

        return attend_paged
    parts = [
        prefill_attend(cache, seq_id, start, layers) for seq_id, start in zip(seq_ids, starts, strict=True)
    ]
    ends = list(itertools.accumulate(num_new))
    spans = list(zip([0, *ends[:-1]], ends, strict=True))

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [
            part(layer, q[:, a:b], k[:, a:b], v[:, a:b]) for part, (a, b) in zip(parts, spans, strict=True)
        ]
        return torch.cat(outs, dim=1)

    return attend


@dataclass(frozen=True)
class PackedPrefill:
    """Several prompts' prefills as one forward: ``tokens`` and ``positions`` ``(1, total)``, the
    packed index of each prompt's ``last`` token ``(n,)``, and the layers' ``attend``."""

    tokens: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    attend: Attend


def pack_prefills(
    prompts: Sequence[torch.Tensor],
    seq_ids: Sequence[Hashable],
    cache: KVCache,
    starts: Sequence[int] | None = None,
    layers: Sequence[LayerAttention] | None = None,
) -> PackedPrefill:
    """Pack prompt ``i``'s positions ``starts[i] ..`` (default: from 0) one after another, for one forward.

    A prompt may be the first tokens of a longer sequence in the cache: then the chunk
    ``starts[i] .. len(prompts[i]) - 1`` runs, and its last logits predict the token after it (a
    chunk of a chunked prefill; only a :class:`~paged_kv.model.kv_cache.PagedKVCache` takes one).
    ``layers`` say how each layer attends (:func:`prefill_attend`).

    Raises:
        ValueError: ``prompts`` is empty, ``prompts``, ``seq_ids`` and ``starts`` differ in length,
            or a start is not in ``0 .. len(prompt) - 1`` (naming it).
    """
    if not prompts:
        raise ValueError("prompts must hold at least one prompt to prefill")
    starts = [0] * len(prompts) if starts is None else starts
    if not len(prompts) == len(seq_ids) == len(starts):
        raise ValueError(
            f"prompts, seq_ids and starts must be as many, got {len(prompts)}, {len(seq_ids)} "
            f"and {len(starts)}"
        )
    starts = [check_prefill_start(start, len(prompt)) for prompt, start in zip(prompts, starts, strict=True)]
    num_new = [len(prompt) - start for prompt, start in zip(prompts, starts, strict=True)]
    device = prompts[0].device
    tokens = torch.cat([prompt[start:] for prompt, start in zip(prompts, starts, strict=True)])
    positions = torch.cat(
        [
            torch.arange(start, len(prompt), device=device)
            for prompt, start in zip(prompts, starts, strict=True)
        ]
    )
    last = torch.tensor(list(itertools.accumulate(num_new)), device=device) - 1
    attend = packed_prefill_attend(cache, seq_ids, starts, num_new, layers)
    return PackedPrefill(tokens[None], positions[None], last, attend)


def append_decode(cache: KVCache, seq_ids: Sequence[Hashable], tokens: torch.Tensor) -> torch.Tensor:
    """``cache.append(seq_ids)`` for a decode step whose input tokens are ``tokens``: their positions.

    A :class:`~paged_kv.model.kv_cache.PagedKVCache` with prefix caching also gets the tokens' ids,
    so the blocks they fill are cached as a prompt's full blocks are; any other cache is asked as
    the :class:`~paged_kv.model.kv_cache.KVCache` protocol says.
    """
    if isinstance(cache, PagedKVCache) and cache.enable_prefix_caching:
        return cache.append(seq_ids, token_ids=tokens.tolist())
    return cache.append(seq_ids)


def decode_attend(cache: KVCache, seq_ids: Sequence[Hashable]) -> Attend:
    """The ``attend`` of one decode step: one token per sequence, after ``cache.append(seq_ids)``."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cache.attend(layer, seq_ids, q[:, 0], k[:, 0], v[:, 0])[:, None]

    return attend


def step_attend(
    metadata: Sequence[AttentionMetadata],
    storage: KVStorage,
    attention_backend: str | None = None,
    layer_group: Sequence[int] | None = None,
    layer_attention: Sequence[LayerAttention] | None = None,
) -> Attend:
    """The ``attend`` of one engine step over ``(1, num_tokens, ...)`` tensors: layer ``l`` attends
    through its KV-cache group's metadata (``metadata[layer_group[l]]``; ``layer_group`` ``None``:
    every layer in group 0) with its window, scale and soft cap (``layer_attention[l]``; ``None``:
    full attention everywhere), in backend ``attention_backend`` (a name of
    :data:`~paged_kv.attention.registry.ATTENTION_BACKENDS`, or ``None`` for the platform's
    default). The backend's ``forward`` writes
    the new K/V at the group's slot mapping through ``storage`` (an fp8 storage quantizes, and
    measures its scales at the first write under ``calculate_kv_scales``) and reads the layer with
    its scales after that write. One implementation per distinct layer attention, made at the
    step's first layer of it. vLLM: each layer's ``AttentionImpl.forward`` with the metadata of the
    layer's group.

    Raises:
        ValueError: ``attention_backend`` is not a backend's name (the message lists them).
    """
    backend = check_backend_name(attention_backend, "attention_backend")
    impls: dict[LayerAttention, AttentionImpl] = {}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = metadata[0 if layer_group is None else layer_group[layer]]
        spec = FULL_ATTENTION if layer_attention is None else layer_attention[layer]
        impl = impls.get(spec)
        if impl is None:
            impl = impls[spec] = spec.impl(backend, q[0], storage.num_kv_heads, storage.dtype)
        return impl.forward(q[0], k[0], v[0], LayerKVCache.of_layer(storage, layer), group)[None]

    return attend

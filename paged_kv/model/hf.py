"""Hugging Face causal LMs (Llama, Qwen2, Mistral, Gemma 2 and 3) on the paged cache (lessons 10, 13).

:class:`HFCausalLM` wraps a ``transformers`` model (Llama, Qwen2, Mistral, Gemma 2, Gemma 3: see
:data:`~paged_kv.model.causal_lm.SUPPORTED_ARCHITECTURES`) so that :func:`~paged_kv.model.generate` and the
:class:`~paged_kv.serving.engine.Engine` run it exactly as they run the tiny GPT: a prefill per
prompt, then one batched decode step per token, every layer's K/V in the one paged cache.

**How it plugs in.** Hugging Face's modules do all of the model: embeddings, RMSNorm, the q/k/v
projections (with Qwen2's biases), rotary embeddings at the ``position_ids`` given, the MLP, the
head. Only the attention itself is ours. transformers looks each layer's attention function up by
name in its ``AttentionInterface`` and passes it any keyword argument the forward was given, so
this module registers one function, ``"paged_kv"``, and each forward passes it the step's
``attend`` (:mod:`paged_kv.model.attend`): the function hands the layer's post-rotary queries,
keys and values to the cache, and the cache stores the K/V and attends (an attention backend's
``forward``, :mod:`paged_kv.attention.registry`: the platform's default). The forward runs with
``use_cache=False``, so Hugging Face keeps no cache of its own. This is the seam HF's own continuous
batching and vLLM's Transformers backend (``vllm/model_executor/models/transformers``) use; the
other way, re-writing each architecture's layers around its weights, is what vLLM's own model files
(``vllm/model_executor/models/llama.py``) do, and it would copy here what transformers already
gets right for every variant (biases, rope scaling, norms).

The model's config is switched to ``"paged_kv"`` only for the duration of our forwards and
restored after, so the wrapped model still runs ``model.generate`` and ``model(...)`` as before.
This module does not import ``transformers`` itself: a model built with it means it is imported.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from paged_kv.kv.sizing import module_bytes
from paged_kv.model.attend import Attend, append_decode, decode_attend, pack_prefills
from paged_kv.model.config import GPTConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from paged_kv.model.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = (
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)
"""The ``transformers`` classes tested to give exactly their own greedy tokens on the paged cache:
the Llama family, and the hybrid models whose layers slide (Mistral with a ``sliding_window``, Qwen2
with ``use_sliding_window``, Gemma 2 and Gemma 3, lesson 13)."""

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
"""The ``config.layer_types`` this package serves: full attention and a sliding window."""

ATTENTION = "paged_kv"


def _paged_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    paged_kv_attend: Attend | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``(batch, heads, tokens, head_dim)`` in, the output
    ``(batch, tokens, heads, head_dim)`` and no attention weights out. The mask is not used: the
    cache knows each sequence's length, and a prefill is causal."""
    if paged_kv_attend is None:
        raise RuntimeError("the paged_kv attention runs only inside HFCausalLM's prefill and decode_step")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return paged_kv_attend(module.layer_idx, q, k, v), None


def unsupported_model(model: object) -> ValueError:
    """The error for a model generation cannot run: it lists what it can."""
    return ValueError(
        f"model must be a TinyGPT or a Hugging Face causal LM of a supported architecture "
        f"({', '.join(SUPPORTED_ARCHITECTURES)}), got {type(model).__name__}"
    )


class HFCausalLM:
    """A Hugging Face causal LM as the :class:`~paged_kv.model.causal_lm.CausalLM` that generation runs.

    :attr:`config` holds the sizes the cache needs, read from the model's config: layers, query and
    K/V heads, head size, vocabulary and ``max_len``, the model's ``max_position_embeddings``; and
    how each layer attends: its sliding window (``config.layer_types``, or Mistral's
    ``sliding_window`` for every layer), the score scale (Gemma's ``query_pre_attn_scalar``) and
    Gemma 2's soft cap of the scores.

    Raises:
        ValueError: ``model`` is not of a supported architecture or a subclass of one (the message
            lists them); a layer type other than :data:`SUPPORTED_LAYER_TYPES` (listed); layer types
            that do not match the model's layers or their attention modules; or layers that scale
            or cap their scores differently.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        transformers = sys.modules.get("transformers")  # imported by whoever built the model
        name = type(model).__name__
        if (
            transformers is None
            or not isinstance(model, transformers.PreTrainedModel)
            or not any(cls.__name__ in SUPPORTED_ARCHITECTURES for cls in type(model).__mro__)
        ):
            raise unsupported_model(model)
        transformers.AttentionInterface.register(ATTENTION, _paged_kv_attention)
        hf = model.config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        attentions = [layer.self_attn for layer in model.model.layers]
        scale = _one_value(name, "scaling", [a.scaling for a in attentions])
        softcap = _one_value(
            name, "attn_logit_softcapping", [getattr(a, "attn_logit_softcapping", None) for a in attentions]
        )
        self.model = model
        self.config = GPTConfig(
            vocab_size=hf.vocab_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            head_dim=head_dim,
            max_len=hf.max_position_embeddings,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            sliding_windows=layer_windows(name, hf, attentions),
            attention_scale=None if math.isclose(scale, head_dim**-0.5) else scale,
            attn_softcap=softcap,
        )

    def __repr__(self) -> str:
        return f"HFCausalLM({type(self.model).__name__}, {self.config})"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def weight_bytes(self) -> int:
        """The bytes of the model's parameters and buffers."""
        return module_bytes(self.model)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence tokens (``generation_config.eos_token_id``), at which
        :func:`~paged_kv.model.generate` ends a sequence as ``model.generate`` does; none when unset."""
        eos = self.model.generation_config.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)

    def prefill(self, prompt: torch.Tensor, seq_id: Hashable, cache: KVCache, start: int = 0) -> torch.Tensor:
        """Run one prompt ``(tokens,)`` from position ``start`` on, storing every layer's K/V in ``cache``.

        As :meth:`~paged_kv.model.tiny_gpt.TinyGPT.prefill`, but only the last position's logits are
        computed (a real vocabulary makes the others costly): returns ``(1, vocab)``.

        Raises:
            ValueError: ``start`` is not an integer in ``0 .. len(prompt) - 1``.
        """
        return self.prefill_batch([prompt], [seq_id], cache, [start])

    def prefill_batch(
        self,
        prompts: Sequence[torch.Tensor],
        seq_ids: Sequence[Hashable],
        cache: KVCache,
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Several prefills in one forward, their tokens packed; each prompt's last logits ``(n, vocab)``.

        As :meth:`~paged_kv.model.tiny_gpt.TinyGPT.prefill_batch`.
        """
        packed = pack_prefills(prompts, seq_ids, cache, starts, self.config.layer_attention)
        return self._forward(packed.tokens, packed.positions, packed.attend, keep=packed.last)[0]

    def decode_step(self, tokens: torch.Tensor, seq_ids: Sequence[Hashable], cache: KVCache) -> torch.Tensor:
        """Feed one token per sequence ``(batch,)`` at the cache's positions; logits ``(batch, vocab)``."""
        positions = append_decode(cache, seq_ids, tokens)
        return self._forward(tokens[:, None], positions[:, None], decode_attend(cache, seq_ids))[:, 0]

    def forward_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """One engine step, as :meth:`~paged_kv.model.tiny_gpt.TinyGPT.forward_step`: the logits
        ``(len(logits_indices), vocab)`` of the flattened batch's tokens ``logits_indices`` names."""
        return self._forward(input_ids[None], positions[None], attend, keep=logits_indices)[0]

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, keep: int | torch.Tensor = 1
    ) -> torch.Tensor:
        """The logits ``(batch, kept, vocab)`` of ``(batch, tokens)`` ids at ``positions``: of the last
        ``keep`` positions, or of the positions a 1-D tensor ``keep`` lists."""
        with self._paged_attention():
            out = self.model(
                input_ids=tokens,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=keep,
                paged_kv_attend=attend,
            )
        return out.logits

    @contextlib.contextmanager
    def _paged_attention(self) -> Iterator[None]:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = previous


def layer_windows(name: str, hf: object, attentions: Sequence[object]) -> tuple[int | None, ...] | None:
    """Each layer's sliding window from a Hugging Face config (``None``: full attention; ``None`` for
    all: no layer slides): ``layer_types`` when the config has it, else Mistral's one
    ``sliding_window`` for every layer. Each layer's attention module, when it says its window,
    must agree.

    Raises:
        ValueError: a layer type this package does not serve (the message lists those it does),
            ``layer_types`` of another length than the layers, or a module whose window disagrees.
    """
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    num_layers = len(attentions)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"{name}'s config lists {len(types)} layer_types for its {num_layers} layers")
    unknown = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"{name} has layers of type {', '.join(unknown)}: paged_kv serves "
            f"{', '.join(SUPPORTED_LAYER_TYPES)}"
        )
    if "sliding_attention" in types and not window:
        raise ValueError(f"{name}'s config has sliding_attention layers but no sliding_window")
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    for layer, (expected, attention) in enumerate(zip(windows, attentions, strict=True)):
        if hasattr(attention, "sliding_window") and attention.sliding_window != expected:
            raise ValueError(
                f"{name}'s layer {layer} attends with sliding_window {attention.sliding_window}, but its "
                f"config's layer_types say {expected}: the model does not match its config"
            )
    return windows if any(w is not None for w in windows) else None


def _one_value(name: str, what: str, values: Sequence[object]) -> object:
    """The value every layer has for ``what``, or a ValueError (the package takes one per model)."""
    if any(value != values[0] for value in values):
        raise ValueError(f"{name}'s layers have different {what}: {sorted(set(map(str, values)))}")
    return values[0]

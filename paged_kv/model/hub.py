"""A real model from the Hugging Face Hub, or a stand-in of the same architecture offline (lesson 09).

:func:`load_model` downloads a causal LM and its tokenizer (``HuggingFaceTB/SmolLM2-135M`` by
default: 135M parameters, a Llama with 9 query heads over 3 K/V heads) when the Hub answers. When it
does not, as on the course's CI machines, it builds a random-weight model of the same architecture,
with the byte vocabulary of :mod:`paged_kv.model.tiny_gpt`, so a lesson runs and shows the same
thing (the cache serves exactly the tokens Hugging Face generates) with no network. Either way
:attr:`LoadedModel.note` says in one line which it is.
"""

from __future__ import annotations

import numbers
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from paged_kv.model.tiny_gpt import decode, encode

HUB_URL = "https://huggingface.co"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M"

# SmolLM2-135M's published config.json, but for the vocabulary: the offline stand-in is this
# architecture with random weights and the 256 byte tokens.
SMOLLM2_ARCHITECTURE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

# huggingface_hub reads HF_HUB_OFFLINE as true for these values, whatever their case.
_TRUE_VALUES = {"1", "on", "yes", "true"}


def hub_offline_by_setting() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks Hugging Face libraries not to use the network (``1``, ``true``...)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE_VALUES


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers an HTTPS request within ``timeout`` seconds.

    One ``HEAD`` request to https://huggingface.co, with no token; any answer short of a server
    error counts. ``False`` without a request when ``HF_HUB_OFFLINE`` is set. A ``timeout`` that is
    not a positive number is a ``ValueError``.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if hub_offline_by_setting():
        return False
    request = urllib.request.Request(HUB_URL, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return True
    except urllib.error.HTTPError as error:  # the Hub answered, with an error status
        return error.code < 500
    except (OSError, ValueError):  # no route, no name, refused, timed out, bad proxy setting
        return False


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM with the tokenizer it reads: ``encode(text) -> ids``, ``decode(ids) -> text``.

    ``real`` says whether the weights came from the Hub; ``note`` says so in one line.
    """

    name: str
    model: torch.nn.Module
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    real: bool
    note: str


def load_model(name: str = SMOLLM2, timeout: float = 3.0, seed: int = 0) -> LoadedModel:
    """``name``'s weights and tokenizer from the Hub in float32, or SmolLM2-135M's stand-in offline.

    The stand-in is a ``LlamaForCausalLM`` of :data:`SMOLLM2_ARCHITECTURE` with a vocabulary of 256
    byte tokens and weights drawn after ``torch.manual_seed(seed)`` (the global generator is
    restored after). Neither has an end-of-sequence token set, so generation runs for as many
    tokens as asked. ``timeout`` bounds the check that the Hub answers.
    """
    import transformers  # a course dependency, imported only when a real model is asked for

    if hub_reachable(timeout):
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        model.generation_config.eos_token_id = None
        return LoadedModel(
            name,
            model,
            lambda text: tokenizer(text)["input_ids"],
            lambda ids: tokenizer.decode(ids),
            real=True,
            note=f"{name}: real weights and tokenizer from the Hugging Face Hub",
        )
    config = transformers.LlamaConfig(
        vocab_size=256, bos_token_id=None, eos_token_id=None, pad_token_id=None, **SMOLLM2_ARCHITECTURE
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    note = (
        f"offline (the Hub does not answer): a random-weight model of {SMOLLM2}'s architecture "
        f"with byte tokens stands in for {name}"
    )
    return LoadedModel(name, model, encode, decode, real=False, note=note)

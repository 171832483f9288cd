"""KV-cache groups: a hybrid model's layers grouped by how they attend (lesson 13).

Most new open models mix two kinds of attention layer. A **full-attention** layer reads every
earlier token of its sequence, so its K/V grow with the sequence. A **sliding-window** layer of
window ``W`` reads only the last ``W`` tokens (the token at position ``p`` sees positions
``p - W + 1 .. p``), so everything before the window can go: Mistral slides in every layer,
Gemma 2 alternates sliding and full layers, Gemma 3 runs five sliding layers to one full, Qwen2
slides above ``max_window_layers``. vLLM 0.33.0 describes each layer by a spec
(``vllm/v1/kv_cache_interface.py``: ``FullAttentionSpec``, ``SlidingWindowSpec``) and groups the
layers into **KV-cache groups** (``vllm/v1/core/kv_cache_planning.py``,
``_get_kv_cache_groups_uniform_page_size``): every layer of a group has the same spec, so one block
table serves the whole group, and every group has the same number of layers, so that a block of the
one shared pool is the same number of bytes in every group.

The grouping rule, as vLLM's: the layers are put in buckets by spec (in the order the specs first
appear); the group size is the smallest bucket's layer count (or the largest's, when the largest
is under 1.5 times the smallest, to waste less padding); each bucket is split into
``ceil(len / group_size)`` groups, group ``i`` taking the bucket's layers ``i, i + n, i + 2n, ..``
(``layers[i::n]``), and a group short of ``group_size`` layers is padded (the padding layers hold
nothing but count in the pool's bytes). A model whose layers all attend alike has one group.

The pool then holds ``group_size`` K/V **tensors**, each shared by one layer of every group
(:func:`layer_tensors`): block ``b`` of tensor ``t`` holds, for whichever group owns block ``b``,
that group's ``t``-th layer. So a block costs ``group_size`` layers' pages whatever its group,
and a request pays full-length K/V only in the full-attention groups.

Nothing here holds a tensor: these are plain descriptions that :mod:`paged_kv.core.kv_cache_coordinator`
and the engine's storage read. A model whose layers all attend fully has one group of every layer
(:func:`full_attention_group`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paged_kv.core.block import blocks_for_tokens
from paged_kv.validate import check_count


@dataclass(frozen=True)
class FullAttentionSpec:
    """Layers that attend to every earlier token (vLLM: ``FullAttentionSpec``): nothing is skipped."""

    block_size: int

    def __post_init__(self) -> None:
        check_count("block_size", self.block_size, minimum=1)

    @property
    def sliding_window(self) -> None:
        return None

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The leading tokens no later token reads: none."""
        return 0


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Layers whose token at position ``p`` attends to positions ``p - sliding_window + 1 .. p``
    (vLLM: ``SlidingWindowSpec``; the window counts the token itself, as Hugging Face's and
    FlashAttention's ``window_size=(W - 1, 0)`` do).

    Raises:
        ValueError: ``block_size`` or ``sliding_window`` is not an integer of at least 1.
    """

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        check_count("block_size", self.block_size, minimum=1)
        check_count("sliding_window", self.sliding_window, minimum=1)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The leading tokens that neither the next token, at position ``num_computed_tokens``, nor
        any later one reads: ``max(0, num_computed_tokens - sliding_window + 1)`` (vLLM:
        ``SlidingWindowManager.get_num_skipped_tokens``).

        >>> SlidingWindowSpec(block_size=4, sliding_window=4).num_skipped_tokens(7)
        4
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @property
    def blocks_for_hit(self) -> int:
        """The cached blocks a prefix-cache hit must end with: those the window of the first
        uncomputed token reads, ``ceil((sliding_window - 1) / block_size)`` (vLLM:
        ``_contiguous_blocks_for_hit``)."""
        return blocks_for_tokens(self.sliding_window - 1, self.block_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The most blocks one request holds at once (vLLM's name): the window's ``sliding_window - 1``
        earlier tokens and the tokens in flight (a step's, the token budget), never more than
        ``max_model_len``, plus one block because the window need not start at a block's edge.

        >>> SlidingWindowSpec(block_size=4, sliding_window=3).max_admission_blocks_per_request(4, 1024)
        3
        """
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return blocks_for_tokens(tokens, self.block_size) + 1


AttentionSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group (vLLM: ``KVCacheGroupSpec``): the model's ``layers`` that share a block
    table, in order, and the ``spec`` every one of them has."""

    layers: tuple[int, ...]
    spec: AttentionSpec


def full_attention_group(block_size: int, num_layers: int = 1) -> tuple[KVCacheGroupSpec, ...]:
    """The one group of a model whose ``num_layers`` layers all attend fully (what a memory with no
    model behind it, such as lesson 07's simulator's, holds its blocks in)."""
    num_layers = check_count("num_layers", num_layers, minimum=1)
    return (KVCacheGroupSpec(tuple(range(num_layers)), FullAttentionSpec(block_size)),)


def attention_spec(sliding_window: int | None, block_size: int) -> AttentionSpec:
    """A layer's spec: full attention for a window of ``None``, else a sliding window."""
    if sliding_window is None:
        return FullAttentionSpec(block_size)
    return SlidingWindowSpec(block_size, sliding_window)


def kv_cache_groups(layer_windows: Sequence[int | None], block_size: int) -> tuple[KVCacheGroupSpec, ...]:
    """The KV-cache groups of a model whose layer ``i`` has window ``layer_windows[i]`` (``None``:
    full attention), by vLLM's rule (see the module).

    >>> [g.layers for g in kv_cache_groups([8, 8, 8, 8, 8, None], 16)]  # Gemma 3's 5:1
    [(0,), (1,), (2,), (3,), (4,), (5,)]
    >>> [g.layers for g in kv_cache_groups([8, None, 8, None], 16)]  # Gemma 2's alternation
    [(0, 2), (1, 3)]

    Raises:
        ValueError: no layers, a window below 1, or a bad ``block_size``.
    """
    if not layer_windows:
        raise ValueError("layer_windows must name at least one layer")
    buckets: dict[AttentionSpec, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(
                f"the window of layer {layer} must be None or an integer of at least 1, got {window!r}"
            )
        buckets.setdefault(attention_spec(window, block_size), []).append(layer)
    sizes = [len(layers) for layers in buckets.values()]
    group_size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups = []
    for spec, layers in buckets.items():
        count = blocks_for_tokens(len(layers), group_size)
        groups += [KVCacheGroupSpec(tuple(layers[i::count]), spec) for i in range(count)]
    return tuple(groups)


def layer_tensors(groups: Sequence[KVCacheGroupSpec]) -> dict[int, int]:
    """The pool tensor each layer reads and writes: its index within its group (in vLLM 0.33.0 the
    groups' ``KVCacheTensor`` placements overlay the same bytes, one layer of every group on each,
    sound because a block is owned by one group at a time). There are as many tensors as
    the largest group has layers."""
    return {layer: index for group in groups for index, layer in enumerate(group.layers)}


def num_tensors(groups: Sequence[KVCacheGroupSpec]) -> int:
    """How many K (and V) tensors the pool holds: the layers of the largest group."""
    return max(len(group.layers) for group in groups)

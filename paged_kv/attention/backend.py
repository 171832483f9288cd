"""What every attention backend is: an implementation class with vLLM's ``forward``, and the one layer
of paged cache it reads and writes (lessons 06, 09, 12).

An attention backend computes paged attention over a step's packed batch
(:class:`~paged_kv.attention.metadata.AttentionMetadata`: decodes and prompt chunks mixed, causal
inside a chunk). Each backend is one module of :mod:`paged_kv.attention.backends` and one subclass
of :class:`AttentionImpl`, built once per layer with the layer's heads, scale, sliding window and
soft cap, and called in each step as vLLM 0.33.0 calls its ``AttentionImpl.forward``
(``vllm/v1/attention/backend.py``): ``forward(query, key, value, kv_cache, metadata)``. It writes
the step's new K/V into the layer's cache at the metadata's slot mapping (vLLM's
``reshape_and_cache``) and returns the attention of every query token. The backends differ only in
how they read the blocks; :mod:`paged_kv.attention.registry` finds them by name.

vLLM splits a backend into an ``AttentionBackend`` (its name, dtypes, metadata builder) and the
``AttentionImpl`` it makes; here one class holds both, since every backend reads the same metadata.
vLLM's ``forward`` also takes the ``layer`` (for its ``_k_scale`` and ``_v_scale``) and an ``output``
buffer; here the scales travel with the cache, in :class:`LayerKVCache`, and the output is returned.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from paged_kv.attention.heads import heads_fit
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.kv.fp8 import check_scale, is_fp8
from paged_kv.kv.storage import KVStorage
from paged_kv.validate import check_count


@dataclass(frozen=True)
class LayerKVCache:
    """One layer's paged cache, as a backend's ``forward`` takes it (vLLM: the layer's ``kv_cache``
    tensor with ``layer._k_scale`` and ``layer._v_scale``).

    ``k_cache`` and ``v_cache`` are the layer's pools, ``(num_blocks, num_kv_heads, block_size,
    head_dim)``, of one shape; both of one fp8 dtype, or both of the query's float dtype (which
    ``forward`` checks). ``k_scale`` and ``v_scale`` are an fp8 pool's per-tensor scales (it holds
    ``K / k_scale`` and ``V / v_scale``; every backend attends over ``stored * scale``); a float
    pool's are 1.0. ``storage`` and ``layer``, when given, are the
    :class:`~paged_kv.kv.storage.KVStorage` the pools are layer ``layer`` of: :meth:`write` stores
    new K/V through it (:meth:`~paged_kv.kv.storage.KVStorage.write_slots`, which quantizes for an
    fp8 pool and measures its scales at the first write under ``calculate_kv_scales``). Without a
    storage the cache is read only, as the teaching functions' caches are.

    Invariant: with a storage, ``k_cache is storage.k_caches[layer]``, ``v_cache is
    storage.v_caches[layer]`` and the scales are the storage's for that layer when this was made
    (:meth:`write` returns the cache as it reads after the write).

    Raises:
        ValueError: a pool is not a tensor, a scale is not a positive finite number, or a float
            pool's scale is not 1.0 (named); the pools' shapes and dtypes are checked against the
            query's by ``forward`` (:func:`check_inputs`).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    storage: KVStorage | None = None
    layer: int = 0

    def __post_init__(self) -> None:
        for name in ("k_cache", "v_cache"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        scales = (check_scale("k_scale", self.k_scale), check_scale("v_scale", self.v_scale))
        if not self.is_fp8 and scales != (1.0, 1.0):
            raise ValueError(
                f"k_scale and v_scale apply to fp8 caches; a {self.k_cache.dtype} cache's are 1.0 (as vLLM "
                f"enforces), got {self.k_scale} and {self.v_scale}"
            )

    @classmethod
    def of_layer(cls, storage: KVStorage, layer: int) -> LayerKVCache:
        """Layer ``layer`` of ``storage``: its pools and its scales now, written through the storage."""
        return cls(
            storage.k_caches[layer],
            storage.v_caches[layer],
            storage.k_scales[layer],
            storage.v_scales[layer],
            storage,
            layer,
        )

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.k_cache.dtype)

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> LayerKVCache:
        """Store ``key`` and ``value`` ``(tokens, num_kv_heads, head_dim)`` at ``slot_mapping``'s slots
        through the storage (vLLM's ``reshape_and_cache``); return the cache as it reads now.

        Raises:
            ValueError: the cache has no storage to write through.
        """
        if self.storage is None:
            raise ValueError(
                "kv_cache has no storage to write key and value through: pass key=None and value=None "
                "for K/V already in the cache, or a LayerKVCache.of_layer(storage, layer)"
            )
        self.storage.write_slots(self.layer, slot_mapping, key, value)
        return LayerKVCache.of_layer(self.storage, self.layer)


class AttentionImpl(ABC):
    """A backend's attention for one layer (vLLM: ``AttentionImpl``); subclasses read the blocks.

    ``num_heads`` query heads of ``head_size`` over ``num_kv_heads`` K/V heads (default
    ``num_heads``; a divisor of it: fewer is grouped-query attention, one multi-query), query head
    ``h`` reading K/V head ``h // (num_heads // num_kv_heads)``. Scores are ``scale * q · k``
    (default ``1 / sqrt(head_size)``), then ``logits_soft_cap * tanh(score / logits_soft_cap)`` when
    a soft cap is given (Gemma 2), before the mask; with ``sliding_window`` ``W`` the query at
    position ``p`` sees positions ``max(0, p - W + 1) .. p`` only, and a request's table entries
    wholly before the window of its first query token take no part: no backend's output depends on
    what those blocks hold, NaN included. vLLM's names: ``num_heads``, ``head_size``, ``scale``,
    ``num_kv_heads``, ``sliding_window``, ``logits_soft_cap``.

    A subclass sets :attr:`name` (its registry name) and :meth:`_attend`, and says in
    :meth:`unavailable` where it cannot run.

    Raises:
        ValueError: a count is not a positive int, ``num_kv_heads`` does not divide ``num_heads``,
            ``scale`` or ``logits_soft_cap`` is not a positive finite number, or ``sliding_window``
            is not an int of at least 1 (named).
    """

    name: ClassVar[str]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = check_count("num_heads", num_heads, minimum=1)
        self.head_size = check_count("head_size", head_size, minimum=1)
        kv_heads = num_heads if num_kv_heads is None else check_count("num_kv_heads", num_kv_heads, minimum=1)
        if not heads_fit(self.num_heads, kv_heads):
            raise ValueError(f"num_kv_heads {kv_heads} must divide num_heads {self.num_heads}")
        self.num_kv_heads = kv_heads
        self.scale = self.head_size**-0.5 if scale is None else check_positive("scale", scale)
        self.sliding_window = check_window(sliding_window)
        self.logits_soft_cap = (
            None if logits_soft_cap is None else check_positive("logits_soft_cap", logits_soft_cap)
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name}: {self.num_heads} heads over {self.num_kv_heads}, "
            f"head_size {self.head_size}, scale {self.scale:g}, sliding_window {self.sliding_window}, "
            f"logits_soft_cap {self.logits_soft_cap})"
        )

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
        """Why this backend cannot attend a ``dtype`` query over a ``cache_dtype`` cache on ``device``
        here, or ``""`` when it can (the registry's default skips a backend that cannot)."""
        return ""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the step's new K/V into the layer's cache, then attend every query token over it.

        Args:
            query: ``(num_tokens, num_heads, head_size)``, the step's query tokens packed as
                ``metadata.query_start_loc`` says; a float dtype (not fp8).
            key, value: ``(num_tokens, num_kv_heads, head_size)``, the same tokens' K and V, stored
                at ``metadata.slot_mapping`` before the attention (:meth:`LayerKVCache.write`); or
                both ``None`` when they are in the cache already.
            kv_cache: the layer's :class:`LayerKVCache`, on the query's device.
            metadata: the step's batch; its invariants (the lengths fit the tables) are the
                builder's to check, and are not read back from the device here.

        Returns:
            ``(num_tokens, num_heads, head_size)`` in the query's dtype: each row the attention of
            its query over its request's positions up to its own (its window's, with a window), an
            fp8 cache's K/V dequantized (``stored * scale``).

        Raises:
            ValueError: a tensor has the wrong type, shape, dtype or device, named as
                :func:`check_inputs` names it; ``key`` without ``value`` (or the reverse) or a
                cache without a storage to write them; or the backend cannot run here (its message
                says why).
        """
        if (key is None) != (value is None):
            raise ValueError("key and value must be given together, or both be None")
        if key is not None:
            if metadata.slot_mapping is None:
                raise ValueError("metadata has no slot_mapping to write key and value at")
            kv_cache = kv_cache.write(metadata.slot_mapping, key, value)
        check_inputs(
            query,
            kv_cache.k_cache,
            kv_cache.v_cache,
            metadata.block_table,
            table_name="block_table",
            seq_lens=metadata.seq_lens,
            query_start_loc=metadata.query_start_loc,
        )
        if (
            query.shape[1:] != (self.num_heads, self.head_size)
            or kv_cache.k_cache.shape[1] != self.num_kv_heads
        ):
            raise ValueError(
                f"query must be (num_tokens, {self.num_heads}, {self.head_size}) over a cache of "
                f"{self.num_kv_heads} K/V heads, as this {self.name} attention was built, got query "
                f"{tuple(query.shape)} and k_cache {tuple(kv_cache.k_cache.shape)}"
            )
        if not metadata.num_tokens or not metadata.num_reqs:
            return query.new_empty(query.shape)
        return self._attend(query, kv_cache, metadata)

    @abstractmethod
    def _attend(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The attention of checked inputs with at least one query token (see :meth:`forward`)."""


def check_inputs(
    query: object,
    k_cache: object,
    v_cache: object,
    block_table: object,
    *,
    table_name: str = "block_tables",
    batch: int | None = None,
    **lengths: object,
) -> None:
    """Raise ``ValueError`` naming the argument unless the tensors fit together: the checks that read
    no value from the device, which every call pays.

    ``query`` is ``(num_tokens, num_heads, head_dim)`` of a float dtype (not fp8), over caches of one
    shape ``(num_blocks, num_kv_heads, block_size, head_dim)`` whose K/V heads divide ``num_heads``,
    both of the query's dtype or both of one fp8 dtype. The block table (named ``table_name``) is a
    2-D integer tensor of one row per request (``batch`` rows when given, else its rows are the
    batch), and each of ``lengths`` (``seq_lens``, ``query_lens``, ``query_start_loc``: by name) an
    integer tensor of one number per request, ``query_start_loc`` one more; everything on the
    query's device.
    """
    named = {"query": query, "k_cache": k_cache, "v_cache": v_cache, table_name: block_table}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or not query.dtype.is_floating_point or is_fp8(query.dtype):
        raise ValueError(f"query must be a 3-D float tensor, got {query.dtype} {tuple(query.shape)}")
    if (
        k_cache.dim() != 4
        or not heads_fit(query.shape[1], k_cache.shape[1])
        or k_cache.shape[3] != query.shape[2]
    ):
        raise ValueError(
            f"k_cache must have shape (num_blocks, num_kv_heads, block_size, {query.shape[2]}) with "
            f"num_kv_heads dividing query's {query.shape[1]} heads, got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}")
    if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):  # an fp8 cache: read in any query dtype
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(f"v_cache has dtype {v_cache.dtype} but k_cache has {k_cache.dtype}")
    else:
        for name in ("k_cache", "v_cache"):
            if named[name].dtype != query.dtype:
                raise ValueError(f"{name} has dtype {named[name].dtype} but query has {query.dtype}")
    for name, tensor in lengths.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    named |= lengths
    for name, tensor in named.items():
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    for name in (table_name, *lengths):
        dtype = named[name].dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got dtype {dtype}")
    if block_table.dim() != 2 or (batch is not None and block_table.shape[0] != batch):
        rows = "batch" if batch is None else batch
        raise ValueError(f"{table_name} must be 2-D ({rows}, max_blocks), got {tuple(block_table.shape)}")
    rows = block_table.shape[0]
    for name, tensor in lengths.items():
        shape = (rows + 1,) if name == "query_start_loc" else (rows,)
        if tensor.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def check_window(sliding_window: object) -> int | None:
    """``sliding_window`` as an ``int`` of at least 1, or ``None``; a ``ValueError`` naming it."""
    return None if sliding_window is None else check_count("sliding_window", sliding_window, minimum=1)


def check_positive(name: str, value: object) -> float:
    """``value`` as a positive finite ``float``; a ``ValueError`` naming ``name`` (a bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return float(value)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch backends compute in for a ``dtype`` query: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)

"""The K/V storage: every layer's ``k_cache`` and ``v_cache``, allocated once, indexed by block id.

Lessons 02 and 03 build one layer of it; a model keeps one per layer, all indexed by the block ids of
one manager (the engine's :class:`~paged_kv.core.kv_cache_manager.KVCacheManager`, or the lessons'
:class:`~paged_kv.core.block_manager.BlockManager`) (vLLM's worker holds a ``kv_caches`` list of
per-layer tensors in the same way, and the scheduler's block ids address all of them). The storage
knows nothing about sequences: it writes and reads through block ids it is given and copies the
blocks a copy-on-write names.

A model with grouped-query attention stores only its K/V heads: ``num_kv_heads`` of them, however
many query heads read each (vLLM's cache tensors are sized by ``num_kv_heads`` in the same way).

A hybrid model's layers share tensors (lesson 13): with ``layer_tensors``, layer ``l`` reads and
writes tensor ``layer_tensors[l]``, its index within its KV-cache group, so the storage holds as
many tensors as the largest group has layers, and a block, owned by one group at a time, holds that
group's layers (in vLLM 0.33.0 the groups' ``KVCacheTensor`` placements overlay the same bytes).

An **fp8** storage (``dtype`` ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, lesson 10;
:mod:`paged_kv.kv.fp8`) holds one byte per number and one pair of per-tensor scales per layer,
``k_scales[layer]`` and ``v_scales[layer]`` (vLLM's ``layer._k_scale`` and ``layer._v_scale``; 1.0
by default, as vLLM's when the checkpoint brings none). A write quantizes what it is given (``value
/ scale``, clamped to the format's range: :func:`~paged_kv.kv.fp8.quantize`), unless it is fp8 of
the storage's dtype already, which is stored as it is (as vLLM's ``reshape_and_cache_kernel_flash``
does, in ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``). A read with a ``dtype``
dequantizes (``stored * scale``); one without returns the stored bytes, which is what swapping
copies out and back. With ``calculate_kv_scales=True`` each layer's scales are measured from its
first write, the largest ``|K|`` and ``|V|`` over the format's largest number
(:func:`~paged_kv.kv.fp8.calculate_scale`), and kept from then on. A float storage's scales are 1.0
and stay so (vLLM enforces it too).

Invariant: ``k_caches[layer]`` and ``v_caches[layer]`` have shape ``(num_blocks, num_kv_heads,
block_size, head_dim)`` and are views of two tensors allocated at construction, which never change
size; token slot ``offset`` of block ``b`` of a layer is ``k_caches[layer][b, :, offset]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_kv.kv import fp8, slots
from paged_kv.kv.sizing import KVCacheSpec
from paged_kv.validate import check_count


class KVStorage:
    """``num_layers`` pairs of K/V pools of ``num_blocks`` blocks, made once on ``device``; with
    ``layer_tensors`` (one tensor index per layer) the layers share :attr:`num_tensors` pairs.

    ``dtype`` may be fp8 (see the module): ``k_scale`` and ``v_scale`` are then every layer's
    scales, a number or one per layer (default 1.0), and ``calculate_kv_scales=True`` measures each
    layer's from its first write instead.

    Raises:
        ValueError: a bad size or dtype, a device that cannot hold the cache, ``layer_tensors``
            not one index per layer covering ``0 .. n - 1``, or a scale that is not a positive
            finite number, not one per layer, or not 1.0 in a float storage (the message names it).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        layer_tensors: Sequence[int] | None = None,
        *,
        k_scale: float | Sequence[float] = 1.0,
        v_scale: float | Sequence[float] = 1.0,
        calculate_kv_scales: bool = False,
    ) -> None:
        self.num_layers = check_count("num_layers", num_layers, minimum=1)
        self.num_blocks = check_count("num_blocks", num_blocks, minimum=1)
        self.block_size = check_count("block_size", block_size, minimum=1)
        self.num_kv_heads = check_count("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_count("head_dim", head_dim, minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        tensors = list(range(self.num_layers)) if layer_tensors is None else list(layer_tensors)
        if (
            len(tensors) != self.num_layers
            or not all(type(t) is int for t in tensors)
            or sorted(set(tensors)) != list(range(max(tensors) + 1))
        ):
            raise ValueError(
                f"layer_tensors must give each of the {self.num_layers} layers a tensor index, "
                f"covering 0 .. n - 1, got {layer_tensors!r}"
            )
        self.layer_tensors = tuple(tensors)
        self.num_tensors = max(tensors) + 1
        shape = (self.num_tensors, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        try:
            self._k = torch.zeros(shape, dtype=dtype, device=device)
            self._v = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, AssertionError, TypeError) as error:
            raise ValueError(f"device {device!r} cannot hold the cache: {error}") from None
        k_tensors, v_tensors = self._k.unbind(0), self._v.unbind(0)
        self.k_caches: tuple[torch.Tensor, ...] = tuple(k_tensors[t] for t in tensors)
        self.v_caches: tuple[torch.Tensor, ...] = tuple(v_tensors[t] for t in tensors)
        self.is_fp8 = fp8.is_fp8(dtype)
        #: Each layer's per-tensor scales: its K is stored as ``K / k_scales[layer]``, its V alike.
        self.k_scales: list[float] = self._scales("k_scale", k_scale)
        self.v_scales: list[float] = self._scales("v_scale", v_scale)
        if calculate_kv_scales and not self.is_fp8:
            raise ValueError(f"calculate_kv_scales applies to fp8 caches, not to a {dtype} one")
        #: The layers whose scales their first write will measure (``calculate_kv_scales``).
        self.scales_to_calculate: set[int] = set(range(self.num_layers)) if calculate_kv_scales else set()

    def __repr__(self) -> str:
        return (
            f"KVStorage(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, {self.dtype}, device='{self.device}')"
        )

    @property
    def dtype(self) -> torch.dtype:
        return self._k.dtype

    @property
    def device(self) -> torch.device:
        return self._k.device

    def _scales(self, name: str, value: float | Sequence[float]) -> list[float]:
        """One checked scale per layer from a number or a sequence of them."""
        many = isinstance(value, Sequence) and not isinstance(value, str)
        values = list(value) if many else [value] * self.num_layers
        if len(values) != self.num_layers:
            raise ValueError(f"{name} must be a number or one per layer ({self.num_layers}), got {value!r}")
        scales = [fp8.check_scale(name, v) for v in values]
        if not self.is_fp8 and any(s != 1.0 for s in scales):
            raise ValueError(
                f"{name} applies to fp8 caches: a {self.dtype} cache's scales are 1.0, got {value!r}"
            )
        return scales

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Give ``layer`` the scales ``k_scale`` and ``v_scale`` (a checkpoint's, say) for its next
        writes and reads; the K/V it holds already were stored with the old ones. A ``ValueError``
        as for the constructor's scales."""
        k, v = fp8.check_scale("k_scale", k_scale), fp8.check_scale("v_scale", v_scale)
        if not self.is_fp8 and (k, v) != (1.0, 1.0):
            raise ValueError(f"k_scale and v_scale apply to fp8 caches: a {self.dtype} cache's are 1.0")
        self.k_scales[layer], self.v_scales[layer] = k, v
        self.scales_to_calculate.discard(layer)

    def scales(self, layer: int) -> dict[str, float]:
        """The keywords paged attention takes to read ``layer``: ``{"k_scale": ..., "v_scale": ...}``
        in an fp8 storage, none in a float one (whose scales are 1.0, the functions' default)."""
        if not self.is_fp8:
            return {}
        return {"k_scale": self.k_scales[layer], "v_scale": self.v_scales[layer]}

    @property
    def bytes_per_block(self) -> int:
        """The bytes one block takes in K and V over all tensors: what one allocation reserves
        (:meth:`~paged_kv.kv.sizing.KVCacheSpec.bytes_per_block`, the one place it is counted)."""
        return self.spec.bytes_per_block(self.block_size)

    @property
    def spec(self) -> KVCacheSpec:
        """What one token slot of this storage costs: its tensors (its layers, unless they share),
        K/V heads, head size and dtype."""
        return KVCacheSpec(self.num_tensors, self.num_kv_heads, self.head_dim, self.dtype)

    def block_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A block table's ids as the 1-D LongTensor, on this device, that writes and reads take."""
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy each ``(source, copy)`` block pair's K and V, in every layer, with one indexing per tensor.

        Whole blocks are copied: the slots past a sequence's tokens are never read.
        """
        if not copies:
            return
        sources = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        targets = torch.tensor([c for _, c in copies], dtype=torch.long, device=self.device)
        self._k[:, targets] = self._k[:, sources]
        self._v[:, targets] = self._v[:, sources]

    def write(
        self, layer: int, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int = 0
    ) -> None:
        """Store one layer's ``k``, ``v`` ``(tokens, heads, dim)`` at positions ``start ..`` of a table
        (quantized, in an fp8 storage)."""
        k, v = self._stored(layer, k, v)
        slots.write_kv(self.k_caches[layer], self.v_caches[layer], block_ids, k, v, start)

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a layer's ``k``, ``v`` ``(tokens, heads, dim)`` in slots ``block * block_size + offset``
        (quantized, in an fp8 storage)."""
        k, v = self._stored(layer, k, v)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.k_caches[layer][blocks, :, offsets] = k
        self.v_caches[layer][blocks, :, offsets] = v

    def _stored(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` and ``v`` as the storage holds them: as given in a float storage or when already of
        its fp8 dtype; else quantized with the layer's scales, measured first if they are still to be."""
        if not self.is_fp8 or k.dtype == self.dtype:
            return k, v
        if layer in self.scales_to_calculate:
            self.set_scales(layer, fp8.calculate_scale(k, self.dtype), fp8.calculate_scale(v, self.dtype))
        return (
            fp8.quantize(k, self.k_scales[layer], self.dtype),
            fp8.quantize(v, self.v_scales[layer], self.dtype),
        )

    def read(
        self, layer: int, block_ids: torch.Tensor, num_tokens: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of a table's first ``num_tokens`` positions, as ``(tokens, heads, dim)``:
        in ``dtype``, dequantized with the layer's scales in an fp8 storage; ``None``: as stored."""
        k, v = slots.read_kv(self.k_caches[layer], self.v_caches[layer], block_ids, num_tokens)
        if dtype is None:
            return k, v
        if self.is_fp8:
            return (
                fp8.dequantize(k, self.k_scales[layer], dtype),
                fp8.dequantize(v, self.v_scales[layer], dtype),
            )
        return k.to(dtype), v.to(dtype)

    def check_kv(self, name: str, tensor: object) -> None:
        """A ``ValueError`` naming ``name`` unless ``tensor`` is ``(tokens, num_kv_heads, head_dim)`` K/V
        of the storage's dtype (an fp8 storage takes any floating point dtype: it quantizes)."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        expected = (self.num_kv_heads, self.head_dim)
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected:
            raise ValueError(
                f"{name} must have shape (num_tokens, {self.num_kv_heads}, {self.head_dim}), "
                f"got {tuple(tensor.shape)}"
            )
        if tensor.dtype != self.dtype and not (self.is_fp8 and tensor.dtype.is_floating_point):
            raise ValueError(f"{name} has dtype {tensor.dtype} but the cache holds {self.dtype}")
        if tensor.device != self.device:
            raise ValueError(f"{name} is on {tensor.device} but the cache is on {self.device}")

    def check_kv_pair(self, k: object, v: object) -> None:
        """:meth:`check_kv` of ``k`` and of ``v``, which must also have the same shape."""
        self.check_kv("k", k)
        self.check_kv("v", v)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")

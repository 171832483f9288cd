"""Where the tiny GPT keeps its K and V: a contiguous baseline and the paged cache (lessons 09, 11).

The attention layers call the small :class:`KVCache` protocol, with two back-ends:

* :class:`ContiguousKVCache`, the baseline: per layer and per sequence, K and V are tensors that
  grow by concatenation, and decode attention is ``scaled_dot_product_attention`` over them.
* :class:`PagedKVCache`, the paged one: **one** :class:`~paged_kv.core.block_manager.BlockManager`
  for the whole model and a :class:`~paged_kv.kv.storage.KVStorage` with one ``k_cache`` /
  ``v_cache`` pool per layer, all indexed by the manager's block ids, as in vLLM. A block is
  allocated, hashed, copied and freed once, whatever the number of layers. A prompt is allocated
  with ``add_sequence`` and each layer writes its K/V; each decode step appends one token to every
  sequence of the batch in one :meth:`~paged_kv.core.block_manager.BlockManager.append_batch` (a new
  block only at a block boundary), builds the batch's block tables and slots once, and each layer's
  attention backend (:mod:`paged_kv.attention.registry`, the platform's default) scatters its new
  K/V into those slots in one indexing operation and attends: no per-sequence loop beyond the
  bookkeeping.

  With ``enable_prefix_caching=True`` the manager reuses the blocks of a prompt prefix that an
  earlier prompt computed (:mod:`paged_kv.core.prefix_cache`): ``add_sequence(seq_id, n, token_ids)``
  looks the prompt up, :meth:`PagedKVCache.num_cached_tokens` says how many leading tokens ``c``
  need no computing, and ``prefill(prompt, seq_id, cache, start=c)`` runs only positions
  ``c .. n - 1``, writing their K/V after the cached ones and attending over both with
  :func:`~paged_kv.attention.paged.paged_prefill_attention`.

  With ``kv_cache_dtype="fp8"`` (``"fp8_e4m3"``, ``"fp8_e5m2"``: vLLM's names, lesson 10) the pools
  hold one byte per number (:mod:`paged_kv.kv.fp8`): the layers' K/V are quantized as they are
  written, with each layer's per-tensor scales (1.0, vLLM's default, or measured from each layer's
  first write with ``calculate_kv_scales=True``), and every attention reads them dequantized, with
  those scales, in the model's dtype. One exception: a prompt prefilled alone from position 0
  (``TinyGPT.prefill``, :func:`~paged_kv.model.attend.prefill_attend`) attends over its K/V as
  computed, before they are stored; :func:`~paged_kv.model.generate`'s packed prefill, and every
  decode, read the cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

import torch

from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.contiguous import causal_attention
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.attention.paged import paged_prefill_attention
from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.block_manager import BlockManager
from paged_kv.core.trace import Recorder, TraceFrame
from paged_kv.kv import swap
from paged_kv.kv.fp8 import is_fp8, kv_cache_dtype_str_to_dtype
from paged_kv.kv.storage import KVStorage
from paged_kv.model.config import FULL_ATTENTION, GPTConfig, LayerAttention
from paged_kv.model.step import BlockTables, prepare_attention


@runtime_checkable
class KVCache(Protocol):
    """What the attention layers call. K/V tensors are ``(tokens, num_kv_heads, head_dim)``; queries
    have ``num_heads`` heads, a multiple of ``num_kv_heads`` (grouped-query attention when larger).
    The package's caches also say how each layer attends, ``layer_attention[layer]`` (its window,
    scale and soft cap: the model config's, lesson 13), and every attention they run honours it; a
    cache without the attribute attends fully in every layer."""

    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make room for a prompt of ``num_tokens`` before its prefill."""
        ...

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's K and V for one layer."""
        ...

    def attend_prefill(
        self, layer: int, seq_id: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Store the K/V of prompt positions ``start ..`` (the prompt's last ``len(k)``) for one layer
        and attend causally with their ``q`` over the whole prompt, cached positions included.

        Only a cache with prefix caching needs it: :meth:`TinyGPT.prefill` calls it when
        ``start > 0``. Returns ``(len(q), heads, dim)``.
        """
        ...

    def append(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Grow each sequence by one token; return the new tokens' positions ``(batch,)``."""
        ...

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store the new tokens' K/V ``(batch, kv_heads, dim)``; attend with ``q`` ``(batch, heads, dim)``
        over each whole sequence."""
        ...

    def free(self, seq_id: Hashable) -> None:
        """Forget a finished sequence."""
        ...


class ContiguousKVCache(KVCache):
    """Per layer and per sequence, K and V tensors grown by concatenation (the baseline)."""

    def __init__(self, config: GPTConfig, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.layer_attention = config.layer_attention
        self.k: list[dict[Hashable, torch.Tensor]] = [{} for _ in range(config.num_layers)]
        self.v: list[dict[Hashable, torch.Tensor]] = [{} for _ in range(config.num_layers)]
        self.lengths: dict[Hashable, int] = {}

    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> None:
        if seq_id in self.lengths:
            raise ValueError(f"seq_id {seq_id!r} is already in the cache")
        self.lengths[seq_id] = num_tokens

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][seq_id], self.v[layer][seq_id] = k, v

    def append(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        positions = [self.lengths[s] for s in seq_ids]
        for s in seq_ids:
            self.lengths[s] += 1
        return torch.tensor(positions, device=self.device)

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = []
        for b, s in enumerate(seq_ids):  # a plain loop: each sequence has its own length
            self.k[layer][s] = torch.cat([self.k[layer][s], k[b : b + 1]])
            self.v[layer][s] = torch.cat([self.v[layer][s], v[b : b + 1]])
            keys, values = self.k[layer][s][None], self.v[layer][s][None]
            spec = self.layer_attention[layer]
            attended = causal_attention(
                q[b : b + 1, None], keys, values, scale=spec.scale, **spec.window_and_cap()
            )
            out.append(attended[0, 0])
        return torch.stack(out)

    def free(self, seq_id: Hashable) -> None:
        self.lengths.pop(seq_id, None)
        for per_layer in (*self.k, *self.v):
            per_layer.pop(seq_id, None)


class PagedKVCache(KVCache):
    """One block manager for every layer and one K/V pool per layer (see the module docstring).

    ``record=True`` keeps :attr:`trace`, the manager's events as frames, to watch blocks arrive at
    the boundaries. ``enable_prefix_caching=True`` builds the manager with prefix caching.
    ``dtype`` is the model's, the dtype of the K/V it writes; ``kv_cache_dtype`` the pools' (vLLM's
    ``cache_dtype``): ``"auto"`` (``dtype``), ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` or a torch
    dtype (:func:`~paged_kv.kv.fp8.kv_cache_dtype_str_to_dtype`); an fp8 cache's per-layer scales
    are ``k_scale`` and ``v_scale`` (a number or one per layer, default 1.0), or, with
    ``calculate_kv_scales=True``, measured from each layer's first write (see the module).

    Invariant: every layer's pool holds the K/V of the same tokens at the same slots, those the
    manager's block tables name; a step's batch layout (:meth:`append`) is built once and read by
    every layer's :meth:`attend`.
    """

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        record: bool = False,
        enable_prefix_caching: bool = False,
        *,
        kv_cache_dtype: str | torch.dtype = "auto",
        k_scale: float | Sequence[float] = 1.0,
        v_scale: float | Sequence[float] = 1.0,
        calculate_kv_scales: bool = False,
    ) -> None:
        stored = kv_cache_dtype_str_to_dtype(kv_cache_dtype, dtype)
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        # Every layer keeps all its blocks, sliding or not (vLLM's --disable-hybrid-kv-cache-manager):
        # a sliding layer's window is its attention's, not the cache's (the engine frees them, lesson 13).
        self.layer_attention = config.layer_attention
        self.storage = KVStorage(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            stored,
            device,
            k_scale=k_scale,
            v_scale=v_scale,
            calculate_kv_scales=calculate_kv_scales,
        )
        #: The dtype the K/V are read back in (:meth:`read_kv`): the model's (float32 when ``dtype``
        #: itself was fp8).
        self.dtype = torch.float32 if is_fp8(dtype) else dtype
        self._recorder = Recorder(self.manager) if record else None
        # A prompt not fully prefilled -> its first unwritten position.
        self._unwritten: dict[Hashable, int] = {}
        self.block_size, self.device = block_size, self.storage.device
        # The sequences' block-table rows on the device, as the engine's runner keeps them.
        self.block_tables = BlockTables(
            16, blocks_for_tokens(max(config.max_len, block_size), block_size), self.device
        )
        self._step: tuple[tuple[Hashable, ...], AttentionMetadata] | None = None  # the last append's
        self._prefill: tuple[tuple[Hashable, ...], AttentionMetadata] | None = None  # the last layout
        self._impls: dict[tuple[LayerAttention, torch.dtype], AttentionImpl] = {}  # each layer attention's

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether prompts added with ``token_ids`` reuse cached blocks (set when the cache is built)."""
        return self.manager.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the pool, which every layer shares."""
        return self.manager.num_free_blocks

    @property
    def trace(self) -> list[TraceFrame]:
        """The recorded frames, oldest first (a new list); empty unless built with ``record=True``."""
        return list(self._recorder.frames) if self._recorder is not None else []

    def needs_new_block(self, seq_id: Hashable) -> bool:
        """Whether the sequence's next token takes a free block (at a block boundary, or a shared block)."""
        return self.manager.needs_new_block(seq_id)

    def add_sequence(
        self, seq_id: Hashable, num_tokens: int, token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> None:
        """Allocate the prompt's blocks, once for every layer; with prefix caching and ``token_ids``,
        the cached prefix's blocks are reused (see :meth:`num_cached_tokens`)."""
        self.manager.allocate(seq_id, num_tokens, token_ids)
        cached = self.manager.num_cached_tokens(seq_id)
        if self.manager.enable_prefix_caching:  # the prefill writes the uncached tail
            self.manager.prepare_write(seq_id, cached, num_tokens)
        self._unwritten[seq_id] = cached
        self.block_tables.add_row(seq_id, (self.manager.table(seq_id).block_ids,))

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """How many leading prompt tokens of the sequence the prefix cache served: prefill from there.

        Raises:
            UnknownSequenceError: ``seq_id`` is not in the cache.
        """
        return self.manager.num_cached_tokens(seq_id)

    def write_prompt(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a whole prompt's K and V for one layer.

        Raises:
            ValueError: part of the prompt came from the prefix cache: those blocks hold K/V that
                other sequences may read, so only the rest is written, with :meth:`attend_prefill`;
                or ``k``, ``v`` are not the prompt's K/V for this cache.
        """
        cached = self.manager.num_cached_tokens(seq_id)
        if cached:
            raise ValueError(
                f"the first {cached} tokens of sequence {seq_id!r} come from the prefix cache: "
                f"prefill from start={cached} (attend_prefill) instead of writing the whole prompt"
            )
        self._check_write(seq_id, k, v, 0)
        self.storage.write(layer, self._block_ids(seq_id), k, v)
        self._unwritten.pop(seq_id, None)

    def attend_prefill(
        self, layer: int, seq_id: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Store the K/V of prompt positions ``start ..`` for one layer; attend causally over the prompt.

        The positions are the prompt's uncached tail: ``start`` is :meth:`num_cached_tokens` and
        ``len(k)`` the tokens after it, so the cached blocks are never written and no position is
        left unwritten. Attention is :func:`~paged_kv.attention.paged.paged_prefill_attention` over
        the sequence's blocks.

        Raises:
            ValueError: ``start`` is not the sequence's cached tokens, ``start + len(k)`` is not
                its length, or ``q`` is not ``k``'s tokens with a multiple of its heads; or ``k``,
                ``v`` are bad as for :meth:`write_prompt`. Nothing is written.
        """
        length, cached = self.manager.sequence_length(seq_id), self.manager.num_cached_tokens(seq_id)
        if start != cached or start + len(k) != length:
            raise ValueError(
                f"start {start} and {len(k)} new tokens must be the uncached tail of sequence "
                f"{seq_id!r}: its {length} tokens from the {cached} cached ones on"
            )
        self._check_write(seq_id, k, v, start)
        if (
            not isinstance(q, torch.Tensor)
            or q.dim() != 3
            or (q.shape[0], q.shape[2]) != (k.shape[0], k.shape[2])
            or q.shape[1] % k.shape[1]
        ):
            got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(
                f"q must be ({len(k)}, num_heads, {k.shape[2]}) with num_heads a multiple of k's "
                f"{k.shape[1]} heads, got {got}"
            )
        block_ids = self._block_ids(seq_id)
        self.storage.write(layer, block_ids, k, v, start)
        self._unwritten.pop(seq_id, None)
        k_cache, v_cache = self.storage.k_caches[layer], self.storage.v_caches[layer]
        spec = self.layer_attention[layer]
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            block_ids[None],
            [length],
            [len(k)],
            spec.scale,
            **self.storage.scales(layer),
            **spec.window_and_cap(),
        )

    def begin_prefill(
        self, seq_ids: Sequence[Hashable], starts: Sequence[int], num_new: Sequence[int] | None = None
    ) -> None:
        """Lay out one packed prefill of the batch, once for every layer's :meth:`attend_prefill_batch`.

        Sequence ``i`` computes positions ``starts[i] .. starts[i] + num_new[i] - 1`` (default: to
        its length), attending over every position up to its own. ``starts[i]`` must be the
        sequence's first position not yet written: :meth:`num_cached_tokens` for its first
        chunk, where the previous chunk ended for a later one (chunked prefill, vLLM's
        ``num_computed_tokens``; a whole prompt may also be laid out again from its cached
        tokens). Its tokens come after those of the sequences before it. The block tables,
        lengths, query lengths and each packed token's slot are built here, as :meth:`append`
        builds a decode step's, and the chunk counts as written from here on.

        Raises:
            ValueError: a start is not the sequence's cached tokens or next unwritten position,
                or a chunk is empty or runs past the sequence; nothing is laid out.
        """
        seq_ids = tuple(seq_ids)
        lengths = [self.manager.sequence_length(seq_id) for seq_id in seq_ids]
        ends = lengths if num_new is None else [start + n for start, n in zip(starts, num_new, strict=True)]
        for seq_id, start, end, length in zip(seq_ids, starts, ends, lengths, strict=True):
            cached = self.manager.num_cached_tokens(seq_id)
            expected = self._unwritten.get(seq_id, cached)
            if start != expected or not start < end <= length:
                raise ValueError(
                    f"start {start} of sequence {seq_id!r} must be its {expected} cached tokens "
                    f"(or computed ones), below an end of at most its {length} tokens, got end {end}: "
                    f"a prefill computes the positions not yet written"
                )
        for seq_id, end, length in zip(seq_ids, ends, lengths, strict=True):
            if end < length:
                self._unwritten[seq_id] = end
            else:
                self._unwritten.pop(seq_id, None)
        self._prefill = (
            seq_ids,
            prepare_attention(
                self.block_tables,
                seq_ids,
                starts,
                [e - a for a, e in zip(starts, ends, strict=True)],
                self.block_size,
            ),
        )

    def attend_prefill_batch(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store one layer's K/V of the packed prefill and attend: one attention backend's
        ``forward`` for the whole batch (the platform's default backend).

        ``q`` ``(tokens, num_heads, head_dim)`` and ``k``, ``v`` ``(tokens, num_kv_heads, head_dim)``
        hold the new tokens of every sequence, packed as :meth:`begin_prefill` laid them out; each
        attends causally over its own sequence, cached positions included.

        Raises:
            RuntimeError: ``seq_ids`` is not the batch of the last :meth:`begin_prefill`.
            ValueError: ``k`` or ``v`` is bad as for :meth:`write_prompt`, or holds another number of
                tokens than the layout. Nothing is written.
        """
        if self._prefill is None or tuple(seq_ids) != self._prefill[0]:
            raise RuntimeError("attend_prefill_batch must follow begin_prefill for the same batch")
        metadata = self._prefill[1]
        self.storage.check_kv_pair(k, v)
        if len(k) != metadata.num_tokens:
            raise ValueError(f"k holds {len(k)} tokens but the prefill laid out {metadata.num_tokens}")
        return self._forward(layer, q, k, v, metadata)

    def append(
        self, seq_ids: Sequence[Hashable], token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Grow every sequence of the batch by one token, all or none; return the new tokens' positions.

        ``token_ids`` are the new tokens' ids, one per sequence: the decode step's input tokens,
        whose K/V the layers write next. With prefix caching, a block they fill is cached under its
        chained hash, as a prompt's full block is (see
        :meth:`~paged_kv.core.block_manager.BlockManager.append_tokens`), so a later prompt that
        repeats this conversation reuses the answer's blocks. The batch's block tables, lengths and
        new slots are built here, once per step, for every layer's :meth:`attend`.
        """
        seq_ids = tuple(seq_ids)
        copies = self.manager.append_batch(seq_ids, token_ids)
        self.storage.copy_blocks(copies)
        held = [self.manager.table(seq_id) for seq_id in seq_ids]
        for seq_id, table in zip(seq_ids, held, strict=True):
            self.block_tables.sync(seq_id, (table.block_ids,))
        computed = [table.num_tokens - 1 for table in held]
        metadata = prepare_attention(
            self.block_tables, seq_ids, computed, [1] * len(seq_ids), self.block_size
        )
        self._step = (seq_ids, metadata)
        return metadata.positions

    def attend(
        self, layer: int, seq_ids: Sequence[Hashable], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store the new tokens' K/V in this layer's slots and attend over each whole sequence.

        Raises:
            RuntimeError: ``seq_ids`` is not the batch of the last :meth:`append`.
        """
        if self._step is None or tuple(seq_ids) != self._step[0]:
            raise RuntimeError("attend must follow append for the same batch: call append(seq_ids) first")
        return self._forward(layer, q, k, v, self._step[1])

    def _forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The layer's attention backend (the platform's default, one per layer attention and query
        dtype) writes ``k`` and ``v`` at the metadata's slots and attends ``q`` over the batch."""
        spec = self.layer_attention[layer]
        impl = self._impls.get((spec, q.dtype))
        if impl is None:
            impl = self._impls[spec, q.dtype] = spec.impl(
                None, q, self.storage.num_kv_heads, self.storage.dtype
            )
        return impl.forward(q, k, v, LayerKVCache.of_layer(self.storage, layer), metadata)

    def free(self, seq_id: Hashable) -> None:
        """Give the sequence's blocks back. A prompt freed before its prefill wrote every position
        (preempted between chunks) first loses the hashes of the blocks it had not written, so that
        the prefix cache never serves K/V nobody computed."""
        unwritten = self._unwritten.pop(seq_id, None)
        if unwritten is not None and self.manager.enable_prefix_caching:
            # The scheduler lets no other prompt share a block before it is computed, so this
            # writes no copy: it only forgets the hashes of the blocks from ``unwritten`` on.
            self.manager.prepare_write(seq_id, unwritten, self.manager.sequence_length(seq_id))
        self.manager.free(seq_id)
        self.block_tables.remove(seq_id)

    def read_kv(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of the sequence, gathered into contiguous ``(num_tokens, heads, dim)``,
        in :attr:`dtype` (an fp8 cache's dequantized)."""
        ids, length = self._block_ids(seq_id), self.manager.sequence_length(seq_id)
        return self.storage.read(layer, ids, length, self.dtype)

    def swap_out(self, seq_id: Hashable) -> swap.SwappedKV:
        """Copy the sequence's K/V, every layer, to host memory and free its blocks (lesson 11)."""
        saved = swap.swap_out(self.manager, self.storage, seq_id)
        self.block_tables.remove(seq_id)
        return saved

    def swap_in(self, seq_id: Hashable, saved: swap.SwappedKV) -> None:
        """Give the sequence fresh blocks and copy back what :meth:`swap_out` saved (lesson 11)."""
        swap.swap_in(self.manager, self.storage, seq_id, saved)
        self.block_tables.add_row(seq_id, (self.manager.table(seq_id).block_ids,))

    def _block_ids(self, seq_id: Hashable) -> torch.Tensor:
        return self.storage.block_index(self.manager.table(seq_id).block_ids)

    def _check_write(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        self.storage.check_kv_pair(k, v)
        length = self.manager.sequence_length(seq_id)
        if start + len(k) > length:
            raise ValueError(
                f"{start + len(k)} positions run past the {length} tokens of sequence {seq_id!r}"
            )


def check_cache_fits(cache: object, config: GPTConfig) -> None:
    """Raise ``ValueError`` when ``cache`` holds K/V of other sizes than a model of ``config`` writes.

    A cache with a :class:`~paged_kv.kv.storage.KVStorage` (``cache.storage``) must have the model's
    layers, K/V heads and head size, and its layers must attend as the model's (window, scale and
    soft cap); a cache without storage is taken on trust for its sizes (its writes check).
    """
    storage = getattr(cache, "storage", None)
    if isinstance(storage, KVStorage):
        _check_storage_fits(storage, config)
    full = (FULL_ATTENTION,) * config.num_layers  # what a cache that does not say attends as
    layers = getattr(cache, "layer_attention", full)
    if tuple(layers) != config.layer_attention:
        raise ValueError(
            f"cache was built for another model: its layers attend as {list(layers)}, the model's as "
            f"{list(config.layer_attention)}"
        )


def _check_storage_fits(storage: KVStorage, config: GPTConfig) -> None:
    has = (storage.num_layers, storage.num_kv_heads, storage.head_dim)
    needs = (config.num_layers, config.num_kv_heads, config.head_dim)
    if has != needs:
        raise ValueError(
            "cache was built for another model: it holds {} layers of {} K/V heads of size {}, the model "
            "writes {} layers of {} K/V heads of size {}".format(*has, *needs)
        )

"""``FLEX_ATTENTION``: paged attention through PyTorch's FlexAttention, for decode and packed batches,
compiled on CUDA (lessons 05, 06).

FlexAttention (``torch.nn.attention.flex_attention``, torch 2.5 and later) runs attention with a
*mask function* that says, for each query and key position, whether the query may see the key,
and a *block mask* that lets the kernel skip whole tiles nobody may see. Compiled with
``torch.compile`` on a GPU it becomes one fused Triton kernel.

Paged decode maps onto it without moving a byte of K or V:

* the keys are the **whole pool**, viewed as one long sequence of ``num_blocks * block_size``
  positions (``k_cache.transpose(0, 1)`` flattened: a view, no copy when the cache is contiguous);
* the queries are the batch's new tokens, one query position per sequence, with ``num_heads``
  heads over the pool's ``num_kv_heads``: with fewer K/V heads (grouped-query or multi-query
  attention) FlexAttention's ``enable_gqa=True`` has query head ``h`` read K/V head
  ``h // (num_heads // num_kv_heads)``, with no copy of K or V per query head;
* query ``b`` sees key ``kv`` as many times as row ``b`` of the block table reads that slot: the
  entries ``j`` that name physical block ``kv // block_size`` and whose logical position
  ``j * block_size + kv % block_size`` is below ``seq_lens[b]``. Every entry but a row's last
  reads its whole block, so a small table ``full[b, block]`` (how many of those entries name the
  block) and the last entry's block and length answer that in one lookup. The same physical block
  in several rows (fork, a prefix cache) needs nothing special: the mask lets each row see it.
  A row that names one block *twice* sees those keys twice, as if they were two keys: softmax
  over a key counted ``m`` times is softmax with ``log m`` added to its score, which a score
  modifier does (only for a batch that has such a row).

A packed batch of several query tokens per sequence (prompts, chunks, decodes:
:func:`flex_varlen`) is the same picture with one query position per query token and a causal
condition: query token ``t`` of sequence ``s`` at position ``p`` sees pool slot ``kv`` as many times
as row ``s`` names block ``kv // block_size`` at an entry ``j`` with ``j * block_size + kv %
block_size <= p``. A small table ``entries[s, block, d]`` (the ``d``-th entry of row ``s`` naming
the block, ``-1`` past the last; ``d`` runs to the most times one row names one block, 1 in every
table an engine builds) answers it in a lookup per ``d``.

A sliding window of ``W`` tokens adds a condition to the mask, ``kv_pos > position - W`` (the slot's
position in the sequence against the query's), and a soft cap a score modifier, ``softcap *
tanh(score / softcap)`` (FlexAttention hands it the scaled score), before the ``log`` term of a
repeated entry. With a window the keys are not the pool: the blocks the windows reach are copied
out of it (:func:`_window_blocks`, a window's worth of blocks per sequence), so the blocks before
the windows, whose table entries an engine points at its null block, are not among the keys at all.

An fp8 cache (lesson 10) is not a dtype FlexAttention computes in: its keys and values are
dequantized to the query's dtype, ``stored * k_scale`` and ``stored * v_scale``
(:func:`~paged_kv.kv.fp8.dequantize`), right before the attention, so the copy is of the keys it
runs over: the pool, or with a window the copy of the windows' blocks, dequantized after that copy.

The result equals the ``GATHER`` backend's (the reference). On a CPU FlexAttention runs unfused
(it materialises the scores over the whole pool), which is correct but slow: this path is for
CUDA, and tests check it against the reference wherever it runs. One difference from the
reference: a masked-out slot still meets a zero weight in ``weights @ V``, so every key slot of the
pool (of the copy, with a window) must hold finite values (the pool starts as zeros and only ever
holds K/V written to it; NaN planted in a free block would leak through, where the reference ignores
it); with a window, the blocks before the windows may hold anything, as they are not copied.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.kv.fp8 import dequantize, is_fp8

NEEDS = f"FLEX_ATTENTION needs torch 2.5 or later (FlexAttention); this is {torch.__version__}"


class FlexAttentionImpl(AttentionImpl):
    """FlexAttention over the pool with a block mask built from the tables (see the module): a step of
    decodes without a window through :func:`flex_decode`, any other step through :func:`flex_varlen`.
    vLLM 0.33.0: ``FlexAttentionImpl`` in ``vllm/v1/attention/backends/flex_attention.py``."""

    name = "FLEX_ATTENTION"

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
        return "" if flex_available() else NEEDS

    def _attend(
        self, query: torch.Tensor, kv_cache: LayerKVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        args = (query, kv_cache.k_cache, kv_cache.v_cache, metadata.block_table, metadata.seq_lens)
        keywords = {
            "sliding_window": self.sliding_window,
            "softcap": self.logits_soft_cap,
            "k_scale": kv_cache.k_scale,
            "v_scale": kv_cache.v_scale,
        }
        if metadata.is_decode_only:
            out = flex_decode(*args, self.scale, **keywords)
        else:
            out = flex_varlen(*args, metadata.query_start_loc, self.scale, **keywords)
        return out.to(query.dtype)


def flex_available() -> bool:
    """Whether this torch has FlexAttention (torch 2.5 or later)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None,
    compiled: bool | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention of checked inputs (one query token per sequence) with FlexAttention.

    ``query`` is ``(batch, num_heads, dim)`` in the caches' dtype (any float dtype over fp8 caches,
    which are dequantized to it with ``k_scale`` and ``v_scale``, checked), over caches of
    ``(num_blocks, num_kv_heads, block_size, dim)`` with ``num_kv_heads`` dividing ``num_heads``
    (FlexAttention's ``enable_gqa``: query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``); ``seq_lens`` is a long tensor on the query's device. ``compiled``
    defaults to ``True`` on CUDA and ``False`` elsewhere. ``sliding_window`` (an int of at least
    1) and ``softcap`` (a positive float), checked (:class:`~paged_kv.attention.backend.AttentionImpl`):
    a decode batch with a window is :func:`flex_varlen`'s, one query token per sequence; the soft
    cap is a score modifier.

    Raises:
        ValueError: this torch has no FlexAttention.
    """
    if sliding_window is not None:
        starts = torch.arange(query.shape[0] + 1, device=query.device)
        return flex_varlen(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            starts,
            scale,
            compiled,
            sliding_window=sliding_window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if not flex_available():
        raise ValueError(NEEDS)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    batch, num_heads, _ = query.shape
    device = query.device
    if compiled is None:
        compiled = device.type == "cuda"
    reads = _slot_reads(block_tables, seq_lens, num_blocks, block_size)
    mask_mod, score_mod = _paged_mods(reads, block_size)
    score_mod = _soft_capped(score_mod, softcap)
    pool = num_blocks * block_size
    block_mask = create_block_mask(mask_mod, None, None, batch, pool, device=device, _compile=compiled)
    k_cache, v_cache = _dequantized(k_cache, v_cache, query.dtype, k_scale, v_scale)
    keys = k_cache.transpose(0, 1).reshape(1, num_kv_heads, pool, head_dim)
    values = v_cache.transpose(0, 1).reshape(1, num_kv_heads, pool, head_dim)
    queries = query.transpose(0, 1).unsqueeze(0)  # (1, heads, batch, dim): one query position per row
    attend = _compiled_flex_attention() if compiled else flex_attention
    grouped = num_heads != num_kv_heads  # query head h reads KV head h // (num_heads // num_kv_heads)
    out = attend(
        queries, keys, values, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=grouped
    )
    return out[0].transpose(0, 1)


def flex_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None,
    compiled: bool | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of a checked packed batch (:class:`~paged_kv.attention.metadata.AttentionMetadata`)
    with FlexAttention: causal inside each sequence, over the whole pool, or with a sliding window
    over the blocks of the windows.

    ``query`` is ``(num_tokens, num_heads, dim)`` in the caches' dtype, sequence ``b``'s query
    tokens being rows ``query_start_loc[b] .. query_start_loc[b + 1] - 1``, the last ones of its
    ``seq_lens[b]`` tokens; the rest as for :func:`flex_decode`. With ``sliding_window`` ``W``, the
    query token at position ``p`` sees positions ``p - W + 1 .. p`` only, and the keys are not the
    pool but a copy of the blocks the windows reach (:func:`_window_blocks`): the blocks before a
    sequence's window, which may hold anything, are not in it. ``softcap`` ``c`` makes each score
    ``c * tanh(score / c)``, a score modifier (FlexAttention scales the scores before it). Over fp8
    caches the query may be in any float dtype: the keys are dequantized to it with ``k_scale`` and
    ``v_scale`` (after the window's copy, with a window).

    Raises:
        ValueError: this torch has no FlexAttention.
    """
    if not flex_available():
        raise ValueError(NEEDS)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_tokens, num_heads, _ = query.shape
    device = query.device
    if not num_tokens:
        return query.new_empty(query.shape)
    if compiled is None:
        compiled = device.type == "cuda"
    tokens = torch.arange(num_tokens, device=device)
    seq = torch.searchsorted(query_start_loc[1:], tokens, right=True)  # the sequence of each token
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    position = (seq_lens - query_lens)[seq] + tokens - query_start_loc[seq]  # its position in it
    first = None
    if sliding_window is not None:  # each row's first entry its first query token's window reaches
        block_size = k_cache.shape[2]
        first = (seq_lens - query_lens - sliding_window + 1).clamp(min=0) // block_size
        first = torch.where(query_lens > 0, first, block_tables.shape[1])  # no query token: no entry
        block_tables, k_cache, v_cache = _window_blocks(block_tables, seq_lens, first, k_cache, v_cache)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    entries = _entries(block_tables, seq_lens, num_blocks, block_size, first)
    repeats = entries.shape[2]

    def times_seen(q, kv):
        block, offset = kv // block_size, kv % block_size
        count = torch.zeros_like(q)
        for d in range(repeats):  # 1 unless a row names one block twice
            entry = entries[seq[q], block, d]
            kv_pos = entry * block_size + offset  # the slot's position in the sequence, at that entry
            seen = (entry >= 0) & (kv_pos <= position[q])
            if sliding_window is not None:  # and not before the query's window
                seen = seen & (kv_pos > position[q] - sliding_window)
            count = count + seen.long()
        return count

    def mask_mod(b, h, q, kv):
        return times_seen(q, kv) > 0

    def score_mod(score, b, h, q, kv):
        return score + torch.log(times_seen(q, kv).to(score.dtype))

    pool = num_blocks * block_size
    block_mask = create_block_mask(mask_mod, None, None, num_tokens, pool, device=device, _compile=compiled)
    k_cache, v_cache = _dequantized(k_cache, v_cache, query.dtype, k_scale, v_scale)
    keys = k_cache.transpose(0, 1).reshape(1, num_kv_heads, pool, head_dim)
    values = v_cache.transpose(0, 1).reshape(1, num_kv_heads, pool, head_dim)
    queries = query.transpose(0, 1).unsqueeze(0)  # (1, heads, tokens, dim): one query position per token
    attend = _compiled_flex_attention() if compiled else flex_attention
    out = attend(
        queries,
        keys,
        values,
        score_mod=_soft_capped(score_mod if repeats > 1 else None, softcap),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)


def _window_blocks(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    first: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks a batch with a sliding window reads, copied out of the pool: ``(tables, k, v)``.

    Row ``b`` reads entries ``first[b] .. ceil(seq_lens[b] / block_size) - 1``; the distinct blocks
    they name, ``n`` of them, are copied into ``k`` and ``v`` of ``(n, num_kv_heads, block_size,
    head_dim)`` (in block id order), and ``tables`` is ``block_tables`` renumbered into them, ``-1``
    at every entry not read. FlexAttention multiplies every key slot it visits by its weight, and a
    zero weight does not cancel NaN: the blocks before the windows (the null block, blocks since
    given to other sequences) must not be among its keys at all. The copy is a window's worth of
    blocks per sequence, where the pool may hold far more.
    """
    num_blocks, _, block_size, _ = k_cache.shape
    batch, width = block_tables.shape
    column = torch.arange(width, device=block_tables.device)
    needed = (seq_lens + block_size - 1) // block_size
    read = (column >= first[:, None]) & (column < needed[:, None])
    live, renumbered = torch.unique(block_tables.long().clamp(0, num_blocks - 1)[read], return_inverse=True)
    tables = torch.full((batch, width), -1, dtype=torch.long, device=block_tables.device)
    tables[read] = renumbered
    return tables, k_cache[live], v_cache[live]


def _dequantized(
    k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as they are, or, when fp8, ``stored * scale`` in ``dtype`` (a copy, in that dtype)."""
    if not is_fp8(k_cache.dtype):
        return k_cache, v_cache
    return dequantize(k_cache, k_scale, dtype), dequantize(v_cache, v_scale, dtype)


def _soft_capped(score_mod: Callable | None, softcap: float | None) -> Callable | None:
    """``score_mod`` (``None``: none) after Gemma 2's soft cap, ``softcap * tanh(score / softcap)``,
    when ``softcap`` is given: the cap applies to the scaled score, before ``score_mod``'s term."""
    if softcap is None:
        return score_mod

    def capped(score, b, h, q, kv):
        score = softcap * torch.tanh(score / softcap)
        return score if score_mod is None else score_mod(score, b, h, q, kv)

    return capped


def _entries(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(batch, num_blocks, repeats)`` int32: ``[s, block, d]`` is the ``d``-th entry (in table
    order) of row ``s`` that names ``block``, among the ``ceil(seq_lens[s] / block_size)`` entries
    the row reads (from entry ``first[s]`` on, when given), or ``-1``; ``repeats`` is the most
    entries of one row naming one block (at least 1). One stable sort ranks the entries of each
    (row, block); no loop."""
    batch, width = block_tables.shape
    device = block_tables.device
    column = torch.arange(width, device=device).expand(batch, width)
    read = column < ((seq_lens + block_size - 1) // block_size)[:, None]
    if first is not None:
        read &= column >= first[:, None]
    rows = torch.arange(batch, device=device)[:, None].expand(batch, width)
    key = (rows * num_blocks + block_tables.long().clamp(0, num_blocks - 1))[read]  # (row, block)
    entry = column[read]
    key, order = torch.sort(key, stable=True)  # the entries of one (row, block) together, in order
    entry = entry[order]
    rank = torch.arange(len(key), device=device) - torch.searchsorted(key, key)  # d of each entry
    repeats = int(rank.max()) + 1 if len(rank) else 1
    entries = torch.full((batch * num_blocks, repeats), -1, dtype=torch.int32, device=device)
    entries[key, rank] = entry.int()
    return entries.view(batch, num_blocks, repeats)


@functools.cache
def _compiled_flex_attention() -> Callable:
    """``flex_attention`` compiled once per process: the fused kernel (Triton on CUDA)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _slot_reads(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How often each row reads each slot of the pool, in three small tensors.

    Returns ``full``, ``(batch, num_blocks)``: how many of a row's read entries before its last
    name each block (those entries read every slot of their block); ``last``, ``(batch,)``: the
    block of the row's last read entry; and ``tail``, ``(batch,)``: how many slots of it are read
    (1 .. block_size). Entries past ``ceil(seq_len / block_size)`` are padding and count for
    nothing. One scatter, no loop.
    """
    batch, width = block_tables.shape
    index = torch.arange(width, device=block_tables.device).expand(batch, width)
    last_entry = (seq_lens + block_size - 1) // block_size - 1
    before_last = index < last_entry[:, None]
    full = torch.zeros((batch, num_blocks + 1), dtype=torch.long, device=block_tables.device)
    targets = torch.where(before_last, block_tables.long(), num_blocks)  # the rest go to a spare column
    full.scatter_add_(1, targets, before_last.long())
    last = block_tables.long().gather(1, last_entry[:, None])[:, 0]
    return full[:, :num_blocks], last, seq_lens - last_entry * block_size


def _paged_mods(
    reads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_size: int
) -> tuple[Callable, Callable | None]:
    """The mask function (query ``q``, a sequence, sees pool slot ``kv`` at all) and, when some row
    reads a slot more than once, the score modifier that adds ``log`` of that count."""
    full, last, tail = reads

    def times_read(q, kv):
        block = kv // block_size
        return full[q, block] + ((last[q] == block) & (kv % block_size < tail[q])).long()

    def mask_mod(b, h, q, kv):
        return times_read(q, kv) > 0

    def score_mod(score, b, h, q, kv):
        return score + torch.log(times_read(q, kv).to(score.dtype))

    rows = torch.arange(len(last), device=last.device)
    repeated = bool((full > 1).any()) or bool((full[rows, last] > 0).any())
    return mask_mod, (score_mod if repeated else None)

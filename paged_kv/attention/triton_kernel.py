"""The paged decode kernel in Triton's language (lesson 12); importing this module imports triton, through
:mod:`paged_kv.attention.triton_language` (its interpreter where there is no GPU, unless triton came first).

:func:`paged_decode_kernel` is a plain function written in Triton's language, not yet a kernel:
``triton.jit(paged_decode_kernel)`` makes it one. :mod:`paged_kv.attention.triton_decode` does so
on its first call (compiled, or interpreted: the process's mode is fixed when triton is imported)
and launches it with ``grid = (batch, num_kv_heads)``: one program per (sequence, KV head).

A program handles the ``GROUP`` query heads that read its KV head (query head ``q`` reads KV head
``q // GROUP``, :mod:`paged_kv.attention.heads`), so each block's K and V are loaded once per KV
head. It walks its sequence's logical blocks ``j = 0 .. ceil(context_len / BLOCK_SIZE) - 1``,
loads block ``j``'s physical id from its row of the table, and addresses slot ``s`` of it, for its
KV head and dimension ``d``, as lesson 03's translation in pointer arithmetic::

    k_cache_ptr + block * k_stride_block + kv_head * k_stride_head + s * k_stride_slot + d * k_stride_dim

Slots ``s`` with ``j * BLOCK_SIZE + s >= context_len`` (the unused tail of the last block) are
masked: never loaded, and given a score of ``-inf``. Lesson 05's online softmax combines the
blocks in float32: ``m``, the running maximum score of each query head; ``total``, the running sum
of ``exp(score - m)``; ``acc``, the running sum of those weights times V. When a block raises the
maximum, the earlier terms are rescaled by ``exp(m_old - m_new)``; the output is ``acc / total``.

Invariants the launcher guarantees: ``context_lens[b] >= 1`` and the first ``ceil(context_lens[b]
/ BLOCK_SIZE)`` entries of row ``b`` are block ids of the cache (the others are never read, so
padding may hold anything), hence every block the loop visits has a live slot and ``m`` is finite
after it; ``GROUP``, ``BLOCK_SIZE`` and ``HEAD_DIM`` are rounded up to powers of two
(``*_PADDED``, as ``tl.arange`` requires) and the padding is masked.
"""

from paged_kv.attention.triton_language import tl


def paged_decode_kernel(
    out_ptr,  # (batch, num_heads, head_dim), the query's dtype
    query_ptr,  # (batch, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, num_kv_heads, block_size, head_dim), any strides
    v_cache_ptr,  # the same axes as k_cache, its own strides
    block_tables_ptr,  # (batch, max_blocks), integer block ids
    context_lens_ptr,  # (batch,), contiguous, each >= 1
    scale,
    out_stride_seq,
    out_stride_head,
    out_stride_dim,
    q_stride_seq,
    q_stride_head,
    q_stride_dim,
    k_stride_block,
    k_stride_head,
    k_stride_slot,
    k_stride_dim,
    v_stride_block,
    v_stride_head,
    v_stride_slot,
    v_stride_dim,
    table_stride_seq,
    table_stride_entry,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PADDED: tl.constexpr,  # the three sizes rounded up to powers of two (tl.arange's rule)
    BLOCK_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """Program ``(seq, kv_head)``: attention of query heads ``kv_head * GROUP ...`` of sequence ``seq``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    members = tl.arange(0, GROUP_PADDED)  # this program's query heads: kv_head * GROUP + members
    slots = tl.arange(0, BLOCK_PADDED)  # offsets within a block
    dims = tl.arange(0, HEAD_DIM_PADDED)
    heads = kv_head * GROUP + members
    real = (members < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]  # not padding: (group, dim)

    q_ptrs = query_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :] * q_stride_dim
    q = tl.load(q_ptrs, mask=real, other=0.0).to(tl.float32)  # (group, dim)
    context_len = tl.load(context_lens_ptr + seq)
    table_row = block_tables_ptr + seq * table_stride_seq

    m = tl.full((GROUP_PADDED,), float("-inf"), dtype=tl.float32)  # running maximum score
    total = tl.zeros((GROUP_PADDED,), dtype=tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((GROUP_PADDED, HEAD_DIM_PADDED), dtype=tl.float32)  # running sum of weights * V
    for j in range(0, tl.cdiv(context_len, BLOCK_SIZE)):  # the logical blocks the sequence holds
        block = tl.load(table_row + j * table_stride_entry).to(tl.int64)  # physical block id
        # Slots at or past the context length (the tail of the last block) do not exist.
        live = (slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < context_len)
        loaded = live[:, None] & (dims < HEAD_DIM)[None, :]  # (slot, dim)
        k_ptrs = (
            k_cache_ptr
            + block * k_stride_block
            + kv_head * k_stride_head
            + slots[:, None] * k_stride_slot
            + dims[None, :] * k_stride_dim
        )
        k = tl.load(k_ptrs, mask=loaded, other=0.0).to(tl.float32)  # (slot, dim)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (group, slot)
        scores = tl.where(live[None, :], scores, float("-inf"))

        # Every block the loop visits holds at least one live slot, so m_new is finite.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)  # what the earlier blocks' terms shrink by; 0 on the first
        weights = tl.exp(scores - m_new[:, None])  # (group, slot), 0 where not live
        total = total * rescale + tl.sum(weights, axis=1)
        v_ptrs = (
            v_cache_ptr
            + block * v_stride_block
            + kv_head * v_stride_head
            + slots[:, None] * v_stride_slot
            + dims[None, :] * v_stride_dim
        )
        v = tl.load(v_ptrs, mask=loaded, other=0.0).to(tl.float32)  # (slot, dim)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out_ptrs = (
        out_ptr + seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :] * out_stride_dim
    )
    tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=real)

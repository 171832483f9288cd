"""The paged attention kernel in Triton's language (lesson 12); importing this module imports triton, through
:mod:`paged_kv.attention.triton_language` (its interpreter where there is no GPU, unless triton came first).

:func:`paged_attention_kernel` is a plain function written in Triton's language, not yet a kernel:
``triton.jit(paged_attention_kernel)`` makes it one. :mod:`paged_kv.attention.triton_decode` does so
on its first call (compiled, or interpreted: the process's mode is fixed when triton is imported)
and launches it with ``grid = (batch, num_kv_heads, query_tiles)``: one program per (sequence, KV
head, tile of ``QUERY_TILE`` query tokens of that sequence). One kernel serves a whole engine step:
the query tokens of every sequence are packed one sequence after another, as vLLM's
``query_start_loc`` packs them, a decode being a sequence of one query token (one tile, and the
launcher makes ``QUERY_TILE`` 1 for a batch of decodes), a prompt or a chunk of one several.

A program's **rows** are (query token, query head) pairs: row ``r`` is query token ``tile *
QUERY_TILE + r // GROUP`` of its sequence, and query head ``kv_head * GROUP + r % GROUP``, one of
the ``GROUP`` heads that read its KV head (query head ``q`` reads KV head ``q // GROUP``,
:mod:`paged_kv.attention.heads`). So each block's K and V are loaded once per (tile, KV head) and
met by every row. Query token ``i`` of sequence ``b`` sits at position ``context_len + i`` of its
sequence, where ``context_len = seq_len - query_len`` tokens came before the query tokens (cached
by earlier steps), and it sees positions ``0 ..`` its own: causal inside a chunk.

The program walks its sequence's logical blocks ``j = 0 .. ceil(kv_len / BLOCK_SIZE) - 1`` (from
the window's first block, with a sliding window: below), where ``kv_len`` is the positions its last
query token sees, loads block ``j``'s physical id from its row of the table, and addresses slot
``s`` of it, for its KV head and dimension ``d``, as lesson 03's translation in pointer arithmetic::

    k_cache_ptr + block * k_stride_block + kv_head * k_stride_head + s * k_stride_slot + d * k_stride_dim

Two masks. A slot is **live** when it holds a token, ``j * BLOCK_SIZE + s < seq_len``: the tail of
the last block is never loaded (it may hold anything, NaN included, and ``0 * NaN`` is NaN). A live
slot is **visible** to a row when its position is at most the row's query position; other scores
are ``-inf``. Lesson 05's online softmax combines the blocks in float32: ``m``, the running maximum
score of each row; ``total``, the running sum of ``exp(score - m)``; ``acc``, the running sum of
those weights times V. When a block raises the maximum, the earlier terms are rescaled by
``exp(m_old - m_new)``; the output is ``acc / total``.

Two options, trailing constexprs with defaults, so that a kernel written without them (lesson 12's
exercise) still launches: the launcher passes them only when asked for. ``SLIDING_WINDOW = W`` (0:
none) makes a row see the positions ``query_pos - W + 1 .. query_pos`` only, a third condition of
the visible mask; and the loop starts at the block of the first position the tile's first query
token sees, ``(first query position - W + 1) // BLOCK_SIZE`` (at least 0), not at block 0: the
blocks before it are never loaded, which is what lets an engine put its null block (or anything)
in their table entries, and what makes a window cheap. A later row's window may start after the
first blocks the loop visits, so its running maximum is still ``-inf`` there: the exponents then
subtract 0 instead (``m_exp``), which keeps its terms 0 rather than ``exp(-inf + inf)``, NaN. A
padding row may see no position at all, and its ``total`` of 0 is replaced by 1 before the division
(the row is not stored). ``SOFTCAP = c`` (0.0: none) makes each scaled score ``c * tanh(score /
c)`` before the masks (Gemma 2), with ``tanh(x) = 2 * sigmoid(2x) - 1``, as Triton's interpreter
has no ``tanh``. Each value compiles a kernel of its own.

Invariants the launcher guarantees: ``query_start_loc`` starts at 0 and never decreases, each
``query_len = query_start_loc[b + 1] - query_start_loc[b]`` is at most ``seq_lens[b]``, and the
first ``ceil(seq_lens[b] / BLOCK_SIZE)`` entries of row ``b`` are block ids of the cache (the others
are never read, so padding may hold anything; with a window, neither are those before the window's
first block). A program whose tile starts at or past its sequence's query tokens returns at once (a
sequence with 0 query tokens has no work). Without a window every row, padding included, sees
position 0 (``query_pos >= 0``) in the first block the loop visits, so ``m`` is finite after it;
with one, every real row sees its own position, in a block of the loop, so its ``total`` ends
positive. ``GROUP * QUERY_TILE``, ``BLOCK_SIZE`` and ``HEAD_DIM`` are rounded up to powers of two
(``*_PADDED``, as ``tl.arange`` requires) and the padding is masked; padding rows (past ``GROUP *
QUERY_TILE``, or past the sequence's query tokens) are computed but never stored.
"""

from paged_kv.attention.triton_language import tl


def paged_attention_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim), the query's dtype
    query_ptr,  # (num_tokens, num_heads, head_dim): every sequence's query tokens, packed in order
    k_cache_ptr,  # (num_blocks, num_kv_heads, block_size, head_dim), any strides
    v_cache_ptr,  # the same axes as k_cache, its own strides
    block_tables_ptr,  # (batch, max_blocks), integer block ids
    seq_lens_ptr,  # (batch,): the tokens each sequence holds, its query tokens included
    query_start_loc_ptr,  # (batch + 1,): sequence b's query tokens are rows [b] .. [b + 1] - 1
    scale,
    out_stride_token,
    out_stride_head,
    out_stride_dim,
    q_stride_token,
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
    QUERY_TILE: tl.constexpr,  # query tokens per program
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS_PADDED: tl.constexpr,  # QUERY_TILE * GROUP, BLOCK_SIZE and HEAD_DIM rounded up to powers of two
    BLOCK_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,  # W > 0: a query at position p sees p - W + 1 .. p only; 0: none
    SOFTCAP: tl.constexpr = 0.0,  # c > 0: each score s becomes c * tanh(s / c) (Gemma 2); 0.0: none
):
    """Program ``(seq, kv_head, tile)``: query tokens ``tile * QUERY_TILE ...`` of sequence ``seq``,
    for query heads ``kv_head * GROUP ...``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    rows = tl.arange(0, ROWS_PADDED)  # (query token, query head) pairs, GROUP heads per token
    slots = tl.arange(0, BLOCK_PADDED)  # offsets within a block
    dims = tl.arange(0, HEAD_DIM_PADDED)

    query_start = tl.load(query_start_loc_ptr + seq)  # the sequence's first row of the packed batch
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile * QUERY_TILE >= query_len:  # the sequence has no query token in this tile
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # the tokens before the query tokens, cached by earlier steps
    token = tile * QUERY_TILE + rows // GROUP  # which query token of the sequence each row is
    heads = kv_head * GROUP + rows % GROUP
    query_pos = context_len + token  # its position in the sequence
    real = ((rows < QUERY_TILE * GROUP) & (token < query_len))[:, None] & (dims < HEAD_DIM)[None, :]

    q_ptrs = (
        query_ptr
        + (query_start + token)[:, None] * q_stride_token
        + heads[:, None] * q_stride_head
        + dims[None, :] * q_stride_dim
    )
    q = tl.load(q_ptrs, mask=real, other=0.0).to(tl.float32)  # (rows, dim)
    table_row = block_tables_ptr + seq * table_stride_seq
    kv_len = tl.minimum(context_len + (tile + 1) * QUERY_TILE, seq_len)  # what the tile's last token sees
    first_block = 0  # the first logical block the tile's queries see: causal, block 0
    if SLIDING_WINDOW > 0:  # in a window, the block of the first position the tile's first token sees;
        # the blocks before it are never loaded, and may hold anything (an engine's null block, say)
        first_block = tl.maximum(context_len + tile * QUERY_TILE - SLIDING_WINDOW + 1, 0) // BLOCK_SIZE

    m = tl.full((ROWS_PADDED,), float("-inf"), dtype=tl.float32)  # running maximum score
    total = tl.zeros((ROWS_PADDED,), dtype=tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((ROWS_PADDED, HEAD_DIM_PADDED), dtype=tl.float32)  # running sum of weights * V
    for j in range(first_block, tl.cdiv(kv_len, BLOCK_SIZE)):  # the logical blocks the tile's queries see
        block = tl.load(table_row + j * table_stride_entry).to(tl.int64)  # physical block id
        kv_pos = j * BLOCK_SIZE + slots  # the positions the block's slots hold
        # Slots at or past the sequence's length (the tail of the last block) hold no token.
        live = (slots < BLOCK_SIZE) & (kv_pos < seq_len)
        loaded = live[:, None] & (dims < HEAD_DIM)[None, :]  # (slot, dim)
        k_ptrs = (
            k_cache_ptr
            + block * k_stride_block
            + kv_head * k_stride_head
            + slots[:, None] * k_stride_slot
            + dims[None, :] * k_stride_dim
        )
        k = tl.load(k_ptrs, mask=loaded, other=0.0).to(tl.float32)  # (slot, dim)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (rows, slot)
        if SOFTCAP > 0:  # Gemma 2's soft cap, SOFTCAP * tanh(scores / SOFTCAP); tanh(x) = 2 * sigmoid(2x) - 1
            scores = SOFTCAP * (2 * tl.sigmoid(2 * scores / SOFTCAP) - 1)
        # Causal: a query sees the live positions up to its own, itself included.
        visible = live[None, :] & (kv_pos[None, :] <= query_pos[:, None])
        if SLIDING_WINDOW > 0:  # and, in a window, the last SLIDING_WINDOW of them only
            visible = visible & (kv_pos[None, :] > query_pos[:, None] - SLIDING_WINDOW)
        scores = tl.where(visible, scores, float("-inf"))

        # Without a window every row sees position 0 in the first block: m_new is finite from then on.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_exp = m_new  # what the exponents subtract
        if SLIDING_WINDOW > 0:  # in a window, a row whose window starts in a later block sees nothing
            # here: its m_new is still -inf, and exp(-inf - -inf) is NaN; subtracting 0 keeps its terms 0
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - m_exp)  # what the earlier blocks' terms shrink by; 0 on the first
        weights = tl.exp(scores - m_exp[:, None])  # (rows, slot), 0 where not visible
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

    if SLIDING_WINDOW > 0:  # a padding row may see nothing at all in a window: spare it 0 / 0 (never stored)
        total = tl.where(total > 0, total, 1.0)
    out_ptrs = (
        out_ptr
        + (query_start + token)[:, None] * out_stride_token
        + heads[:, None] * out_stride_head
        + dims[None, :] * out_stride_dim
    )
    tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=real)

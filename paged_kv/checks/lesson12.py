"""Checks of exercise 12: the paged attention kernel, in Triton, run by Triton on the learner's function.

The learner writes ``paged_attention_kernel``, a plain function in Triton's language with the
arguments of :func:`paged_kv.attention.triton_kernel.paged_attention_kernel`: one kernel for a
packed batch of decodes, prompts and chunks of prompts, causal inside each sequence. The check
launches it the way the package launches its own, through
:func:`paged_kv.attention.triton_decode.triton_attention`, which applies ``triton.jit`` to it on first
use (compiled on CUDA, in Triton's interpreter on the CPU: :mod:`paged_kv.attention.triton_language`
fixes the mode), and compares its output with the ``GATHER`` backend of ``paged_prefill_attention``,
from one decode in one block to a packed step of decodes, a prompt, a chunk and a sequence with no
query token, with grouped-query attention and vLLM's cache layout. Sizes stay small: the
interpreter runs each program in numpy. (The task keeps its first id, ``12.paged_decode_kernel``,
from when the kernel served decodes only.)

The K and V caches of every case are views into a larger buffer, one block of stale data before
and after them, and each row of the block table has one entry more than the longest sequence
needs: a kernel that reads one slot or one entry too far still reads memory of the case, the same
on every run, and a wrong output is compared, not a crash reported. The slots of each sequence's
last block past its last token hold no token: from the second of them on they hold NaN, and in one
case (the last) the first of them too, so a kernel that loads the whole tail and one that loads one
slot too many fail on different cases (a zero weight does not cancel NaN: ``0 * NaN`` is NaN). The
output tensor is filled with NaN before the launch, so a row the kernel never stores shows.

When an output is wrong, the check runs the package's kernel with one classic mistake written into
its source (:func:`mistaken`) on the same case, and names the mistake whose output the learner's
matches there and on a chunk after cached tokens (:data:`DISCRIMINATOR`): one case may not tell two
mistakes apart (a decode cannot tell a query that misses its own token from a sequence whose last
token is never loaded), the two together do. The mistakes: the key positions off by one in the live
mask, a live mask written ``<= seq_len``, the tail of the last block not masked, the block loop one
block short (``tl.cdiv(kv_len, BLOCK_SIZE) - 1``, or ``kv_len // BLOCK_SIZE``), K or V addressed one
slot after or before its own, the running maximum not rescaled, a query head reading the wrong KV
head, a block id read from the wrong row; and those of several query tokens: the causal mask leaving
out the query's own token (``<`` for ``<=``) or missing, a query's position counted from 0 instead
of from ``context_len = seq_len - query_len``, a query read from the wrong row of the packed batch,
a row's token and head swapped, every tile computing the first tile's tokens.

A block loop one block too long (``tl.cdiv(kv_len, BLOCK_SIZE) + 1``) leaves the output as it is:
the extra block has no slot any query sees, so ``m``, ``total`` and ``acc`` do not change. It reads
an entry of the table past the sequence's blocks, though, which may hold anything. In Triton's
interpreter the check records the addresses the learner's kernel loads (:func:`table_reads`) and
expects, on every case, reads of entries ``j < ceil(seq_lens[b] / BLOCK_SIZE)`` of row ``b``
only. Compiled (CUDA), a kernel's loads cannot be seen from Python, nor interpreted on CUDA
tensors (their host copies are read): there that expectation is skipped (:func:`loads_seen`).

A program that stores a row outside its own tile (its real rows: ``r < QUERY_TILE * GROUP`` and
``token < query_len``, a mask written ``<=`` breaks either) may leave the output right too: Triton's
interpreter runs the programs one after another, grid order, so the program that owns the row runs
later and overwrites it (on a GPU they run at once and race). In the interpreter the check records
the rows and heads each program stores (:func:`stored_addresses`) and expects its own only; one case
has 3 query heads per KV head, so that a tile's rows (15) are padded (to 16) and ``rows <=`` shows.
On any device it expects the stale rows around the output unchanged (:func:`output_for`): a row
stored past the batch's first or last lands there.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
from collections.abc import Callable, Iterator

import torch

from paged_kv.attention.paged import paged_prefill_attention
from paged_kv.checks._core import Checker, task
from paged_kv.checks.lesson05 import TOL, _problem, _randn, _scattered, _shape

OFF_BY_ONE = (
    "a token's position is off by one in the live mask: slot s of logical block j holds position "
    "kv_pos = j * BLOCK_SIZE + s, and it is live when kv_pos < seq_len, so the sequence's last token, "
    "at seq_len - 1, is live (kv_pos + 1 < seq_len leaves it out)"
)
LIVE_TO_SEQ_LEN = (
    "the live mask lets in one slot too many: kv_pos <= seq_len loads the slot at position seq_len, "
    "the first past the sequence, which holds no token (here NaN: a zero weight does not cancel it, "
    "0 * NaN is NaN); a slot is live when kv_pos < seq_len"
)
NO_TAIL_MASK = (
    "the tail of the last block is not masked: its slots at or past seq_len hold no token (stale data, "
    "here NaN: a zero weight does not cancel it, 0 * NaN is NaN); load only the live slots, "
    "(slots < BLOCK_SIZE) & (kv_pos < seq_len)"
)
LOOP_ROUNDS_DOWN = (
    "the block loop stops one block short when the last block it needs is partly full: kv_len // "
    "BLOCK_SIZE rounds down; loop over range(0, tl.cdiv(kv_len, BLOCK_SIZE)), every block the tile's "
    "queries see"
)
LOOP_ONE_SHORT = (
    "the block loop stops one block short: range(0, tl.cdiv(kv_len, BLOCK_SIZE) - 1) skips the "
    "last block (range already stops before its end): loop over range(0, tl.cdiv(kv_len, BLOCK_SIZE))"
)
LOOP_ONE_LONG = (
    "the block loop runs one block too many: past the blocks the tile's queries see it reads the next "
    "entry of the sequence's row, for the last tile entry ceil(seq_len / BLOCK_SIZE), past the sequence's "
    "blocks (padding, which may hold anything); loop over range(0, tl.cdiv(kv_len, BLOCK_SIZE)), not "
    "tl.cdiv(kv_len, BLOCK_SIZE) + 1 (nor kv_len // BLOCK_SIZE + 1, one too many when the last block is full)"
)


def _slot_off(k_or_v: str, sign: str) -> str:
    """The hint of K or V addressed one slot after (``sign`` ``"+"``) or before (``"-"``) its own."""
    stride = f"{k_or_v.lower()}_stride_slot"
    return (
        f"{k_or_v} is read one slot {'after' if sign == '+' else 'before'} its own: the offset of slot s "
        f"is s * {stride} (slots[:, None] * {stride}), not (s {sign} 1) * {stride}"
    )


K_SLOT_AFTER, K_SLOT_BEFORE = _slot_off("K", "+"), _slot_off("K", "-")
V_SLOT_AFTER, V_SLOT_BEFORE = _slot_off("V", "+"), _slot_off("V", "-")
NOT_RESCALED = (
    "the running maximum is not rescaled: when a block raises m, multiply the running total and acc "
    "by exp(m_old - m_new) before adding the block's terms"
)
WRONG_KV_HEAD = (
    "a query head reads the wrong KV head: program (seq, kv_head, tile) handles query heads kv_head * "
    "GROUP + 0 .. GROUP - 1 (query head q reads KV head q // GROUP, not q % num_kv_heads)"
)
WRONG_ROW = (
    "a block id is read from the wrong row of the table: sequence seq's row starts at "
    "block_tables_ptr + seq * table_stride_seq, and entry j is table_stride_entry further"
)
OWN_TOKEN_UNSEEN = (
    "the causal mask leaves out the query's own token: a query at position query_pos sees positions "
    "0 .. query_pos, itself included, so a slot is visible when kv_pos <= query_pos (not <, and kv_pos "
    "is j * BLOCK_SIZE + slots, not + 1)"
)
NOT_CAUSAL = (
    "the causal mask is missing: a query token of a prompt or a chunk sees the tokens after it too; a "
    "live slot is visible to a row only when kv_pos <= query_pos, the row's own position"
)
POSITION_FROM_ZERO = (
    "a query's position is counted from 0: query token i of a sequence sits at position context_len + "
    "i, after the context_len = seq_len - query_len tokens cached before it (a decode's one token at "
    "seq_len - 1), not at i"
)
WRONG_QUERY_ROW = (
    "a query is read from the wrong row of the packed batch: sequence seq's query tokens are rows "
    "query_start .. query_start + query_len - 1 of query (query_start = query_start_loc[seq]), so its "
    "token i is row query_start + i, not row i"
)
ROWS_SWAPPED = (
    "a row's query token and query head are swapped: row r of a program is query token tile * "
    "QUERY_TILE + r // GROUP and query head kv_head * GROUP + r % GROUP (the GROUP heads of one token "
    "are neighbouring rows)"
)
FIRST_TILE_ONLY = (
    "every tile computes the sequence's first query tokens: program (seq, kv_head, tile) takes tokens "
    "tile * QUERY_TILE + r // GROUP (not r // GROUP), so that every token of a prompt longer than one "
    "tile is computed"
)
ROWS_OUTSIDE_TILE = (
    "a program writes rows outside its own tile: program (seq, kv_head, tile) owns only its real rows, "
    "r < QUERY_TILE * GROUP and token < query_len (both <, not <=), each stored at row query_start + token "
    "and query head kv_head * GROUP + r % GROUP; mask the store like the queries. Triton's interpreter runs "
    "the programs one after another, so the program that owns such a row may overwrite the damage and the "
    "output looks right; on a GPU the programs run at once and race, and a row holds whichever program "
    "wrote last"
)
DEFAULT_HINT = (
    "follow the package's order: program ids, the sequence's first query row and query length, each "
    "row's token, head and position, the queries, then for each logical block j its block id, the live "
    "slots, K, the scores and the causal mask, the online-softmax update, V; at the end store acc / total"
)

LIVE = "live = (slots < BLOCK_SIZE) & (kv_pos < seq_len)"
CAUSAL = "kv_pos[None, :] <= query_pos[:, None]"
LOOP = "tl.cdiv(kv_len, BLOCK_SIZE)"

#: Each classic mistake as edits ``(old, new)`` of the package kernel's source, and the hint naming it.
#: Where two mistakes give the same output on a case and on :data:`DISCRIMINATOR`, the first wins:
#: the narrower mistake comes first (``//`` is short only when the last block is partly full,
#: ``- 1`` always, so a kernel short on a case whose full blocks it got right rounds down).
MISTAKES = (
    (((LIVE, "live = (slots < BLOCK_SIZE) & (kv_pos + 1 < seq_len)"),), OFF_BY_ONE),
    (((LIVE, "live = (slots < BLOCK_SIZE) & (kv_pos <= seq_len)"),), LIVE_TO_SEQ_LEN),
    (((LIVE, "live = slots < BLOCK_SIZE"),), NO_TAIL_MASK),
    (((LOOP, "kv_len // BLOCK_SIZE"),), LOOP_ROUNDS_DOWN),
    (((LOOP, f"{LOOP} - 1"),), LOOP_ONE_SHORT),
    *(
        (((f"slots[:, None] * {x}_stride_slot", f"(slots[:, None] {sign} 1) * {x}_stride_slot"),), hint)
        for x, sign, hint in (
            ("k", "+", K_SLOT_AFTER),
            ("k", "-", K_SLOT_BEFORE),
            ("v", "+", V_SLOT_AFTER),
            ("v", "-", V_SLOT_BEFORE),
        )
    ),
    (
        (("total = total * rescale +", "total = total +"), ("acc = acc * rescale[:, None] +", "acc = acc +")),
        NOT_RESCALED,
    ),
    (
        (
            (
                "heads = kv_head * GROUP + rows % GROUP",
                "heads = kv_head + (rows % GROUP) * tl.num_programs(1)",
            ),
        ),
        WRONG_KV_HEAD,
    ),
    ((("seq * table_stride_seq", "seq * table_stride_entry"),), WRONG_ROW),
    (((CAUSAL, "kv_pos[None, :] < query_pos[:, None]"),), OWN_TOKEN_UNSEEN),
    ((("scores = tl.where(visible,", "scores = tl.where(live[None, :],"),), NOT_CAUSAL),
    ((("query_pos = context_len + token", "query_pos = token"),), POSITION_FROM_ZERO),
    (
        (("query_ptr\n        + (query_start + token)[:, None]", "query_ptr\n        + token[:, None]"),),
        WRONG_QUERY_ROW,
    ),
    (
        (
            ("token = tile * QUERY_TILE + rows // GROUP", "token = tile * QUERY_TILE + rows % GROUP"),
            ("heads = kv_head * GROUP + rows % GROUP", "heads = kv_head * GROUP + rows // GROUP"),
        ),
        ROWS_SWAPPED,
    ),
    ((("token = tile * QUERY_TILE + rows // GROUP", "token = rows // GROUP"),), FIRST_TILE_ONLY),
)


def mistaken(*edits: tuple[str, str]) -> Callable:
    """The package's ``paged_attention_kernel`` with a mistake: each ``old`` of ``edits`` in its source
    replaced by its ``new``.

    The edited source is registered in :mod:`linecache`, so Triton (which reads a kernel's source)
    sees it as the function's own.
    """
    from paged_kv.attention import triton_kernel

    source = inspect.getsource(triton_kernel.paged_attention_kernel)
    for old, new in edits:
        if old not in source:
            raise ValueError(f"{old!r} is not in the source of paged_attention_kernel")
        source = source.replace(old, new)
    filename = f"<paged_attention_kernel with {edits!r}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(vars(triton_kernel))
    exec(compile(source, filename, "exec"), namespace)
    return namespace["paged_attention_kernel"]


def launch(
    kernel: Callable,
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_lens,
    query_start_loc=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernel`` launched by the package's launcher on a packed batch, into an output filled with
    NaN (a row the kernel never stores stays NaN); an error in it is raised as itself (the
    interpreter wraps it in an ``InterpreterError``), so a stub's ``NotImplementedError`` stays one.
    Compiled, a kernel cannot raise: a stub is recognised by its ``raise NotImplementedError``.
    ``query_start_loc`` defaults to ``0`` then the running sum of ``query_lens``; ``out`` to
    :func:`output_for` the query."""
    from triton.runtime.errors import InterpreterError

    from paged_kv.attention.triton_decode import triton_attention, triton_interpreted

    if not triton_interpreted() and "NotImplementedError" in kernel.__code__.co_names:
        raise NotImplementedError("paged_attention_kernel still raises NotImplementedError: write its body")
    if query_start_loc is None:
        query_start_loc = torch.nn.functional.pad(torch.cumsum(query_lens, 0), (1, 0))
    max_query_len = int(query_lens.max())
    out = output_for(query) if out is None else out
    try:
        return triton_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, None, kernel, out
        )
    except InterpreterError as error:
        if error.__cause__ is None:
            raise
        raise error.__cause__ from None


def _guarded(memory: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of ``memory`` in the middle of a buffer one block longer on each side, those two blocks
    stale random data: a kernel that reads one slot before block 0 or after the last block reads
    them, in bounds and the same on every run."""
    shape = (memory.shape[0] + 2, *memory.shape[1:])
    buffer = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    buffer = buffer.to(device=memory.device, dtype=memory.dtype)
    buffer[1:-1] = memory
    return buffer[1:-1]


#: The rows of stale data before and after a case's query and output: a row index or a head off by
#: up to a program's rows (32) still lands in memory of the case.
MARGIN = 32


def _between_rows(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of ``tensor`` (its rows along axis 0) in the middle of a buffer :data:`MARGIN` rows
    longer on each side, of stale random data: a kernel that reads or writes a query row or head
    out of range stays in bounds."""
    buffer = torch.randn(
        (tensor.shape[0] + 2 * MARGIN, *tensor.shape[1:]), generator=torch.Generator().manual_seed(seed)
    )
    buffer = buffer.to(device=tensor.device, dtype=tensor.dtype)
    buffer[MARGIN:-MARGIN] = tensor
    return buffer[MARGIN:-MARGIN]


def output_for(query: torch.Tensor) -> torch.Tensor:
    """The output tensor a kernel writes: the query's shape and dtype, filled with NaN (a row the
    kernel never stores stays NaN), between :data:`MARGIN` rows of stale data (:func:`_between_rows`):
    a row stored past the batch's first or last lands there, in bounds."""
    return _between_rows(torch.full_like(query, float("nan")), seed=0)


def _case(seq_lens, query_lens, block_size, num_kv_heads, group, seed, layout, first_unwritten_nan=False):
    """Inputs of one case, ``(query, k_cache, v_cache, block_tables, seq_lens, query_lens)``, and the
    expected output: scattered blocks of stale data, ``sum(query_lens)`` packed query rows of
    ``num_kv_heads * group`` heads.

    The K and V caches are views into buffers with a guard block of stale data before and after
    (:func:`_guarded`), the query lies between rows of stale data (:func:`_between_rows`), and the
    block table has one column of padding (``-1``) past the longest sequence's blocks: a kernel that
    reads one slot, one table entry or a query row too far stays in bounds.
    ``layout`` ``"vllm"`` copies the cache into vLLM 0.33.0's default layout of one layer,
    ``(num_blocks, block_size, num_kv_heads, 2 * head_size)`` in memory (K and V side by side), and
    passes the K and V halves of its heads-first view, read through their strides. The expected
    output is the GATHER backend's on the clean cache; then the slots of each last block past its
    sequence's last token get NaN from the second on (from the first with ``first_unwritten_nan``).
    """
    head_dim = 8
    cache = _scattered(seq_lens, block_size, num_kv_heads, head_dim, seed=1000 + seed)
    if layout == "vllm":
        memory = torch.cat([cache.k_cache, cache.v_cache], dim=-1).transpose(1, 2)
        view = _guarded(memory, seed=3000 + seed).transpose(1, 2)
        k_cache, v_cache = view[..., :head_dim], view[..., head_dim:]
    else:
        k_cache, v_cache = (
            _guarded(cache.k_cache, seed=3000 + seed),
            _guarded(cache.v_cache, seed=4000 + seed),
        )
    query = _between_rows(
        _randn(sum(query_lens), num_kv_heads * group, head_dim, seed=2000 + seed), 5000 + seed
    )
    tables = torch.nn.functional.pad(cache.block_tables_tensor(range(len(seq_lens))), (0, 1), value=-1)
    lens = torch.tensor(seq_lens, device=query.device)
    new = torch.tensor(query_lens, device=query.device)
    inputs = (query, k_cache, v_cache, tables, lens, new)
    expected = paged_prefill_attention(*inputs, backend="GATHER")
    for row, length in enumerate(seq_lens):
        first = length % block_size + (0 if first_unwritten_nan else 1)  # the tail's slots from there
        if length % block_size and first < block_size:
            last_block = int(tables[row, -(-length // block_size) - 1])
            for cache_tensor in (k_cache, v_cache):
                cache_tensor[last_block, :, first:] = float("nan")
    return inputs, expected


def loads_seen(device: torch.device) -> bool:
    """Whether :func:`loaded_addresses` sees the loads of kernels launched on ``device``'s tensors:
    in Triton's interpreter, on the CPU (the interpreter runs CUDA tensors on host copies of them;
    compiled, a kernel's loads happen on the GPU, out of Python's sight)."""
    from paged_kv.attention.triton_decode import triton_interpreted

    return triton_interpreted() and device.type == "cpu"


@contextlib.contextmanager
def loaded_addresses(start: int = 0, end: int = 2**64) -> Iterator[list[int]]:
    """The addresses in ``[start, end)`` that kernels launched in the block load, recorded in
    Triton's interpreter (where :func:`loads_seen`), in the order loaded, repeats included.

    The interpreter runs every ``tl.load`` as ``interpreter_builder.create_masked_load(ptrs, mask,
    ...)``, ``ptrs`` holding addresses in the tensors' own memory on the CPU (a tensor argument is
    its ``data_ptr()``, the address of its first element); the lanes where ``mask`` holds are read.
    The list is filled when the block ends.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    own = vars(builder).get("create_masked_load")
    load = builder.create_masked_load
    batches: list = []

    def recording_load(ptrs, mask, *args, **kwargs):
        loaded = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
        batches.append(loaded[(loaded >= start) & (loaded < end)])
        return load(ptrs, mask, *args, **kwargs)

    addresses: list[int] = []
    builder.create_masked_load = recording_load
    try:
        yield addresses
    finally:
        if own is None:
            del builder.create_masked_load
        else:
            builder.create_masked_load = own
        addresses.extend(int(address) for batch in batches for address in batch)


@contextlib.contextmanager
def table_reads(block_tables: torch.Tensor) -> Iterator[set[tuple[int, int]]]:
    """The entries ``(row, entry)`` of ``block_tables`` (on the CPU, its last axis contiguous) that
    kernels launched in the block load (:func:`loaded_addresses`); the set is filled when it ends.

    The entry ``index`` elements past the table's first is ``divmod(index, block_tables.stride(0))``.
    """
    start, size, row = block_tables.data_ptr(), block_tables.element_size(), block_tables.stride(0)
    read: set[tuple[int, int]] = set()
    addresses: list[int] = []
    try:
        with loaded_addresses(start, start + block_tables.shape[0] * row * size) as addresses:
            yield read
    finally:
        read.update(divmod((address - start) // size, row) for address in addresses)


@contextlib.contextmanager
def stored_addresses(start: int = 0, end: int = 2**64) -> Iterator[list[tuple[tuple[int, int, int], int]]]:
    """The addresses in ``[start, end)`` that kernels launched in the block store to, each with the
    program that stored it (its grid index ``(x, y, z)``), recorded in Triton's interpreter (where
    :func:`loads_seen`): it runs the programs one at a time and every ``tl.store`` as
    ``interpreter_builder.create_masked_store(ptrs, value, mask, ...)``, the builder's ``grid_idx``
    the program running. The list is filled when the block ends."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    own = vars(builder).get("create_masked_store")
    store = builder.create_masked_store
    batches: list = []

    def recording_store(ptrs, value, mask, *args, **kwargs):
        stored = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
        batches.append((tuple(builder.grid_idx), stored[(stored >= start) & (stored < end)]))
        return store(ptrs, value, mask, *args, **kwargs)

    stores: list[tuple[tuple[int, int, int], int]] = []
    builder.create_masked_store = recording_store
    try:
        yield stores
    finally:
        if own is None:
            del builder.create_masked_store
        else:
            builder.create_masked_store = own
        stores.extend((program, int(address)) for program, batch in batches for address in batch)


def _row_owner(row: int, query_lens: list[int], query_tile: int) -> str:
    """Whose row of the packed batch ``row`` is: a sequence's query token and its tile, or the
    stale rows before or after the batch."""
    starts = [sum(query_lens[:b]) for b in range(len(query_lens) + 1)]
    if row < 0:
        return "before the batch's first row"
    if row >= starts[-1]:
        return f"past the batch's last row, {starts[-1] - 1}"
    seq = max(b for b in range(len(query_lens)) if starts[b] <= row)
    token = row - starts[seq]
    return f"sequence {seq}'s query token {token}, tile {token // query_tile}"


def _stray_writes(
    out: torch.Tensor, stores: list[tuple[tuple[int, int, int], int]], query_lens: list[int], group: int
) -> str | None:
    """What ``stores`` (:func:`stored_addresses` into ``out`` and the :data:`MARGIN` rows around it)
    wrote outside the storing program's own rows, the first such program's writes described, or
    ``None``: program ``(seq, kv_head, tile)`` owns rows ``query_start + token`` of its tile's tokens
    ``token < query_len``, query heads ``kv_head * group ..``."""
    from paged_kv.attention.triton_decode import query_tile_for

    query_tile = query_tile_for(max(query_lens), group)
    size, row_stride, head_stride = out.element_size(), out.stride(0), out.stride(1)
    starts = [sum(query_lens[:b]) for b in range(len(query_lens))]
    stray: dict[tuple[int, int, int], dict[int, set[int]]] = {}
    for (seq, kv_head, tile), address in stores:
        row, within = divmod((address - out.data_ptr()) // size, row_stride)
        head = within // head_stride
        token = row - starts[seq]
        own_token = tile * query_tile <= token < min((tile + 1) * query_tile, query_lens[seq])
        if not (own_token and kv_head * group <= head < (kv_head + 1) * group):
            stray.setdefault((seq, kv_head, tile), {}).setdefault(row, set()).add(head)
    if not stray:
        return None
    (seq, kv_head, tile), rows = min(stray.items())
    first, last = starts[seq] + tile * query_tile, starts[seq] + min((tile + 1) * query_tile, query_lens[seq])
    heads = f"{kv_head * group}" if group == 1 else f"{kv_head * group}:{(kv_head + 1) * group}"
    written = "; ".join(
        f"row {row}, head {', '.join(map(str, sorted(heads_of)))} ({_row_owner(row, query_lens, query_tile)})"
        for row, heads_of in sorted(rows.items())[:4]
    )
    others = f", and {len(stray) - 1} other program(s) likewise" if len(stray) > 1 else ""
    return (
        f"program (seq={seq}, kv_head={kv_head}, tile={tile}), whose rows are out[{first}:{last}, {heads}], "
        f"also wrote {written}{others}"
    )


def _margins(out: torch.Tensor) -> torch.Tensor:
    """A copy of the :data:`MARGIN` rows of stale data before and after ``out`` (:func:`output_for`)."""
    buffer = out._base
    return torch.cat([buffer[:MARGIN], buffer[-MARGIN:]]).clone()


def _margin_writes(out: torch.Tensor, before: torch.Tensor, query_lens: list[int]) -> str | None:
    """The stale rows around ``out`` that a launch changed (``before``: :func:`_margins` before it),
    described, or ``None``: seen on any device, where a kernel's stores cannot be."""
    changed = (_margins(out) != before).flatten(1).any(dim=1).tolist()
    rows = [
        index - MARGIN if index < MARGIN else len(out) + index - MARGIN
        for index, c in enumerate(changed)
        if c
    ]
    if not rows:
        return None
    where = ", ".join(f"row {row} ({_row_owner(row, query_lens, 1)})" for row in rows[:4])
    return f"some program wrote {where}, outside every program's rows"


CASES = (  # what the case adds, seq_lens, query_lens, block_size, num_kv_heads, group, layout
    ("one decode: one sequence, one query token, one full block, one head", [4], [1], 4, 1, 1, "course"),
    ("a last block only partly full", [6], [1], 4, 1, 1, "course"),
    ("several scattered blocks", [13], [1], 4, 1, 1, "course"),
    (
        "a batch of decodes: each sequence has its own row of the table",
        [8, 7, 6],
        [1, 1, 1],
        4,
        1,
        1,
        "course",
    ),
    ("grouped-query attention, 2 query heads per KV head", [7, 4], [1, 1], 4, 2, 2, "course"),
    ("vLLM v1's cache layout, read through its strides", [10, 3], [1, 1], 8, 2, 2, "vllm"),
    ("a fresh prompt: each query token sees the tokens up to its own", [6], [6], 4, 1, 1, "course"),
    ("a chunk after 7 cached tokens: its query token i is at position 7 + i", [10], [3], 4, 1, 1, "course"),
    (
        "a prompt longer than one tile of query tokens (8 here, with 2 query heads per KV head)",
        [10],
        [10],
        4,
        1,
        2,
        "course",
    ),
    (
        "a packed step: decodes, a prompt, a chunk and a sequence with no query token, 2 query heads",
        [6, 5, 10, 1, 3],
        [1, 5, 3, 1, 0],
        4,
        1,
        2,
        "course",
    ),
    (
        "3 query heads per KV head: a tile of 5 query tokens is 15 rows, padded to 16",
        [12],
        [12],
        4,
        1,
        3,
        "course",
    ),
    ("the slot right after each sequence's last token holds NaN too", [7, 5, 3], [1, 2, 3], 4, 1, 2, "vllm"),
)
#: The case a mistake that matches a learner's output is tried on again, to tell apart mistakes
#: that one case cannot (a chunk after cached tokens, its last block's tail NaN from the second slot).
DISCRIMINATOR = 7


class _Close:
    """A kernel's output, equal to another when close to it: how a mistake's output is recognised."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Close) and torch.allclose(self.tensor, other.tensor, equal_nan=True, **TOL)


@functools.cache
def _mistakes() -> list[tuple[Callable, str]]:
    return [(mistaken(*edits), hint) for edits, hint in MISTAKES]


@functools.cache
def _inputs(case: int):
    """Case ``case``'s inputs and expected output (made once per process: the interpreter is slow)."""
    _, seq_lens, query_lens, block_size, num_kv_heads, group, layout = CASES[case]
    return _case(seq_lens, query_lens, block_size, num_kv_heads, group, case, layout, case == len(CASES) - 1)


@functools.cache
def _mistake_output(mistake: int, case: int) -> _Close | None:
    """Mistake ``mistake``'s output on case ``case`` (``None`` when it cannot run there), computed
    once per process: the check of one kernel after another meets the same mistakes again."""
    try:
        return _Close(launch(_mistakes()[mistake][0], *_inputs(case)[0]))
    except Exception:  # this mistake cannot even run on the case: it is not the learner's
        return None


def _diagnose(kernel: Callable, case: int) -> str:
    """The hint of the first mistake whose output equals ``kernel``'s on case ``case`` and on
    :data:`DISCRIMINATOR` (the first that matches on ``case`` alone, when none matches on both);
    :data:`DEFAULT_HINT` when none matches, or when ``kernel`` raises."""

    @functools.cache
    def learner(on: int) -> _Close | None:
        try:
            return _Close(launch(kernel, *_inputs(on)[0]))
        except Exception:  # the learner's bug; the case at hand reports it
            return None

    if learner(case) is None:
        return DEFAULT_HINT
    alone = None
    for mistake, (_, hint) in enumerate(_mistakes()):
        if _mistake_output(mistake, case) != learner(case):
            continue
        if case == DISCRIMINATOR or learner(DISCRIMINATOR) is None:
            return hint
        if _mistake_output(mistake, DISCRIMINATOR) == learner(DISCRIMINATOR):
            return hint
        alone = alone or hint
    return alone or DEFAULT_HINT


@task("12.paged_decode_kernel", "the paged attention kernel, in Triton", needs=("paged_attention_kernel",))
def _paged_attention_kernel(c: Checker, paged_attention_kernel) -> None:
    """Per case, the output, then (interpreted, on the CPU: :func:`loads_seen`) the table entries read:
    those of the sequence's own blocks only, which a block loop one block too long oversteps."""
    from paged_kv.attention.triton_decode import query_tile_for
    from paged_kv.attention.triton_language import MISSING

    c.holds("import triton.language as tl", not MISSING, "triton, importable", MISSING, "use Linux (or WSL)")
    for case, (what, seq_lens, query_lens, block_size, num_kv_heads, group, _) in enumerate(CASES):
        inputs, expected = _inputs(case)
        query, _, _, tables, _, _ = inputs
        tiles = -(-max(query_lens) // query_tile_for(max(query_lens), group))
        call = (
            f"paged_attention_kernel[(batch={len(seq_lens)}, num_kv_heads={num_kv_heads}, "
            f"tiles={tiles})](...)  # {what}: block_tables {tables.tolist()}, seq_lens {seq_lens}, "
            f"query_lens {query_lens}, "
            f"block_size {block_size}, {query.shape[1]} query heads"
        )
        seen = loads_seen(tables.device)
        out = output_for(query)
        margins, row_bytes = _margins(out), out.stride(0) * out.element_size()
        start, end = out.data_ptr() - MARGIN * row_bytes, out.data_ptr() + (len(out) + MARGIN) * row_bytes
        with contextlib.ExitStack() as recording:
            read = recording.enter_context(table_reads(tables)) if seen else set()
            stores = recording.enter_context(stored_addresses(start, end)) if seen else []
            got = c.run(
                call,
                lambda inputs=inputs, out=out: launch(paged_attention_kernel, *inputs, out=out),
                DEFAULT_HINT,
            )
        problem = _problem(got, expected, exact=False)
        c.holds(
            call,
            problem is None,
            f"{_shape(expected)} equal to paged_prefill_attention(..., backend='GATHER'), "
            "within atol=rtol=1e-5",
            problem,
            lambda case=case: _diagnose(paged_attention_kernel, case),
        )
        if seen:
            held = [-(-n // block_size) for n in seq_lens]
            past = sorted((row, entry) for row, entry in read if entry >= held[row])
            c.holds(
                call,
                not past,
                "reads of block_tables[b, j] for j < ceil(seq_lens[b] / block_size) only: "
                f"{', '.join(f'row {b}, j < {n}' for b, n in enumerate(held))}",
                ", ".join(f"block_tables[{row}, {entry}] read too" for row, entry in past),
                LOOP_ONE_LONG,
            )
        stray = (
            _stray_writes(out, stores, query_lens, group)
            if seen
            else _margin_writes(out, margins, query_lens)
        )
        c.holds(
            call,
            stray is None,
            "each program stores only its own rows: out[query_start + token, kv_head * GROUP + i] for its "
            "tile's tokens token < query_len and i < GROUP",
            stray,
            ROWS_OUTSIDE_TILE,
        )


# ------------------------------------------------------------------ the exercise's kernel at work


def fill_stale(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
):
    """Write NaN into every slot of ``k_cache`` and ``v_cache`` (``(num_blocks, num_kv_heads,
    block_size, head_dim)``) that holds no token of a sequence: the tail of each last block, past
    ``seq_lens[b]``, and the blocks no row of ``block_tables`` holds. A pool's memory there is stale,
    and may hold anything: a kernel that loads it gives NaN (``0 * NaN`` is NaN), where finite stale
    data is cancelled by the causal mask and hides a missing tail mask."""
    num_blocks, _, block_size, _ = k_cache.shape
    held = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for row, length in zip(block_tables.tolist(), seq_lens.tolist(), strict=True):
        for position in range(length):
            held[row[position // block_size], position % block_size] = True
    stale = ~held[:, None, :, None].to(k_cache.device)
    for cache in (k_cache, v_cache):
        cache.masked_fill_(stale, float("nan"))


def compare_with_gather(mine: torch.Tensor, gathered: torch.Tensor, query_start_loc: torch.Tensor) -> str:
    """Whether a kernel's output ``mine`` equals the GATHER backend's, within ``atol=rtol=1e-5``, and
    when not, which query tokens of which sequence are wrong and where NaN comes from (the slots
    :func:`fill_stale` filled)."""
    same = torch.allclose(mine, gathered, **TOL)
    lines = [f"your kernel equals the gather: {same}"]
    if same:
        return lines[0]
    starts = query_start_loc.tolist()
    wrong = (~torch.isclose(mine, gathered, **TOL)).flatten(1).any(dim=1).tolist()
    nan = mine.isnan().flatten(1).any(dim=1).tolist()

    def tokens(rows: list[bool]) -> str:
        parts = []
        for seq in range(len(starts) - 1):
            picked = [row - starts[seq] for row in range(starts[seq], starts[seq + 1]) if rows[row]]
            if picked:
                parts.append(f"sequence {seq}'s token{'s' * (len(picked) > 1)} {', '.join(map(str, picked))}")
        return "; ".join(parts)

    lines.append(f"  wrong{', all NaN' if nan == wrong else ''}: {tokens(wrong)}")
    if any(nan):
        if nan != wrong:
            lines.append(f"  NaN: {tokens(nan)}")
        lines.append(
            "  the slots that hold no token here (past each sequence's last token, and the blocks no "
            "sequence holds) hold NaN, as a pool's stale memory may: a kernel that loads them gives NaN, "
            "since a zero weight does not cancel it (0 * NaN is NaN). Load only the live slots, (slots < "
            "BLOCK_SIZE) & (kv_pos < seq_len), of the blocks the sequence holds"
        )
    lines.append("  run the check above: it names the mistake")
    return "\n".join(lines)

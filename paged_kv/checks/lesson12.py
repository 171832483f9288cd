"""Checks of exercise 12: the paged decode kernel, in Triton, run by Triton on the learner's function.

The learner writes ``paged_decode_kernel``, a plain function in Triton's language with the arguments
of :func:`paged_kv.attention.triton_kernel.paged_decode_kernel`. The check launches it the way the
package launches its own, through :func:`paged_kv.attention.triton_decode.triton_decode`, which
applies ``triton.jit`` to it on first use (compiled on CUDA, in Triton's interpreter on the CPU:
:mod:`paged_kv.attention.triton_language` fixes the mode), and compares its output with the gather
strategy of ``paged_attention``, from one block of one sequence to a batch of scattered tables with
grouped-query attention and vLLM's cache layout. Sizes stay small: the interpreter
runs each program in numpy.

The K and V caches of every case are views into a larger buffer, one block of stale data before
and after them, and each row of the block table has one entry more than the longest sequence
needs: a kernel that reads one slot or one entry too far still reads memory of the case, the same
on every run, and a wrong output is compared, not a crash reported.

When an output is wrong, the check runs the package's kernel with one classic mistake written into
its source (:func:`mistaken`) on the same case, and names the mistake whose output the learner's
matches: a token position off by one, a live mask written ``<= context_len``, the tail of the last
block not masked, the block loop one block short (``tl.cdiv(context_len, BLOCK_SIZE) - 1``, or
``context_len // BLOCK_SIZE``), K or V addressed one slot after or before its own, the running
maximum not rescaled, a query head reading the wrong KV head, a block id read from the wrong row.

A block loop one block too long (``tl.cdiv(context_len, BLOCK_SIZE) + 1``) leaves the output as it
is: the extra block has no live slot, so ``m``, ``total`` and ``acc`` do not change. It reads an
entry of the table past the sequence's blocks, though, which may hold anything. In Triton's
interpreter the check records the addresses the learner's kernel loads (:func:`table_reads`) and
expects, on every case, reads of entries ``j < ceil(context_lens[b] / BLOCK_SIZE)`` of row ``b``
only. Compiled (CUDA), a kernel's loads cannot be seen from Python, nor interpreted on CUDA
tensors (their host copies are read): there that expectation is skipped (:func:`loads_seen`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
from collections.abc import Callable, Iterator

import torch

from paged_kv.attention.paged import paged_attention
from paged_kv.checks._core import Checker, Mistake, diagnose, task
from paged_kv.checks.lesson05 import TOL, _problem, _randn, _scattered, _shape

OFF_BY_ONE = (
    "a token's position is off by one: slot s of logical block j holds position j * BLOCK_SIZE + s, "
    "and it is live when that position is < context_len"
)
LIVE_TO_CONTEXT_LEN = (
    "the live mask lets in one slot too many: j * BLOCK_SIZE + slots <= context_len lets in the slot "
    "at position context_len, the first past the sequence (stale data); a slot is live when "
    "j * BLOCK_SIZE + slots < context_len"
)
NO_TAIL_MASK = (
    "the tail of the last block is not masked: its slots at or past context_len hold stale data; mask "
    "them out of the loads and give them a score of -inf"
)
LOOP_ROUNDS_DOWN = (
    "the block loop stops one block short when the last block is partly full: context_len // "
    "BLOCK_SIZE rounds down; loop over range(0, tl.cdiv(context_len, BLOCK_SIZE)), every block the "
    "sequence holds"
)
LOOP_ONE_SHORT = (
    "the block loop stops one block short: range(0, tl.cdiv(context_len, BLOCK_SIZE) - 1) skips the "
    "last block (range already stops before its end): loop over range(0, tl.cdiv(context_len, BLOCK_SIZE))"
)
LOOP_ONE_LONG = (
    "the block loop runs one block too many: it reads entry ceil(context_len / BLOCK_SIZE) of the "
    "sequence's row, past its blocks (padding, which may hold anything); loop over range(0, "
    "tl.cdiv(context_len, BLOCK_SIZE)), not tl.cdiv(context_len, BLOCK_SIZE) + 1 (nor context_len // "
    "BLOCK_SIZE + 1, one too many when the last block is full)"
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
    "a query head reads the wrong KV head: program (seq, kv_head) handles query heads kv_head * GROUP "
    "+ 0 .. GROUP - 1 (query head q reads KV head q // GROUP, not q % num_kv_heads)"
)
WRONG_ROW = (
    "a block id is read from the wrong row of the table: sequence seq's row starts at "
    "block_tables_ptr + seq * table_stride_seq, and entry j is table_stride_entry further"
)
DEFAULT_HINT = (
    "follow the package's order: program ids, the query, then for each logical block j its block id, "
    "the live slots, K, the scores, the online-softmax update, V; at the end store acc / total"
)

#: Each classic mistake as edits ``(old, new)`` of the package kernel's source, and the hint naming it.
#: Where two mistakes give the same output on a case, the first wins: the narrower mistake comes
#: first (``<= context_len`` lets in one stale slot, an unmasked tail all of them; ``//`` is short
#: only when the last block is partly full, ``- 1`` always, so a kernel short on a case whose
#: full blocks it got right rounds down).
MISTAKES = (
    ((("j * BLOCK_SIZE + slots < context_len", "j * BLOCK_SIZE + slots + 1 < context_len"),), OFF_BY_ONE),
    (
        (("j * BLOCK_SIZE + slots < context_len", "j * BLOCK_SIZE + slots <= context_len"),),
        LIVE_TO_CONTEXT_LEN,
    ),
    (
        (("(slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < context_len)", "slots < BLOCK_SIZE"),),
        NO_TAIL_MASK,
    ),
    ((("tl.cdiv(context_len, BLOCK_SIZE)", "context_len // BLOCK_SIZE"),), LOOP_ROUNDS_DOWN),
    ((("tl.cdiv(context_len, BLOCK_SIZE)", "tl.cdiv(context_len, BLOCK_SIZE) - 1"),), LOOP_ONE_SHORT),
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
        (("heads = kv_head * GROUP + members", "heads = members * tl.num_programs(1) + kv_head"),),
        WRONG_KV_HEAD,
    ),
    ((("seq * table_stride_seq", "seq * table_stride_entry"),), WRONG_ROW),
)


def mistaken(*edits: tuple[str, str]) -> Callable:
    """The package's ``paged_decode_kernel`` with a mistake: each ``old`` of ``edits`` in its source
    replaced by its ``new``.

    The edited source is registered in :mod:`linecache`, so Triton (which reads a kernel's source)
    sees it as the function's own.
    """
    from paged_kv.attention import triton_kernel

    source = inspect.getsource(triton_kernel.paged_decode_kernel)
    for old, new in edits:
        if old not in source:
            raise ValueError(f"{old!r} is not in the source of paged_decode_kernel")
        source = source.replace(old, new)
    filename = f"<paged_decode_kernel with {edits!r}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(vars(triton_kernel))
    exec(compile(source, filename, "exec"), namespace)
    return namespace["paged_decode_kernel"]


def launch(kernel: Callable, query, k_cache, v_cache, block_tables, context_lens) -> torch.Tensor:
    """``kernel`` launched by the package's launcher; an error in it is raised as itself (the
    interpreter wraps it in an ``InterpreterError``), so a stub's ``NotImplementedError`` stays one.
    Compiled, a kernel cannot raise: a stub is recognised by its ``raise NotImplementedError``."""
    from triton.runtime.errors import InterpreterError

    from paged_kv.attention.triton_decode import triton_decode, triton_interpreted

    if not triton_interpreted() and "NotImplementedError" in kernel.__code__.co_names:
        raise NotImplementedError("paged_decode_kernel still raises NotImplementedError: write its body")
    try:
        return triton_decode(query, k_cache, v_cache, block_tables, context_lens, None, kernel=kernel)
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


def _case(lengths, block_size, num_kv_heads, group, seed, layout):
    """Inputs of one case: scattered blocks of stale data, a query of ``num_kv_heads * group`` heads.

    The K and V caches are views into buffers with a guard block of stale data before and after
    (:func:`_guarded`), and the block table has one column of padding (``-1``) past the longest
    sequence's blocks: a kernel that reads one slot or one table entry too far stays in bounds.
    ``layout`` ``"vllm"`` copies the cache into vLLM 0.33.0's default layout of one layer,
    ``(num_blocks, block_size, num_kv_heads, 2 * head_size)`` in memory (K and V side by side), and
    passes the K and V halves of its heads-first view, read through their strides.
    """
    head_dim = 8
    cache = _scattered(lengths, block_size, num_kv_heads, head_dim, seed=1000 + seed)
    if layout == "vllm":
        memory = torch.cat([cache.k_cache, cache.v_cache], dim=-1).transpose(1, 2)
        view = _guarded(memory, seed=3000 + seed).transpose(1, 2)
        k_cache, v_cache = view[..., :head_dim], view[..., head_dim:]
    else:
        k_cache, v_cache = (
            _guarded(cache.k_cache, seed=3000 + seed),
            _guarded(cache.v_cache, seed=4000 + seed),
        )
    query = _randn(len(lengths), num_kv_heads * group, head_dim, seed=2000 + seed)
    tables = torch.nn.functional.pad(cache.block_tables_tensor(range(len(lengths))), (0, 1), value=-1)
    context_lens = torch.tensor(lengths, device=query.device)
    return query, k_cache, v_cache, tables, context_lens


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


CASES = (  # what the case adds, lengths, block_size, num_kv_heads, group, layout
    ("one sequence, one full block, one head", [4], 4, 1, 1, "course"),
    ("a last block only partly full", [6], 4, 1, 1, "course"),
    ("several scattered blocks", [13], 4, 1, 1, "course"),
    ("a batch: each sequence has its own row of the table", [8, 7, 6], 4, 1, 1, "course"),
    ("grouped-query attention, 2 query heads per KV head", [7, 4], 4, 2, 2, "course"),
    ("vLLM v1's cache layout, read through its strides", [10, 3], 8, 2, 2, "vllm"),
)


class _Close:
    """A kernel's output, equal to another when close to it: how a mistake's output is recognised."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Close) and torch.allclose(self.tensor, other.tensor, equal_nan=True, **TOL)


@functools.cache
def _mistakes() -> list[Mistake]:
    return [(mistaken(*edits), hint) for edits, hint in MISTAKES]


@task("12.paged_decode_kernel", "the paged decode kernel, in Triton")
def _paged_decode_kernel(c: Checker, paged_decode_kernel) -> None:
    """Per case, the output, then (interpreted, on the CPU: :func:`loads_seen`) the table entries read:
    those of the sequence's own blocks only, which a block loop one block too long oversteps."""
    from paged_kv.attention.triton_language import MISSING

    c.holds("import triton.language as tl", not MISSING, "triton, importable", MISSING, "use Linux (or WSL)")
    for seed, (what, lengths, block_size, num_kv_heads, group, layout) in enumerate(CASES):
        inputs = _case(lengths, block_size, num_kv_heads, group, seed, layout)
        query, _, _, tables, _ = inputs
        call = (
            f"paged_decode_kernel[(batch={len(lengths)}, num_kv_heads={num_kv_heads})](...)  # {what}: "
            f"block_tables {tables.tolist()}, context_lens {lengths}, block_size {block_size}, "
            f"{query.shape[1]} query heads"
        )
        seen = loads_seen(tables.device)
        with table_reads(tables) if seen else contextlib.nullcontext(set()) as read:
            got = c.run(call, lambda inputs=inputs: launch(paged_decode_kernel, *inputs), DEFAULT_HINT)
        expected = paged_attention(*inputs, strategy="gather")
        problem = _problem(got, expected, exact=False)

        def probe(kernel, inputs=inputs):
            return _Close(launch(kernel, *inputs))

        c.holds(
            call,
            problem is None,
            f"{_shape(expected)} equal to paged_attention(..., strategy='gather'), within atol=rtol=1e-5",
            problem,
            lambda probe=probe: diagnose(paged_decode_kernel, _mistakes(), probe, DEFAULT_HINT),
        )
        if seen:
            held = [-(-n // block_size) for n in lengths]
            past = sorted((row, entry) for row, entry in read if entry >= held[row])
            c.holds(
                call,
                not past,
                "reads of block_tables[b, j] for j < ceil(context_lens[b] / block_size) only: "
                f"{', '.join(f'row {b}, j < {n}' for b, n in enumerate(held))}",
                ", ".join(f"block_tables[{row}, {entry}] read too" for row, entry in past),
                LOOP_ONE_LONG,
            )

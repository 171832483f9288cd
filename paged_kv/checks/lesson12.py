"""Checks of exercise 12: the paged decode kernel, in Triton, run by Triton on the learner's function.

The learner writes ``paged_decode_kernel``, a plain function in Triton's language with the arguments
of :func:`paged_kv.attention.triton_kernel.paged_decode_kernel`. The check launches it the way the
package launches its own, through :func:`paged_kv.attention.triton_decode.triton_decode`, which
applies ``triton.jit`` to it on first use (compiled on CUDA, in Triton's interpreter on the CPU:
:mod:`paged_kv.attention.triton_language` fixes the mode), and compares its output with the gather
strategy of ``paged_attention``, from one block of one sequence to a batch of scattered tables with
grouped-query attention and vLLM's cache layout. Sizes stay small: the interpreter
runs each program in numpy.

When an output is wrong, the check runs the package's kernel with one classic mistake written into
its source (:func:`mistaken`) on the same case, and names the mistake whose output the learner's
matches: a token position off by one, the tail of the last block not masked, the running maximum
not rescaled, a query head reading the wrong KV head, a block id read from the wrong row.
"""

from __future__ import annotations

import functools
import inspect
import linecache
from collections.abc import Callable

import torch

from paged_kv.attention.paged import paged_attention
from paged_kv.checks._core import Checker, Mistake, diagnose, task
from paged_kv.checks.lesson05 import TOL, _problem, _randn, _scattered, _shape

OFF_BY_ONE = (
    "a token's position is off by one: slot s of logical block j holds position j * BLOCK_SIZE + s, "
    "and it is live when that position is < context_len"
)
NO_TAIL_MASK = (
    "the tail of the last block is not masked: its slots at or past context_len hold stale data; mask "
    "them out of the loads and give them a score of -inf"
)
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
MISTAKES = (
    ((("j * BLOCK_SIZE + slots < context_len", "j * BLOCK_SIZE + slots + 1 < context_len"),), OFF_BY_ONE),
    (
        (("(slots < BLOCK_SIZE) & (j * BLOCK_SIZE + slots < context_len)", "slots < BLOCK_SIZE"),),
        NO_TAIL_MASK,
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


def _case(lengths, block_size, num_kv_heads, group, seed, layout):
    """Inputs of one case: scattered blocks of stale data, a query of ``num_kv_heads * group`` heads.

    ``layout`` ``"vllm"`` copies the cache into vLLM 0.33.0's default layout of one layer,
    ``(num_blocks, block_size, num_kv_heads, 2 * head_size)`` in memory (K and V side by side), and
    passes the K and V halves of its heads-first view, read through their strides.
    """
    head_dim = 8
    cache = _scattered(lengths, block_size, num_kv_heads, head_dim, seed=1000 + seed)
    k_cache, v_cache = cache.k_cache, cache.v_cache
    if layout == "vllm":
        view = torch.cat([k_cache, v_cache], dim=-1).transpose(1, 2).contiguous().transpose(1, 2)
        k_cache, v_cache = view[..., :head_dim], view[..., head_dim:]
    query = _randn(len(lengths), num_kv_heads * group, head_dim, seed=2000 + seed)
    tables = cache.block_tables_tensor(range(len(lengths)))
    context_lens = torch.tensor(lengths, device=query.device)
    return query, k_cache, v_cache, tables, context_lens


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

"""Checks of exercise 05: gathering K/V through a block table, decode attention, paged attention.

Every case runs on scattered blocks of a pool whose unused slots hold stale random data, so a wrong
slot read gives a visibly wrong answer. When a result is wrong, the check also computes the classic
mistakes (K and V swapped, a missing or wrong scale, a softmax over heads, blocks in sorted order,
no mask) and, when the result matches one, the hint names it.

While the learner's code runs, what the check compares with and the package's own answers
(``paged_kv.paged_attention``, and ``gather_kv``, ``decode_attention`` and ``paged_attention`` of
:mod:`paged_kv.attention.paged`) raise when called through their modules. The package is graded through
:mod:`paged_kv.reference.lesson05`, which binds those functions at import, so it still passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F

import paged_kv
import paged_kv.attention.paged
from paged_kv.checks._core import Checker, task
from paged_kv.kv.cache import PagedKVCacheAllocator

# Attention results are compared with these tolerances; gathered K/V must be exactly equal.
TOL = {"atol": 1e-5, "rtol": 1e-5}

Mistakes = Sequence[tuple[str, Callable[[], object]]]

SWAPPED = "K and V are swapped: scores come from q · k, and the weights multiply v"
NO_SCALE = "the scores are not scaled: multiply q · k by scale, 1 / sqrt(head_dim) by default"
SCALE_BY_D = (
    "the scores are scaled by 1 / head_dim: the default scale is 1 / sqrt(head_dim), head_dim ** -0.5"
)
OVER_HEADS = "the softmax runs over the heads: it must run over the positions (tokens), for each head"
SORTED = "the blocks are in sorted order: position p lives in block_table[p // block_size], in table order"
TAIL = (
    "the positions past seq_len are not masked: the last block holds only some real tokens, "
    "the rest of its slots is stale data"
)


# ------------------------------------------------------------------------------ test data


def _scattered(lengths: Sequence[int], block_size: int, num_heads: int, head_dim: int, seed: int):
    """A cache holding sequences 0, 1, ... of ``lengths`` tokens in blocks taken in a random order.

    Every block first holds a one-block filler; the fillers are freed in a seeded random order, so
    the FIFO free list hands out shuffled blocks. All slots start with stale random K/V.
    """
    gen = torch.Generator().manual_seed(seed)
    device = paged_kv.default_device()
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache = PagedKVCacheAllocator(num_blocks, block_size, num_heads, head_dim, device=device)
    for block in range(num_blocks):
        cache.allocate_for_sequence(("old", block), 1)
    for block in torch.randperm(num_blocks, generator=gen).tolist():
        cache.free_sequence(("old", block))
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=gen))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=gen))
    for seq_id, length in enumerate(lengths):
        cache.allocate_for_sequence(seq_id, length)
        k, v = torch.randn(2, length, num_heads, head_dim, generator=gen).to(device)
        cache.write_kv(seq_id, k, v)
    return cache


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(paged_kv.default_device())


# ------------------------------------------------------------------------------ references


def _attention(q, k, v, scale=None, over_heads=False) -> torch.Tensor:
    """Decode attention, optionally with a classic mistake: q (heads, dim), k/v (tokens, heads, dim)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    weights = torch.softmax(scores, dim=0 if over_heads else -1)
    return torch.einsum("ht,thd->hd", weights, v)


def _sdpa(q, k, v, scale=None) -> torch.Tensor:
    """SDPA of q (heads, dim) over k, v (tokens, heads, dim): (heads, dim)."""
    out = F.scaled_dot_product_attention(
        q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
    )
    return out[0, :, 0]


def _gather(cache_tensor, table, seq_len, order="table", layout="right") -> torch.Tensor:
    """One sequence's K or V, (seq_len, heads, dim), optionally gathered the wrong way."""
    block_size, heads, dim = cache_tensor.shape[2], cache_tensor.shape[1], cache_tensor.shape[3]
    ids = [int(b) for b in table][: -(-seq_len // block_size)]
    if order == "sorted":
        ids = sorted(ids)
    blocks = cache_tensor[torch.tensor(ids, device=cache_tensor.device)]
    if layout == "no transpose":
        return blocks.reshape(-1, heads, dim)[:seq_len]
    return blocks.transpose(1, 2).reshape(-1, heads, dim)[:seq_len]


def _paged(cache, query, lens, *, swap=False, scale=None, over_heads=False, order="table", mask="positions"):
    """Paged attention per sequence, optionally with a classic mistake, stacked: (batch, heads, dim).

    ``mask`` is ``"positions"`` (right: positions from seq_len on are ignored), ``"blocks"``
    (only the padding blocks are ignored, not the tail of the last block), ``"none"`` (every slot
    of the row is attended, -1 reading the last block) or ``"none, clamped"`` (the same, -1 read as
    block 0).
    """
    tables = cache.block_tables_tensor(range(len(lens)))
    size = cache.block_size
    rows = []
    for b, length in enumerate(lens):
        row = tables[b].tolist()
        used = {
            "positions": length,
            "blocks": -(-length // size) * size,
            "none": len(row) * size,
            "none, clamped": len(row) * size,
        }[mask]
        pad = 0 if mask == "none, clamped" else cache.num_blocks - 1
        row = [r if r >= 0 else pad for r in row]
        k = _gather(cache.k_cache, row, used, order)
        v = _gather(cache.v_cache, row, used, order)
        if swap:
            k, v = v, k
        rows.append(_attention(query[b], k, v, scale, over_heads))
    return torch.stack(rows)


# ------------------------------------------------------------------------------ comparing


def _shape(t: torch.Tensor) -> str:
    return f"a tensor of shape {tuple(t.shape)}"


def _problem(got: object, expected: torch.Tensor, exact: bool) -> str | None:
    """What is wrong with ``got`` (None when it matches ``expected``)."""
    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, not a tensor"
    if got.shape != expected.shape:
        return _shape(got)
    if got.device != expected.device:
        return f"{_shape(got)} on {got.device}, not on the inputs' device {expected.device}"
    if got.dtype != expected.dtype:
        return f"{_shape(got)} of dtype {got.dtype}, not {expected.dtype}"
    if exact and torch.equal(got, expected):
        return None
    if not exact and torch.allclose(got, expected, **TOL):
        return None
    if got.isnan().any():
        return f"{_shape(got)} with NaN in it"
    difference = (got - expected).abs().max().item()
    return f"{_shape(got)} that differs from it by up to {difference:.3g}"


def _expect(
    c: Checker,
    call: str,
    got: object,
    expected: torch.Tensor,
    reference: str,
    hint: str,
    mistakes: Mistakes = (),
    exact: bool = False,
) -> None:
    """``got`` must equal ``expected`` (exactly, or within TOL); a known mistake gets its own hint."""
    __tracebackhide__ = True
    problem = _problem(got, expected, exact)
    if problem is not None:
        for mistake_hint, wrong in mistakes:
            if _problem(got, wrong(), exact) is None:
                hint = mistake_hint
                break
    what = "exactly" if exact else "within atol=rtol=1e-5"
    c.holds(call, problem is None, f"{_shape(expected)} equal to {reference}, {what}", problem, hint)


class _Forbidden(RuntimeError):
    """Raised when the learner's code calls what the check uses as its answer."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(why)
        self.name, self.why = name, why


@contextmanager
def _forbidden(module: object, name: str, why: str) -> Iterator[None]:
    """While the learner's code runs, ``module.name`` raises ``_Forbidden``."""
    original = getattr(module, name)

    def refuse(*args, **kwargs):
        raise _Forbidden(f"{getattr(module, '__name__', module)}.{name}", why)

    setattr(module, name, refuse)
    try:
        yield
    finally:
        setattr(module, name, original)


def _package(name: str) -> tuple[object, str, str]:
    """The package's own ``paged_kv.attention.paged.<name>``, refused while the learner's code runs."""
    why = f"write your own: paged_kv.attention.paged.{name} is the package's answer to this exercise"
    return (paged_kv.attention.paged, name, why)


def _run_without(c: Checker, call: str, thunk: Callable[[], object], hint: str, *forbidden) -> object:
    """Run the learner's code with each ``(module, name, why)`` of ``forbidden`` made to raise."""
    __tracebackhide__ = True
    with ExitStack() as stack:
        for module, name, why in forbidden:
            stack.enter_context(_forbidden(module, name, why))
        try:
            return thunk()
        except NotImplementedError:
            raise
        except _Forbidden as error:
            c.fail(call, "your own computation", f"a call to {error.name}", error.why)
        except Exception as error:  # the learner's bug, reported as such
            c.fail(call, "no exception", f"{type(error).__name__}: {error}", hint)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------ task 1


@task("05.gather_kv", "gather one sequence's K and V through its block table")
def _gather_kv(c: Checker, gather_kv) -> None:
    cache = _scattered([8, 11, 5], block_size=4, num_heads=3, head_dim=5, seed=56)
    padded_row = cache.block_tables_tensor([1, 2])[1]  # an int32 row ending in -1
    cases = [
        (
            cache.get_block_mapping(0),
            str(cache.get_block_mapping(0)),
            0,
            8,
            "k_cache[table] has shape (blocks, heads, block_size, dim): bring block_size next to blocks "
            "(transpose(1, 2)), then reshape(-1, heads, dim)",
        ),
        (
            cache.get_block_mapping(1),
            str(cache.get_block_mapping(1)),
            1,
            11,
            "11 tokens fill 2 blocks of 4 and 3 slots of the third: keep the first seq_len positions",
        ),
        (
            padded_row,
            f"torch.tensor({padded_row.tolist()}, dtype=torch.int32)",
            2,
            5,
            "block_table may be an int32 tensor longer than needed, padded with -1: use only its first "
            "ceil(seq_len / block_size) entries, and keep the first seq_len positions",
        ),
    ]
    for table, shown, seq_id, seq_len, hint in cases:
        call = f"gather_kv(k_cache, v_cache, {shown}, {seq_len})"
        result = _run_without(
            c,
            call,
            lambda t=table, n=seq_len: gather_kv(cache.k_cache, cache.v_cache, t, n),
            hint,
            _package("gather_kv"),
        )
        c.holds(
            call,
            isinstance(result, tuple) and len(result) == 2,
            "a tuple (k, v)",
            type(result).__name__ + (f" of length {len(result)}" if isinstance(result, tuple) else ""),
            "return both tensors: return k, v",
        )
        k, v = result
        expected_k, expected_v = cache.read_kv(seq_id)
        ids = [b if b >= 0 else cache.num_blocks - 1 for b in torch.as_tensor(table).tolist()]
        whole = len(ids) * cache.block_size
        mistakes = [
            (
                "K and V are swapped: k comes from k_cache and v from v_cache, returned as (k, v)",
                lambda ev=expected_v: ev,
            ),
            (SORTED, lambda ids=ids, n=seq_len: _gather(cache.k_cache, ids, n, "sorted")),
            (
                "reshaping (blocks, heads, block_size, dim) straight to (-1, heads, dim) mixes heads and "
                "offsets: transpose(1, 2) first",
                lambda ids=ids, n=seq_len: _gather(cache.k_cache, ids, n, layout="no transpose"),
            ),
            (
                "the positions past seq_len are kept (padding -1 reads the last block of the cache): "
                "keep only the first seq_len positions",
                lambda ids=ids, whole=whole: _gather(cache.k_cache, ids, whole),
            ),
            (
                "the result is (seq_len, num_heads, head_dim), tokens first like cache.read_kv, "
                "not heads first",
                lambda ek=expected_k: ek.transpose(0, 1),
            ),
        ]
        _expect(c, f"{call}[0]", k, expected_k, "cache.read_kv(...)[0]", hint, mistakes, exact=True)
        _expect(
            c,
            f"{call}[1]",
            v,
            expected_v,
            "cache.read_kv(...)[1]",
            "gather v from v_cache exactly as k from k_cache",
            [
                (
                    "the v you return holds K: gather v from v_cache (your code reads k_cache twice)",
                    lambda ek=expected_k: ek,
                )
            ],
            exact=True,
        )


# ------------------------------------------------------------------------------ task 2


@task("05.decode_attention", "decode attention for one sequence, by hand")
def _decode_attention(c: Checker, decode_attention) -> None:
    sdpa = (
        F,
        "scaled_dot_product_attention",
        "compute it by hand: scaled_dot_product_attention is what this check compares with",
    )
    formula = (
        "scores = einsum('hd,thd->ht', q, k) * scale, a softmax over t (dim=-1), "
        "then einsum('ht,thd->hd', weights, v)"
    )
    cases = [  # name, tokens, heads, head_dim, scale, size of q and k, hint
        (
            "one token",
            1,
            3,
            4,
            None,
            1.0,
            "with one token its weight is 1: the output is v[0] for every head",
        ),
        ("seven tokens", 7, 3, 16, None, 1.0, formula),
        (
            "seven tokens, a given scale",
            7,
            3,
            16,
            0.5,
            1.0,
            "use scale when it is given; None means 1 / sqrt(head_dim)",
        ),
        (
            "large scores",
            9,
            2,
            16,
            None,
            10.0,
            "exp of a large score overflows to inf: subtract each head's largest score before exp, "
            "or use torch.softmax",
        ),
    ]
    for seed, (name, tokens, heads, dim, scale, size, hint) in enumerate(cases):
        q = _randn(heads, dim, seed=500 + seed) * size
        k = _randn(tokens, heads, dim, seed=600 + seed) * size
        v = _randn(tokens, heads, dim, seed=700 + seed)
        arguments = "q, k, v" if scale is None else f"q, k, v, scale={scale}"
        call = f"decode_attention({arguments})  # {name}: q {tuple(q.shape)}, k and v {tuple(k.shape)}"
        got = _run_without(
            c,
            call,
            lambda q=q, k=k, v=v, s=scale: decode_attention(q, k, v, s),
            hint,
            sdpa,
            _package("decode_attention"),
        )
        mistakes = [
            (SWAPPED, lambda q=q, k=k, v=v, s=scale: _sdpa(q, v, k, s)),
            (OVER_HEADS, lambda q=q, k=k, v=v, s=scale: _attention(q, k, v, s, over_heads=True)),
        ]
        if scale is None:
            mistakes += [
                (NO_SCALE, lambda q=q, k=k, v=v: _sdpa(q, k, v, 1.0)),
                (SCALE_BY_D, lambda q=q, k=k, v=v, d=dim: _sdpa(q, k, v, 1 / d)),
            ]
        else:
            mistakes += [("scale is ignored: " + hint, lambda q=q, k=k, v=v: _sdpa(q, k, v))]
        expected = _sdpa(q, k, v, scale)
        _expect(c, call, got, expected, "scaled_dot_product_attention", hint, mistakes)


# ------------------------------------------------------------------------------ task 3


@task("05.paged_decode_attention", "paged decode attention for a batch, masked")
def _paged_decode_attention(c: Checker, paged_decode_attention) -> None:
    block_size, heads, dim = 4, 2, 16
    answer = "paged_kv.paged_attention computes the answer this check compares with: write your own"
    padding_hint = (
        "row 1 is padded with -1, and k_cache[-1] is the last block of the cache: clamp the padding to "
        "a real block and give every position at or past seq_len a score of -inf before the softmax"
    )
    clamped_hint = (
        "the padding is clamped but still attended: the block it now names holds another sequence's "
        "data; give every position at or past seq_len a score of -inf before the softmax"
    )
    tail_hint = TAIL + "; give them a score of -inf before the softmax"
    unmasked = {"none": tail_hint, "none, clamped": tail_hint}
    cases = [  # lengths, hint, hints when nothing is masked, padding value, on the CPU
        (
            [8],
            "scores = einsum('bhd,bhpd->bhp', query, k) * head_dim ** -0.5, a softmax over p, then "
            "einsum('bhp,bhpd->bhd', weights, v)",
            unmasked,
            -1,
            False,
        ),
        ([8, 4], padding_hint, {"none": padding_hint, "none, clamped": clamped_hint}, -1, False),
        ([11], tail_hint, unmasked, -1, False),
        (
            [11, 4, 16, 6, 1, 9],
            "lengths 1, exact multiples of block_size and partial last blocks together: clamp the padding, "
            "gather in table order, mask positions >= seq_len",
            unmasked,
            -1,
            False,
        ),
        (
            [11, 4, 16, 6, 1, 9],
            "the padding may hold any value, here far past every block id: clamp block_tables to "
            "0 .. num_blocks - 1 before indexing (the mask hides those blocks). This case runs on the CPU: "
            "make new tensors on query.device",
            unmasked,
            10**6,
            True,
        ),
    ]
    for seed, (lengths, hint, unmasked_hints, pad, on_cpu) in enumerate(cases):
        cache = _scattered(lengths, block_size, heads, dim, seed=300 + 7 * seed)
        query = _randn(len(lengths), heads, dim, seed=400 + seed)
        expected = torch.stack([_sdpa(query[b], *cache.read_kv(b)) for b in range(len(lengths))])
        tables = cache.block_tables_tensor(range(len(lengths)))
        tables = torch.where(tables == -1, torch.full_like(tables, pad), tables)
        lens = torch.tensor(lengths, device=query.device)
        inputs = [query, cache.k_cache, cache.v_cache, tables, lens]
        if on_cpu:
            inputs = [t.cpu() for t in inputs]
            expected = expected.cpu()
        where = " (on the CPU)" if on_cpu else ""
        call = (
            "paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens)"
            f"  # block_tables {tables.tolist()}, seq_lens {lengths}{where}"
        )
        got = _run_without(
            c,
            call,
            lambda inputs=inputs: paged_decode_attention(*inputs),
            hint,
            (paged_kv, "paged_attention", answer),
            (paged_kv.attention.paged, "paged_attention", answer),
            _package("gather_kv"),
            _package("decode_attention"),
        )

        def wrong(cache=cache, query=query, lengths=lengths, on_cpu=on_cpu, **mistake):
            result = _paged(cache, query, lengths, **mistake)
            return result.cpu() if on_cpu else result

        mistakes = [
            (SWAPPED, lambda w=wrong: w(swap=True)),
            (NO_SCALE, lambda w=wrong: w(scale=1.0)),
            (SCALE_BY_D, lambda w=wrong: w(scale=1 / dim)),
            (OVER_HEADS, lambda w=wrong: w(over_heads=True)),
            (unmasked_hints["none"], lambda w=wrong: w(mask="none")),
            (unmasked_hints["none, clamped"], lambda w=wrong: w(mask="none, clamped")),
            (
                TAIL + "; mask every position >= seq_len, not only the padding",
                lambda w=wrong: w(mask="blocks"),
            ),
            (SORTED, lambda w=wrong: w(order="sorted")),
        ]
        _expect(c, call, got, expected, "scaled_dot_product_attention per sequence", hint, mistakes)

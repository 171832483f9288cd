"""Checks of exercise 06: grouped-query decode attention, a prompt chunk's causal attention over the
cache, and a packed batch of decodes and chunks.

Every case runs on lesson 05's pools (:func:`paged_kv.checks.lesson05._scattered`): sequences in
blocks taken in a shuffled order from a pool whose other slots hold stale random K/V, so a wrong
slot read shows. The answer is SDPA over each sequence's K/V read back with ``read_kv``, each K/V
head repeated for its group of query heads (``repeat_interleave``), with a causal mask for the
chunks; outputs must agree within ``atol=rtol=1e-5``.

When an output is wrong, :func:`~paged_kv.checks._core.diagnose` runs the learner's function and
small wrong implementations of the classic mistakes on every case of the task, and names the
mistake whose outputs are close to the learner's on all of them (a case where the learner's code
raises counts as wrong for both): query head ``h`` read with KV head ``h % num_kv_heads`` (``repeat``
where ``repeat_interleave`` belongs) or ``h // num_kv_heads``, the positions past the sequence's length not
masked; a chunk attending over itself alone, without the causal mask, with the mask one position
off either way, or as if it started at position 0; packed rows split by the sequence lengths, one
query row assumed per sequence, or each sequence's rows starting one row off.

While the learner's code runs, SDPA and the package's own answers raise when called through their
modules: ``paged_kv.paged_attention`` and ``paged_kv.paged_prefill_attention``, and
``paged_attention``, ``paged_prefill_attention`` and ``decode_attention`` of
:mod:`paged_kv.attention.paged` (lesson 05's mechanism, :func:`paged_kv.checks.lesson05._run_without`).
The package is graded through :mod:`paged_kv.reference.lesson06`, which binds them at import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import paged_kv
from paged_kv.checks._core import Checker, Mistake, diagnose, task
from paged_kv.checks.lesson05 import TAIL, TOL, _gather, _package, _problem, _randn, _run_without, _scattered

BLOCK_SIZE, HEAD_DIM = 4, 8
REFERENCE = "SDPA per sequence over read_kv, each KV head repeated for its group (repeat_interleave)"

MODULO = (
    "query head h reads KV head h % num_kv_heads (what k.repeat(1, group, 1) pairs): the heads of a "
    "group are consecutive, so query head h reads KV head h // group (repeat_interleave, or view the "
    "query as (num_kv_heads, group))"
)
BY_KV_HEADS = (
    "query head h reads KV head h // num_kv_heads: the group is computed the other way round; "
    "group = num_heads // num_kv_heads query heads share a KV head, and head h reads KV head h // group"
)
UNMASKED = TAIL + "; give every position at or past seq_len a score of -inf before the softmax"
ALONE = (
    "the chunk attends over its own tokens only: its queries attend over the cached positions before "
    "it too, positions 0 .. seq_len - q + i for query i"
)
NOT_CAUSAL = (
    "every query sees all seq_len positions: the mask is not causal. Query i is at position "
    "seq_len - q + i and must not see a later one (a score of -inf where position > its own)"
)
ONE_MORE = (
    "the mask is one off: query i sees one position past its own. It is at position "
    "seq_len - q + i and sees positions up to that one (position <= its own), not the next"
)
ONE_LESS = (
    "the mask is one off: query i does not see its own position. It is at position "
    "seq_len - q + i and sees positions 0 .. its own, itself included (<=, not <)"
)
FROM_ZERO = (
    "the chunk is masked as if it started at position 0 (query i sees 0 .. i, which is what SDPA's "
    "is_causal does when there are fewer queries than keys): it is the last q of seq_len "
    "positions, so query i sees 0 .. seq_len - q + i"
)
STARTS_FROM_SEQ_LENS = (
    "the packed rows are split by seq_lens: only the new tokens have query rows, so sequence b's "
    "rows start at sum(query_lens[:b]) and there are query_lens[b] of them"
)
ONE_ROW_EACH = (
    "every sequence is given one query row (row b for sequence b, as in a decode batch): sequence b "
    "has query_lens[b] rows, from sum(query_lens[:b]) on, and the result has as many rows as query"
)
START_ONE_OFF = (
    "each sequence's rows start one row off: sequence b's first row is sum(query_lens[:b]) exactly "
    "(0 for the first), and it has query_lens[b] rows"
)

_FORBIDDEN_WHY = "write your own: paged_kv.{} is the package's answer to this exercise"
_SDPA_WHY = (
    "compute it by hand (einsum, a mask of -inf, torch.softmax): scaled_dot_product_attention is what "
    "this check compares with"
)


def _forbidden() -> tuple[tuple[object, str, str], ...]:
    """What raises while the learner's code runs: SDPA and the package's own answers."""
    return (
        (F, "scaled_dot_product_attention", _SDPA_WHY),
        (paged_kv, "paged_attention", _FORBIDDEN_WHY.format("paged_attention")),
        (paged_kv, "paged_prefill_attention", _FORBIDDEN_WHY.format("paged_prefill_attention")),
        _package("paged_attention"),
        _package("paged_prefill_attention"),
        _package("decode_attention"),
    )


# ------------------------------------------------------------------------------ references


def _expected_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """SDPA of q (rows, heads, dim) over k, v (tokens, kv_heads, dim), repeated for each group of heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=visible).transpose(0, 1)


def _causal(num_queries: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """The (queries, positions) mask of the last ``num_queries`` of ``seq_len`` positions: True = seen."""
    offset = seq_len - num_queries
    rows = torch.arange(num_queries, device=device)[:, None]
    return torch.arange(seq_len, device=device)[None, :] <= offset + rows


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, kv_of: list[int]):
    """Attention by hand for the wrong implementations: query head h reads KV head ``kv_of[h]``."""
    index = torch.tensor(kv_of, device=k.device)
    k, v = k[:, index], v[:, index]  # (tokens, heads, dim): copies, fine for a check
    scores = torch.einsum("nhd,thd->nht", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nht,thd->nhd", torch.softmax(scores, dim=-1), v)


def _kv_heads(pairing: str, num_heads: int, num_kv_heads: int) -> list[int]:
    group = num_heads // num_kv_heads
    rule = {
        "group": lambda h: h // group,
        "modulo": lambda h: h % num_kv_heads,
        "by kv": lambda h: h // num_kv_heads,
    }
    return [rule[pairing](h) for h in range(num_heads)]


def _row_ids(block_table, num_blocks: int, pad: int | None = None) -> list[int]:
    """A table row as ints, its negative padding read as block ``pad`` (default: the last, as k_cache[-1])."""
    pad = num_blocks - 1 if pad is None else pad
    return [b if b >= 0 else pad for b in torch.as_tensor(block_table).tolist()]


# ------------------------------------------------------------------------------ wrong implementations


def _gqa(query, k_cache, v_cache, block_tables, seq_lens, *, pairing="group", mask="positions"):
    """Decode attention of task 1, with a pairing of the heads and a mask (``"positions"`` is right;
    ``"blocks"`` masks the padding blocks only, ``"none"`` nothing, ``"none, clamped"`` nothing with
    the padding read as block 0)."""
    num_blocks, size = k_cache.shape[0], k_cache.shape[2]
    kv_of = _kv_heads(pairing, query.shape[1], k_cache.shape[1])
    out = []
    for b in range(query.shape[0]):
        row = _row_ids(block_tables[b], num_blocks, 0 if mask == "none, clamped" else None)
        n = int(seq_lens[b])
        used = {"positions": n, "blocks": -(-n // size) * size}.get(mask, len(row) * size)
        k, v = _gather(k_cache, row, used), _gather(v_cache, row, used)
        visible = torch.ones(1, used, dtype=torch.bool, device=query.device)
        out.append(_rows(query[b : b + 1], k, v, visible, kv_of)[0])
    return torch.stack(out)


def _chunk(query, k_cache, v_cache, block_table, seq_len, *, sees="causal", pairing="group"):
    """The chunk attention of task 2; ``sees`` says which positions query i sees (``"causal"`` is right)."""
    q, n, device = query.shape[0], int(seq_len), query.device
    row = _row_ids(block_table, k_cache.shape[0])
    k, v = _gather(k_cache, row, n), _gather(v_cache, row, n)
    i = torch.arange(q, device=device)[:, None]
    p = torch.arange(n, device=device)[None, :]
    own = n - q + i
    visible = {
        "causal": p <= own,
        "alone": (p >= n - q) & (p <= own),
        "all": p < n + 0 * i,
        "one more": p <= own + 1,
        "one less": p < own,
        "from 0": p <= i,
    }[sees]
    return _rows(query, k, v, visible, _kv_heads(pairing, query.shape[1], k_cache.shape[1]))


def _packed(query, k_cache, v_cache, block_tables, seq_lens, query_lens, *, starts="query_lens", **chunk):
    """The packed attention of task 3; ``starts`` says where sequence b's rows begin (``"query_lens"``
    is right; ``"one row"`` gives every sequence row b alone, as its decode)."""
    new, lens = [int(n) for n in query_lens], [int(n) for n in seq_lens]
    out = []
    for b, (q, n) in enumerate(zip(new, lens, strict=True)):
        if starts == "one row":
            start, q = b, 1
        else:
            start = {
                "query_lens": sum(new[:b]),
                "seq_lens": sum(lens[:b]),
                "one early": max(sum(new[:b]) - 1, 0),
                "one late": sum(new[:b]) + (1 if b else 0),
            }[starts]
        rows = query[start : start + q]
        if rows.shape[0] < q:
            raise IndexError(
                f"sequence {b}'s rows {start} .. {start + q - 1} run past the {len(query)} of query"
            )
        out.append(_chunk(rows, k_cache, v_cache, block_tables[b], n, **chunk))
    return torch.cat(out)


def _with(implementation: Callable[..., torch.Tensor], **mistake: str) -> Callable[..., torch.Tensor]:
    return lambda *args: implementation(*args, **mistake)


GQA_MISTAKES: list[Mistake] = [
    (_with(_gqa, pairing="modulo"), MODULO),
    (_with(_gqa, pairing="by kv"), BY_KV_HEADS),
    (_with(_gqa, mask="none"), UNMASKED),
    (_with(_gqa, mask="none, clamped"), UNMASKED),
    (_with(_gqa, mask="blocks"), TAIL + "; mask every position >= seq_len, not only the padding blocks"),
]
CHUNK_MISTAKES: list[Mistake] = [
    (_with(_chunk, sees="alone"), ALONE),
    (_with(_chunk, sees="all"), NOT_CAUSAL),
    (_with(_chunk, sees="from 0"), FROM_ZERO),
    (_with(_chunk, sees="one more"), ONE_MORE),
    (_with(_chunk, sees="one less"), ONE_LESS),
    (_with(_chunk, pairing="modulo"), MODULO),
]
PACKED_MISTAKES: list[Mistake] = [
    (_with(_packed, starts="seq_lens"), STARTS_FROM_SEQ_LENS),
    (_with(_packed, starts="one row"), ONE_ROW_EACH),
    (_with(_packed, starts="one early"), START_ONE_OFF),
    (_with(_packed, starts="one late"), START_ONE_OFF),
    (_with(_packed, sees="all"), NOT_CAUSAL),
    (_with(_packed, sees="from 0"), FROM_ZERO),
    (_with(_packed, sees="alone"), ALONE),
    (_with(_packed, pairing="modulo"), MODULO),
]


# ------------------------------------------------------------------------------ naming the mistake


def _fresh(arguments: Sequence[object]) -> list[object]:
    """Copies of a case's tensors, so that code that changes its inputs in place changes no other run."""
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in arguments]


def _output(implementation: Callable[..., object], arguments: Sequence[object]) -> object:
    try:
        return implementation(*_fresh(arguments))
    except Exception:  # a wrong implementation, or the learner's code, that cannot run on this case
        return None


def _close(got: object, expected: object) -> bool:
    return (
        isinstance(got, torch.Tensor)
        and isinstance(expected, torch.Tensor)
        and got.shape == expected.shape
        and got.dtype == expected.dtype
        and bool(torch.allclose(got.cpu(), expected.cpu(), equal_nan=True, **TOL))
    )


def _probe(cases: Sequence[Sequence[object]], right: Callable[..., object], mistakes: Sequence[Mistake]):
    """A probe for :func:`diagnose`: on each case, which of the right output and the mistakes' outputs
    an implementation's output is close to (the first), or ``"wrong"`` (none of them, or it raised)."""
    implementations = [right, *(wrong for wrong, _ in mistakes)]
    candidates: list[list[object]] = []

    def probe(implementation: Callable[..., object]) -> list[object]:
        if not candidates:
            candidates.extend([_output(i, case) for i in implementations] for case in cases)
        seen = []
        for case, outputs in zip(cases, candidates, strict=True):
            got = _output(implementation, case)
            seen.append(next((n for n, out in enumerate(outputs) if _close(got, out)), "wrong"))
        return seen

    return probe


def _check_cases(
    c: Checker,
    learner: Callable[..., object],
    cases: Sequence[tuple[str, Sequence[object], torch.Tensor, str]],
    right: Callable[..., object],
    mistakes: Sequence[Mistake],
) -> None:
    """Run ``learner`` on each ``(call, arguments, expected, hint)``; a wrong output gets the hint of
    the mistake it behaves like on every case, else the case's own."""
    __tracebackhide__ = True
    probe = _probe([arguments for _, arguments, _, _ in cases], right, mistakes)
    for call, arguments, expected, hint in cases:

        def named(hint: str = hint) -> str:
            return diagnose(learner, mistakes, probe, hint)

        got = _run_without(c, call, lambda a=arguments: learner(*_fresh(a)), named, *_forbidden())
        problem = _problem(got, expected, exact=False)
        c.holds(call, problem is None, f"{REFERENCE}: {tuple(expected.shape)}, within 1e-5", problem, named)


# ------------------------------------------------------------------------------ task 1


@task("06.gqa_decode_attention", "paged decode attention with grouped-query heads")
def _gqa_decode_attention(c: Checker, gqa_decode_attention) -> None:
    cases = [  # lengths, query heads, KV heads, hint
        (
            [8],
            4,
            2,
            "4 query heads over 2 KV heads: groups of 2, query head h reads KV head h // 2. View the query "
            "as (batch, num_kv_heads, group, head_dim) and let the products broadcast over the group",
        ),
        ([11], 8, 2, "groups of 4: query heads 0-3 read KV head 0, heads 4-7 KV head 1"),
        (
            [11, 4, 16, 6, 1, 9],
            6,
            3,
            "a batch with padded rows and partial last blocks, groups of 2: clamp the padding, mask the "
            "positions >= seq_len, pair query head h with KV head h // group",
        ),
        ([5, 12], 8, 1, "multi-query attention: one KV head, read by every query head"),
        (
            [7, 3],
            4,
            4,
            "as many KV heads as query heads: groups of 1, lesson 05's paged decode attention",
        ),
        ([9, 16, 2, 13], 8, 4, "groups of 2 over 4 KV heads: query head h reads KV head h // 2"),
    ]
    checked = []
    for seed, (lengths, heads, kv_heads, hint) in enumerate(cases):
        cache = _scattered(lengths, BLOCK_SIZE, kv_heads, HEAD_DIM, seed=610 + seed)
        query = _randn(len(lengths), heads, HEAD_DIM, seed=620 + seed)
        tables = cache.block_tables_tensor(range(len(lengths)))
        lens = torch.tensor(lengths, device=query.device)
        expected = torch.cat(
            [
                _expected_rows(query[b : b + 1], *cache.read_kv(b), _causal(1, n, query.device))
                for b, n in enumerate(lengths)
            ]
        )
        call = (
            f"gqa_decode_attention(query, k_cache, v_cache, block_tables, seq_lens)  # {heads} query "
            f"heads over {kv_heads} KV heads, block_tables {tables.tolist()}, seq_lens {lengths}"
        )
        checked.append((call, (query, cache.k_cache, cache.v_cache, tables, lens), expected, hint))
    _check_cases(c, gqa_decode_attention, checked, _gqa, GQA_MISTAKES)


# ------------------------------------------------------------------------------ task 2


@task("06.chunk_attention", "a prompt chunk's causal attention over the cache")
def _chunk_attention(c: Checker, chunk_attention) -> None:
    cases = [  # the sequence's length, its new tokens, query heads, KV heads, other sequences, hint
        (
            6,
            6,
            2,
            2,
            [],
            "a fresh prompt is a chunk at offset 0: query i sees positions 0 .. i, a score of -inf for "
            "every later position",
        ),
        (
            13,
            5,
            2,
            2,
            [],
            "8 tokens cached and a chunk of 5: query i is at position 8 + i and sees positions 0 .. 8 + i, "
            "the cached ones included (seq_len - q + i in general)",
        ),
        (10, 1, 2, 2, [], "a chunk of one token is a decode: it sees all seq_len positions"),
        (
            14,
            7,
            2,
            2,
            [19],
            "a chunk that starts and ends inside a block, its row padded with -1: use the first "
            "ceil(seq_len / block_size) entries of block_table",
        ),
        (
            11,
            4,
            8,
            2,
            [],
            "8 query heads over 2 KV heads: pair query head h with KV head h // group, as in task 1",
        ),
    ]
    checked = []
    for seed, (length, new, heads, kv_heads, others, hint) in enumerate(cases):
        cache = _scattered([length, *others], BLOCK_SIZE, kv_heads, HEAD_DIM, seed=630 + seed)
        query = _randn(new, heads, HEAD_DIM, seed=640 + seed)
        row = cache.block_tables_tensor([0, *range(1, 1 + len(others))])[0]  # padded when others are longer
        expected = _expected_rows(query, *cache.read_kv(0), _causal(new, length, query.device))
        call = (
            f"chunk_attention(query, k_cache, v_cache, block_table, {length})  # {new} new tokens, the last "
            f"of {length}; block_table {row.tolist()}; {heads} query heads over {kv_heads} KV heads"
        )
        checked.append((call, (query, cache.k_cache, cache.v_cache, row, length), expected, hint))
    _check_cases(c, chunk_attention, checked, _chunk, CHUNK_MISTAKES)


# ------------------------------------------------------------------------------ task 3


@task("06.packed_attention", "decodes and prompt chunks packed into one call")
def _packed_attention(c: Checker, packed_attention) -> None:
    cases = [  # query_lens, seq_lens, query heads, KV heads, hint
        ([5], [13], 2, 2, "one sequence is task 2's chunk: its 5 rows are the last 5 of its 13 positions"),
        (
            [1, 1, 1],
            [11, 4, 6],
            2,
            2,
            "three decodes: one query row each, row b for sequence b, each seeing all its positions",
        ),
        (
            [1, 5],
            [11, 13],
            2,
            2,
            "a decode, then a chunk of 5: row 0 is the first sequence's, rows 1 .. 5 the second's; "
            "sequence b's rows start at sum(query_lens[:b])",
        ),
        (
            [3, 2, 4],
            [3, 2, 9],
            2,
            2,
            "two fresh prompts, then a chunk of 4 over 9 positions: each sequence's rows attend as in "
            "task 2, at offset seq_len - query_len",
        ),
        (
            [3, 1, 4, 2],
            [3, 9, 4, 7],
            2,
            2,
            "a fresh prompt, a decode, a fresh prompt and a chunk: rows 0-2, 3, 4-7 and 8-9",
        ),
        ([2, 1, 6], [9, 5, 6], 4, 2, "4 query heads over 2 KV heads, paired as in task 1"),
    ]
    checked = []
    for seed, (new, lengths, heads, kv_heads, hint) in enumerate(cases):
        cache = _scattered(lengths, BLOCK_SIZE, kv_heads, HEAD_DIM, seed=650 + seed)
        query = _randn(sum(new), heads, HEAD_DIM, seed=660 + seed)
        tables = cache.block_tables_tensor(range(len(lengths)))
        device = query.device
        starts = [sum(new[:b]) for b in range(len(new))]
        expected = torch.cat(
            [
                _expected_rows(query[s : s + q], *cache.read_kv(b), _causal(q, n, device))
                for b, (s, q, n) in enumerate(zip(starts, new, lengths, strict=True))
            ]
        )
        arguments = (
            query,
            cache.k_cache,
            cache.v_cache,
            tables,
            torch.tensor(lengths, device=device),
            torch.tensor(new, device=device),
        )
        call = (
            "packed_attention(query, k_cache, v_cache, block_tables, seq_lens, query_lens)  # "
            f"query_lens {new}, seq_lens {lengths}, {sum(new)} query rows, {heads} query heads over "
            f"{kv_heads} KV heads"
        )
        checked.append((call, arguments, expected, hint))
    _check_cases(c, packed_attention, checked, _packed, PACKED_MISTAKES)

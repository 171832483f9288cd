"""Checks of exercise 03: position -> (block, offset) -> slot, and K/V scattered and gathered on tensors.

The K/V tensors of these checks name their own place: element ``(t, h, d)`` of K is
``100 * t + 10 * h + d`` and V is its negative, and the caches start filled with ``0.5``, which no
token has. So a failed check can say which token landed where.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from paged_kv.checks._core import Checker, diagnose, task
from paged_kv.device import default_device

TABLE = [5, 2, 7]  # the scattered table of lesson 03: 11 tokens in blocks of 4
UNWRITTEN = 0.5
TRANSLATION = (
    "logical block = position // block_size, offset = position % block_size, "
    "physical block = block_table[logical block]"
)
WHERE = (
    "token p goes to k_cache[block_table[p // block_size], :, p % block_size, :]: "
    "the cache's axes are (block, head, offset, dim), so the heads axis sits between block and offset"
)
# Tensor methods that move data from the tensor to Python: a sign of a per-token loop.
TO_PYTHON = {"tolist", "item", "unbind", "__iter__", "__int__", "__index__", "__float__", "numpy"}


class _CountOps(TorchFunctionMode):
    """Record the name of every torch function and tensor method called inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _ops(thunk: Callable[[], object]) -> list[str]:
    with _CountOps() as counter:
        thunk()
    return counter.names


# ------------------------------------------------------------------------------- Task 1


def _location_hint(got: object, table: list[int], position: int, block_size: int) -> str:
    """Name the classic mistake that gives ``got``, or state the translation."""
    logical, offset = divmod(position, block_size)
    if isinstance(got, tuple) and any(isinstance(x, float) for x in got):
        return "/ gives a float: use // for the logical block"
    if got == (offset, table[logical]):
        return "block and offset are swapped: return (physical_block_id, offset)"
    if got == (logical, offset):
        return "that is the logical block index: look it up in the table, block_table[position // block_size]"
    wrong_logical = position % block_size
    if wrong_logical < len(table) and got == (table[wrong_logical], position // block_size):
        return "// and % are confused: logical block = position // block_size, offset = position % block_size"
    return TRANSLATION


@task("03.physical_location", "position -> (physical block, offset)")
def _physical_location(c: Checker, physical_location) -> None:
    cases = [
        (TABLE, 0, 4),
        (TABLE, 1, 4),
        (TABLE, 3, 4),
        (TABLE, 4, 4),
        (TABLE, 6, 4),
        (TABLE, 9, 4),
        (TABLE, 11, 4),
        ([3, 0], 17, 16),
        ([4, 1, 6], 2, 1),
    ]
    for table, position, size in cases:
        call = f"physical_location({table}, {position}, {size})"
        got = c.run(
            call,
            lambda table=table, position=position, size=size: physical_location(table, position, size),
            f"position {position} is inside the table's capacity: {len(table)} blocks of {size} hold "
            f"positions 0 to {len(table) * size - 1}"
            if position == len(table) * size - 1
            else f"{TRANSLATION} (/ gives a float, which cannot index a list)",
        )
        logical, offset = divmod(position, size)
        c.equal(
            call, lambda got=got: got, (table[logical], offset), _location_hint(got, table, position, size)
        )
    got = physical_location(TABLE, 10, 4)
    c.holds(
        f"[type(x) for x in physical_location({TABLE}, 10, 4)]",
        isinstance(got, tuple) and all(type(x) is int for x in got),
        "a tuple of two ints",
        f"{type(got).__name__} of {[type(x).__name__ for x in got]}",
        "return plain ints, e.g. (block_table[logical], offset)",
    )
    c.raises(
        f"physical_location({TABLE}, 12, 4)",
        lambda: physical_location(TABLE, 12, 4),
        ValueError,
        "3 blocks of 4 hold positions 0 to 11; position 12 has no block, say so with a ValueError",
    )
    c.raises(
        f"physical_location({TABLE}, -1, 4)",
        lambda: physical_location(TABLE, -1, 4),
        ValueError,
        "refuse a negative position: -1 // 4 is -1, and block_table[-1] silently reads the last block",
    )


# ------------------------------------------------------------------------------- Task 2


def _loop_slots(table: list[int], positions: list[int], block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _slot_hint(got: object, table: list[int], positions: list[int], block_size: int) -> str:
    if isinstance(got, torch.Tensor) and got.shape == (len(positions),):
        values = got.tolist()
        if values == positions:
            return "that is the position itself: look the logical block up in block_table first"
        swapped = [
            table[p % block_size] * block_size + p // block_size if p % block_size < len(table) else None
            for p in positions
        ]
        if values == swapped:
            return "// and % are confused: logical block = positions // block_size, offset = ... % block_size"
        if values == [(p % block_size) * block_size + table[p // block_size] for p in positions]:
            return "block and offset are swapped: slot = physical_block * block_size + offset"
    return (
        f"slot = block_table[positions // block_size] * block_size + positions % block_size ({TRANSLATION})"
    )


@task("03.slot_mapping", "vectorised slot mapping")
def _slot_mapping(c: Checker, slot_mapping) -> None:
    device = default_device()
    table = torch.tensor(TABLE, device=device)

    def expect(table_list: list[int], positions_list: list[int], size: int, table_t, call: str) -> None:
        positions = torch.tensor(positions_list, dtype=torch.long, device=device)
        got = c.run(
            call,
            lambda: slot_mapping(table_t, positions, size),
            "logical block = positions // block_size (/ gives floats, which cannot index a tensor), "
            "offset = positions % block_size",
        )
        c.holds(
            f"type({call})",
            isinstance(got, torch.Tensor),
            "a torch.Tensor",
            type(got).__name__,
            "return a tensor, computed with tensor operations",
        )
        expected = torch.tensor(_loop_slots(table_list, positions_list, size), dtype=torch.long)
        c.equal(call, lambda: got, expected, _slot_hint(got, table_list, positions_list, size))

    all_11 = list(range(11))
    expect(TABLE, all_11, 4, table, f"slot_mapping(torch.tensor({TABLE}), torch.arange(11), 4)")
    expect(TABLE, [10, 0, 4], 4, table, f"slot_mapping(torch.tensor({TABLE}), torch.tensor([10, 0, 4]), 4)")

    positions = torch.arange(11, device=device)
    got = slot_mapping(table, positions, 4)
    c.holds(
        "slot_mapping(...).dtype",
        got.dtype == torch.long,
        "torch.int64 (long): slots index tensors",
        str(got.dtype),
        "return a LongTensor (torch.int64): keep to // and %, and do not cast to another dtype",
    )
    c.holds(
        "slot_mapping(...).device == positions.device",
        got.device == positions.device,
        str(positions.device),
        str(got.device),
        "compute on the positions' device; do not build new tensors on the CPU",
    )
    int32_table = table.to(torch.int32)  # what block_tables_tensor hands a kernel
    got = c.run(
        f"slot_mapping(torch.tensor({TABLE}, dtype=torch.int32), torch.arange(11), 4)",
        lambda: slot_mapping(int32_table, positions, 4),
    )
    c.equal(
        f"slot_mapping(torch.tensor({TABLE}, dtype=torch.int32), torch.arange(11), 4)",
        lambda: got,
        torch.tensor(_loop_slots(TABLE, all_11, 4)),
        "an int32 block table (as block_tables_tensor gives) must work too",
    )
    c.holds(
        "slot_mapping(int32 table, long positions, 4).dtype",
        got.dtype == torch.long,
        "torch.int64 (long)",
        str(got.dtype),
        "do not cast the result to the table's dtype; int32 * int + int64 gives int64 by itself",
    )
    empty = torch.zeros(0, dtype=torch.long, device=device)
    c.equal(
        f"slot_mapping(torch.tensor({TABLE}), torch.tensor([], dtype=torch.long), 4)",
        lambda: slot_mapping(table, empty, 4),
        torch.zeros(0, dtype=torch.long),
        "no positions, no slots: an empty long tensor",
    )

    generator = torch.Generator().manual_seed(3)
    for size, num_blocks in [(1, 9), (4, 6), (16, 5), (3, 12)]:
        table_list = torch.randperm(64, generator=generator)[:num_blocks].tolist()
        positions_list = torch.randperm(num_blocks * size, generator=generator).tolist()
        expect(
            table_list,
            positions_list,
            size,
            torch.tensor(table_list, device=device),
            f"slot_mapping(torch.tensor({table_list}), torch.tensor({positions_list}), {size})",
        )

    few, many = torch.arange(8, device=device), torch.arange(800, device=device)
    big_table = torch.arange(200, device=device)
    few_ops, many_ops = (
        _ops(lambda: slot_mapping(big_table, few, 4)),
        _ops(lambda: slot_mapping(big_table, many, 4)),
    )
    to_python = sorted(TO_PYTHON.intersection(few_ops + many_ops))
    c.holds(
        "slot_mapping(table, positions, 4) for 8 and for 800 positions",
        not to_python and len(many_ops) <= len(few_ops),
        "the same few tensor operations for any number of positions, and no values moved to Python",
        f"{len(few_ops)} tensor operations for 8 positions, {len(many_ops)} for 800"
        + (f"; calls {', '.join(to_python)}" if to_python else ""),
        "no Python loop over tokens and no .tolist() / .item(): index the table with the whole tensor "
        "positions // block_size at once",
    )


# ------------------------------------------------------------------------------- Task 3


def _kv(
    num_tokens: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(num_tokens, device=device).view(-1, 1, 1)
    h = torch.arange(num_heads, device=device).view(1, -1, 1)
    d = torch.arange(head_dim, device=device).view(1, 1, -1)
    k = (100 * t + 10 * h + d).float()
    return k, -k


def _caches(
    num_blocks: int, num_heads: int, block_size: int, head_dim: int, device
) -> tuple[torch.Tensor, ...]:
    shape = (num_blocks, num_heads, block_size, head_dim)
    return (torch.full(shape, UNWRITTEN, device=device), torch.full(shape, UNWRITTEN, device=device))


def _writer(
    *,
    k_from: str = "k",
    v_from: str = "v",
    offsets_on_heads: bool = False,
    flat_rows: bool = False,
    from_zero: bool = False,
) -> Callable[..., None]:
    """A ``write_kv``, one token at a time: the reference with no option, else a classic mistake.

    ``k_from`` / ``v_from`` say which input each cache gets ("k" or "v"); ``offsets_on_heads``
    indexes ``cache[block, offset]``; ``flat_rows`` treats the cache as ``(slot, head, dim)`` rows;
    ``from_zero`` ignores ``start_position``.
    """

    def write(k_cache, v_cache, block_table, k, v, start_position=0) -> None:
        num_heads, size, dim = k_cache.shape[1:]
        sources = {"k": k, "v": v}
        for i in range(k.shape[0]):
            p = i + (0 if from_zero else start_position)
            block, offset = int(block_table[p // size]), p % size
            for cache, name in ((k_cache, k_from), (v_cache, v_from)):
                if flat_rows:
                    cache.view(-1, num_heads, dim)[block * size + offset] = sources[name][i]
                elif offsets_on_heads:
                    cache[block, offset] = sources[name][i]
                else:
                    cache[block, :, offset, :] = sources[name][i]

    return write


_write = _writer()
WRITE_MISTAKES = [
    (_writer(k_from="v", v_from="k"), "K and V are swapped: k goes to k_cache, v to v_cache"),
    (
        _writer(v_from="k"),
        "v_cache holds K: your code writes k into both caches. Write k into k_cache and v into v_cache",
    ),
    (
        _writer(k_from="v"),
        "k_cache holds V: your code writes v into both caches. Write k into k_cache and v into v_cache",
    ),
    (_writer(offsets_on_heads=True), f"the offsets land on the heads axis: {WHERE}"),
    (_writer(flat_rows=True), f"the cache is not a list of (slot, head, dim) rows: {WHERE}"),
    (
        _writer(from_zero=True),
        "every chunk is written from position 0: token i of k is at position start_position + i",
    ),
]


def _written(
    write_kv, config: tuple, chunks: tuple[tuple[int, int], ...], device
) -> tuple[torch.Tensor, ...]:
    """The caches after ``write_kv`` wrote a sequence's K/V chunk by chunk, ``(start, end)`` each."""
    num_blocks, heads, size, dim, table, tokens = config
    k, v = _kv(tokens, heads, dim, device)
    k_cache, v_cache = _caches(num_blocks, heads, size, dim, device)
    block_table = torch.tensor(table, device=device)
    for start, end in chunks:
        write_kv(k_cache, v_cache, block_table, k[start:end], v[start:end], start)
    return k_cache, v_cache


def _write_hint(write_kv, config: tuple, chunks: tuple[tuple[int, int], ...], device, default: str) -> str:
    """The classic mistake ``write_kv`` makes on this configuration, else ``default``."""
    return diagnose(write_kv, WRITE_MISTAKES, lambda write: _written(write, config, chunks, device), default)


def _describe(vector: torch.Tensor) -> str:
    """What a head_dim vector holds: K or V of which token and head, nothing, or plain numbers."""
    values = vector.tolist()
    if all(x == UNWRITTEN for x in values):
        return "nothing (never written)"
    dims = len(values)
    last = abs(values[-1]) - (dims - 1)
    if last >= 0 and last == int(last):
        token, head = int(last) // 100, int(last) % 100 // 10
        pattern = [100 * token + 10 * head + d for d in range(dims)]
        if values == pattern:
            return f"K of token {token}, head {head}"
        if values == [-x for x in pattern]:
            return f"V of token {token}, head {head}"
    return str(values)


def _cache_difference(name: str, got: torch.Tensor, expected: torch.Tensor) -> tuple[str, str] | None:
    """The first slot and head where ``got`` differs from ``expected``, described both ways."""
    if got.shape != expected.shape:
        return f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}"
    differs = (got != expected).any(dim=-1).nonzero()
    if differs.numel() == 0:
        return None
    block, head, offset = differs[0].tolist()
    where = f"{name}[{block}, {head}, {offset}, :] holds"
    return (
        f"{where} {_describe(expected[block, head, offset])}",
        f"{where} {_describe(got[block, head, offset])}",
    )


def _rows_difference(name: str, got: object, expected: torch.Tensor) -> tuple[str, str] | None:
    """The first token row and head where a gathered tensor differs from the contiguous one."""
    if not isinstance(got, torch.Tensor):
        return "a torch.Tensor", type(got).__name__
    if got.shape != expected.shape:
        return f"shape {tuple(expected.shape)}", f"shape {tuple(got.shape)}"
    differs = (got.cpu() != expected.cpu()).any(dim=-1).nonzero()
    if differs.numel() == 0:
        return None
    row, head = differs[0].tolist()
    where = f"{name}[{row}, {head}] (token {row}, head {head}) holds"
    return f"{where} {_describe(expected[row, head])}", f"{where} {_describe(got[row, head])}"


def _reordered(got: object, expected: torch.Tensor) -> bool:
    """Whether ``got`` holds exactly the rows of ``expected``, in another order."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.shape[0] < 2:
        return False
    rows, wanted = got.cpu().flatten(1), expected.cpu().flatten(1)
    if torch.equal(rows, wanted):
        return False
    matches = (rows[:, None, :] == wanted[None, :, :]).all(dim=-1)  # matches[i, j]: got row i is token j
    return bool(matches.any(dim=1).all() and matches.any(dim=0).all())


def _gather_hint(got: object, expected: torch.Tensor) -> str:
    """Name a gather in the wrong order (physical block order, say), or state where token p lives."""
    where = "each from k_cache[block_table[p // block_size], :, p % block_size, :]"
    if _reordered(got, expected):
        return (
            "the right tokens in the wrong order: row p must be token p, so gather positions "
            f"0 .. num_tokens - 1 in logical order through the table ({where}), not the blocks or "
            "slots in physical order"
        )
    return f"row p is token p: gather positions 0 .. num_tokens - 1 in order, {where}"


def kv_mixup(got_k: object, got_v: object, k: torch.Tensor, v: torch.Tensor) -> str:
    """Name K and V swapped, or one of them returned twice, from a returned pair; else ``""``."""

    def holds(tensor: object, wanted: torch.Tensor) -> bool:
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.shape == wanted.shape
            and torch.equal(tensor.cpu(), wanted.cpu())
        )

    if holds(got_k, v) and holds(got_v, k):
        return "K and V are swapped: return (k, v), read from k_cache and v_cache"
    if holds(got_k, k) and holds(got_v, k):
        return "the v you return holds K: read v from v_cache (your code reads k_cache twice)"
    if holds(got_k, v) and holds(got_v, v):
        return "the k you return holds V: read k from k_cache (your code reads v_cache twice)"
    return ""


@task("03.write_read_kv", "write and gather K/V through a block table")
def _write_read_kv(c: Checker, write_kv, read_kv) -> None:
    device = default_device()
    # (num_blocks, num_heads, block_size, head_dim, table, tokens): in the second, heads == block size,
    # so mixing up the head and offset axes gives no index error, only wrong data.
    configs = [(8, 2, 4, 3, TABLE, 11), (6, 4, 4, 3, [3, 0, 5], 10)]

    # The whole sequence at once, then a prompt and one decode token at a time.
    writes = [(config, ((0, config[5]),), WHERE) for config in configs] + [
        (configs[0], ((0, 8), (8, 9), (9, 10), (10, 11)), "token i of k is at position start_position + i")
    ]
    for config, chunks, default in writes:
        num_blocks, heads, size, dim, table, tokens = config
        shapes = f"k_cache of shape {(num_blocks, heads, size, dim)} and k of shape {(tokens, heads, dim)}"
        call = (
            f"write_kv(k_cache, v_cache, torch.tensor({table}), k, v, 0) with {shapes}"
            if len(chunks) == 1
            else f"write_kv(k_cache, v_cache, torch.tensor({table}), k[:8], v[:8], 0), then k[8:9] at 8, ..."
        )
        k_cache, v_cache = c.run(
            call,
            lambda config=config, chunks=chunks: _written(write_kv, config, chunks, device),
            "positions run from start_position to start_position + len(k) - 1" if len(chunks) > 1 else WHERE,
        )
        expected_k, expected_v = _written(_write, config, chunks, device)
        for name, got, expected in (("k_cache", k_cache, expected_k), ("v_cache", v_cache, expected_v)):
            difference = _cache_difference(name, got, expected)
            c.holds(
                call,
                difference is None,
                *(difference or ("", "")),
                lambda config=config, chunks=chunks, default=default: _write_hint(
                    write_kv, config, chunks, device, default
                ),
            )

    for num_blocks, heads, size, dim, table, tokens in configs:
        k, v = _kv(tokens, heads, dim, device)
        k_cache, v_cache = _written(
            _write, (num_blocks, heads, size, dim, table, tokens), ((0, tokens),), device
        )
        block_table = torch.tensor(table, device=device)
        for count in (tokens, 5, 0):
            call = (
                f"read_kv(k_cache, v_cache, torch.tensor({table}), {count}) "
                f"with k_cache of shape {tuple(k_cache.shape)}"
            )
            got = c.run(
                call,
                lambda k_cache=k_cache, v_cache=v_cache, block_table=block_table, count=count: read_kv(
                    k_cache, v_cache, block_table, count
                ),
                WHERE,
            )
            c.holds(
                call,
                isinstance(got, tuple | list) and len(got) == 2,
                "a pair (k, v)",
                type(got).__name__,
                "return k, v",
            )
            got_k, got_v = got
            for name, got_t, expected in (("k", got_k, k[:count]), ("v", got_v, v[:count])):
                difference = _rows_difference(name, got_t, expected)
                c.holds(
                    call,
                    difference is None,
                    *(difference or ("", "")),
                    kv_mixup(got_k, got_v, k[:count], v[:count]) or _gather_hint(got_t, expected),
                )

    # No Python loop over tokens: the number of tensor operations must not grow with them.
    k_cache, v_cache = _caches(64, 2, 4, 3, device)
    block_table = torch.arange(64, device=device)
    small, large = _kv(4, 2, 3, device), _kv(200, 2, 3, device)
    for name, few, many in (
        (
            "write_kv",
            lambda: write_kv(k_cache, v_cache, block_table, *small, 0),
            lambda: write_kv(k_cache, v_cache, block_table, *large, 0),
        ),
        (
            "read_kv",
            lambda: read_kv(k_cache, v_cache, block_table, 4),
            lambda: read_kv(k_cache, v_cache, block_table, 200),
        ),
    ):
        few_ops, many_ops = _ops(few), _ops(many)
        c.holds(
            f"{name} for 4 and for 200 tokens",
            len(many_ops) <= len(few_ops),
            "the same tensor operations for any number of tokens",
            f"{len(few_ops)} tensor operations for 4 tokens, {len(many_ops)} for 200",
            "no Python loop over tokens: compute block_ids and offsets for all positions at once, then "
            "k_cache[block_ids, :, offsets] (= k to write, as is to read)",
        )

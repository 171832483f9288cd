"""Checks of exercise 04: the block boundary rule, a block appended on demand, a decode step for a batch,
and free-and-admit."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from paged_kv.checks._core import FAIL, Checker, CheckFailed, answers, diagnose, task
from paged_kv.core.block import blocks_for_tokens
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator

RULE = (
    "a new block is needed exactly when the blocks held are full: num_tokens == num_blocks_held * block_size"
)
OFF_BY_ONE = (
    "the check (num_tokens + 1) % block_size == 0 is off by one: it takes the block one token early, "
    "while the last slot is still free"
)
LATE = (
    "your rule takes the block one token late: num_tokens > num_blocks_held * block_size is only true "
    "once a token has already gone past the full blocks, so the token after a full block finds no slot. "
    "Compare with ==: the blocks are full when num_tokens == num_blocks_held * block_size"
)
BOUNDARY_MISTAKES = [
    (lambda n, held, size: (n + 1) % size == 0, OFF_BY_ONE),
    (
        lambda n, held, size: n % size == 1,
        "your rule (num_tokens % block_size == 1) takes the block one token late: one token after the "
        "block filled up, so the token after a full block finds no slot",
    ),
    (lambda n, held, size: n > held * size, LATE),
    (
        lambda n, held, size: n % size == 0,
        "num_tokens % block_size == 0 ignores the blocks held: a block reserved ahead (4 tokens in 2 "
        "blocks of 4) still has room. Compare with the capacity, num_blocks_held * block_size",
    ),
    (
        lambda n, held, size: held > 0 and n == held * size,
        "an empty sequence holds no block (0 tokens in 0 blocks), so its first token needs one: "
        "0 == 0 * block_size is True already, it needs no special case",
    ),
]
# Around every boundary: 0 to 3 blocks of 1, 2, 4 and 16, from empty to one token past full.
BOUNDARY_PROBES = [
    (n, held, size) for size in (1, 2, 4, 16) for held in range(4) for n in range(held * size + 2)
]


def _boundary_hint(needs_new_block, case_hint: str) -> str:
    """The mistake ``needs_new_block`` makes around the boundaries, else what the failing case shows."""
    return diagnose(needs_new_block, BOUNDARY_MISTAKES, answers(BOUNDARY_PROBES), f"{case_hint}; {RULE}")


# ------------------------------------------------------------------------------- Task 1


@task("04.needs_new_block", "the block boundary rule")
def _needs_new_block(c: Checker, needs_new_block) -> None:
    cases = [
        (1, 1, 4, False, "1 token in a block of 4 leaves 3 slots free: the next token fits"),
        (4, 1, 4, True, "4 tokens fill the block of 4, so token 5 needs a new one"),
        (3, 1, 4, False, "3 tokens in a block of 4 leave one slot for token 4"),
        (0, 0, 4, True, "an empty sequence holds no block, so its first token needs one"),
        (5, 2, 4, False, "5 tokens in 2 blocks of 4 leave 3 slots free"),
        (8, 2, 4, True, "8 tokens fill 2 blocks of 4"),
        (47, 3, 16, False, "47 tokens in 3 blocks of 16 leave one slot"),
        (48, 3, 16, True, "48 tokens fill 3 blocks of 16: the 49th needs a 4th block"),
        (1, 1, 1, True, "with blocks of 1, every token needs a new block"),
        (4, 2, 4, False, "2 blocks of 4 hold 8 tokens: the second block was reserved ahead and has room"),
        (0, 1, 4, False, "one empty block reserved ahead: the first token fits in it"),
    ]
    for tokens, blocks, size, expected, hint in cases:
        c.equal(
            f"needs_new_block({tokens}, {blocks}, {size})",
            lambda tokens=tokens, blocks=blocks, size=size: needs_new_block(tokens, blocks, size),
            expected,
            lambda hint=hint: _boundary_hint(needs_new_block, hint),
        )
    result = c.run("needs_new_block(4, 1, 4)", lambda: needs_new_block(4, 1, 4))
    c.holds(
        "type(needs_new_block(4, 1, 4))",
        type(result) is bool,
        "bool",
        type(result).__name__,
        "return the comparison itself, True or False",
    )


# ------------------------------------------------------------------------------- Task 2


def _manager_state(manager) -> str:
    tables = {seq_id: table.block_ids for seq_id, table in manager.sequence_block_tables.items()}
    refs = [block.ref_count for block in manager.blocks]
    return f"tables {tables}, free list {list(manager.free_blocks)}, ref counts {refs}"


def _append_hint(manager, seq_id: Hashable, block_id: object, table_before: list[int]) -> str:
    """Name what a wrong append left undone, from the manager's state after it."""
    table = manager.sequence_block_tables[seq_id].block_ids
    if block_id in manager.free_blocks:
        return (
            f"block {block_id} is still on the free list: take it off with free_blocks.popleft(), or the "
            "next allocation hands it out a second time"
        )
    if table == table_before:
        return (
            f"block {block_id} left the free list but the table of {seq_id!r} does not hold it, so it is "
            "lost (a leak): append it to the table, table.append_block(block_id)"
        )
    if (
        isinstance(block_id, int)
        and 0 <= block_id < len(manager.blocks)
        and not manager.blocks[block_id].ref_count
    ):
        return (
            f"block {block_id}'s ref count is still 0, so it looks free although {seq_id!r} holds it: "
            "set blocks[block_id].ref_count = 1"
        )
    return (
        "take the block at the head of the free list (free_blocks.popleft()), give it ref count 1, "
        "append it to the sequence's table and return its id"
    )


@task("04.append_block", "append a block on demand", needs=("BlockManager",))
def _append_block(c: Checker, manager_class) -> None:
    manager = c.run("manager = BlockManager(num_blocks=4, block_size=4)", lambda: manager_class(4, 4))
    c.run('manager.allocate_for_sequence("a", 4)', lambda: manager.allocate_for_sequence("a", 4))
    c.run('manager.allocate_for_sequence("b", 2)', lambda: manager.allocate_for_sequence("b", 2))
    for seq_id, expected, table in (("a", 2, [0, 2]), ("b", 3, [1, 3])):
        before, free_before = list(manager.sequence_block_tables[seq_id].block_ids), list(manager.free_blocks)
        call = f"manager.append_block_to_sequence({seq_id!r}) with {_manager_state(manager)}"
        got = c.run(call, lambda seq_id=seq_id: manager.append_block_to_sequence(seq_id))
        c.equal(
            call,
            lambda got=got: got,
            expected,
            lambda seq_id=seq_id, got=got, before=before, free_before=free_before: (
                "return the id of the block you took"
                if got is None
                else f"block {got} is the tail of the free list {free_before}: take its head with "
                "free_blocks.popleft() (pop() takes the tail)"
                if len(free_before) > 1 and got == free_before[-1]
                else _append_hint(manager, seq_id, got, before)
            ),
        )
        c.holds(
            f"the manager after {call}",
            manager.sequence_block_tables[seq_id].block_ids == table
            and manager.blocks[expected].ref_count == 1
            and expected not in manager.free_blocks,
            f"the table of {seq_id!r} {table}, block {expected} with ref count 1 and off the free list",
            _manager_state(manager),
            lambda seq_id=seq_id, got=got, before=before: _append_hint(manager, seq_id, got, before),
        )
    c.equal(
        "manager.sequence_block_tables['a'].num_tokens",
        lambda: manager.sequence_block_tables["a"].num_tokens,
        4,
        "appending a block adds room, not tokens: num_tokens stays as it was",
    )

    before = _manager_state(manager)
    call = f"manager.append_block_to_sequence('a') with {before}"
    error = c.raises(
        call,
        lambda: manager.append_block_to_sequence("a"),
        OutOfBlocksError,
        "check the free list before taking from it: with no free block, raise OutOfBlocksError(needed=1, "
        "free=0) (free_blocks.popleft() on an empty deque raises IndexError)",
    )
    c.equal(
        "(error.needed, error.free)",
        lambda: (getattr(error, "needed", None), getattr(error, "free", None)),
        (1, 0),
        "raise OutOfBlocksError(needed=1, free=0)",
    )
    c.holds(
        f"the manager after {call}",
        _manager_state(manager) == before,
        f"unchanged: {before}",
        _manager_state(manager),
        "a refused append changes nothing: check the free list first",
    )

    fresh = c.run("manager = BlockManager(num_blocks=2, block_size=4)", lambda: manager_class(2, 4))
    before = _manager_state(fresh)
    call = f"manager.append_block_to_sequence('ghost') with {before}"
    c.raises(
        call,
        lambda: fresh.append_block_to_sequence("ghost"),
        KeyError,
        "an unknown sequence is a KeyError: look its table up in sequence_block_tables first",
    )
    c.holds(
        f"the manager after {call}",
        _manager_state(fresh) == before,
        f"unchanged: {before}",
        _manager_state(fresh),
        "the refused call took a block and leaked it: look the sequence up before taking a block",
    )


# ------------------------------------------------------------------------------- Task 3


def _cache(
    num_blocks: int, block_size: int, sequences: list[tuple[Hashable, int, int]]
) -> PagedKVCacheAllocator:
    """A small cache holding ``(seq_id, tokens, spare_blocks)`` sequences, allocated in order."""
    cache = PagedKVCacheAllocator(num_blocks, block_size, 1, 1)
    for seq_id, tokens, spare in sequences:
        cache.allocate_for_sequence(seq_id, tokens)
        for _ in range(spare):
            cache.append_block_to_sequence(seq_id)
    return cache


def _describe(cache: PagedKVCacheAllocator) -> str:
    return "; ".join(
        f"{seq_id!r} holds {cache.sequence_length(seq_id)} tokens in {cache.get_block_mapping(seq_id)}"
        for seq_id in cache.seq_ids
    )


def _state(cache: PagedKVCacheAllocator) -> str:
    return f"{_describe(cache)}; free list {list(cache.snapshot().free_block_ids)}"


def _reference_step(cache: PagedKVCacheAllocator, seq_ids: list[Hashable]) -> dict[Hashable, int | None]:
    taken = {}
    for seq_id in seq_ids:
        new = cache.append_tokens(seq_id, 1)
        taken[seq_id] = new[0] if new else None
    return taken


def _taken_anyway(seq_id: Hashable, blocks_before: list[int], after: PagedKVCacheAllocator) -> str:
    """``""``, or the clause saying that ``after``'s ``append_tokens`` took the block a decode step
    did not: the pool's usage climbs while the step reports no new block."""
    added = after.get_block_mapping(seq_id)[len(blocks_before) :] if seq_id in after else []
    if not added:
        return ""
    return (
        f": cache.append_tokens took block {added[0]} for it itself, so the pool's usage climbs while your "
        "step reports no new block"
    )


def _step_hint(
    before: PagedKVCacheAllocator, got: object, expected: dict, after: PagedKVCacheAllocator | None = None
) -> str:
    """Name the mistake behind a wrong decode step, from the state ``before`` it (and ``after`` it)."""
    if isinstance(got, dict) and set(got) == set(expected):
        for seq_id in expected:
            tokens, blocks = before.sequence_length(seq_id), len(before.get_block_mapping(seq_id))
            held = f"{seq_id!r} holds {tokens} tokens in {blocks} block(s) of {before.block_size}"
            if expected[seq_id] is not None and got[seq_id] is None:
                anyway = _taken_anyway(seq_id, before.get_block_mapping(seq_id), after) if after else ""
                if blocks == 0:
                    return (
                        f"{held}: its first token needs a block (the (n + 1) % block_size check never "
                        f"fires at n = 0){anyway}. Take it with cache.append_block_to_sequence and return "
                        "its id"
                    )
                return (
                    f"{held}: they are full, so its token needs a new block{anyway}. Take it with "
                    "cache.append_block_to_sequence before append_tokens, and return its id"
                )
            if expected[seq_id] is None and got[seq_id] is not None:
                if blocks * before.block_size - tokens >= before.block_size:
                    return (
                        f"{held}: a spare block was reserved ahead and has room, so it takes no block. "
                        "Compare with the capacity, not only num_tokens % block_size"
                    )
                return f"{held}: a slot is still free, so it takes no block; {OFF_BY_ONE}"
    return f"return {{seq_id: the block id taken, or None}} for every sequence; {RULE}"


@task("04.decode_step", "one decode step for a batch, all or nothing")
def _decode_step(c: Checker, decode_step) -> None:
    scenarios = [
        ("one sequence with a free slot", 8, 4, [("a", 3, 0)], ["a"]),
        ("one sequence with a full block", 8, 4, [("b", 4, 0)], ["b"]),
        ("an empty sequence (no block yet)", 8, 4, [("c", 0, 0)], ["c"]),
        ("a full block and a spare block reserved ahead", 8, 4, [("d", 4, 1)], ["d"]),
        ("a batch of three", 8, 4, [("a", 3, 0), ("b", 4, 0), ("c", 0, 0)], ["a", "b", "c"]),
        ("blocks of 1", 8, 1, [("e", 2, 0)], ["e"]),
    ]
    for what, num_blocks, size, sequences, batch in scenarios:
        cache = _cache(num_blocks, size, sequences)
        expected_cache = _cache(num_blocks, size, sequences)
        before = _describe(cache)
        call = f"decode_step(cache, {batch}) with block_size {size} and {before} ({what})"
        got = c.run(call, lambda cache=cache, batch=batch: decode_step(cache, batch))
        expected = _reference_step(expected_cache, batch)
        hint = _step_hint(_cache(num_blocks, size, sequences), got, expected, cache)
        c.equal(call, lambda got=got: got, expected, hint)
        c.holds(
            f"the cache after {call}",
            cache.snapshot() == expected_cache.snapshot(),
            _state(expected_cache),
            _state(cache),
            "every sequence gains exactly one token, and a block only when its blocks were full",
        )

    # Many steps on two sequences of different lengths.
    cache = _cache(16, 4, [("x", 2, 0), ("y", 5, 0)])
    expected_cache = _cache(16, 4, [("x", 2, 0), ("y", 5, 0)])
    got_steps = c.run(
        "[decode_step(cache, ['x', 'y']) for _ in range(8)] with x holding 2 tokens and y 5",
        lambda: [decode_step(cache, ["x", "y"]) for _ in range(8)],
    )
    expected_steps = [_reference_step(expected_cache, ["x", "y"]) for _ in range(8)]
    c.equal(
        "[decode_step(cache, ['x', 'y']) for _ in range(8)] with x holding 2 tokens and y 5",
        lambda: got_steps,
        expected_steps,
        f"x takes a block when it holds 4 and 8 tokens, y when it holds 8 and 12; {RULE}",
    )

    cache = _cache(8, 4, [("a", 3, 0)])
    c.equal("decode_step(cache, [])", lambda: decode_step(cache, []), {}, "no sequences, nothing to do: {}")

    # Exactly enough: three sequences need a block and three are free.
    full = [("a", 4, 0), ("b", 4, 0), ("c", 4, 0)]
    cache, expected_cache = _cache(6, 4, full), _cache(6, 4, full)
    call = f"decode_step(cache, ['a', 'b', 'c']) with {_state(cache)}"
    got = c.run(call, lambda: _refusal_as_value(lambda: decode_step(cache, ["a", "b", "c"])))
    if isinstance(got, OutOfBlocksError):
        c.fail(call, "a block for each of the three", f"OutOfBlocksError: {got}", EXACT_FIT)
    expected = _reference_step(expected_cache, ["a", "b", "c"])
    c.equal(call, lambda: got, expected, _step_hint(_cache(6, 4, full), got, expected))

    # All or nothing: three sequences need a block, one is free.
    cache = _cache(4, 4, [("a", 4, 0), ("b", 4, 0), ("c", 4, 0)])
    before_snapshot, before, before_free = cache.snapshot(), _state(cache), cache.num_free_blocks
    call = f"decode_step(cache, ['a', 'b', 'c']) with {before}"
    error = c.raises(
        call,
        lambda: decode_step(cache, ["a", "b", "c"]),
        OutOfBlocksError,
        "three sequences need a block and only one is free: raise OutOfBlocksError(needed, free)",
    )
    c.holds(
        f"the cache after {call}",
        cache.snapshot() == before_snapshot,
        f"unchanged: {before}",
        _state(cache),
        (
            f"the step took {before_free - cache.num_free_blocks} block(s) before it ran out and kept them "
            "(a leak). "
            if cache.num_free_blocks < before_free
            else ""
        )
        + "all or nothing: count the blocks the batch needs and compare with cache.num_free_blocks "
        "before you take any block or add any token",
    )
    c.holds(
        f"(error.needed, error.free) after {call}",
        (getattr(error, "needed", None), getattr(error, "free", None)) == (3, 1),
        "(3, 1)",
        (getattr(error, "needed", None), getattr(error, "free", None)),
        "raise OutOfBlocksError(needed, free) with the counts of the whole batch",
    )

    # An unknown sequence: the cache's own error, before anything changes.
    cache = _cache(8, 4, [("a", 3, 0), ("b", 4, 0)])
    before_snapshot, before = cache.snapshot(), _state(cache)
    call = f"decode_step(cache, ['a', 'b', 'ghost']) with {before}"
    c.raises(
        call,
        lambda: decode_step(cache, ["a", "b", "ghost"]),
        KeyError,
        "ask the cache about every sequence first (cache.needs_new_block raises UnknownSequenceError)",
    )
    c.holds(
        f"the cache after {call}",
        cache.snapshot() == before_snapshot,
        f"unchanged: {before}",
        _state(cache),
        "all or nothing: look at every sequence before changing any",
    )


# ------------------------------------------------------------------------------- Task 4


EXACT_FIT = (
    "exactly as many blocks are free as are needed, so it fits: refuse only when more blocks are "
    "needed than are free (needed > free, not needed >= free)"
)


def _refusal_as_value(thunk: Callable[[], object]) -> object:
    """``thunk()``, or the ``OutOfBlocksError`` it raised, returned rather than raised."""
    try:
        return thunk()
    except OutOfBlocksError as error:
        return error


def _pool() -> PagedKVCacheAllocator:
    """6 blocks of 4: 'a' holds 8 tokens in [0, 1], 'b' 12 in [2, 3, 4]; block 5 is free."""
    return _cache(6, 4, [("a", 8, 0), ("b", 12, 0)])


def _admit_hint(
    got: object, finished: list[Hashable], waiting: list[tuple[Hashable, int]], admitted: list, hint: str
) -> str:
    """Name a request that skipped ahead of an older one, or one refused although its blocks were
    exactly free, else the case's own hint."""
    if isinstance(got, list) and got == admitted[: len(got)] and len(got) < len(admitted):
        pool = _pool()
        for seq_id in finished:
            pool.free_sequence(seq_id)
        for seq_id, prompt in waiting[: len(got)]:
            pool.allocate_for_sequence(seq_id, prompt)
        refused, prompt = waiting[len(got)]
        if blocks_for_tokens(prompt, pool.block_size) == pool.num_free_blocks:
            free = pool.num_free_blocks
            return f"{refused!r} needs {free} block(s) and {free} are free: {EXACT_FIT}"
    if isinstance(got, list) and got != admitted:
        order = [seq_id for seq_id, _ in waiting]
        for later in got:
            if later in order:
                older = [seq_id for seq_id in order[: order.index(later)] if seq_id not in got]
                if older:
                    return (
                        f"{later!r} skipped ahead of {older[0]!r}, which arrived first and still waits; "
                        f"stop at the first request that does not fit ({hint})"
                    )
    return hint


def _freed_hint(cache: PagedKVCacheAllocator, finished: list[Hashable], hint: str) -> str:
    """Name a finished sequence that still holds its blocks, else the case's own hint."""
    for seq_id in finished:
        if seq_id in cache:
            return (
                f"finished sequence {seq_id!r} still holds its blocks {cache.get_block_mapping(seq_id)}: "
                "free every finished sequence with cache.free_sequence, before admitting anyone"
            )
    return hint


@task("04.finish_and_admit", "free finished requests at once, admit waiting ones")
def _finish_and_admit(c: Checker, finish_and_admit) -> None:
    setup = "'a' holding 8 tokens in [0, 1], 'b' 12 in [2, 3, 4], block 5 free"
    cases = [
        # (finished, waiting, max_running, admitted, remaining, hint)
        (
            ["a"],
            [],
            4,
            [],
            [],
            "free every finished sequence at once with cache.free_sequence",
        ),
        (
            ["a"],
            [("c", 6), ("d", 4)],
            4,
            ["c", "d"],
            [],
            "free first, then admit: a's two blocks and block 5 make room for c (2 blocks) and d (1)",
        ),
        (
            [],
            [("c", 4)],
            4,
            ["c"],
            [],
            "nothing finished, but block 5 is free: c's 4-token prompt fits in it",
        ),
        (
            ["a"],
            [("e", 20), ("f", 1)],
            4,
            [],
            [("e", 20), ("f", 1)],
            "serve in arrival order: e needs 5 blocks and 3 are free, so it waits, and f waits behind it",
        ),
        (
            ["a"],
            [("g", 13)],
            4,
            [],
            [("g", 13)],
            "a 13-token prompt needs ceil(13 / 4) = 4 blocks and 3 are free: use blocks_for_tokens",
        ),
        (
            ["a", "b"],
            [("h", 24)],
            4,
            ["h"],
            [],
            "free all the finished sequences before admitting: 6 blocks hold h's 24 tokens exactly",
        ),
        (
            ["a"],
            [("c", 1), ("d", 1), ("e", 1)],
            3,
            ["c", "d"],
            [("e", 1)],
            "at most max_running sequences run: b, c and d make 3, so e waits",
        ),
    ]
    for finished, waiting_list, max_running, admitted, remaining, hint in cases:
        cache, expected_cache = _pool(), _pool()
        for seq_id in finished:
            expected_cache.free_sequence(seq_id)
        for seq_id, prompt in waiting_list[: len(admitted)]:
            expected_cache.allocate_for_sequence(seq_id, prompt)
        waiting = deque(waiting_list)
        call = (
            f"finish_and_admit(cache, {finished}, deque({waiting_list}), max_running={max_running}) "
            f"with {setup}"
        )
        got = c.run(
            call,
            lambda cache=cache, waiting=waiting, f=finished, m=max_running: finish_and_admit(
                cache, f, waiting, m
            ),
            hint,
        )
        c.equal(call, lambda got=got: got, admitted, _admit_hint(got, finished, waiting_list, admitted, hint))
        c.holds(
            f"the cache after {call}",
            cache.snapshot() == expected_cache.snapshot(),
            _state(expected_cache),
            _state(cache),
            _freed_hint(cache, finished, hint),
        )
        c.holds(
            f"waiting after {call}",
            list(waiting) == remaining,
            f"deque({remaining})",
            f"deque({list(waiting)})",
            "pop each admitted request from the left of the queue, and only those",
        )


# ------------------------------------------------------------------------------- the closing run


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _rule_says(needs_new_block, tokens: int, blocks: int, block_size: int, full: bool) -> str:
    """``""``, or the clause naming what the learner's ``needs_new_block`` returned where it is wrong."""
    if needs_new_block is None:
        return ""
    try:
        said = needs_new_block(tokens, blocks, block_size)
    except Exception as error:  # the learner's bug: name it, the check of 04.needs_new_block shows where
        return (
            f"; your needs_new_block({tokens}, {blocks}, {block_size}) raised {type(error).__name__}: {error}"
        )
    if said == full:
        return ""
    return (
        f"; your needs_new_block({tokens}, {blocks}, {block_size}) returned {said!r}, it should return "
        f"{full}: a new block is needed exactly when num_tokens == num_blocks_held * block_size, and "
        f"{tokens} {'==' if full else '!='} {blocks} * {block_size}"
    )


def step_mistake(
    before: dict[Hashable, tuple[int, list[int]]],
    after: PagedKVCacheAllocator,
    taken: object,
    needs_new_block: Callable[[int, int, int], bool] | None = None,
) -> str | None:
    """What a decode step did wrong, or ``None``: ``before`` is each sequence of the batch's tokens and
    block ids before the step, ``after`` the cache after it, ``taken`` what the step returned; with
    the learner's ``needs_new_block``, what it returned where it is wrong is named too.

    A sequence must gain one token, and a block exactly when the blocks it held were full (the
    block it returned), none otherwise."""
    if not isinstance(taken, dict) or set(taken) != set(before):
        return (
            f"decode_step returned {taken!r}: return {{seq_id: the block id taken, or None}} for every "
            f"sequence of the batch, {list(before)}"
        )
    size = after.block_size
    for seq_id, (tokens, blocks) in before.items():
        full = tokens == len(blocks) * size
        held = f"{seq_id!r} held {_count(tokens, 'token')} in {_count(len(blocks), 'block')} of {size}"
        rule = _rule_says(needs_new_block, tokens, len(blocks), size, full)
        got = taken[seq_id]
        if full and got is None:
            return (
                f"{held}, all full, so its token {tokens + 1} needed a new block, and your decode_step took "
                f"none{_taken_anyway(seq_id, blocks, after)}{rule}"
            )
        if not full and got is not None:
            free = _count(len(blocks) * size - tokens, "slot")
            return (
                f"{held}, {free} still free, so its token {tokens + 1} needed no block, and your "
                f"decode_step took block {got}{rule}"
            )
        added = after.get_block_mapping(seq_id)[len(blocks) :] if seq_id in after else []
        if (added[:1] or [None]) != [got] or len(added) > 1:
            return f"decode_step returned {got!r} for {seq_id!r}, but its block table gained {added}"
        length = after.sequence_length(seq_id) if seq_id in after else None
        if length != tokens + 1:
            return (
                f"{seq_id!r} holds {length} token(s) after the step, not {tokens + 1}: record its one token "
                "with cache.append_tokens(seq_id, 1)"
            )
    return None


def watched_step(
    step: int,
    decode_step: Callable,
    cache: PagedKVCacheAllocator,
    seq_ids: list[Hashable],
    needs_new_block: Callable[[int, int, int], bool] | None = None,
) -> dict[Hashable, int | None]:
    """``decode_step(cache, seq_ids)``, the learner's, as step ``step`` of exercise 04's closing run,
    watched: when a sequence took a block it did not need, or none where its blocks were full (the
    cache's ``append_tokens`` then takes it silently, and the log shows no new block while the usage
    climbs), the run stops with :class:`CheckFailed` naming the sequence, its token, and what the
    learner's ``needs_new_block`` returned (:func:`step_mistake`)."""
    __tracebackhide__ = True
    before = {
        seq_id: (cache.sequence_length(seq_id), list(cache.get_block_mapping(seq_id))) for seq_id in seq_ids
    }
    taken = decode_step(cache, seq_ids)
    problem = step_mistake(before, cache, taken, needs_new_block)
    if problem:
        raise CheckFailed(
            f"{FAIL} step {step} went wrong: {problem}.\n  The run stops here; run the checks of the tasks "
            "above: they name the mistake"
        )
    return taken

"""Checks of exercise 13: the tokens a sliding window skips, the blocks it frees, the hybrid prefix-cache hit.

Each task is checked on examples that isolate one rule (the token itself inside its window, no negative
count, only whole blocks before the window freed, the null block never freed, the groups asked again at a
shorter length...), then against the package on many cases: ``num_skipped_tokens`` against
:class:`~paged_kv.core.kv_cache_groups.SlidingWindowSpec`, ``remove_skipped_blocks`` against
:class:`~paged_kv.core.single_type_kv_cache_manager.SlidingWindowManager` on a pool holding the table's
blocks, and ``hybrid_hit`` against a :class:`~paged_kv.core.kv_cache_coordinator.KVCacheCoordinator`
with prefix caching whose groups cached a prompt and then lost the blocks the flags say are gone (the
package's reference, :mod:`paged_kv.reference.lesson13`). When an answer is wrong, the check runs the
learner's code beside the classic mistakes, written as small wrong implementations, and names the one it
behaves like (:func:`~paged_kv.checks._core.diagnose`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from paged_kv.checks._core import Checker, answers, diagnose, task
from paged_kv.core.kv_cache_groups import SlidingWindowSpec
from paged_kv.reference.lesson13 import hybrid_hit as package_hit
from paged_kv.reference.lesson13 import remove_skipped_blocks as package_remove

# ------------------------------------------------------------------------------- Task 1

SKIP_RULE = (
    "the next token sits at position num_computed_tokens and reads the sliding_window positions "
    "num_computed_tokens - sliding_window + 1 .. num_computed_tokens, itself included; the tokens before "
    "those are skipped: max(0, num_computed_tokens - sliding_window + 1)"
)
ITSELF = (
    "off by one: the window counts the token itself. The next token, at position num_computed_tokens, "
    "reads num_computed_tokens - sliding_window + 1 .. num_computed_tokens, so "
    "num_computed_tokens - sliding_window + 1 tokens come before it, not num_computed_tokens - sliding_window"
)
NEGATIVE = (
    "a count of tokens is never negative: while fewer tokens than the window are computed, the window "
    "still reaches back to token 0 and nothing is skipped; take max(0, ...)"
)
BLOCKS = (
    "you used the block size: the skipped tokens are counted in tokens, and no block size enters the rule. "
    "Task 2 turns the tokens into whole blocks (num_skipped_tokens // block_size)"
)


def _itself(n: int, window: int) -> int:
    return max(0, n - window)


def _negative(n: int, window: int) -> int:
    return n - window + 1


def _itself_negative(n: int, window: int) -> int:
    return n - window


def _in_blocks(size: int, whole: bool) -> Callable[[int, int], int]:
    def skipped(n: int, window: int) -> int:
        blocks = max(0, n - window + 1) // size
        return blocks * size if whole else blocks

    return skipped


SKIP_MISTAKES: list[tuple[Callable[[int, int], int], str]] = [
    (_itself, ITSELF),
    (_negative, NEGATIVE),
    (_itself_negative, f"{ITSELF}; and {NEGATIVE}"),
    *[(_in_blocks(size, whole), BLOCKS) for size in (2, 4, 8, 16, 32) for whole in (False, True)],
]
SKIP_GRID = [(n, window) for window in (1, 2, 3, 4, 5, 8, 16) for n in range(0, 40)]


def _skip_hint(skipped: Callable[..., object]) -> str:
    return diagnose(skipped, SKIP_MISTAKES, answers(SKIP_GRID, convert=lambda x: x), SKIP_RULE)


def _package_skipped(n: int, window: int) -> int:
    return SlidingWindowSpec(block_size=1, sliding_window=window).num_skipped_tokens(n)


@task("13.num_skipped_tokens", "the tokens a sliding window skips", needs=("num_skipped_tokens",))
def _num_skipped_tokens(c: Checker, skipped) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _skip_hint(skipped)

    examples = [  # (num_computed_tokens, sliding_window, what the window of the next token reads)
        (7, 4, "the next token, at position 7, reads 4..7: tokens 0..3 are skipped"),
        (8, 4, "the next token, at position 8, reads 5..8"),
        (3, 4, "the next token, at position 3, reads 0..3: nothing is skipped"),
        (4, 4, "the next token, at position 4, reads 1..4"),
        (0, 4, "no token computed yet"),
        (2, 4, "fewer tokens than the window"),
        (5, 1, "a window of one token reads the token itself only"),
        (1023, 1024, "Gemma 3's window: position 1023 reads 0..1023"),
        (1024, 1024, "position 1024 reads 1..1024"),
        (32768, 1024, "a 32k-token request"),
    ]
    for n, window, why in examples:
        c.equal(
            f"num_skipped_tokens({n}, {window})  # {why}",
            lambda n=n, window=window: skipped(n, window),
            _package_skipped(n, window),
            hint,
        )
    result = c.run("num_skipped_tokens(7, 4)", lambda: skipped(7, 4))
    c.holds(
        "type(num_skipped_tokens(7, 4))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a number of tokens is an int: use integer arithmetic (max, -, +), no float",
    )
    grid = [(n, w) for w in range(1, 13) for n in range(0, 41)] + [(n, 4096) for n in (0, 4095, 4096, 131072)]
    call = (
        f"num_skipped_tokens(n, w) on {len(grid)} cases against SlidingWindowSpec(...).num_skipped_tokens(n)"
    )
    wrong = c.run(
        call, lambda: next((case for case in grid if skipped(*case) != _package_skipped(*case)), None)
    )
    if wrong is not None:
        c.equal(f"num_skipped_tokens{wrong}", lambda: skipped(*wrong), _package_skipped(*wrong), hint)
    c.holds(call, wrong is None, "the package's answer on every case", wrong)


# ------------------------------------------------------------------------------- Task 2

FREE_RULE = (
    "the blocks wholly before the window are the first num_skipped_tokens(...) // block_size entries; walk "
    "them from the last one down, stop at the first entry that is null already, and for each other one "
    "list it as freed and put null_block in its place; return (new table, freed)"
)
FREES_LIVE = (
    "you freed a block that still holds a position in the window: only blocks wholly before it go, the "
    "first num_skipped_tokens // block_size entries (rounded down). Rounding up frees the block that holds "
    "the window's first token"
)
REFREES_NULL = (
    "the null block is never freed: an entry that is null already left the window in an earlier call. "
    "Stop at the first null entry (walking from the last skipped block down) and list only real blocks"
)
LEFT_IN_TABLE = (
    "the freed blocks are still in the table: put null_block in the place of each block you free, so that "
    "the table keeps its length and every position keeps its slot, and the freed ids can serve others"
)
ORDER = (
    "the right blocks in the wrong order: list them from the last skipped block down to the first, the "
    "order vLLM frees them in (_remove_blocks_in_range walks backward, stopping at the first null entry)"
)
NOT_A_COPY = "return a new list and leave block_ids as it was: work on a copy, list(block_ids)"


def _skipped_blocks(n: int, window: int, size: int, rounding: str = "floor") -> int:
    skipped = max(0, n - window + 1)
    return -(-skipped // size) if rounding == "ceil" else skipped // size


def _remove(
    block_ids: list,
    n: int,
    window: int,
    size: int,
    null: int = 0,
    *,
    rounding: str = "floor",
    stop_at_null: bool = True,
    write_null: bool = True,
    backward: bool = True,
) -> tuple[list, list]:
    """The rule, or a classic mistake (a keyword changed)."""
    table = list(block_ids)
    count = min(_skipped_blocks(n, window, size, rounding), len(table))
    freed = []
    order = range(count - 1, -1, -1) if backward else range(count)
    for i in order:
        if table[i] == null:
            if stop_at_null and backward:
                break
            if stop_at_null:
                continue
        freed.append(table[i])
        if write_null:
            table[i] = null
    return table, freed


FREE_MISTAKES: list[tuple[Callable[..., tuple], str]] = [
    (lambda *a: _remove(*a, rounding="ceil"), FREES_LIVE),
    (lambda *a: _remove(*a, rounding="ceil", stop_at_null=False), f"{FREES_LIVE}; and {REFREES_NULL}"),
    (lambda *a: _remove(*a, stop_at_null=False), REFREES_NULL),
    (lambda *a: _remove(*a, stop_at_null=False, backward=False), REFREES_NULL),
    (lambda *a: _remove(*a, write_null=False), LEFT_IN_TABLE),
    (lambda *a: _remove(*a, write_null=False, stop_at_null=False), LEFT_IN_TABLE),
    (lambda *a: _remove(*a, backward=False), ORDER),
]


def _normal(result: object) -> object:
    """A ``(table, freed)`` answer as two plain lists, for comparing; anything else as it is."""
    if isinstance(result, tuple | list) and len(result) == 2:
        try:
            return list(result[0]), list(result[1])
        except TypeError:  # not two sequences: compared as it is
            return result
    return result


def _free_probe_cases() -> list[tuple]:
    """Cases around every rule: boundaries, tables with null entries, several blocks at once."""
    cases = []
    for size in (1, 2, 4):
        for window in (2, 3, 4, 5, 8):
            for nulls in (0, 1, 2):
                table = [0] * nulls + [11, 12, 13, 14, 15, 16][: 6 - nulls]
                cases += [(table, n, window, size) for n in range(0, 6 * size + 3)]
    return cases


def _free_hint(remove: Callable[..., object]) -> str:
    def probe(fn: Callable[..., object]) -> list:
        return [_normal(fn(list(table), n, w, s)) for table, n, w, s in _free_probe_cases()]

    return diagnose(remove, FREE_MISTAKES, probe, FREE_RULE)


def _random_tables(count: int, seed: int) -> list[tuple]:
    """Tables with a run of null entries first, as a sliding group's are, and any numbers."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        size, window = rng.choice((1, 2, 3, 4, 16)), rng.randint(1, 40)
        length = rng.randint(0, 9)
        nulls = rng.randint(0, length)
        table = [0] * nulls + rng.sample(range(1, 200), length - nulls)
        cases.append((table, rng.randint(0, (length + 2) * size), window, size))
    return cases


@task("13.remove_skipped_blocks", "the blocks a sliding window frees", needs=("remove_skipped_blocks",))
def _remove_skipped_blocks(c: Checker, remove) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _free_hint(remove)

    def expect(table: list, n: int, window: int, size: int, why: str, null: int = 0) -> list:
        args = f"{table}, {n}, {window}, {size}" + (f", null_block={null}" if null else "")
        call = f"remove_skipped_blocks({args})  # {why}"
        given = list(table)
        got = c.run(
            call,
            lambda: (
                remove(given, n, window, size, null_block=null) if null else remove(given, n, window, size)
            ),
        )
        c.holds(
            call,
            isinstance(got, tuple) and len(got) == 2 and all(isinstance(part, list) for part in got),
            "a tuple of two lists: (new_block_ids, freed)",
            repr(got),
            "return the new table and the freed blocks, as a tuple of two lists",
        )
        expected = list(package_remove(table, n, window, size, null))
        c.equal(call, lambda: _normal(got), (list(expected[0]), list(expected[1])), hint)
        c.holds(f"block_ids after {call}", given == table, repr(table), repr(given), NOT_A_COPY)
        return expected[0]

    expect([7, 3, 9, 4], 0, 4, 2, "nothing computed: nothing is skipped")
    expect([5, 6, 7], 6, 4, 4, "the window of position 6 is 3..6: block 5 still holds position 3")
    expect([5, 6, 7], 7, 4, 4, "the window of position 7 is 4..7: block 5 (positions 0..3) leaves it")
    expect([5, 6, 7, 8, 9], 9, 4, 2, "the window of position 9 is 6..9: three blocks of 2 leave at once")
    expect([0, 0, 7, 8, 9, 4], 11, 4, 2, "blocks 0 and 1 left in an earlier call: only 7 and 8 go now")
    expect([0, 0, 7], 7, 4, 2, "nothing new leaves: the skipped blocks are null already")
    expect([5, 6], 9, 2, 2, "4 blocks' worth skipped, but the table holds only 2")
    expect([99, 3, 4, 5], 9, 4, 2, "this pool's null block is 99", null=99)
    # vLLM's test_sliding_window_remove_skipped_blocks: 11 blocks of 2, window 4, calls one after another.
    table = list(range(1, 12))
    for n in (0, 4, 5, 6, 7, 11):
        table = expect(table, n, 4, 2, "the table the previous call returned")
    cases = _random_tables(400, 13)
    call = (
        f"remove_skipped_blocks(...) on {len(cases)} random tables against "
        "SlidingWindowManager.remove_skipped_blocks"
    )

    def first_wrong() -> tuple | None:
        for table, n, window, size in cases:
            if _normal(remove(list(table), n, window, size)) != package_remove(table, n, window, size):
                return table, n, window, size
        return None

    wrong = c.run(call, first_wrong)
    if wrong is not None:
        expect(*wrong, "a random table")
    c.holds(call, wrong is None, "the package's answer on every table", wrong)


# ------------------------------------------------------------------------------- Task 3

HIT_RULE = (
    "start from (num_tokens - 1) // block_size blocks and ask each group in turn for its longest hit no "
    "longer than that: a full-attention group needs every block from the start cached; a sliding group "
    "needs a run of ceil((window - 1) / block_size) cached blocks ending at the hit, or a shorter run "
    "starting at block 0. Each answer becomes the new length; repeat until no group shortens it"
)
MIN_OF_HITS = (
    "you took the shortest of the groups' own hits: a sliding group's hit at a shorter length needs "
    "other blocks (the window of the first uncomputed token moves with the length), so ask it again at "
    "the shorter length, until no group shortens it (a fixed point)"
)
ONE_PASS = (
    "one pass over the groups is not enough: when a later group shortens the length, an earlier sliding "
    "group must be asked again at that length; repeat the pass until no group shortens it"
)
SLIDING_AS_FULL = (
    "a sliding group was asked for every block from the start, as a full-attention group is: its first "
    "uncomputed token reads only the last ceil((window - 1) / block_size) blocks of the hit, so the blocks "
    "before those may be gone"
)
NEED_OFF_BY_ONE = (
    "the blocks a sliding hit needs are off by one: the first uncomputed token reads the window - 1 "
    "tokens before it (the window counts the token itself), so a hit ends with "
    "ceil((window - 1) / block_size) cached blocks, not window // block_size or ceil(window / block_size)"
)
CAP = (
    "the hit is at most (num_tokens - 1) // block_size blocks: the last token is always computed (its "
    "logits give the next token), so a prompt of whole blocks cannot hit its last block"
)


def _full_hit(flags: list, length: int) -> int:
    hit = 0
    while hit < length and flags[hit]:
        hit += 1
    return hit


def _sliding_hit(flags: list, length: int, need: int) -> int:
    if need <= 0:
        return length
    run = 0
    for i in range(length - 1, -1, -1):
        run = run + 1 if flags[i] else 0
        if run >= need:
            return i + run
    return run


def _need(window: int, size: int, how: str) -> int:
    if how == "floor":
        return window // size
    if how == "ceil_window":
        return -(-window // size)
    return -(-(window - 1) // size)


def _hit(
    cached: list,
    windows: list,
    size: int,
    num_tokens: int,
    *,
    cap: str = "minus_one",
    need: str = "right",
    sliding_as_full: bool = False,
    passes: int | None = None,
    min_of_own: bool = False,
) -> int:
    """The rule, or a classic mistake (a keyword changed)."""
    length = (num_tokens - 1) // size if cap == "minus_one" else num_tokens // size

    def ask(flags: list, window: int | None, at: int) -> int:
        if window is None or sliding_as_full:
            return _full_hit(flags, at)
        return _sliding_hit(flags, at, _need(window, size, need))

    if min_of_own:
        return min(ask(flags, window, length) for flags, window in zip(cached, windows, strict=True))
    done = 0
    while passes is None or done < passes:
        candidate = length
        for flags, window in zip(cached, windows, strict=True):
            length = ask(flags, window, length)
        done += 1
        if length == candidate:
            break
    return length


HIT_MISTAKES: list[tuple[Callable[..., int], str]] = [
    (lambda *a: _hit(*a, min_of_own=True), MIN_OF_HITS),
    (lambda *a: _hit(*a, passes=1), ONE_PASS),
    (lambda *a: _hit(*a, sliding_as_full=True), SLIDING_AS_FULL),
    (lambda *a: _hit(*a, need="floor"), NEED_OFF_BY_ONE),
    (lambda *a: _hit(*a, need="ceil_window"), NEED_OFF_BY_ONE),
    (lambda *a: _hit(*a, cap="whole"), CAP),
]

T, F = True, False
# (cached per group, windows, block_size, num_tokens, why): each isolates one rule
HIT_EXAMPLES = [
    ([[T, T, F, T]], [None], 2, 9, "full attention: every block from the start"),
    ([[T, T, T, T]], [None], 4, 16, "a prompt of whole blocks: its last block is never a hit"),
    (
        [[F, F, T, T, T]],
        [4],
        2,
        11,
        "window 4, blocks of 2: the hit must end with ceil(3 / 2) = 2 cached blocks",
    ),
    ([[T, F, F, F]], [9], 2, 9, "window 9 needs 4 blocks; a shorter run from block 0 is a hit too"),
    ([[F, T, F, T, F, T]], [6], 4, 25, "window 6, blocks of 4: ceil(5 / 4) = 2 blocks, not 6 // 4 = 1"),
    ([[F, F, F, T]], [5], 4, 17, "window 5, blocks of 4: ceil(4 / 4) = 1 block, not ceil(5 / 4) = 2"),
    (
        [[T, T, T, F, T, T], [T, F, T, T, T, T]],
        [None, 4],
        2,
        13,
        "the full group hits 3 blocks; at 3 the sliding group needs blocks 1 and 2",
    ),
    (
        [[T, T, T, T, T, T], [F, T, T, T, F, T], [T, T, F, T, T, T]],
        [None, 4, 5],
        2,
        13,
        "the last group shortens the length; the middle one must be asked again",
    ),
    ([[F, F, F], [F, F, F]], [None, 8], 4, 14, "nothing cached: no hit"),
    ([[T, T, T, T, T]], [100], 4, 20, "a window longer than the prompt needs every block from the start"),
]


def _hit_probe_cases() -> list[tuple]:
    cases = [(cached, windows, size, n) for cached, windows, size, n, _ in HIT_EXAMPLES]
    return cases + _random_hits(150, 31)


def _random_hits(count: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        size = rng.choice((1, 2, 4))
        num_tokens = rng.randint(2, 14 * size)
        windows = [rng.choice((None, rng.randint(2, 12))) for _ in range(rng.randint(1, 3))]
        odds = rng.choice((0.5, 0.75, 0.9))
        cached = [[rng.random() < odds for _ in range(num_tokens // size)] for _ in windows]
        cases.append((cached, windows, size, num_tokens))
    return cases


def _hit_hint(hit: Callable[..., object]) -> str:
    def probe(fn: Callable[..., object]) -> list:
        return [
            fn([list(f) for f in cached], list(windows), size, n)
            for cached, windows, size, n in _hit_probe_cases()
        ]

    return diagnose(hit, HIT_MISTAKES, probe, HIT_RULE)


def _show(cached: list) -> str:
    return "[" + ", ".join("[" + ", ".join("T" if f else "F" for f in flags) + "]" for flags in cached) + "]"


@task("13.hybrid_hit", "the prefix-cache hit every group agrees on", needs=("hybrid_hit",))
def _hybrid_hit(c: Checker, hit) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _hit_hint(hit)

    def expect(cached: list, windows: list, size: int, n: int, why: str) -> None:
        c.equal(
            f"hybrid_hit({_show(cached)}, {windows}, {size}, {n})  # {why}",
            lambda: hit([list(f) for f in cached], list(windows), size, n),
            package_hit(cached, windows, size, n),
            hint,
        )

    for cached, windows, size, n, why in HIT_EXAMPLES:
        expect(cached, windows, size, n, why)
    result = c.run("hybrid_hit([[T, T]], [None], 2, 5)", lambda: hit([[T, T]], [None], 2, 5))
    c.holds(
        "type(hybrid_hit([[T, T]], [None], 2, 5))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a number of blocks is an int",
    )
    cases = _random_hits(300, 47)
    call = f"hybrid_hit(...) on {len(cases)} random prompts against KVCacheCoordinator.get_computed_blocks"
    wrong = c.run(
        call,
        lambda: next(
            (
                case
                for case in cases
                if hit([list(f) for f in case[0]], list(case[1]), case[2], case[3]) != package_hit(*case)
            ),
            None,
        ),
    )
    if wrong is not None:
        expect(*wrong, "a random prompt")
    c.holds(call, wrong is None, "the coordinator's hit on every prompt", wrong)

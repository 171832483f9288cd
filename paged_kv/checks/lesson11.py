"""Checks of exercise 11: admission with a watermark, victims and their requeueing, swapping K/V out and in,
and the victims of vLLM's priority policy.

The admission rule is vLLM's, the engine's: the prompt's blocks, and the watermark's blocks only while
another request runs, with no headroom for the running requests' growth. It is checked on examples at
the boundary, then against the engine's own memory, :class:`paged_kv.core.kv_cache_manager.KVCacheManager`,
on a grid of cases one block on either side of the rule. The victims are checked on small cases that
each isolate one mistake, then against the package's answer
(:func:`paged_kv.reference.lesson11.choose_victims`, the scheduler's preemption on plain
numbers) on random cases. The swap round trip runs on a :class:`~paged_kv.kv.cache.PagedKVCacheAllocator`
on the default device whose pool starts full of stale random K/V and whose freed blocks are overwritten
before the sequence comes back, so a copy that is not a copy, a block that is not written, or a token
lost on the way gives a visibly wrong answer. When an answer is wrong, the check looks for the classic
mistakes and names the one it finds.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable

import torch

from paged_kv.checks._core import Checker, answers, diagnose, task
from paged_kv.checks.lesson03 import kv_mixup
from paged_kv.core.kv_cache_manager import KVCacheManager, watermark_blocks
from paged_kv.device import default_device
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.reference.lesson11 import choose_victims as package_victims
from paged_kv.reference.lesson11 import priority_victims as package_priority_victims
from paged_kv.serving.request import EngineCoreRequest

# ------------------------------------------------------------------------------- Task 1

RULE = (
    "admit when prompt_blocks + keep <= num_free_blocks, keep = ceil(watermark * num_blocks) while "
    "another request runs (num_running > 0) and 0 when none does: the prompt's blocks, and the "
    "watermark's only beside running requests (vLLM's rule)"
)
HEADROOM = (
    "keep no block of headroom per running sequence: vLLM admits a request when its prompt's blocks are "
    "free (and the watermark's, while others run), into a pool that the next decode may find full; "
    "when a running request's next token then finds no block, the newest running request is "
    "preempted. Drop the num_running (+ 1) blocks"
)
WATERMARK_ALONE = (
    "the watermark is kept only while another request runs: vLLM applies it only when some request "
    "is scheduled (has_scheduled_reqs). Alone, a request needs no watermark, so a request resumed by "
    "recompute, whose prompt now holds its output too, always comes back. Keep "
    "ceil(watermark * num_blocks) blocks free only when num_running > 0"
)


def _keep(running: int, num_blocks: int, watermark: float, rounding: Callable = math.ceil) -> int:
    """The blocks the rule keeps free: the watermark's, rounded by ``rounding``, while others run; else 0."""
    return rounding(watermark * num_blocks) if running else 0


def _old_rule(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + running + 1 + watermark_blocks(watermark, num_blocks) <= free


def _headroom(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + running + 1 + _keep(running, num_blocks, watermark) <= free


def _headroom_of_others(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + running + _keep(running, num_blocks, watermark) <= free


def _old_headroom_of_others(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + running + watermark_blocks(watermark, num_blocks) <= free


def _watermark_alone(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + watermark_blocks(watermark, num_blocks) <= free


def _rounds_down(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + _keep(running, num_blocks, watermark, int) <= free


def _of_free(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + _keep(running, free, watermark) <= free


def _no_watermark(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks <= free


def _strict(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    return blocks + _keep(running, num_blocks, watermark) < free


ADMISSION_MISTAKES: list[tuple[Callable[..., bool], str]] = [
    (_old_rule, HEADROOM),
    (_headroom, HEADROOM),
    (_headroom_of_others, HEADROOM),
    (_old_headroom_of_others, HEADROOM),
    (_watermark_alone, WATERMARK_ALONE),
    (
        _rounds_down,
        "the watermark is rounded down: 1 % of 50 blocks is half a block, and int() keeps none free. The "
        "course rounds up, math.ceil(watermark * num_blocks), so that any watermark above 0 keeps at least "
        "one block (vLLM 0.33.0 rounds down)",
    ),
    (
        _of_free,
        "the watermark is a fraction of all the blocks, num_blocks, not of the blocks free now: "
        "ceil(watermark * num_blocks)",
    ),
    (
        _no_watermark,
        "the watermark is ignored: while another request runs, keep ceil(watermark * num_blocks) blocks "
        "free besides the prompt's",
    ),
    (_strict, "exactly enough free blocks is enough: compare with <=, not <"),
]

# (num_free_blocks, prompt_blocks, num_running, num_blocks, watermark) on both sides of the rule
BOUNDARY = [
    (3, 3, 2, 40, 0.0, True),
    (2, 3, 2, 40, 0.0, False),
    (3, 3, 0, 40, 0.0, True),
    (2, 3, 0, 40, 0.0, False),
    (7, 3, 2, 40, 0.1, True),
    (6, 3, 2, 40, 0.1, False),
    (4, 3, 1, 50, 0.01, True),
    (3, 3, 1, 50, 0.01, False),
    (14, 4, 5, 100, 0.1, True),
    (13, 4, 5, 100, 0.1, False),
    (1, 1, 0, 16, 0.5, True),
    (0, 1, 0, 16, 0.5, False),
    (9, 1, 1, 16, 0.5, True),
    (8, 1, 1, 16, 0.5, False),
    (10, 10, 0, 16, 0.5, True),
]
GRID_BLOCKS = (12, 40, 50, 100)
GRID_WATERMARKS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)


def _engine_admits(free: int, blocks: int, running: int, num_blocks: int, watermark: float) -> bool:
    """The engine's answer: its memory, with ``free`` blocks free, asked for a prompt of ``blocks``
    blocks of one token (vLLM's ``allocate_slots`` with the whole prompt to fit)."""
    memory = KVCacheManager(num_blocks, 1, watermark=watermark)  # its block 0, the null block, never free
    others = num_blocks - 1 - free
    if others:
        memory.allocate_slots(EngineCoreRequest("others", others, 1), others, has_scheduled_reqs=False)
    request = EngineCoreRequest("new", blocks, 1)
    taken = memory.allocate_slots(request, blocks, num_tokens_to_fit=blocks, has_scheduled_reqs=running > 0)
    return taken is not None


def _grid() -> list[tuple[int, int, int, int, float]]:
    """Cases one block short of the rule, exactly at it and one block over."""
    cases = []
    for num_blocks in GRID_BLOCKS:
        for watermark in GRID_WATERMARKS:
            for blocks in (1, 3):
                for running in (0, 2, 5):
                    needed = blocks + _keep(running, num_blocks, watermark)
                    cases += [
                        (free, blocks, running, num_blocks, watermark)
                        for free in range(needed - 1, needed + 2)
                    ]
    return [case for case in cases if 0 <= case[0] < case[3]]  # the pool's null block is never free


def _admission_hint(admit: Callable[..., object]) -> str:
    """The classic mistake that ``admit`` makes on the grid, else the rule."""
    return diagnose(admit, ADMISSION_MISTAKES, answers(_grid()), RULE)


def _needs(blocks: int, running: int, num_blocks: int, watermark: float) -> str:
    """What a boundary case needs, in words, for the call's comment."""
    if not running:
        return f"needs {blocks} prompt block(s); nothing runs, so nothing is kept free"
    kept = _keep(running, num_blocks, watermark)
    return f"needs {blocks} prompt block(s) + {kept} kept free beside {running} running"


@task("11.admit_with_watermark", "admission with a watermark", needs=("admit_with_watermark",))
def _admit_with_watermark(c: Checker, admit) -> None:
    hint = _admission_hint(admit)
    for free, blocks, running, num_blocks, watermark, expected in BOUNDARY:
        c.equal(
            f"admit_with_watermark({free}, {blocks}, {running}, {num_blocks}, {watermark})  "
            f"# {_needs(blocks, running, num_blocks, watermark)}",
            lambda args=(free, blocks, running, num_blocks, watermark): bool(admit(*args)),
            expected,
            hint,
        )
    result = c.run("admit_with_watermark(3, 3, 2, 40, 0.0)", lambda: admit(3, 3, 2, 40, 0.0))
    c.holds(
        "type(admit_with_watermark(3, 3, 2, 40, 0.0))",
        type(result) is bool,
        "bool",
        type(result).__name__,
        "return the comparison itself, True or False",
    )
    grid = _grid()
    engine = {case: _engine_admits(*case) for case in grid}
    call = f"admit_with_watermark(...) on {len(grid)} cases one block either side of the rule"
    wrong = c.run(call, lambda: next((case for case in grid if bool(admit(*case)) != engine[case]), None))
    if wrong is not None:
        c.equal(f"admit_with_watermark{wrong}", lambda: bool(admit(*wrong)), engine[wrong], hint)
    c.holds(
        call,
        wrong is None,
        "the answers of the engine's memory (KVCacheManager.allocate_slots for the whole prompt)",
        wrong,
    )


# ------------------------------------------------------------------------------- Task 2

VICTIMS_RULE = (
    "take sequences from the end of running (the newest), as vLLM's scheduler pops self.running, until "
    "the others' next tokens fit: each victim's blocks become free, and it no longer needs a block itself"
)
NEVER_OLDEST = (
    "never preempt the oldest sequence: with nothing left running, nothing would finish (vLLM's loop would "
    "preempt the request itself; the engine rules that out by refusing a request that cannot run alone "
    "in the whole pool). When only the oldest is left and it still does not fit, raise "
    "OutOfBlocksError(needed, free)"
)


def _victims(running: list, free: int, *, newest_first=True, frees=True, need_leaves=True) -> list:
    """The rule, or a classic mistake (a keyword set to False); raises when the oldest alone does not fit."""
    return _take(running[::-1] if newest_first else running, free, frees=frees, need_leaves=need_leaves)


def _take(order: list, free: int, *, frees=True, need_leaves=True) -> list:
    """Take the entries of ``order`` (``(seq_id, blocks, needs_block, ...)``, the first preempted
    first) until the others' needs fit; raises when only the last one is left and it does not."""
    needed = sum(entry[2] for entry in order)
    victims = []
    while needed > free:
        if len(victims) == len(order) - 1:
            raise OutOfBlocksError(needed, free)
        seq_id, blocks, needs, *_ = order[len(victims)]
        victims.append(seq_id)
        free += blocks if frees else 0
        needed -= needs if need_leaves else 0
    return victims


VICTIM_MISTAKES: list[tuple[Callable[[list, int], list], str]] = [
    (
        lambda running, free: _victims(running, free, newest_first=False),
        "you preempted the oldest sequences first: preempt the newest first (the end of running), so that "
        "the requests that came first keep their place (first come, first served)",
    ),
    (
        lambda running, free: _victims(running, free)[::-1],
        "the right victims in the wrong order: list them newest first, the order they are preempted in",
    ),
    (
        lambda running, free: _victims(running, free, frees=False),
        "a victim's blocks become free: add its blocks to the free count, and the sequences left may fit",
    ),
    (
        lambda running, free: _victims(running, free, need_leaves=False),
        "a victim does not decode in this step: take its needs_block out of the blocks the step needs",
    ),
]

# (running, num_free_blocks, expected victims): each case tells one mistake from the rule
VICTIM_CASES = [
    ([("a", 3, True), ("b", 2, True)], 2, []),
    ([("a", 3, False), ("b", 2, False)], 0, []),
    ([("a", 3, True), ("b", 2, True), ("c", 2, True)], 1, ["c"]),
    ([("a", 4, True), ("b", 1, True), ("c", 1, True), ("d", 1, True)], 0, ["d", "c"]),
    ([("a", 4, True), ("b", 2, False)], 0, ["b"]),
    ([("a", 4, True), ("b", 1, True), ("c", 0, True)], 2, ["c"]),
    ([("a", 1, True), ("b", 3, True), ("c", 2, True), ("d", 2, False)], 1, ["d"]),
]


def _random_cases(count: int, seed: int) -> list[tuple[list, int]]:
    """Random cases where the oldest alone fits, so that every answer is a list."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        running = [(f"s{i}", rng.randint(0, 5), rng.random() < 0.6) for i in range(rng.randint(1, 8))]
        free = rng.randint(0, 4)
        try:
            package_victims(running, free)
        except OutOfBlocksError:
            continue
        cases.append((running, free))
    return cases


def _outcome(choose: Callable[..., object], running: list, free: int) -> object:
    try:
        return choose(list(running), free)
    except Exception as error:  # the learner's bug, or a mistake that raises: compared by type
        return type(error)


def _victims_hint(choose: Callable[..., object]) -> str:
    """The classic mistake that ``choose`` makes on the examples and random cases, else the rule."""
    cases = [(running, free) for running, free, _ in VICTIM_CASES] + _random_cases(100, 81)
    answers = [_outcome(choose, *case) for case in cases]
    for mistake, hint in VICTIM_MISTAKES:
        if answers == [_outcome(mistake, *case) for case in cases]:
            return hint
    return VICTIMS_RULE


REQUEUED_AT_THE_BACK = (
    "the victims went to the back of the queue: they arrived before every request still waiting, so they "
    "go to the front (first come, first served)"
)
REQUEUE_MISTAKES: list[tuple[Callable[[deque, list], None], str]] = [
    (lambda waiting, victims: waiting.extend(victims), REQUEUED_AT_THE_BACK),
    (lambda waiting, victims: waiting.extend(victims[::-1]), REQUEUED_AT_THE_BACK),
    (
        lambda waiting, victims: waiting.extendleft(victims[::-1]),
        "the victims are at the front but the newest first: the oldest victim was admitted first, so it "
        "comes first (appendleft each victim in the order given, or waiting.extendleft(victims))",
    ),
]
REQUEUE_RULE = (
    "put the victims at the front of waiting, in place, the oldest victim first: appendleft each victim in "
    "the order given (newest first), or waiting.extendleft(victims)"
)
REQUEUE_CASES = [(["w1", "w2"], ["c", "b"]), ([], ["b"]), (["w1"], []), (["w1"], ["d", "c", "b"])]


def _requeue_hint(got: list, waiting: list, victims: list) -> str:
    for mistake, hint in REQUEUE_MISTAKES:
        queue = deque(waiting)
        mistake(queue, list(victims))
        if got == list(queue):
            return hint
    if got == waiting:
        return "change waiting itself, in place (the engine keeps that deque); return nothing"
    return REQUEUE_RULE


@task("11.choose_victims", "who is preempted, and where they wait", needs=("choose_victims", "requeue"))
def _choose_victims(c: Checker, choose_victims, requeue) -> None:
    hint = _victims_hint(choose_victims)
    for running, free, expected in VICTIM_CASES:
        c.equal(
            f"choose_victims({running}, {free})",
            lambda running=running, free=free: choose_victims(list(running), free),
            expected,
            hint,
        )
    running = [("a", 2, True), ("b", 1, True), ("c", 1, True)]
    given = list(running)
    c.run(f"choose_victims({given}, 0)", lambda: choose_victims(given, 0))
    c.holds(
        f"running after choose_victims({running}, 0)",
        given == running,
        repr(running),
        repr(given),
        "leave running as it is (the engine still holds it): take victims by index, or from a copy",
    )
    for running in ([("a", 5, True), ("b", 0, False)], [("a", 5, True)]):
        c.raises(
            f"choose_victims({running}, 0)  # even 'a' alone does not fit",
            lambda running=running: choose_victims(list(running), 0),
            OutOfBlocksError,
            NEVER_OLDEST,
        )
    cases = _random_cases(300, 80)
    call = "choose_victims(running, free) on 300 random cases"
    wrong = c.run(
        call,
        lambda: next(
            (case for case in cases if _outcome(choose_victims, *case) != package_victims(*case)), None
        ),
    )
    if wrong is not None:
        running, free = wrong
        c.equal(
            f"choose_victims({running}, {free})",
            lambda: choose_victims(list(running), free),
            package_victims(running, free),
            hint,
        )
    c.holds(call, wrong is None, "the package's answers (the scheduler's preemption on these numbers)", wrong)

    for waiting, victims in REQUEUE_CASES:
        queue = deque(waiting)
        call = f"requeue(waiting, {victims})  # waiting = deque({waiting}); victims newest first"
        c.run(call, lambda queue=queue, victims=victims: requeue(queue, list(victims)))
        expected, got = victims[::-1] + waiting, list(queue)
        c.holds(
            f"waiting after {call}",
            got == expected,
            f"deque({expected})",
            f"deque({got})",
            _requeue_hint(got, waiting, victims),
        )


# ------------------------------------------------------------------------------- Task 3

HEADS, DIM = 2, 8
HOST = (
    "swap_out returns the sequence's K and V in host memory: read_kv gathers them from its blocks, then "
    "put them on the CPU (.cpu()) and free the sequence"
)
KV_ORDER = "K and V are swapped: return (k, v), and write k to k_cache and v to v_cache"
WRITE_BACK = (
    "write the saved K and V into the new blocks: allocator.write_kv(seq_id, k.to(allocator.device), "
    "v.to(allocator.device))"
)
ALL_OR_NOTHING = (
    "a call that raises changes nothing: let allocate_for_sequence (all or nothing) take every block the "
    "sequence needs before anything is written, or check the free blocks first"
)


def _stale(allocator: PagedKVCacheAllocator, generator: torch.Generator) -> None:
    """Fill the whole pool with random K/V, as if old sequences had used every block."""
    for pool in (allocator.k_cache, allocator.v_cache):
        pool.copy_(torch.randn(pool.shape, generator=generator))


def _kv(num_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (torch.randn(num_tokens, HEADS, DIM, generator=generator) for _ in range(2))
    return k.to(default_device()), v.to(default_device())


def _pool(num_blocks: int, sequences: list[tuple[str, int]], generator: torch.Generator) -> tuple:
    """A pool of stale blocks of 4 holding ``(seq_id, tokens)`` sequences with random K/V; their K/V by id."""
    allocator = PagedKVCacheAllocator(num_blocks, 4, HEADS, DIM, device=default_device())
    _stale(allocator, generator)
    kv = {}
    for seq_id, tokens in sequences:
        allocator.allocate_for_sequence(seq_id, tokens)
        kv[seq_id] = _kv(tokens, generator)
        allocator.write_kv(seq_id, *kv[seq_id])
    return allocator, kv


def _state(allocator: PagedKVCacheAllocator) -> str:
    held = "; ".join(
        f"{s!r} holds {allocator.sequence_length(s)} tokens in blocks {allocator.get_block_mapping(s)}"
        for s in allocator.seq_ids
    )
    return f"{held or 'no sequence'}; {allocator.num_free_blocks} blocks free"


def _kv_hint(got: tuple, k: torch.Tensor, v: torch.Tensor, otherwise: str) -> str:
    got_k, got_v = (t.to(k.device) for t in got)
    if torch.equal(got_k, v) and torch.equal(got_v, k):
        return KV_ORDER
    mixup = kv_mixup(got_k, got_v, k, v)
    if mixup:
        return mixup
    if got_k.shape[0] == k.shape[0] - 1 and torch.equal(got_k, k[:-1]):
        return "the last token is missing: a sequence of n tokens holds positions 0 to n - 1, all of them"
    return otherwise


def _fails_cleanly(
    c: Checker, call: str, allocator: PagedKVCacheAllocator, thunk, error: type, hint: str
) -> None:
    """``thunk`` raises ``error`` and leaves the allocator, K/V included, exactly as it was."""
    before, state = allocator.snapshot(), _state(allocator)
    k_before, v_before = allocator.k_cache.clone(), allocator.v_cache.clone()
    c.raises(call, thunk, error, hint)
    c.holds(
        f"the allocator after {call}",
        allocator.snapshot() == before
        and torch.equal(allocator.k_cache, k_before)
        and torch.equal(allocator.v_cache, v_before),
        f"unchanged: {state}",
        _state(allocator),
        ALL_OR_NOTHING,
    )


def _round_trip(c: Checker, swap_out, swap_in, num_tokens: int, seed: int) -> None:
    """Swap 'a' out next to 'b', let another sequence write over every free block, swap 'a' back in."""
    generator = torch.Generator().manual_seed(seed)
    allocator, kv = _pool(12, [("a", num_tokens), ("b", 9)], generator)
    (k, v), old_blocks = kv["a"], allocator.get_block_mapping("a")
    free_before = allocator.num_free_blocks
    call = f"saved = swap_out(allocator, 'a')  # {_state(allocator)}, blocks of 4"
    saved = c.run(call, lambda: swap_out(allocator, "a"), HOST)
    c.holds(
        call,
        isinstance(saved, tuple) and len(saved) == 2 and all(isinstance(t, torch.Tensor) for t in saved),
        "a tuple (k, v) of two tensors",
        repr(saved) if not isinstance(saved, tuple) else f"a tuple of {len(saved)}",
        "return the K and V that read_kv gives, as a tuple (k, v)",
    )
    c.holds(
        "[t.shape for t in saved]",
        saved[0].shape == k.shape and saved[1].shape == v.shape,
        f"two of {tuple(k.shape)}: (tokens, num_heads, head_dim)",
        f"{tuple(saved[0].shape)} and {tuple(saved[1].shape)}",
        _kv_hint(saved, k, v, "save every token the sequence holds, as read_kv returns them"),
    )
    c.holds(
        "[t.device.type for t in saved]",
        all(t.device.type == "cpu" for t in saved),
        "['cpu', 'cpu']: host memory",
        [t.device.type for t in saved],
        HOST,
    )
    c.holds(
        "saved",
        torch.equal(saved[0], k.cpu()) and torch.equal(saved[1], v.cpu()),
        "(k, v): the K and V 'a' held",
        "other tensors",
        _kv_hint(saved, k, v, HOST),
    )
    c.holds(
        "('a' in allocator, allocator.num_free_blocks)  # after swap_out",
        "a" not in allocator and allocator.num_free_blocks == free_before + len(old_blocks),
        (False, free_before + len(old_blocks)),
        ("a" in allocator, allocator.num_free_blocks),
        "after copying, free the sequence (allocator.free_sequence): its blocks serve others meanwhile",
    )

    # Another sequence takes every free block, the ones 'a' left included, and writes over them.
    filler = allocator.num_free_blocks * allocator.block_size
    allocator.allocate_for_sequence("c", filler)
    allocator.write_kv("c", *_kv(filler, generator))
    c.holds(
        f"saved  # after another sequence wrote over every free block, {old_blocks} included",
        torch.equal(saved[0], k.cpu()) and torch.equal(saved[1], v.cpu()),
        "unchanged: the K and V 'a' held",
        "changed",
        "the saved tensors share memory with the pool: save copies (read_kv gathers one; .cpu() of a "
        "CUDA tensor makes one), not views of k_cache and v_cache",
    )
    allocator.free_sequence("c")

    call = f"swap_in(allocator, 'a', saved)  # {_state(allocator)}"
    c.run(call, lambda: swap_in(allocator, "a", saved))
    length = allocator.sequence_length("a") if "a" in allocator else None
    c.holds(
        "allocator.sequence_length('a')  # after swap_in",
        length == num_tokens,
        num_tokens,
        "'a' is not allocated" if length is None else length,
        "give the sequence blocks for every saved token, the last one included: "
        "allocate_for_sequence(seq_id, k.shape[0]), then write them all",
    )
    got = c.run("allocator.read_kv('a')", lambda: allocator.read_kv("a"))
    c.holds(
        f"allocator.read_kv('a')  # after swap_in, now in blocks {allocator.get_block_mapping('a')}",
        torch.equal(got[0], k) and torch.equal(got[1], v),
        f"the K and V 'a' held in blocks {old_blocks}",
        "other values",
        _kv_hint(got, k, v, WRITE_BACK),
    )
    c.holds(
        "allocator.num_free_blocks  # after swap_in",
        allocator.num_free_blocks == free_before,
        free_before,
        allocator.num_free_blocks,
        f"{num_tokens} tokens take {len(old_blocks)} block(s) of 4: allocate exactly those",
    )


@task(
    "11.swap_round_trip",
    "swapping a sequence's K/V out to host memory and back",
    needs=("swap_out", "swap_in"),
)
def _swap_round_trip(c: Checker, swap_out, swap_in) -> None:
    for seed, num_tokens in enumerate((6, 8, 1)):
        _round_trip(c, swap_out, swap_in, num_tokens, seed)

    generator = torch.Generator().manual_seed(80)
    allocator, _ = _pool(8, [("a", 9)], generator)
    saved = c.run(
        "saved = swap_out(allocator, 'a')  # 9 tokens in 3 blocks of 4", lambda: swap_out(allocator, "a")
    )
    allocator.allocate_for_sequence("big", 24)  # 6 of the 8 blocks: 2 are left, 'a' needs 3
    _fails_cleanly(
        c,
        f"swap_in(allocator, 'a', saved)  # 'a' needs 3 blocks; {_state(allocator)}",
        allocator,
        lambda: swap_in(allocator, "a", saved),
        OutOfBlocksError,
        "too few free blocks: raise OutOfBlocksError (allocate_for_sequence does) and change nothing",
    )
    allocator.free_sequence("big")
    allocator.allocate_for_sequence("a", 2)
    _fails_cleanly(
        c,
        "swap_in(allocator, 'a', saved)  # 'a' is allocated already",
        allocator,
        lambda: swap_in(allocator, "a", saved),
        ValueError,
        "a sequence that is allocated cannot be swapped in: allocate_for_sequence raises ValueError for a "
        "duplicate seq_id; let it, before anything is written",
    )
    _fails_cleanly(
        c,
        "swap_out(allocator, 'nobody')",
        allocator,
        lambda: swap_out(allocator, "nobody"),
        KeyError,
        "an unknown sequence is a KeyError (read_kv raises UnknownSequenceError) and frees nothing",
    )


# ------------------------------------------------------------------------------- Task 4

PRIORITY_RULE = (
    "take the running sequence with the largest (priority, arrival) first, wherever it stands in running "
    "(vLLM: max(self.running, key=lambda r: (r.priority, r.arrival_time))), then the next largest, until "
    "the others' next tokens fit: each victim's blocks become free and its need goes"
)
PRIORITY_MISTAKES: list[tuple[Callable[[list, int], list], str]] = [
    (
        lambda running, free: _ranked(running, free, key=lambda i, e: i),
        "you took the newest first, the first-come-first-served rule: under priority the victim is the "
        "running sequence with the largest (priority, arrival), wherever it stands",
    ),
    (
        lambda running, free: _ranked(running, free, key=lambda i, e: (-e[3], -e[4])),
        "you took the most urgent first: a lower priority value is served first (vLLM's rule), so the "
        "victim is the one with the largest (priority, arrival)",
    ),
    (
        lambda running, free: _ranked(running, free, key=lambda i, e: (e[3], -i)),
        "equal priorities are ordered by arrival: among them the latest arrival goes first, whatever its "
        "place in running (admission order is not arrival order under priority)",
    ),
    (
        lambda running, free: _ranked(running, free, key=lambda i, e: e[4]),
        "you ranked by arrival alone: the priority comes first, the arrival only breaks ties",
    ),
    (
        lambda running, free: _ranked(running, free, frees=False),
        "a victim's blocks become free: add its blocks to the free count, and the sequences left may fit",
    ),
]

# (running, num_free_blocks, expected victims): each case tells one mistake from the rule
PRIORITY_CASES = [
    ([("a", 2, True, 0, 0.0), ("b", 1, True, 1, 1.0)], 2, []),
    ([("a", 2, True, 1, 0.0), ("b", 1, True, 0, 1.0), ("c", 1, True, 0, 2.0)], 2, ["a"]),
    ([("b", 1, True, 1, 2.0), ("a", 1, True, 1, 5.0), ("c", 1, True, 0, 9.0)], 2, ["a"]),
    ([("a", 1, True, 0, 3.0), ("b", 1, True, 0, 1.0)], 1, ["a"]),
    (
        [("a", 3, True, 0, 0.0), ("b", 1, False, 2, 1.0), ("c", 1, True, 1, 2.0), ("d", 1, True, 0, 3.0)],
        0,
        ["b", "c"],
    ),
]


def _ranked(running: list, free: int, *, key=lambda i, e: (e[3], e[4]), frees=True) -> list:
    """The rule, or a classic mistake: another ranking ``key(index, entry)``, or no blocks freed."""
    order = sorted(range(len(running)), key=lambda i: key(i, running[i]), reverse=True)
    return _take([running[i] for i in order], free, frees=frees)


def _random_priority_cases(count: int, seed: int) -> list[tuple[list, int]]:
    """Random cases, distinct arrivals, where the last left fits, so that every answer is a list."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        size = rng.randint(1, 8)
        arrivals = rng.sample(range(100), size)
        running = [
            (f"s{i}", rng.randint(0, 5), rng.random() < 0.6, rng.randint(0, 2), float(arrivals[i]))
            for i in range(size)
        ]
        free = rng.randint(0, 4)
        try:
            package_priority_victims(running, free)
        except OutOfBlocksError:
            continue
        cases.append((running, free))
    return cases


def _priority_hint(choose: Callable[..., object]) -> str:
    """The classic mistake that ``choose`` makes on the examples and random cases, else the rule."""
    cases = [(running, free) for running, free, _ in PRIORITY_CASES] + _random_priority_cases(100, 83)
    answers = [_outcome(choose, *case) for case in cases]
    for mistake, hint in PRIORITY_MISTAKES:
        if answers == [_outcome(mistake, *case) for case in cases]:
            return hint
    return PRIORITY_RULE


@task("11.priority_victims", "whose blocks the priority policy takes", needs=("priority_victims",))
def _priority_victims(c: Checker, priority_victims) -> None:
    hint = _priority_hint(priority_victims)
    for running, free, expected in PRIORITY_CASES:
        c.equal(
            f"priority_victims({running}, {free})",
            lambda running=running, free=free: priority_victims(list(running), free),
            expected,
            hint,
        )
    running = [("a", 5, True, 0, 0.0), ("b", 0, False, 9, 1.0)]
    c.raises(
        f"priority_victims({running}, 0)  # even 'a' alone does not fit",
        lambda: priority_victims(list(running), 0),
        OutOfBlocksError,
        "when only one sequence is left and it still does not fit, raise OutOfBlocksError(needed, free)",
    )
    cases = _random_priority_cases(300, 82)
    call = "priority_victims(running, free) on 300 random cases"
    wrong = c.run(
        call,
        lambda: next(
            (case for case in cases if _outcome(priority_victims, *case) != package_priority_victims(*case)),
            None,
        ),
    )
    if wrong is not None:
        running, free = wrong
        c.equal(
            f"priority_victims({running}, {free})",
            lambda: priority_victims(list(running), free),
            package_priority_victims(running, free),
            hint,
        )
    c.holds(call, wrong is None, "the package's answers (the priority scheduler's preemption)", wrong)

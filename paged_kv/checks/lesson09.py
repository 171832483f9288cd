"""Checks of exercise 09: the engine's admission rule, the slots of a decode step, a paged cache of one's own.

The admission rule is vLLM's (the whole prompt's blocks free, nothing kept for the running requests'
growth): it is checked on examples at the boundary, then against what
:class:`~paged_kv.serving.engine.Engine` actually does beside requests that are decoding. The slots
are compared with the package's :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.slot_mapping` on a
twin allocator, in pools whose free lists are shuffled, so that a slot is never the position itself.
The cache is checked call by call against attention over the same tokens held contiguously, then
end to end in :func:`~paged_kv.model.generate`, against the contiguous cache (the engine runs its
own step on the package's storage, not on a learner's cache). Every pool starts full of stale
random K/V, so a slot written or read in the wrong place gives a visibly wrong answer. When an
answer is wrong, the check looks for the classic mistakes and names the one it finds.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F

from paged_kv.checks._core import Checker, answers, diagnose, task
from paged_kv.core.block import blocks_for_tokens
from paged_kv.device import default_device
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest

# A GPT small enough for the checks to run in a blink, with two layers so that "once for all layers" matters.
CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)
# The paged and the contiguous caches sum the same products in a different order.
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _one_thread(check: Callable[..., None]) -> Callable[..., None]:
    """Run a check with one torch thread: its models are tiny, and on a busy 2-core machine two
    threads fighting over them made the checks about ten times slower."""

    @functools.wraps(check)
    def run(*args: object) -> None:
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            check(*args)
        finally:
            torch.set_num_threads(saved)

    return run


# ------------------------------------------------------------------------------- Task 1

RULE = (
    "admit when blocks_for_tokens(prompt_tokens, block_size) <= num_free_blocks: the whole prompt's "
    "blocks must be free, whatever num_running (vLLM keeps no block for the running requests' growth)"
)
NO_HEADROOM = (
    "vLLM keeps no block per running request: it admits into a full pool and preempts when a decode "
    "finds no block. Only the prompt's blocks must be free, blocks_for_tokens(prompt_tokens, block_size) "
    "<= num_free_blocks, whatever num_running (the watermark that keeps a few blocks back is lesson 11's)"
)


def _rounded_down(free: int, prompt: int, running: int, size: int) -> bool:
    return prompt // size <= free


def _headroom(free: int, prompt: int, running: int, size: int) -> bool:
    return blocks_for_tokens(prompt, size) + running + 1 <= free


def _headroom_for_the_others(free: int, prompt: int, running: int, size: int) -> bool:
    return blocks_for_tokens(prompt, size) + running <= free


def _strict(free: int, prompt: int, running: int, size: int) -> bool:
    return blocks_for_tokens(prompt, size) < free


def _tokens_as_blocks(free: int, prompt: int, running: int, size: int) -> bool:
    return prompt <= free


def _first_token_counted(free: int, prompt: int, running: int, size: int) -> bool:
    return blocks_for_tokens(prompt + 1, size) <= free


ADMISSION_MISTAKES: list[tuple[Callable[[int, int, int, int], bool], str]] = [
    (
        _headroom,
        "you kept num_running + 1 blocks of headroom, one per running request and one for the new one, so "
        "that the next decode step always fits. " + NO_HEADROOM,
    ),
    (_headroom_for_the_others, "you kept one block of headroom per running request. " + NO_HEADROOM),
    (
        _rounded_down,
        "the prompt's blocks are rounded down: 5 tokens in blocks of 4 fill 2 blocks, so round up "
        "(blocks_for_tokens, or -(-prompt_tokens // block_size))",
    ),
    (_strict, "exactly enough free blocks is enough: compare with <=, not <"),
    (
        _tokens_as_blocks,
        "you compared tokens with blocks: prompt_tokens counts tokens, num_free_blocks counts blocks of "
        "block_size slots. Turn the tokens into blocks first, blocks_for_tokens(prompt_tokens, block_size)",
    ),
    (
        _first_token_counted,
        "you made room for the first output token too: only the prompt's slots are needed at admission. "
        "The prefill samples the first token, and its K/V is written in the next step, whose "
        "allocate_slots takes a block for it then (vLLM checks the request's num_tokens, its prompt)",
    ),
]


def _admission_hint(can_admit: Callable[..., object]) -> str:
    """The classic mistake that ``can_admit`` makes on a grid of cases, else the rule."""
    grid = [(f, p, r, b) for f in range(9) for p in range(1, 13) for r in range(4) for b in (1, 4)]
    return diagnose(can_admit, ADMISSION_MISTAKES, answers(grid), RULE)


def _admitted_beside(model: TinyGPT, free: int, prompt_tokens: int, running: int, block_size: int) -> bool:
    """Whether the engine admits a request the step it arrives, beside ``running`` running requests.

    The pool has ``free + running`` blocks, and its null block. The running requests arrive at step 0,
    each with a prompt of ``block_size - 1`` tokens in one block, and are still decoding at step 1,
    their next token in that block; the new request arrives at step 1, when ``free`` blocks are free,
    and is admitted then or later.
    """
    requests = [EngineRequest(("running", i), [1] * (block_size - 1), 3) for i in range(running)]
    requests.append(EngineRequest("new", [2] * prompt_tokens, 1, arrival_step=1))
    result = Engine(model, num_blocks=free + running + 1, block_size=block_size).run(requests)
    return "new" in dict(result.scheduled_tokens[1])


def _engine_cases(block_size: int = 4) -> list[tuple[int, int, int]]:
    """``(free, prompt_tokens, running)`` on both sides of the rule: one block short, and exactly enough.

    Only the cases the engine can set up: every request fits the pool alone (a running one grows to
    2 blocks, the new one needs its prompt's), and at least one block is free.
    """
    cases = []
    for running in range(4):
        for prompt in (1, 4, 5, 9):
            needed = blocks_for_tokens(prompt, block_size)
            for free in (needed - 1, needed):
                num_blocks = free + running
                if free >= 1 and needed <= num_blocks and (running == 0 or num_blocks >= 2):
                    cases.append((free, prompt, running))
    return cases


@task("09.can_admit", "the engine's admission rule", needs=("can_admit",))
@_one_thread
def _can_admit(c: Checker, can_admit) -> None:
    hint = _admission_hint(can_admit)
    cases = [
        (3, 9, 0, 4, True),
        (2, 9, 0, 4, False),
        (3, 9, 2, 4, True),
        (2, 8, 2, 4, True),
        (1, 1, 0, 4, True),
        (0, 1, 0, 4, False),
        (1, 4, 0, 4, True),
        (1, 5, 0, 4, False),
        (2, 5, 0, 4, True),
        (2, 5, 7, 4, True),
        (5, 9, 1, 1, False),
        (9, 9, 3, 1, True),
    ]
    for free, prompt, running, size, expected in cases:
        needed = f"{blocks_for_tokens(prompt, size)} prompt block(s), {free} free, {running} running"
        c.equal(
            f"can_admit({free}, {prompt}, {running}, {size})  # {needed}",
            lambda free=free, prompt=prompt, running=running, size=size: bool(
                can_admit(free, prompt, running, size)
            ),
            expected,
            hint,
        )
    result = c.run("can_admit(3, 9, 2, 4)", lambda: can_admit(3, 9, 2, 4))
    c.holds(
        "type(can_admit(3, 9, 2, 4))",
        type(result) is bool,
        "bool",
        type(result).__name__,
        "return the comparison itself, True or False",
    )
    model = TinyGPT(GPTConfig(num_layers=1, num_heads=1, head_dim=4, max_len=32), seed=0).to(default_device())
    for free, prompt, running in _engine_cases():
        call = f"can_admit({free}, {prompt}, {running}, 4)"
        got = c.run(
            call, lambda free=free, prompt=prompt, running=running: bool(can_admit(free, prompt, running, 4))
        )
        engine = _admitted_beside(model, free, prompt, running, 4)
        c.holds(
            f"{call}  # an Engine with {free} free blocks of 4 and {running} running request(s)",
            got == engine,
            f"{engine} (the engine {'admits' if engine else 'does not admit'} a {prompt}-token prompt then)",
            got,
            hint,
        )


# ------------------------------------------------------------------------------- Task 2


def _shuffled_pool(num_blocks: int, block_size: int, seed: int) -> PagedKVCacheAllocator:
    """An empty allocator on the default device whose free list is in a seeded random order."""
    allocator = PagedKVCacheAllocator(num_blocks, block_size, 1, 1, device=default_device())
    for block in range(num_blocks):
        allocator.allocate_for_sequence(("old", block), 1)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    for block in order:
        allocator.free_sequence(("old", block))
    return allocator


def _allocator(
    num_blocks: int, block_size: int, sequences: Sequence[tuple[Hashable, int]], seed: int
) -> PagedKVCacheAllocator:
    """A shuffled pool holding ``(seq_id, tokens)`` sequences, allocated in order."""
    allocator = _shuffled_pool(num_blocks, block_size, seed)
    for seq_id, tokens in sequences:
        allocator.allocate_for_sequence(seq_id, tokens)
    return allocator


def _state(allocator: PagedKVCacheAllocator) -> str:
    held = "; ".join(
        f"{s!r} holds {allocator.sequence_length(s)} tokens in {allocator.get_block_mapping(s)}"
        for s in allocator.seq_ids
    )
    return f"{held}; free list {list(allocator.snapshot().free_block_ids)}"


def _expected_slots(twin: PagedKVCacheAllocator, seq_ids: Sequence[Hashable]) -> list[int]:
    """One decode step on ``twin`` the package's way: the slot of each sequence's new last position."""
    slots = []
    for seq_id in seq_ids:
        twin.append_tokens(seq_id, 1)
        position = twin.sequence_length(seq_id) - 1
        slots.append(int(twin.slot_mapping(seq_id, [position])))
    return slots


def _slot_of(allocator: PagedKVCacheAllocator, seq_id: Hashable, position: int) -> int | None:
    """The slot of ``position`` in the sequence's table as it is now, or None when the table is too short."""
    table, size = allocator.get_block_mapping(seq_id), allocator.block_size
    if not 0 <= position < len(table) * size:
        return None
    return table[position // size] * size + position % size


def _slots_hint(
    after: PagedKVCacheAllocator, seq_ids: Sequence[Hashable], got: object, expected: list[int]
) -> str:
    """Name the mistake behind wrong slots, from the state of the correct twin after the step."""
    if not isinstance(got, list) or len(got) != len(expected):
        return "return one slot per sequence of seq_ids, in their order, as a 1-D LongTensor"
    size = after.block_size
    for seq_id, slot, right in zip(seq_ids, got, expected, strict=True):
        if slot == right:
            continue
        n = after.sequence_length(seq_id) - 1  # the new token's position
        block, offset = divmod(n, size)
        physical = after.get_block_mapping(seq_id)[block]
        if slot == n:
            return (
                f"the new token of {seq_id!r} is at position {n}, its slot is {right}: you returned the "
                "position itself. Translate it through the block table: "
                "block_table[position // block_size] * block_size + position % block_size "
                "(allocator.physical_location gives both parts)"
            )
        if slot == _slot_of(after, seq_id, n + 1):
            return (
                f"you returned the slot of position {n + 1}, the sequence's length after the append: its "
                f"new token is at position {n}, length - 1"
            )
        if slot == _slot_of(after, seq_id, n - 1):
            return (
                f"you returned the slot of position {n - 1}, the token before the new one: after the append "
                f"the sequence holds {n + 1} tokens, and the new one is at position {n}"
            )
        if slot == offset * size + physical:
            return "block and offset are swapped: the slot is block_id * block_size + offset"
        return (
            f"the new token of {seq_id!r} is at position {n}, in block {physical} at offset {offset}: slot "
            f"{physical} * {size} + {offset} = {right}"
        )
    return (
        "the slots are right but the tensor is not: return torch.tensor(slots, dtype=torch.long, device=...)"
    )


NEW_POSITION = (
    "after allocator.append_tokens(seq_id, 1) a sequence holds length tokens, positions 0 to length - 1: "
    "its new token is at position length - 1 (a position at or past the length is out of range)"
)


def _as_list(got: object) -> object:
    return got.tolist() if isinstance(got, torch.Tensor) and got.dim() == 1 else got


@task("09.decode_slots", "the slots of a decode step, all or nothing")
def _decode_slots(c: Checker, decode_slots) -> None:
    scenarios = [  # what, num_blocks, block_size, sequences, batch
        ("a free slot in its last block", 8, 4, [("a", 3)], ["a"]),
        ("its blocks full: a new block", 8, 4, [("b", 4)], ["b"]),
        ("a batch of three", 12, 4, [("a", 3), ("b", 4), ("c", 5)], ["a", "b", "c"]),
        ("the batch in another order", 12, 4, [("a", 3), ("b", 4), ("c", 5)], ["c", "a", "b"]),
        ("blocks of 1", 8, 1, [("e", 2)], ["e"]),
    ]
    for seed, (what, num_blocks, size, sequences, batch) in enumerate(scenarios):
        allocator = _allocator(num_blocks, size, sequences, seed)
        twin = _allocator(num_blocks, size, sequences, seed)
        before = _state(allocator)
        call = f"decode_slots(allocator, {batch})  # block_size {size}, {before} ({what})"
        got = c.run(
            call, lambda allocator=allocator, batch=batch: decode_slots(allocator, batch), NEW_POSITION
        )
        expected = _expected_slots(twin, batch)
        c.holds(
            call,
            isinstance(got, torch.Tensor) and _as_list(got) == expected,
            f"tensor({expected})",
            repr(got),
            _slots_hint(twin, batch, _as_list(got), expected),
        )
        c.holds(
            f"the allocator after {call}",
            allocator.snapshot() == twin.snapshot(),
            _state(twin),
            _state(allocator),
            "each sequence gains exactly one token (allocator.append_tokens(seq_id, 1)), and a new block "
            "only when its blocks were full",
        )
        c.holds(
            f"decode_slots(...).dtype  # {what}",
            got.dtype == torch.long,
            "torch.int64",
            got.dtype,
            "slots index the pool's token slots: make a LongTensor (torch.tensor(slots, dtype=torch.long))",
        )
        c.holds(
            f"decode_slots(...).device  # {what}",
            got.device == allocator.device,
            str(allocator.device),
            str(got.device),
            "put the slots on the allocator's device: torch.tensor(..., device=allocator.device)",
        )

    # Eight steps of two sequences, crossing several block boundaries.
    allocator = _allocator(16, 4, [("x", 2), ("y", 5)], seed=7)
    twin = _allocator(16, 4, [("x", 2), ("y", 5)], seed=7)
    call = "[decode_slots(allocator, ['x', 'y']).tolist() for _ in range(8)]  # x holds 2 tokens, y 5"
    got_steps = c.run(
        call, lambda: [_as_list(decode_slots(allocator, ["x", "y"])) for _ in range(8)], NEW_POSITION
    )
    expected_steps = [_expected_slots(twin, ["x", "y"]) for _ in range(8)]
    c.equal(
        call,
        lambda: got_steps,
        expected_steps,
        "x takes a block when it holds 4 and 8 tokens, y when it holds 8 and 12; each slot is "
        "allocator.slot_mapping(seq_id, [length - 1]) after the append",
    )
    c.holds(
        f"the allocator after {call}",
        allocator.snapshot() == twin.snapshot(),
        _state(twin),
        _state(allocator),
        "each call adds exactly one token to each sequence",
    )

    # All or nothing: three sequences need a block, one is free.
    allocator = _allocator(4, 4, [("a", 4), ("b", 4), ("c", 4)], seed=11)
    snapshot, before, free = allocator.snapshot(), _state(allocator), allocator.num_free_blocks
    call = f"decode_slots(allocator, ['a', 'b', 'c'])  # {before}"
    error = c.raises(
        call,
        lambda: decode_slots(allocator, ["a", "b", "c"]),
        OutOfBlocksError,
        "three sequences need a block and only one is free: raise OutOfBlocksError(needed, free)",
    )
    leaked = free - allocator.num_free_blocks
    c.holds(
        f"the allocator after {call}",
        allocator.snapshot() == snapshot,
        f"unchanged: {before}",
        _state(allocator),
        (f"the step took {leaked} block(s) before it ran out and kept them (a leak). " if leaked else "")
        + "All or nothing: count the blocks the batch needs (allocator.needs_new_block) and compare with "
        "allocator.num_free_blocks before you append any token",
    )
    c.holds(
        f"(error.needed, error.free) after {call}",
        (getattr(error, "needed", None), getattr(error, "free", None)) == (3, 1),
        "(3, 1)",
        (getattr(error, "needed", None), getattr(error, "free", None)),
        "raise OutOfBlocksError(needed, free) with the counts of the whole batch",
    )


# ------------------------------------------------------------------------------- Task 3

ONCE = (
    "one manager serves every layer: a block id names the same slots in every layer's pool, so "
    "a sequence is allocated, grown and freed once, whatever the number of layers"
)
SWAPPED = "K and V are swapped: k goes to the layer's k_cache, v to its v_cache"
POSITION = (
    "the position of the new token is the sequence's length before the append (a sequence of 6 tokens "
    "holds positions 0 to 5, so its new token is at position 6); the model embeds it"
)
ATTEND = (
    "after storing k and v, return paged_attention(q, self.storage.k_caches[layer], "
    "self.storage.v_caches[layer], block_tables, lengths) with the padded block_rows(seq_ids) and "
    "the lengths after the append"
)


def _stale(cache: object, seed: int) -> None:
    """Fill every layer's pool with random K/V, as if old sequences had used every block."""
    generator = torch.Generator().manual_seed(seed)
    for pool in (*cache.storage.k_caches, *cache.storage.v_caches):
        pool.copy_(torch.randn(pool.shape, generator=generator))


def _read(cache: object, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s K and V of the sequence, gathered through the manager's block table."""
    table = cache.manager.get_block_table(seq_id)
    block_ids = torch.tensor(table.block_ids, dtype=torch.long, device=cache.storage.device)
    return cache.storage.read(layer, block_ids, table.num_tokens)


def _randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(default_device())


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q (heads, dim) over k, v (tokens, heads, dim): (heads, dim)."""
    out = F.scaled_dot_product_attention(q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    return out[0, :, 0]


def _stored_hint(cache: object, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> str:
    """Why the new token's K/V are not where they belong (position length - 1)."""
    got_k, got_v = (t[-1] for t in _read(cache, layer, seq_id))
    if torch.equal(got_k, v) and torch.equal(got_v, k):
        return SWAPPED
    length, size = cache.manager.sequence_length(seq_id), cache.block_size
    table = cache.manager.get_block_table(seq_id).block_ids
    if length < len(table) * size:
        block, offset = table[length // size], length % size
        if torch.equal(cache.storage.k_caches[layer][block, :, offset], k):
            return (
                f"you wrote the new token at position {length}, the length after the append: the sequence "
                f"holds {length} tokens, positions 0 to {length - 1}, so the new one is at length - 1"
            )
    return (
        "store the new token's k and v at its slot (the slots your append computed, in self.new_slots): "
        "self.storage.write_slots(layer, self.new_slots, k, v)"
    )


@task("09.paged_cache", "your own paged cache, in the model", needs=("MyPagedCache",))
@_one_thread
def _paged_cache(c: Checker, cache_class) -> None:
    device = default_device()
    heads, dim, layers = CONFIG.num_heads, CONFIG.head_dim, CONFIG.num_layers
    generator = torch.Generator().manual_seed(90)
    call_new = "cache = MyPagedCache(config, 16, 4, device, torch.float32)  # 2 layers, 2 heads of 8"
    cache = c.run(call_new, lambda: cache_class(CONFIG, 16, 4, device, torch.float32))
    c.run("cache.storage  # made by the __init__ you were given", lambda: _stale(cache, seed=91))
    c.equal(
        "cache.num_free_blocks  # a new cache", lambda: cache.num_free_blocks, 16, "all 16 blocks are free"
    )

    # add_sequence, needs_new_block
    c.run("cache.add_sequence('a', 6)", lambda: cache.add_sequence("a", 6))
    c.equal(
        "cache.num_free_blocks after cache.add_sequence('a', 6)",
        lambda: cache.num_free_blocks,
        14,
        "6 tokens in blocks of 4 take 2 blocks: self.manager.allocate(seq_id, num_tokens), once",
    )
    c.equal(
        "cache.manager.sequence_length('a')",
        lambda: cache.manager.sequence_length("a"),
        6,
        "add_sequence gives the prompt its blocks in the manager: " + ONCE,
    )
    c.run("cache.add_sequence('b', 8)", lambda: cache.add_sequence("b", 8))
    c.equal(
        "cache.needs_new_block('a')  # 6 tokens in 2 blocks of 4",
        lambda: cache.needs_new_block("a"),
        False,
        "'a' has 2 free slots in its last block: ask the manager's needs_new_block",
    )
    c.equal(
        "cache.needs_new_block('b')  # 8 tokens in 2 blocks of 4",
        lambda: cache.needs_new_block("b"),
        True,
        "'b' fills its 2 blocks: its next token needs a new one (ask the manager's needs_new_block)",
    )

    # write_prompt
    prompt = {
        (layer, seq_id): (
            _randn(n, heads, dim, generator=generator),
            _randn(n, heads, dim, generator=generator),
        )
        for layer in range(layers)
        for seq_id, n in (("a", 6), ("b", 8))
    }
    for (layer, seq_id), (k, v) in prompt.items():
        c.run(
            f"cache.write_prompt({layer}, {seq_id!r}, k, v)",
            lambda layer=layer, seq_id=seq_id, k=k, v=v: cache.write_prompt(layer, seq_id, k, v),
        )
    for (layer, seq_id), (k, v) in prompt.items():
        call = f"layer {layer}'s K and V of {seq_id!r} after cache.write_prompt({layer}, {seq_id!r}, k, v)"
        got_k, got_v = c.run(call, lambda layer=layer, seq_id=seq_id: _read(cache, layer, seq_id))
        swapped = torch.equal(got_k, v) and torch.equal(got_v, k)
        c.holds(
            call,
            torch.equal(got_k, k) and torch.equal(got_v, v),
            "(k, v)",
            "(v, k)" if swapped else "other tensors",
            SWAPPED
            if swapped
            else f"store layer {layer}'s prompt in its pool: self.storage.write({layer}, block_ids, k, v)",
        )

    # append
    positions = c.run("cache.append(['a', 'b'])", lambda: cache.append(["a", "b"]))
    c.holds(
        "type(cache.append(['a', 'b']))",
        isinstance(positions, torch.Tensor),
        "torch.Tensor",
        type(positions).__name__,
        "return the positions as a tensor on self.device: the model adds their embeddings",
    )
    got = positions.tolist()
    c.holds(
        "cache.append(['a', 'b'])  # 'a' held 6 tokens, 'b' 8",
        got == [6, 8],
        "tensor([6, 8])",
        f"tensor({got})",
        POSITION,
    )
    c.holds(
        "cache.append(['a', 'b']).dtype",
        not positions.dtype.is_floating_point and positions.dtype != torch.bool,
        "an integer dtype (torch.int64)",
        positions.dtype,
        "positions index the position embedding: make them integers (torch.long)",
    )
    c.holds(
        "cache.append(['a', 'b']).device",
        positions.device == cache.storage.device,
        str(cache.storage.device),
        str(positions.device),
        "make the positions on self.device, the model's",
    )
    lengths = c.run(
        "[cache.manager.sequence_length(s) for s in ('a', 'b')] after cache.append(['a', 'b'])",
        lambda: [cache.manager.sequence_length(s) for s in ("a", "b")],
    )
    c.holds(
        "[cache.manager.sequence_length(s) for s in ('a', 'b')] after cache.append(['a', 'b'])",
        lengths == [7, 9],
        [7, 9],
        lengths,
        f"you grew each sequence {layers} times, once per layer: " + ONCE
        if lengths == [6 + layers, 8 + layers]
        else "append grows each sequence by one token, all or nothing: self.manager.append_batch(seq_ids)",
    )
    c.equal(
        "cache.num_free_blocks after cache.append(['a', 'b'])",
        lambda: cache.num_free_blocks,
        11,
        "'b' crossed a block boundary and took a third block; 'a' fits its 7th token in its second block",
    )

    # attend
    for layer in range(layers):
        q, k, v = (_randn(2, heads, dim, generator=generator) for _ in range(3))
        call = f"cache.attend({layer}, ['a', 'b'], q, k, v)  # after the append: 'a' holds 7 tokens, 'b' 9"
        out = c.run(call, lambda layer=layer, q=q, k=k, v=v: cache.attend(layer, ["a", "b"], q, k, v))
        c.equal(
            f"[cache.manager.sequence_length(s) for s in ('a', 'b')] after {call}",
            lambda: [cache.manager.sequence_length(s) for s in ("a", "b")],
            [7, 9],
            "attend stores and attends, and grows nothing: the step's one append already grew every "
            "sequence for all the layers",
        )
        for b, seq_id in enumerate(("a", "b")):
            read = f"layer {layer}'s last K and V of {seq_id!r} in cache.storage after {call}"
            got_k, got_v = (t[-1] for t in c.run(read, lambda s=seq_id, layer=layer: _read(cache, layer, s)))
            c.holds(
                read,
                torch.equal(got_k, k[b]) and torch.equal(got_v, v[b]),
                f"k[{b}] and v[{b}], the new token's",
                "other values",
                _stored_hint(cache, layer, seq_id, k[b], v[b]),
            )
        expected = torch.stack(
            [
                _sdpa(
                    q[b],
                    torch.cat([prompt[layer, s][0], k[b : b + 1]]),
                    torch.cat([prompt[layer, s][1], v[b : b + 1]]),
                )
                for b, s in enumerate(("a", "b"))
            ]
        )
        without_new = torch.stack(
            [_sdpa(q[b], prompt[layer, s][0], prompt[layer, s][1]) for b, s in enumerate(("a", "b"))]
        )
        right = (
            isinstance(out, torch.Tensor)
            and out.shape == expected.shape
            and torch.allclose(out, expected, **TOL)
        )
        hint = ATTEND
        if (
            isinstance(out, torch.Tensor)
            and out.shape == expected.shape
            and torch.allclose(out, without_new, **TOL)
        ):
            hint = "the new token attends to itself too: pass the lengths after the append, not length - 1"
        c.holds(
            call,
            right,
            f"a tensor of shape {tuple(expected.shape)}: attention over prompt and new token, within 1e-4",
            f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else repr(out),
            hint,
        )

    # free
    c.run("cache.free('a')", lambda: cache.free("a"))
    free_hint = "free must give the sequence's blocks back to the manager (self.manager.free), once"
    c.equal("cache.num_free_blocks after cache.free('a')", lambda: cache.num_free_blocks, 13, free_hint)
    c.equal("'a' in cache.manager after cache.free('a')", lambda: "a" in cache.manager, False, free_hint)
    c.run("cache.free('b')", lambda: cache.free("b"))

    # generate, in a shuffled pool of stale blocks
    model = TinyGPT(CONFIG, seed=1).to(device)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 17, 11)]
    expected_run = generate(model, prompts, 12, cache="contiguous")
    pool = c.run(
        "pool = MyPagedCache(config, 40, 4, device, torch.float32)",
        lambda: cache_class(CONFIG, 40, 4, device, torch.float32),
    )
    _stale(pool, seed=92)
    order = list(range(40))
    random.Random(93).shuffle(order)

    def shuffle() -> None:
        for block in range(40):
            pool.add_sequence(("old", block), 4)
        for block in order:
            pool.free(("old", block))

    c.run("pool.add_sequence(('old', i), 4) for 40 blocks, then pool.free in a shuffled order", shuffle)
    call = "generate(model, prompts, 12, cache=pool)  # prompts of 5, 17 and 11 tokens, blocks of 4, shuffled"
    got_run = c.run(call, lambda: generate(model, prompts, 12, cache=pool))
    c.equal(
        f"{call}.tokens",
        lambda: got_run.tokens,
        expected_run.tokens,
        "the tokens differ from the contiguous cache's: check append's positions and attend's lengths",
    )
    c.holds(
        f"{call}.logits",
        torch.allclose(got_run.logits, expected_run.logits, **TOL),
        "the contiguous cache's logits, within 1e-4",
        "logits that differ",
        ATTEND,
    )
    c.equal(
        f"pool.num_free_blocks after {call}",
        lambda: pool.num_free_blocks,
        40,
        "generate frees every sequence at the end: give the blocks back in free (self.manager.free)",
    )

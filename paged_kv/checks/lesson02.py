"""Checks of exercise 02: the block allocator, sequences on top of it, and the K/V cache they manage."""

from __future__ import annotations

import torch

from paged_kv.checks._core import Checker, task
from paged_kv.errors import OutOfBlocksError

FIFO_HINT = (
    "allocate takes the head of the free list (deque.popleft()) and free appends to its tail; "
    "popping from the tail (LIFO) hands out the most recently freed block first"
)
REF_COUNT_HINT = (
    "free drops one holder: the block goes back to the free list (and free returns True) only when "
    "its ref count reaches 0"
)
DOUBLE_FREE_HINT = (
    "a block with ref count 0 is already free: freeing it again is a double free and must raise "
    "ValueError, or the block lands on the free list twice"
)
RANGE_HINT = (
    "check 0 <= block_id < num_blocks yourself and raise ValueError: a list raises IndexError past "
    "the end, and quietly reads from the end for a negative id"
)
LEAK_HINT = (
    "the failed call took blocks and kept them (a leak): check can_allocate(needed) and raise "
    "OutOfBlocksError before taking any block"
)


@task("02.block_allocator", "free list and ref counts", needs=("BlockAllocator",))
def _block_allocator(c: Checker, allocator_class) -> None:
    pool = c.run("pool = BlockAllocator(5)", lambda: allocator_class(5))
    c.equal("pool.num_free_blocks", lambda: pool.num_free_blocks, 5, "a new pool has every block free")
    c.equal(
        "pool.free_block_ids",
        lambda: tuple(pool.free_block_ids),
        (0, 1, 2, 3, 4),
        "a new pool's free list holds every id, in order: deque(range(num_blocks))",
    )
    c.equal("pool.ref_count(0)", lambda: pool.ref_count(0), 0, "a free block has no holder")
    for n, expected in [(0, True), (5, True), (6, False)]:
        c.equal(
            f"pool.can_allocate({n})",
            lambda n=n: pool.can_allocate(n),
            expected,
            "n blocks can be allocated when n <= num_free_blocks (off by one with <?)",
        )

    c.equal(
        "[pool.allocate() for _ in range(3)]",
        lambda: [pool.allocate() for _ in range(3)],
        [0, 1, 2],
        FIFO_HINT,
    )
    c.equal("pool.free_block_ids", lambda: tuple(pool.free_block_ids), (3, 4), FIFO_HINT)
    c.equal("pool.num_free_blocks", lambda: pool.num_free_blocks, 2)
    c.equal(
        "pool.ref_count(0)",
        lambda: pool.ref_count(0),
        1,
        "allocate gives the block its first holder: ref count 1",
    )
    c.equal("pool.can_allocate(2)", lambda: pool.can_allocate(2), True, "2 blocks are free")
    c.equal("pool.can_allocate(3)", lambda: pool.can_allocate(3), False, "only 2 blocks are free")

    c.equal(
        "pool.free(0)", lambda: pool.free(0), True, "free returns True when the block went back to the pool"
    )
    c.equal("pool.ref_count(0)", lambda: pool.ref_count(0), 0, "a freed block has no holder left")
    c.equal(
        "pool.free_block_ids",
        lambda: tuple(pool.free_block_ids),
        (3, 4, 0),
        "free puts the block at the tail of the free list (append), not at its head",
    )
    c.equal("pool.free(2)", lambda: pool.free(2), True)
    c.equal(
        "[pool.allocate() for _ in range(4)]",
        lambda: [pool.allocate() for _ in range(4)],
        [3, 4, 0, 2],
        "first in, first out: the blocks that were already free come first, then 0 and 2 in the order "
        "they were freed (allocate pops the head, free appends to the tail)",
    )
    error = c.raises(
        "pool.allocate()  # every block is in use",
        pool.allocate,
        OutOfBlocksError,
        "with an empty free list, raise OutOfBlocksError(needed=1, free=0) (a deque's IndexError is not it)",
    )
    c.equal(
        "(error.needed, error.free)",
        lambda: (error.needed, error.free),
        (1, 0),
        "raise OutOfBlocksError(needed=1, free=0)",
    )
    c.equal("pool.num_free_blocks", lambda: pool.num_free_blocks, 0, "a refused allocate changes nothing")

    shared = c.run("pool = BlockAllocator(3)", lambda: allocator_class(3))
    c.equal("pool.allocate()", shared.allocate, 0)
    c.equal(
        "pool.add_ref(0)", lambda: shared.add_ref(0), 2, "add_ref adds a holder and returns the new ref count"
    )
    c.equal("pool.ref_count(0)", lambda: shared.ref_count(0), 2)
    c.equal("pool.free(0)  # one holder left", lambda: shared.free(0), False, REF_COUNT_HINT)
    c.equal("pool.ref_count(0)", lambda: shared.ref_count(0), 1, REF_COUNT_HINT)
    c.equal(
        "pool.free_block_ids",
        lambda: tuple(shared.free_block_ids),
        (1, 2),
        "block 0 still has a holder, so it must stay off the free list; " + REF_COUNT_HINT,
    )
    c.equal("pool.free(0)  # the last holder", lambda: shared.free(0), True, REF_COUNT_HINT)
    c.equal("pool.free_block_ids", lambda: tuple(shared.free_block_ids), (1, 2, 0))

    c.raises("pool.free(0)  # again", lambda: shared.free(0), ValueError, DOUBLE_FREE_HINT)
    c.equal(
        "pool.free_block_ids",
        lambda: tuple(shared.free_block_ids),
        (1, 2, 0),
        "the refused double free must change nothing: raise before touching the free list",
    )
    c.equal(
        "pool.ref_count(0)",
        lambda: shared.ref_count(0),
        0,
        "the refused double free must change nothing: check the ref count before decreasing it",
    )
    c.raises("pool.free(1)  # never allocated", lambda: shared.free(1), ValueError, DOUBLE_FREE_HINT)
    c.raises(
        "pool.add_ref(1)  # a free block",
        lambda: shared.add_ref(1),
        ValueError,
        "add_ref shares a block in use; a free block has no holder to share it with",
    )

    full = c.run("pool = BlockAllocator(3); take all 3 blocks", lambda: allocator_class(3))
    c.run("pool.allocate() three times", lambda: [full.allocate() for _ in range(3)])
    for call, thunk in [
        ("pool.free(3)", lambda: full.free(3)),
        ("pool.free(-1)", lambda: full.free(-1)),
        ("pool.add_ref(3)", lambda: full.add_ref(3)),
        ("pool.ref_count(-1)", lambda: full.ref_count(-1)),
    ]:
        c.raises(call, thunk, ValueError, RANGE_HINT)
    c.equal(
        "[pool.ref_count(b) for b in range(3)]",
        lambda: [full.ref_count(b) for b in range(3)],
        [1, 1, 1],
        "a refused call must change nothing; " + RANGE_HINT,
    )


@task("02.sequence_allocator", "sequences, all or nothing", needs=("SequenceAllocator",))
def _sequence_allocator(c: Checker, sequences_class) -> None:
    seqs = c.run("seqs = SequenceAllocator(num_blocks=5, block_size=16)", lambda: sequences_class(5, 16))
    c.equal(
        'seqs.allocate_for_sequence("req-a", 33)',
        lambda: seqs.allocate_for_sequence("req-a", 33),
        [0, 1, 2],
        "33 tokens need ceil(33 / 16) = 3 blocks (33 // 16 rounds down to 2 and leaves token 32 "
        "without a slot), taken from the head of the free list",
    )
    c.equal('seqs.get_block_mapping("req-a")', lambda: seqs.get_block_mapping("req-a"), [0, 1, 2])
    c.equal("seqs.allocator.free_block_ids", lambda: tuple(seqs.allocator.free_block_ids), (3, 4))
    c.equal(
        'seqs.allocate_for_sequence("req-b", 16)',
        lambda: seqs.allocate_for_sequence("req-b", 16),
        [3],
        "16 tokens fill exactly one block of 16 (off by one at the block boundary?)",
    )

    c.raises(
        'seqs.allocate_for_sequence("req-a", 1)  # req-a is already allocated',
        lambda: seqs.allocate_for_sequence("req-a", 1),
        ValueError,
        "a duplicate id must raise ValueError: accepting it replaces req-a's table and leaks its blocks",
    )
    c.equal(
        "seqs.allocator.free_block_ids",
        lambda: tuple(seqs.allocator.free_block_ids),
        (4,),
        "the refused duplicate took a block: check the id before taking any block",
    )
    c.equal(
        'seqs.get_block_mapping("req-a")',
        lambda: seqs.get_block_mapping("req-a"),
        [0, 1, 2],
        "the refused duplicate must leave req-a's table as it was",
    )

    error = c.raises(
        'seqs.allocate_for_sequence("req-c", 17)  # needs 2 blocks, 1 is free',
        lambda: seqs.allocate_for_sequence("req-c", 17),
        OutOfBlocksError,
        "when fewer than ceil(17 / 16) = 2 blocks are free, raise OutOfBlocksError(needed, free)",
    )
    c.equal(
        "(error.needed, error.free)",
        lambda: (error.needed, error.free),
        (2, 1),
        "raise OutOfBlocksError(needed=2, free=1) yourself, before taking blocks: the error a failing "
        "allocate() raises halfway says needed=1, and the blocks taken before it leak",
    )
    c.equal("seqs.allocator.num_free_blocks", lambda: seqs.allocator.num_free_blocks, 1, LEAK_HINT)
    c.equal("seqs.allocator.free_block_ids", lambda: tuple(seqs.allocator.free_block_ids), (4,), LEAK_HINT)
    c.raises(
        'seqs.get_block_mapping("req-c")  # its allocation failed',
        lambda: seqs.get_block_mapping("req-c"),
        KeyError,
        "the failed call left a half-built table for req-c: add the table only once all its blocks are taken",
    )

    mapping = c.run('mapping = seqs.get_block_mapping("req-a")', lambda: seqs.get_block_mapping("req-a"))
    c.run("mapping.append(99)", lambda: mapping.append(99))
    c.equal(
        'seqs.get_block_mapping("req-a")',
        lambda: seqs.get_block_mapping("req-a"),
        [0, 1, 2],
        "return a copy of the block ids, list(...), so that a caller cannot change the table",
    )

    c.equal(
        'seqs.free_sequence("req-a")',
        lambda: seqs.free_sequence("req-a"),
        [0, 1, 2],
        "free_sequence frees every block of the table and returns those that went back to the pool",
    )
    c.equal(
        "seqs.allocator.free_block_ids",
        lambda: tuple(seqs.allocator.free_block_ids),
        (4, 0, 1, 2),
        "req-a's blocks go to the tail of the free list, in table order",
    )
    c.raises(
        'seqs.get_block_mapping("req-a")  # freed',
        lambda: seqs.get_block_mapping("req-a"),
        KeyError,
        "free_sequence must drop the sequence's table",
    )
    unknown_hint = (
        "a request may be cancelled before it was ever allocated: free_sequence of an unknown id is a "
        "no-op that returns [] (use self.tables.pop(seq_id, None))"
    )
    c.equal('seqs.free_sequence("req-a")  # again', lambda: seqs.free_sequence("req-a"), [], unknown_hint)
    c.equal('seqs.free_sequence("never-seen")', lambda: seqs.free_sequence("never-seen"), [], unknown_hint)
    c.raises(
        'seqs.get_block_mapping("never-seen")',
        lambda: seqs.get_block_mapping("never-seen"),
        KeyError,
        "an unknown id is a KeyError",
    )

    c.equal(
        'seqs.allocate_for_sequence("req-c", 40)',
        lambda: seqs.allocate_for_sequence("req-c", 40),
        [4, 0, 1],
        "block 4 was at the head of the free list, then req-a's freed blocks",
    )
    c.run("seqs.allocator.add_ref(4)  # another table holds block 4 too", lambda: seqs.allocator.add_ref(4))
    c.equal(
        'seqs.free_sequence("req-c")',
        lambda: seqs.free_sequence("req-c"),
        [0, 1],
        "block 4 has another holder, so it does not go back to the pool: return only the blocks for "
        "which allocator.free(...) returned True",
    )
    c.equal("seqs.allocator.ref_count(4)", lambda: seqs.allocator.ref_count(4), 1, REF_COUNT_HINT)
    c.equal("seqs.allocator.free_block_ids", lambda: tuple(seqs.allocator.free_block_ids), (2, 0, 1))


# ------------------------------------------------------------------------------- Task 3

AXES = ("num_blocks", "num_heads", "block_size", "head_dim")
ONCE_HINT = (
    "k_cache and v_cache are allocated once, in __init__, for all num_blocks blocks: a sequence only "
    "takes block ids. Making new tensors when a sequence comes or goes throws away every other "
    "sequence's K/V and allocates memory on the hot path"
)
SUPER_HINT = (
    "call super().__init__(num_blocks, block_size) first: SequenceAllocator sets up the free list "
    "(self.allocator) and the block tables (self.tables)"
)


def _shape_hint(got: object, sizes: dict[str, int]) -> str:
    """Name the axis order a wrong cache shape has, from the sizes (all different) it was built with."""
    if not isinstance(got, torch.Tensor):
        return f"k_cache must be one tensor for the whole pool, not a {type(got).__name__}; {ONCE_HINT}"
    by_size = {size: name for name, size in sizes.items()}
    names = [by_size.get(size) for size in got.shape]
    expected = f"({', '.join(AXES)})"
    if sorted(map(str, names)) == sorted(AXES):
        return (
            f"the axes are in the wrong order: yours are ({', '.join(map(str, names))}), the cache's are "
            f"{expected}: a block, then its heads, then the token's offset in the block, then the dims"
        )
    return f"the shape is {expected}, one entry per block of the pool"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any memory."""
    if a.device != b.device or a.device.type == "meta":
        return a is b
    start_a, start_b = a.data_ptr(), b.data_ptr()
    return (
        start_a < start_b + b.numel() * b.element_size() and start_b < start_a + a.numel() * a.element_size()
    )


@task("02.kv_cache", "the K/V cache, allocated once", needs=("PagedKVCacheAllocator",))
def _kv_cache(c: Checker, cache_class) -> None:
    sizes = {"num_blocks": 6, "num_heads": 3, "block_size": 4, "head_dim": 5}
    call = (
        "cache = PagedKVCacheAllocator(num_blocks=6, block_size=4, num_heads=3, head_dim=5, "
        'dtype=torch.float16, device="cpu")'
    )
    cache = c.run(call, lambda: cache_class(**sizes, dtype=torch.float16, device="cpu"), SUPER_HINT)
    for name in ("k_cache", "v_cache"):
        tensor = c.run(
            f"cache.{name}", lambda name=name: getattr(cache, name), f"set self.{name} in __init__"
        )
        c.holds(
            f"cache.{name}.shape",
            isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == (6, 3, 4, 5),
            "(6, 3, 4, 5), that is (num_blocks, num_heads, block_size, head_dim)",
            tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__,
            _shape_hint(tensor, sizes),
        )
        c.holds(
            f"cache.{name}.dtype",
            tensor.dtype == torch.float16,
            "torch.float16",
            str(tensor.dtype),
            "torch.zeros(shape) makes the default dtype, float32: pass dtype=dtype"
            if tensor.dtype == torch.get_default_dtype()
            else "pass dtype=dtype when you make the tensor",
        )
    c.holds(
        "cache.k_cache and cache.v_cache share memory?",
        not _overlap(cache.k_cache, cache.v_cache),
        "two separate tensors",
        "one tensor" if cache.k_cache is cache.v_cache else "tensors over the same memory",
        "k_cache and v_cache are one tensor (self.k_cache = self.v_cache = torch.zeros(...) makes one): "
        "writing V would overwrite K. Make two tensors, one torch.zeros(...) each",
    )
    c.equal(
        "cache.allocator.free_block_ids",
        lambda: tuple(cache.allocator.free_block_ids),
        tuple(range(6)),
        SUPER_HINT,
    )
    c.equal("cache.tables", lambda: dict(cache.tables), {}, SUPER_HINT)

    meta = c.run(
        'PagedKVCacheAllocator(4, 2, 2, 3, torch.float32, device="meta")  # a device with no memory',
        lambda: cache_class(4, 2, 2, 3, torch.float32, device="meta"),
        "pass device=device to torch.zeros: it must accept any device torch knows",
    )
    for name in ("k_cache", "v_cache"):
        device = getattr(meta, name).device
        c.holds(
            f"PagedKVCacheAllocator(..., device='meta').{name}.device",
            device.type == "meta",
            "meta",
            str(device),
            f"the {name} tensor is on {device}: pass device=device when you make it. On a GPU machine the "
            "cache must live on the GPU, beside the model",
        )

    k_before, v_before = cache.k_cache, cache.v_cache
    c.run("cache.k_cache[0] = 1  # K of a token in block 0", lambda: cache.k_cache[0].fill_(1))
    c.equal('cache.allocate_for_sequence("a", 9)', lambda: cache.allocate_for_sequence("a", 9), [0, 1, 2])
    c.equal('cache.allocate_for_sequence("b", 4)', lambda: cache.allocate_for_sequence("b", 4), [3])
    c.equal('cache.free_sequence("b")', lambda: cache.free_sequence("b"), [3])
    c.holds(
        "cache.k_cache and cache.v_cache after allocating and freeing sequences",
        cache.k_cache is k_before and cache.v_cache is v_before,
        "the very tensors __init__ made",
        "new tensors",
        ONCE_HINT,
    )
    c.holds(
        "cache.k_cache[0] after allocating and freeing sequences",
        bool((cache.k_cache[0] == 1).all()),
        "still 1: nothing overwrote the K/V a sequence holds",
        "changed",
        ONCE_HINT,
    )

"""Checks of exercise 01: Block, BlockTable and the look-up of a position's physical block."""

from __future__ import annotations

import dataclasses

from paged_kv.checks._core import Checker, task
from paged_kv.core.block import BlockTable as ReferenceTable

SHARED_DEFAULT_HINT = (
    "a default of [] is created once, when the def runs, and shared by every table made without "
    "block_ids: default to None and create a new list in __init__"
)
LOOKUP_HINT = (
    "the logical block is position // block_size (integer division: `/` gives a float, which cannot "
    "index a list); return block_ids[that]"
)


@task("01.block", "a handle to one physical block", needs=("Block",))
def _block(c: Checker, block_class) -> None:
    c.equal("Block(3).block_id", lambda: block_class(3).block_id, 3, "the first field is block_id")
    c.equal(
        "Block(3).ref_count",
        lambda: block_class(3).ref_count,
        0,
        "a new block has no holder yet: ref_count defaults to 0",
    )
    c.equal(
        "Block(3, 2).ref_count",
        lambda: block_class(3, 2).ref_count,
        2,
        "the fields are, in order, block_id then ref_count",
    )
    c.equal(
        "Block(block_id=4, ref_count=1).block_id",
        lambda: block_class(block_id=4, ref_count=1).block_id,
        4,
        "the fields are named block_id and ref_count",
    )
    c.holds(
        "dataclasses.is_dataclass(Block)",
        dataclasses.is_dataclass(block_class),
        "True",
        False,
        "put @dataclass on the line above `class Block:`",
    )
    c.equal(
        "Block(3) == Block(3)",
        lambda: block_class(3) == block_class(3),
        True,
        "a dataclass compares its fields; did you write your own __eq__?",
    )
    c.equal("Block(3) == Block(3, 1)", lambda: block_class(3) == block_class(3, 1), False)

    def hold_once() -> int:
        block = block_class(3)
        block.ref_count += 1
        return block.ref_count

    c.equal(
        "block = Block(3); block.ref_count += 1; block.ref_count",
        hold_once,
        1,
        "the allocator changes ref_count in place: do not freeze the dataclass",
    )


@task("01.block_table", "a sequence's page table", needs=("BlockTable",))
def _block_table(c: Checker, table_class) -> None:
    c.equal(
        "BlockTable(block_ids=[0, 1, 2], num_tokens=33).block_ids",
        lambda: table_class(block_ids=[0, 1, 2], num_tokens=33).block_ids,
        [0, 1, 2],
    )
    c.equal(
        "BlockTable(block_ids=[0, 1, 2], num_tokens=33).num_tokens",
        lambda: table_class(block_ids=[0, 1, 2], num_tokens=33).num_tokens,
        33,
    )
    c.equal(
        "BlockTable([0, 1, 2], 33).num_blocks",
        lambda: table_class([0, 1, 2], 33).num_blocks,
        3,
        "num_blocks is len(block_ids)",
    )
    c.equal(
        "BlockTable().block_ids",
        lambda: table_class().block_ids,
        [],
        "a new table starts with an empty list of its own; " + SHARED_DEFAULT_HINT,
    )
    c.equal("BlockTable().num_tokens", lambda: table_class().num_tokens, 0)

    first, second = table_class(), table_class()
    c.run("first.append_block(1)", lambda: first.append_block(1))
    c.equal(
        "first, second = BlockTable(), BlockTable(); first.append_block(1); second.block_ids",
        lambda: second.block_ids,
        [],
        SHARED_DEFAULT_HINT,
    )
    c.holds(
        "first.block_ids is second.block_ids",
        first.block_ids is not second.block_ids,
        "False: each table owns its list",
        True,
        SHARED_DEFAULT_HINT,
    )

    grown = table_class([], 0)
    for block_id in (7, 2, 5):
        c.run(f"table.append_block({block_id})", lambda block_id=block_id: grown.append_block(block_id))
    c.equal(
        "table = BlockTable([], 0); table.append_block(7), (2), (5); table.block_ids",
        lambda: grown.block_ids,
        [7, 2, 5],
        "append at the end: the new block becomes the next logical block",
    )
    c.equal("table.num_blocks", lambda: grown.num_blocks, 3)
    c.equal("table.num_tokens", lambda: grown.num_tokens, 0, "append_block adds a block, not tokens")

    for block_ids, num_tokens, size, expected, hint in [
        (
            [0, 1, 2],
            33,
            16,
            48,
            "capacity is num_blocks * block_size: 3 blocks of 16 hold 48 tokens, positions 0 to 47 "
            "(off by one? the capacity counts slots, it is not the last position)",
        ),
        ([], 0, 16, 0, "a table without blocks has room for nothing"),
        ([4], 16, 16, 16, "one full block of 16 holds exactly 16 tokens (off by one?)"),
        ([3, 8], 16, 16, 32, "capacity counts the blocks the table holds, not the blocks its tokens need"),
        ([0, 1, 2], 3, 1, 3, "blocks of 1 token: capacity is the number of blocks"),
    ]:
        c.equal(
            f"BlockTable({block_ids}, {num_tokens}).capacity({size})",
            lambda block_ids=block_ids, num_tokens=num_tokens, size=size: table_class(
                list(block_ids), num_tokens
            ).capacity(size),
            expected,
            hint,
        )

    original = table_class([4, 9], 5)
    duplicate = c.run("original = BlockTable([4, 9], 5); copy = original.copy()", original.copy)
    c.holds(
        "copy is original",
        duplicate is not original,
        "False: a new table",
        True,
        "copy() must return a new BlockTable, not self",
    )
    c.holds(
        "isinstance(copy, BlockTable)",
        isinstance(duplicate, table_class),
        "True",
        type(duplicate).__name__,
        "copy() returns a BlockTable",
    )
    c.equal("copy.block_ids", lambda: duplicate.block_ids, [4, 9])
    c.equal(
        "copy.num_tokens", lambda: duplicate.num_tokens, 5, "the copy holds as many tokens as the original"
    )
    copy_hint = (
        "copy() must build a new list, list(self.block_ids); "
        "BlockTable(self.block_ids, ...) wraps the same list in a second table"
    )
    c.holds(
        "copy.block_ids is original.block_ids",
        duplicate.block_ids is not original.block_ids,
        "False: the copy owns its list",
        True,
        copy_hint,
    )
    c.run("copy.append_block(1)", lambda: duplicate.append_block(1))
    c.equal("copy.append_block(1); original.block_ids", lambda: original.block_ids, [4, 9], copy_hint)


@task("01.physical_block", "which physical block holds a position")
def _physical_block(c: Checker, physical_block) -> None:
    req_a = ReferenceTable([0, 1, 2], num_tokens=33)
    for position, expected in [(0, 0), (32, 2)]:
        c.equal(
            f"physical_block(BlockTable([0, 1, 2], num_tokens=33), {position}, 16)",
            lambda position=position: physical_block(req_a, position, 16),
            expected,
            LOOKUP_HINT,
        )
    scattered = ReferenceTable([7, 2, 5], num_tokens=40)
    for position, expected, hint in [
        (0, 7, "return the physical block, block_ids[position // block_size], not the logical index"),
        (
            15,
            7,
            "positions 0 to 15 all live in logical block 0: the index is position // block_size, "
            "rounded down, not the count of blocks blocks_for_tokens(position, block_size)",
        ),
        (16, 2, "position 16 is the first token of logical block 1: position // block_size, no + 1"),
        (31, 2, LOOKUP_HINT),
        (32, 5, LOOKUP_HINT),
        (39, 5, "the last token of the sequence lives in the last block"),
    ]:
        c.equal(
            f"physical_block(BlockTable([7, 2, 5], num_tokens=40), {position}, 16)",
            lambda position=position: physical_block(scattered, position, 16),
            expected,
            hint,
        )
    small = ReferenceTable([7, 2, 5], num_tokens=10)
    c.equal(
        "physical_block(BlockTable([7, 2, 5], num_tokens=10), 9, 4)",
        lambda: physical_block(small, 9, 4),
        5,
        "use the block_size argument, not 16",
    )
    result = physical_block(scattered, 16, 16)
    c.holds(
        "type(physical_block(BlockTable([7, 2, 5], num_tokens=40), 16, 16))",
        type(result) is int,
        "int",
        type(result).__name__,
        "return the entry of block_ids itself",
    )
    for position, hint in [
        (
            40,
            "the table holds positions 0 to num_tokens - 1 = 39; position 40 has a slot "
            "but holds no token yet: raise ValueError",
        ),
        (48, "check the range yourself: the list's IndexError is not the ValueError asked for"),
        (
            -1,
            "Python reads block_ids[-1] as the last entry, so a negative position would quietly "
            "return block 5: raise ValueError unless 0 <= position < num_tokens",
        ),
    ]:
        c.raises(
            f"physical_block(BlockTable([7, 2, 5], num_tokens=40), {position}, 16)",
            lambda position=position: physical_block(scattered, position, 16),
            ValueError,
            hint,
        )

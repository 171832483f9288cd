"""How well a pool of blocks is used: the metrics of :class:`BlockUsage` (lessons 00 and 02).

A block shared by several block tables (a forked sequence, a cached prefix) is one physical block:
it counts once among the used blocks, and its tokens count once among the tokens held. Every
holder of a shared block keeps the same tokens in it (a write first copies the block, see
:meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.append_tokens`), so "the tokens a block holds" is well
defined; :func:`block_tokens` takes the most any holder keeps there all the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from itertools import chain

from paged_kv.core.block import BlockTable


@dataclass(frozen=True)
class BlockUsage:
    """A picture of the pool at one moment.

    Fields:
        used_blocks: blocks held by at least one sequence, each counted once.
        free_blocks: blocks on the free list.
        allocated_tokens: tokens stored in the used blocks; a token in a shared block counts once.
            Without sharing this is the sum of the sequences' lengths.
        reserved_tokens: token slots in the used blocks, ``used_blocks * block_size``.
        internal_fragmentation_tokens: reserved slots holding no token,
            ``reserved_tokens - allocated_tokens`` (the empty tails of last blocks).
        block_utilization: ``allocated_tokens / reserved_tokens``, and 0.0 when nothing is reserved.
        shared_blocks: used blocks held by more than one block table (ref count above 1).

    Counting shared tokens once keeps ``0 <= block_utilization <= 1`` and the waste at least 0.
    """

    used_blocks: int
    free_blocks: int
    allocated_tokens: int
    reserved_tokens: int
    internal_fragmentation_tokens: int
    block_utilization: float
    shared_blocks: int = 0

    @classmethod
    def measure(
        cls,
        *,
        used_blocks: int,
        free_blocks: int,
        allocated_tokens: int,
        block_size: int,
        shared_blocks: int = 0,
    ) -> BlockUsage:
        """Derive the reserved, wasted and utilization figures from the counts."""
        reserved = used_blocks * block_size
        return cls(
            used_blocks=used_blocks,
            free_blocks=free_blocks,
            allocated_tokens=allocated_tokens,
            reserved_tokens=reserved,
            internal_fragmentation_tokens=reserved - allocated_tokens,
            block_utilization=allocated_tokens / reserved if reserved else 0.0,
            shared_blocks=shared_blocks,
        )

    @classmethod
    def of_tables(
        cls, tables: Iterable[BlockTable], *, num_blocks: int, free_blocks: int, block_size: int
    ) -> BlockUsage:
        """Measure a pool of ``num_blocks`` blocks, ``free_blocks`` of them free, held by ``tables``.

        Each physical block and each stored token counts once, however many tables share it. When
        no block is shared (the common case, checked with one set) the tokens are simply the sum of
        the tables' lengths, so the cost stays O(number of tables) plus one pass in C.
        """
        tables = list(tables)
        entries = sum(table.num_blocks for table in tables)
        held = set(chain.from_iterable(table.block_ids for table in tables))
        if len(held) == entries:
            tokens, shared = sum(table.num_tokens for table in tables), 0
        else:
            tokens = sum(block_tokens(tables, block_size).values())
            holders = Counter(chain.from_iterable(table.block_ids for table in tables))
            shared = sum(1 for count in holders.values() if count > 1)
        return cls.measure(
            used_blocks=num_blocks - free_blocks,
            free_blocks=free_blocks,
            allocated_tokens=tokens,
            block_size=block_size,
            shared_blocks=shared,
        )

    def as_dict(self) -> dict[str, int | float]:
        """The fields as a plain dict, ready for ``json.dumps``.

        ``shared_blocks`` is left out when it is 0, so an unshared pool gives exactly the six
        metrics of the blog seed's report (``paged_kv.simulation.fragmentation.fragmentation_report``).
        """
        fields = asdict(self)
        if not self.shared_blocks:
            del fields["shared_blocks"]
        return fields


def block_tokens(tables: Iterable[BlockTable], block_size: int) -> dict[int, int]:
    """How many tokens each block held by a table stores: the most any of its holders keeps there.

    Logical block ``i`` of a table with ``n`` tokens holds ``min(block_size, max(0, n - i * block_size))``.

    >>> block_tokens([BlockTable([2, 0, 1], 9), BlockTable([2, 3], 5)], 4)
    {2: 4, 0: 4, 1: 1, 3: 1}
    """
    tokens: dict[int, int] = {}
    for table in tables:
        for logical, block_id in enumerate(table.block_ids):
            held = min(block_size, max(0, table.num_tokens - logical * block_size))
            tokens[block_id] = max(held, tokens.get(block_id, 0))
    return tokens

"""How well a pool of blocks is used: the metrics of :class:`BlockUsage`."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BlockUsage:
    """A picture of the pool at one moment.

    Fields:
        used_blocks: blocks held by at least one sequence.
        free_blocks: blocks on the free list.
        allocated_tokens: tokens the sequences actually hold.
        reserved_tokens: token slots in the used blocks, ``used_blocks * block_size``.
        internal_fragmentation_tokens: reserved slots holding no token,
            ``reserved_tokens - allocated_tokens`` (the empty tails of last blocks).
        block_utilization: ``allocated_tokens / reserved_tokens``, and 0.0 when nothing is reserved.
    """

    used_blocks: int
    free_blocks: int
    allocated_tokens: int
    reserved_tokens: int
    internal_fragmentation_tokens: int
    block_utilization: float

    @classmethod
    def measure(
        cls, *, used_blocks: int, free_blocks: int, allocated_tokens: int, block_size: int
    ) -> BlockUsage:
        """Derive the reserved, wasted and utilisation figures from the three counts."""
        reserved = used_blocks * block_size
        return cls(
            used_blocks=used_blocks,
            free_blocks=free_blocks,
            allocated_tokens=allocated_tokens,
            reserved_tokens=reserved,
            internal_fragmentation_tokens=reserved - allocated_tokens,
            block_utilization=allocated_tokens / reserved if reserved else 0.0,
        )

    def as_dict(self) -> dict[str, int | float]:
        """The fields as a plain dict, ready for ``json.dumps``."""
        return asdict(self)

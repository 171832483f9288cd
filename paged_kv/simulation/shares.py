"""Where the KV memory goes: the four shares of the vLLM paper's Figure 2, measured (lessons 00 and 07).

The PagedAttention paper (Kwon et al., SOSP 2023) splits the KV cache memory of a serving system
into four parts. This module measures the same four, in **slot-steps**: one token slot of the
memory during one step of the scheduler. At one step, for each running sequence that stores
``held`` tokens in ``reserved`` slots and will end at ``final`` tokens (prompt plus output):

* **token states**: ``held``, the slots that hold a computed token's K/V;
* **reservation**: ``min(reserved, final) - held``, slots kept for tokens the sequence will still
  generate (they will be used, but nobody else can use them until then);
* **internal fragmentation**: ``max(reserved - final, 0)``, slots reserved beyond the final
  length, never used: the over-reservation of Orca (Max) and (Pow2), the unused end of a paged
  sequence's last block;

and, for the memory as a whole,

* **external fragmentation and others**: the free slots, ``capacity - sum(reserved)``.

:class:`SlotUse` is that split at one step; the four always sum to ``capacity``.
:class:`MemoryShares` sums them over the steps at which **a request waits** once the step's
admissions are done: the steps at which memory limits the server. At such a step a free slot is
one the request at the front of the queue could not take: no hole was large enough for its
contiguous range (external fragmentation proper), or the free total was too small for it (paged:
fewer free blocks than its whole prompt needs; the "others" the paper lumps in). Steps at which
nobody waits are left out: their free slots are idle, not wasted.
So the four shares sum to 100 % of the memory over the measured steps.

:data:`PAPER_FIGURE_2` holds the paper's own figures, for comparison.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

from paged_kv.validate import check_count

SHARES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation")
"""The four shares, in the order of the paper's stacked bars."""

PAPER_FIGURE_2: dict[str, dict[str, float | None]] = {
    "Orca (Max)": dict(
        token_states=20.4, reservation=13.3, internal_fragmentation=57.3, external_fragmentation=8.9
    ),
    "Orca (Pow2)": dict(
        token_states=26.8, reservation=17.9, internal_fragmentation=13.6, external_fragmentation=41.6
    ),
    "Orca (Oracle)": dict(
        token_states=38.2, reservation=25.2, internal_fragmentation=0.0, external_fragmentation=36.6
    ),
    "vLLM": dict(
        token_states=96.3, reservation=None, internal_fragmentation=None, external_fragmentation=None
    ),
}
"""The paper's Figure 2, in percent of the KV memory (OPT-13B on one A100-40GB, ShareGPT, §6.2).

Orca (Oracle) has no internal fragmentation; for vLLM the paper gives only the token states, and
leaves the other 3.7 % unsplit (None here).
"""


class SlotUse(NamedTuple):
    """The memory's slots at one step, split four ways; the four sum to the capacity."""

    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int

    @classmethod
    def measure(cls, sequences: Iterable[tuple[int, int, int]], capacity: int) -> SlotUse:
        """Split ``capacity`` slots among ``(held, reserved, final)`` sequences (see the module).

        >>> SlotUse.measure([(100, 2048, 300), (50, 64, 60)], capacity=4096)
        SlotUse(token_states=150, reservation=210, internal_fragmentation=1752, external_fragmentation=1984)

        Raises:
            ValueError: a count is not a whole number, a sequence holds more than it reserves or
                more than its final length, or the sequences reserve more than ``capacity``.
        """
        capacity = check_count("capacity", capacity)
        tokens = reservation = internal = used = 0
        for held, reserved, final in sequences:
            if not (type(held) is type(reserved) is type(final) is int and held >= 0):  # the common case
                held, reserved = check_count("held", held), check_count("reserved", reserved)
                final = check_count("final", final)
            if held > reserved or held > final:
                raise ValueError(
                    f"a sequence cannot hold {held} tokens in {reserved} reserved slots "
                    f"with final length {final}"
                )
            tokens += held
            if reserved > final:
                reservation += final - held
                internal += reserved - final
            else:
                reservation += reserved - held
            used += reserved
        if used > capacity:
            raise ValueError(f"the sequences reserve {used} slots, more than capacity={capacity}")
        return cls(tokens, reservation, internal, capacity - used)


@dataclass(frozen=True)
class MemoryShares:
    """The four parts of the memory in slot-steps, summed over ``steps`` steps of ``capacity`` slots.

    Invariant: the four sum to :attr:`total`, ``capacity * steps``, so :meth:`percent` sums to 100.
    """

    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int
    steps: int
    capacity: int

    @classmethod
    def measure(cls, uses: Iterable[SlotUse], capacity: int) -> MemoryShares:
        """Sum the :class:`SlotUse` of each measured step, each of ``capacity`` slots.

        Raises:
            ValueError: a step's four parts do not sum to ``capacity``.
        """
        capacity = check_count("capacity", capacity)
        sums, steps = [0, 0, 0, 0], 0
        for use in uses:
            if sum(use) != capacity:
                raise ValueError(f"a step's slots {tuple(use)} do not sum to capacity={capacity}")
            sums = [total + part for total, part in zip(sums, use, strict=True)]
            steps += 1
        return cls(*sums, steps=steps, capacity=capacity)

    @property
    def total(self) -> int:
        """Every slot-step measured: ``capacity * steps``."""
        return self.capacity * self.steps

    def percent(self) -> dict[str, float]:
        """Each share in percent of :attr:`total`, in the order of :data:`SHARES`.

        Raises:
            ValueError: no step was measured (no request ever waited: memory never limited the server).
        """
        if not self.total:
            raise ValueError(
                "no step was measured: no request ever waited, so memory never limited the server; "
                "send more requests, or send them faster"
            )
        return {name: 100 * getattr(self, name) / self.total for name in SHARES}

    def as_dict(self) -> dict[str, object]:
        """The slot-steps, the steps and capacity, and ``percent`` (None when no step was measured)."""
        fields = asdict(self)
        fields["percent"] = self.percent() if self.total else None
        return fields


def beside_the_paper(measured: Sequence[MemoryShares]) -> list[tuple[str, dict[str, float | None]]]:
    """Figure 2's bars: each system's shares as the paper gives them, then as ``measured``, in percent.

    ``measured`` holds one :class:`MemoryShares` per system of :data:`PAPER_FIGURE_2`, in its order
    (Orca (Max), Orca (Pow2), Orca (Oracle), vLLM). The result is what
    :func:`~paged_kv.pictures.plots.plot_memory_shares` draws with ``group=2``: the paper's bar and
    the measured one side by side for each system.

    Raises:
        ValueError: ``measured`` does not hold one entry per system (or one measured no step).
    """
    if len(measured) != len(PAPER_FIGURE_2):
        raise ValueError(
            f"measured must hold one MemoryShares per system of the paper's Figure 2 "
            f"({', '.join(PAPER_FIGURE_2)}), got {len(measured)}"
        )
    bars: list[tuple[str, dict[str, float | None]]] = []
    for (system, paper), shares in zip(PAPER_FIGURE_2.items(), measured, strict=True):
        label = system.replace(" (", "\n(")
        bars += [(f"{label}\npaper", paper), ("measured", shares.percent())]
    return bars

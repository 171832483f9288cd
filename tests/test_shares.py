"""The four shares of the KV memory, as the vLLM paper's Figure 2 splits it (lessons 00 and 07)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv.simulation.shares import PAPER_FIGURE_2, SHARES, MemoryShares, SlotUse, beside_the_paper

pytestmark = pytest.mark.lesson07


def test_a_sequence_splits_into_tokens_reservation_and_internal_fragmentation():
    # 100 tokens held in a 2,048-slot range, final length 300: 200 still to come, 1,748 never used.
    assert SlotUse.measure([(100, 2048, 300)], 4096) == SlotUse(100, 200, 1748, 2048)
    # The oracle reserves the final length: no internal fragmentation.
    assert SlotUse.measure([(100, 300, 300)], 300) == SlotUse(100, 200, 0, 0)
    # A paged sequence of 50 tokens in 4 blocks of 16, final length 60: 10 to come, 4 never used.
    assert SlotUse.measure([(50, 64, 60)], 64) == SlotUse(50, 10, 4, 0)
    # Still growing past its blocks: all of the unused tail is reservation.
    assert SlotUse.measure([(50, 64, 200)], 100) == SlotUse(50, 14, 0, 36)
    assert SlotUse.measure([], 10) == SlotUse(0, 0, 0, 10)


@pytest.mark.parametrize(
    ("sequences", "capacity", "match"),
    [
        ([(5, 4, 9)], 10, "cannot hold 5 tokens in 4 reserved slots"),
        ([(5, 8, 4)], 10, "final length 4"),
        ([(1, 8, 4), (1, 8, 4)], 10, "reserve 16 slots, more than capacity=10"),
        ([(-1, 8, 4)], 10, "held"),
        ([(1, 8.5, 4)], 10, "reserved"),
        ([(1, 8, True)], 10, "final"),
        ([], -1, "capacity"),
    ],
)
def test_impossible_sequences_are_value_errors(sequences, capacity, match):
    with pytest.raises(ValueError, match=match):
        SlotUse.measure(sequences, capacity)


@st.composite
def moments(draw):
    """Sequences ``(held, reserved, final)`` that fit in a capacity, and that capacity."""
    sequences = []
    for _ in range(draw(st.integers(0, 8))):
        final = draw(st.integers(1, 300))
        reserved = draw(st.integers(1, 400))
        held = draw(st.integers(0, min(reserved, final)))
        sequences.append((held, reserved, final))
    capacity = sum(r for _, r, _ in sequences) + draw(st.integers(0, 500))
    return sequences, capacity


@given(moments())
def test_the_four_parts_always_sum_to_the_capacity(moment):
    sequences, capacity = moment
    use = SlotUse.measure(sequences, capacity)
    assert sum(use) == capacity and min(use) >= 0
    assert use.token_states == sum(held for held, _, _ in sequences)
    assert use.token_states + use.reservation + use.internal_fragmentation == sum(r for _, r, _ in sequences)
    # Slot by slot: a slot of a range is a token, a slot for a token to come, or one past the end.
    for held, reserved, final in sequences:
        alone = SlotUse.measure([(held, reserved, final)], reserved)
        slots = ["token" if i < held else "to come" if i < final else "never" for i in range(reserved)]
        assert alone[:3] == (slots.count("token"), slots.count("to come"), slots.count("never"))


@given(st.lists(moments(), max_size=6))
def test_shares_sum_to_one_hundred_percent_of_the_measured_memory(steps):
    capacity = max((c for _, c in steps), default=1) or 1
    uses = [SlotUse.measure(sequences, capacity) for sequences, c in steps]
    shares = MemoryShares.measure(uses, capacity)
    assert (shares.steps, shares.total) == (len(uses), capacity * len(uses))
    assert [getattr(shares, name) for name in SHARES] == [sum(u[i] for u in uses) for i in range(4)]
    if uses:
        assert sum(shares.percent().values()) == pytest.approx(100)
        assert list(shares.percent()) == list(SHARES)
        assert shares.as_dict()["percent"] == shares.percent()
    else:
        assert shares.as_dict()["percent"] is None
        with pytest.raises(ValueError, match="no request ever waited"):
            shares.percent()


def test_shares_by_hand():
    uses = [SlotUse(7, 7, 2, 1), SlotUse(9, 5, 2, 1)]
    shares = MemoryShares.measure(uses, 17)
    assert shares == MemoryShares(16, 12, 4, 2, steps=2, capacity=17)
    assert shares.percent() == pytest.approx(
        {
            "token_states": 1600 / 34,
            "reservation": 1200 / 34,
            "internal_fragmentation": 400 / 34,
            "external_fragmentation": 200 / 34,
        }
    )


def test_a_step_that_does_not_add_up_is_refused():
    with pytest.raises(ValueError, match="do not sum to capacity=10"):
        MemoryShares.measure([SlotUse(1, 2, 3, 3)], 10)


def test_the_papers_figures():
    assert list(PAPER_FIGURE_2) == ["Orca (Max)", "Orca (Pow2)", "Orca (Oracle)", "vLLM"]
    for name, shares in PAPER_FIGURE_2.items():
        assert list(shares) == list(SHARES)
        if name != "vLLM":
            assert sum(shares.values()) == pytest.approx(100, abs=0.15)  # as printed, to one decimal
    assert [PAPER_FIGURE_2[n]["token_states"] for n in PAPER_FIGURE_2] == [20.4, 26.8, 38.2, 96.3]


def test_beside_the_paper_puts_each_measured_bar_after_the_papers():
    measured = [
        MemoryShares.measure([SlotUse(5 * i, 1, 0, 19 - 5 * i)], 20) for i in range(len(PAPER_FIGURE_2))
    ]
    bars = beside_the_paper(measured)
    assert [label for label, _ in bars] == [
        "Orca\n(Max)\npaper",
        "measured",
        "Orca\n(Pow2)\npaper",
        "measured",
        "Orca\n(Oracle)\npaper",
        "measured",
        "vLLM\npaper",
        "measured",
    ]
    assert [shares for _, shares in bars[::2]] == list(PAPER_FIGURE_2.values())
    assert [shares["token_states"] for _, shares in bars[1::2]] == [0.0, 25.0, 50.0, 75.0]


def test_beside_the_paper_needs_one_measurement_per_system():
    with pytest.raises(ValueError, match="one MemoryShares per system"):
        beside_the_paper([])

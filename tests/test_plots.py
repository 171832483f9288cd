"""The course's matplotlib pictures draw what they say (checked on the artists, not on pixels)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from paged_kv import PagedKVCacheAllocator
from paged_kv.plots import plot_block_tables, plot_held_and_reserved, plot_reservations

pytestmark = pytest.mark.lesson00


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_reservations_draw_one_slot_or_whole_blocks_per_request():
    slots = plot_reservations([9, 17], slot_tokens=41)
    assert [t.get_text() for t in slots.texts] == ["9 / 41", "17 / 41"]
    blocks = plot_reservations([9, 17], block_size=16)
    assert [t.get_text() for t in blocks.texts] == ["9 / 16", "17 / 32"]
    with pytest.raises(ValueError, match="exactly one of slot_tokens and block_size"):
        plot_reservations([9], slot_tokens=16, block_size=16)


def test_block_tables_label_every_physical_block_and_every_sequence():
    cache = PagedKVCacheAllocator(8, 4, 1, 1)
    cache.allocate_for_sequence("A", 6)
    cache.allocate_for_sequence("B", 3)
    labels = [t.get_text() for t in plot_block_tables(cache.snapshot()).texts]
    assert {str(block) for block in range(8)} <= set(labels)
    assert {"A", "B"} <= set(labels)


def test_held_and_reserved_draws_both_staircases_and_the_gap():
    ax = plot_held_and_reserved([3, 4, 5], [4, 4, 8], xlabel="decode step")
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    assert lines["tokens held"] == [3, 4, 5] and lines["slots reserved"] == [4, 4, 8]
    assert ax.get_xlabel() == "decode step"
    assert [c.get_label() for c in ax.collections] == ["reserved, empty"]

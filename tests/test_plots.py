"""The course's matplotlib pictures draw what they say (checked on the artists, not on pixels)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex, to_rgba
from matplotlib.patches import FancyArrowPatch, Rectangle

from paged_kv import PagedKVCacheAllocator
from paged_kv.pictures.plots import (
    MEMORY_SHARES,
    PALETTE,
    contrast_ratio,
    plot_block_tables,
    plot_free_list_steps,
    plot_held_and_reserved,
    plot_memory_shares,
    plot_padded_block_tables,
    plot_positions_in_pool,
    plot_reservations,
    plot_weights_by_block,
)
from paged_kv.simulation.shares import PAPER_FIGURE_2, SHARES

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


def two_tables():
    cache = PagedKVCacheAllocator(8, 4, 1, 1)
    cache.allocate_for_sequence("A", 6)  # blocks 0, 1
    cache.allocate_for_sequence("B", 3)  # block 2
    cache.free_sequence("A")
    cache.allocate_for_sequence("C", 9)  # three blocks from the free list, wherever they are
    return cache.snapshot()


def arrows(ax):
    return [p for p in ax.patches if isinstance(p, FancyArrowPatch)]


def test_block_tables_label_every_physical_block_and_every_sequence():
    snapshot = two_tables()
    labels = [t.get_text() for t in plot_block_tables(snapshot).texts]
    assert {str(block) for block in range(8)} <= set(labels)
    assert {"B", "C"} <= set(labels)
    entries = [str(b) for table in snapshot.tables.values() for b in table.block_ids]
    titles = [
        "physical pool: 8 blocks of 4 slots",
        "block tables: logical blocks left to right, each naming its physical block",
    ]
    assert sorted(labels) == sorted([*map(str, range(8)), *entries, "B", "C", *titles])


def test_block_tables_draw_one_arrow_per_entry_up_to_its_physical_block():
    snapshot = two_tables()
    ax = plot_block_tables(snapshot)
    pool = {t.get_text(): t.get_position() for t in ax.texts[: snapshot.num_blocks]}
    drawn = arrows(ax)
    entries = [b for table in snapshot.tables.values() for b in table.block_ids]
    assert len(drawn) == len(entries)
    for arrow, block_id in zip(drawn, entries, strict=True):
        (_, y0), (x1, y1) = arrow._posA_posB
        px, py = pool[str(block_id)]
        assert (x1, y1) == pytest.approx((px, py - 0.4))  # the bottom edge of its physical block
        assert y0 < y1  # from the tables below, up


def test_block_tables_keep_the_titles_clear_of_the_arrows_and_the_pool_in_rows():
    ax = plot_block_tables(two_tables(), blocks_per_row=3)
    pool_title, tables_title = ax.texts[-2], ax.texts[-1]
    assert pool_title.get_text() == "physical pool: 8 blocks of 4 slots"
    assert tables_title.get_text().startswith("block tables: logical blocks left to right")
    ends = [y for arrow in arrows(ax) for _, y in arrow._posA_posB]
    assert tables_title.get_position()[1] < min(ends) and max(ends) < pool_title.get_position()[1]
    rows = {round(t.get_position()[1], 3) for t in ax.texts[:8]}
    assert len(rows) == 3  # 8 blocks in rows of 3
    assert len({round(t.get_position()[1], 3) for t in plot_block_tables(two_tables()).texts[:8]}) == 1


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "8"])
def test_block_tables_refuse_a_bad_row_length(bad):
    with pytest.raises(ValueError, match="blocks_per_row must be a positive int or None"):
        plot_block_tables(two_tables(), blocks_per_row=bad)


def test_held_and_reserved_draws_both_staircases_and_the_gap():
    ax = plot_held_and_reserved([3, 4, 5], [4, 4, 8], xlabel="decode step")
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
    assert lines["tokens held"] == [3, 4, 5] and lines["slots reserved"] == [4, 4, 8]
    assert ax.get_xlabel() == "decode step"
    assert [c.get_label() for c in ax.collections] == ["reserved, empty"]


def test_free_list_steps_colour_a_sequence_the_same_in_every_row_and_number_the_free_blocks():
    cache = PagedKVCacheAllocator(4, 4, 1, 1)
    steps = [("new pool", cache.snapshot())]
    cache.allocate_for_sequence("a", 5)  # blocks 0, 1
    steps.append(("a: 5 tokens", cache.snapshot()))
    cache.allocate_for_sequence("b", 1)  # block 2
    cache.free_sequence("a")
    steps.append(("a finishes", cache.snapshot()))
    ax = plot_free_list_steps(steps, title="three steps")
    fills = [p.get_facecolor() for p in ax.patches if isinstance(p, Rectangle)]
    white = (1.0, 1.0, 1.0, 1.0)
    assert fills[:4] == [white] * 4
    assert fills[4] == fills[5] != white and fills[6] == white  # a in its colour, block 2 free
    assert fills[8:10] == [white, white] and fills[10] not in (white, fills[4])  # b takes a new colour
    texts = [t.get_text() for t in ax.texts]
    assert "free list [3, 0, 1]" in texts and "free list [2, 3]" in texts
    places = [t for t in texts if t.startswith("#")]  # row by row, in block order
    assert places == ["#1", "#2", "#3", "#4", "#1", "#2", "#2", "#3", "#1"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    with pytest.raises(ValueError, match="steps must hold at least one"):
        plot_free_list_steps([])


def test_positions_in_pool_label_each_position_twice_and_every_flat_slot():
    cache = PagedKVCacheAllocator(4, 4, 1, 1)
    cache.allocate_for_sequence("other", 6)  # blocks 0 and 1, the second holding 2 tokens
    cache.allocate_for_sequence("s", 7)  # blocks 2 and 3
    ax = plot_positions_in_pool(cache.snapshot(), "s")
    texts = [t.get_text() for t in ax.texts]
    for position in range(7):
        assert texts.count(str(position)) >= 2  # in the logical view and in the pool
    flat = [t for t in ax.texts if t.get_fontsize() == 6 and t.get_text()]
    assert {t.get_text() for t in flat} == {str(slot) for slot in range(16)}
    grey = to_rgba("#BBBBBB")
    # the 6 tokens of "other", and nothing else, are grey
    assert sum(p.get_facecolor() == grey for p in ax.patches if isinstance(p, Rectangle)) == 6
    assert len(arrows(ax)) == 2
    with pytest.raises(KeyError, match="'t' is not a sequence of the snapshot"):
        plot_positions_in_pool(cache.snapshot(), "t")


def test_padded_block_tables_hatch_the_padding_and_colour_the_highlighted_row():
    ax = plot_padded_block_tables([[3, 1, -1], [2, -1, -1]], ["a", "b"], highlight=0)
    assert [t.get_text() for t in ax.texts] == ["3", "1", "-1", "2", "-1", "-1"]
    hatched = [p for p in ax.patches if p.get_hatch() == "///"]
    assert len(hatched) == 3
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    for bad, message in [
        (([[1, 2], [3]], ["a", "b"]), "rows of the same length"),
        (([[1, 2]], ["a", "b"]), "labels must name each of the 1 rows, got 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            plot_padded_block_tables(*bad)
    with pytest.raises(ValueError, match="highlight must be a row index below 2, got 2"):
        plot_padded_block_tables([[1], [2]], ["a", "b"], highlight=2)


def labels_on_sequence_colours(ax) -> list[tuple[str, str, str]]:
    """Every text drawn inside a rectangle filled with a sequence colour: (text, its colour, the fill)."""
    palette = {to_rgba(fill): fill for fill in PALETTE}
    found = []
    for text in ax.texts:
        x, y = text.get_position()
        under = [
            palette[p.get_facecolor()]
            for p in ax.patches
            if isinstance(p, Rectangle)
            and p.get_facecolor() in palette
            and p.get_x() <= x <= p.get_x() + p.get_width()
            and p.get_y() <= y <= p.get_y() + p.get_height()
        ]
        if text.get_text() and under:
            found.append((text.get_text(), to_hex(text.get_color()), under[-1]))
    return found


def test_a_number_on_a_sequence_colour_is_black_or_white_whichever_reads_better():
    cache = PagedKVCacheAllocator(8, 4, 1, 1)
    cache.allocate_for_sequence("s", 30)  # eight logical blocks, eight colours
    pictures = [
        plot_positions_in_pool(cache.snapshot(), "s"),
        plot_padded_block_tables([list(range(8)), [0, -1, -1, -1, -1, -1, -1, -1]], ["s", "t"]),
    ]
    for ax in pictures:
        labels = labels_on_sequence_colours(ax)
        assert {fill for _, _, fill in labels} == set(PALETTE)
        faint = [label for label in labels if contrast_ratio(label[1], label[2]) < 4.5]
        assert not faint, faint


def test_weights_by_block_draw_one_bar_per_held_position_and_hatch_the_masked_slots():
    weights = [0.1, 0.2, 0.3, 0.15, 0.25, 0.0, 0.0, 0.0]
    ax = plot_weights_by_block(weights, [7, 2], 4, 5)
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert [round(b.get_height(), 2) for b in bars[:5]] == [0.1, 0.2, 0.3, 0.15, 0.25]
    assert len(bars) == 8 and all(b.get_hatch() == "///" for b in bars[5:])
    assert bars[0].get_facecolor() == bars[3].get_facecolor() != bars[4].get_facecolor()  # by block
    assert {"block 7", "block 2", "masked: weight 0"} <= {t.get_text() for t in ax.texts}
    with pytest.raises(ValueError, match="weights must have one value per slot, 8, got 3"):
        plot_weights_by_block([0.5, 0.5, 0.0], [7, 2], 4, 2)
    with pytest.raises(ValueError, match=r"context_len must be in 1 \.\. 8, got 0"):
        plot_weights_by_block(weights, [7, 2], 4, 0)


def test_memory_shares_stack_each_bar_to_its_shares_and_box_what_a_source_does_not_split():
    assert [key for key, _, _ in MEMORY_SHARES] == list(SHARES)  # the simulator's four shares
    measured = {"token_states": 50.0, "reservation": 30.0, "internal_fragmentation": 0.0}
    measured["external_fragmentation"] = 20.0
    bars = [("Oracle\npaper", PAPER_FIGURE_2["Orca (Oracle)"]), ("Oracle\nmeasured", measured)]
    ax = plot_memory_shares([*bars, ("vLLM\npaper", PAPER_FIGURE_2["vLLM"])], group=2)
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    heights = [round(p.get_height(), 1) for p in boxes]
    # Oracle in the paper: 38.2, 25.2, no internal fragmentation, 36.6; measured: 50, 30, 20;
    # vLLM: 96.3 and a dashed box for the 3.7 % the paper does not split.
    assert heights == [38.2, 25.2, 36.6, 50.0, 30.0, 20.0, 96.3, 3.7]
    assert [round(p.get_y(), 1) for p in boxes] == [0, 38.2, 63.4, 0, 50.0, 80.0, 0, 96.3]
    assert boxes[-1].get_linestyle() == "--"
    xs = sorted({round(p.get_x() + p.get_width() / 2, 1) for p in boxes})
    assert xs == [0, 1, 2.6]  # a gap after each group of two
    assert [t.get_text() for t in ax.texts] == ["38.2", "25.2", "36.6", "50.0", "30.0", "20.0", "96.3"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [name for _, name, _ in MEMORY_SHARES] + ["not broken down"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "Oracle\npaper",
        "Oracle\nmeasured",
        "vLLM\npaper",
    ]


@pytest.mark.parametrize(
    ("shares", "match"),
    [
        ({"token_states": 50.0}, "must give the shares"),
        (dict.fromkeys(SHARES, 30.0), "sum to at most 100"),
        ({**dict.fromkeys(SHARES, 10.0), "reservation": -1.0}, "at least 0"),
    ],
)
def test_memory_shares_refuse_bars_that_are_not_shares_of_the_memory(shares, match):
    with pytest.raises(ValueError, match=match):
        plot_memory_shares([("bad", shares)])


# ------------------------------------------------------------------- one engine step's batch (lesson 09)

STEP = {  # step 1 of lesson 09: a and b decode, c's 5-token prompt is prefilled, in blocks of 4
    "req_ids": ["a", "b", "c"],
    "query_start_loc": [0, 1, 2, 7],
    "positions": [9, 2, 0, 1, 2, 3, 4],
    "slot_mapping": [9, 14, 16, 17, 18, 19, 20],
    "block_table": [[0, 1, 2], [3, -1, -1], [4, 5, -1]],
    "block_size": 4,
}


def step_batch(**changes):
    from paged_kv.pictures.plots import plot_step_batch

    return plot_step_batch(**{**STEP, **changes})


@pytest.mark.lesson09
def test_step_batch_draws_every_token_its_slot_and_one_arrow_to_its_block():
    ax = step_batch()
    texts = [t.get_text() for t in ax.texts]
    for slot in STEP["slot_mapping"]:
        assert str(slot) in texts
    assert {"a: 1 token", "b: 1 token", "c: 5 tokens"} <= set(texts)
    assert {"a's row, seq_len 10", "b's row, seq_len 3", "c's row, seq_len 5"} <= set(texts)
    assert any("query_start_loc [0, 1, 2, 7]" in t for t in texts)
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 7
    assert [to_hex(a.get_edgecolor()) for a in arrows] == [PALETTE[0].lower()] + [PALETTE[1].lower()] + [
        PALETTE[2].lower()
    ] * 5
    # Each arrow runs down from its slot to the block its position falls in, in its request's row.
    block_boxes = {
        t.get_text(): t.get_position()
        for t in ax.texts
        if t.get_position()[1] < -3 and t.get_text().isdigit()
    }
    blocks = [2, 3, 4, 4, 4, 4, 5]  # the block of each token's position, from its request's row
    for arrow, block in zip(arrows, blocks, strict=True):
        (_, y0), (x1, y1) = arrow._posA_posB
        bx, by = block_boxes[str(block)]
        assert (x1, y1) == pytest.approx((bx, by + 0.4))  # the top edge of the block's box
        assert y1 < y0
    hatched = [p for p in ax.patches if p.get_hatch() == "///"]
    assert len(hatched) == 3  # the padding of b's and c's rows


@pytest.mark.lesson09
def test_step_batch_colours_the_blocks_written_this_step_and_greys_the_older_ones():
    ax = step_batch()
    fills = {
        t.get_text(): to_hex(p.get_facecolor())
        for t in ax.texts
        for p in ax.patches
        if isinstance(p, Rectangle)
        and p.get_hatch() is None
        and p.get_y() < -3
        and p.get_x() <= t.get_position()[0] <= p.get_x() + p.get_width()
        and p.get_y() <= t.get_position()[1] <= p.get_y() + p.get_height()
    }
    assert fills == {
        "0": "#e8e8e8",
        "1": "#e8e8e8",
        "2": PALETTE[0].lower(),
        "3": PALETTE[1].lower(),
        "4": PALETTE[2].lower(),
        "5": PALETTE[2].lower(),
    }


@pytest.mark.lesson09
def test_step_batch_takes_tensors_as_the_runner_prepares_them():
    import torch

    ax = step_batch(
        query_start_loc=torch.tensor(STEP["query_start_loc"], dtype=torch.int32),
        positions=torch.tensor(STEP["positions"]),
        slot_mapping=torch.tensor(STEP["slot_mapping"]),
        block_table=torch.tensor(STEP["block_table"], dtype=torch.int32),
    )
    assert len([p for p in ax.patches if isinstance(p, FancyArrowPatch)]) == 7


@pytest.mark.lesson09
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"slot_mapping": [9, 14, 16, 17, 18, 19, 21]}, r"token 6 \(position 4 of 'c'\) has slot 21"),
        ({"slot_mapping": [9, 14]}, "one slot per token"),
        ({"query_start_loc": [0, 1, 7]}, "one entry per request and one more"),
        ({"query_start_loc": [0, 2, 2, 7]}, "query_start_loc must increase"),
        ({"block_table": [[0, 1, 2], [3, -1, -1]]}, "one row per request"),
        ({"block_table": [[0, 1], [3, -1, -1], [4, 5, -1]]}, r"position 9 of 'a'"),
        ({"block_size": 0}, "block_size must be a positive int"),
    ],
)
def test_step_batch_refuses_inputs_that_are_not_one_step(changes, message):
    with pytest.raises(ValueError, match=message):
        step_batch(**changes)

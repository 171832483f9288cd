"""The widgets, kernel side: the player's wiring and the playground's actions, with no browser.

Setting a widget's ``.value`` fires its observers at once, and :func:`press` runs a button's
click callbacks. (``Button.click()`` would run them too, but it logs any exception and goes on,
so a broken callback could still pass a test.) The player's frames move in the browser, through
jslinks, so here we check that the right links exist, not that they move anything.
"""

from __future__ import annotations

import base64
import html
import re

import ipywidgets as widgets
import pytest
from ipywidgets.widgets.widget_link import Link

from paged_kv import PagedKVCacheAllocator
from paged_kv.core.trace import TraceFrame
from paged_kv.pictures.pool import render_allocator
from paged_kv.pictures.widgets import AllocationPlayer, AllocatorPlayground, refusal_caption, sequence_name

pytestmark = pytest.mark.lesson04


def press(button: widgets.Button) -> None:
    """Run the button's click callbacks, letting any exception through."""
    callbacks = list(button._click_handlers.callbacks)
    assert callbacks, f"the button {button.description!r} has no callback"
    for callback in callbacks:
        callback(button)


def shows(text: str, markup: str) -> bool:
    """Whether the HTML ``markup`` shows ``text``, whether its quotes are escaped or not."""
    return any(form in markup for form in (text, html.escape(text), html.escape(text, quote=False)))


def recorded_cache() -> PagedKVCacheAllocator:
    """A cache that recorded two prompts, a decode across a block boundary, and a free."""
    cache = PagedKVCacheAllocator(8, 2, 1, 1, record=True)
    cache.allocate_for_sequence("A", 3)
    cache.allocate_for_sequence("B", 1)
    cache.append_tokens("A")
    cache.append_tokens("A")  # the fifth token takes a third block
    cache.free_sequence("B")
    return cache


def handmade_frames(captions: list[str]) -> list[TraceFrame]:
    """One frame per caption, each with one more single-block sequence than the one before."""
    cache = PagedKVCacheAllocator(8, 2, 1, 1)
    frames = [TraceFrame(cache.snapshot(), captions[0], "start", None, ())]
    for caption in captions[1:]:
        seq_id = sequence_name(len(cache.seq_ids))
        table = cache.allocate_for_sequence(seq_id, 1)
        frames.append(TraceFrame(cache.snapshot(), caption, "allocate", seq_id, tuple(table.block_ids)))
    return frames


def endpoints(link: Link) -> frozenset[tuple[int, str]]:
    """The two ``(widget, trait)`` ends of a link, widgets by identity, in no order."""
    return frozenset((id(widget), trait) for widget, trait in (link.source, link.target))


# ---------------------------------------------------------------------------------- sequence_name


def test_sequence_names_run_like_spreadsheet_columns():
    assert [sequence_name(i) for i in range(3)] == ["A", "B", "C"]
    assert [sequence_name(i) for i in (25, 26, 27, 51, 52, 701, 702)] == [
        "Z", "AA", "AB", "AZ", "BA", "ZZ", "AAA",
    ]  # fmt: skip
    assert len({sequence_name(i) for i in range(1000)}) == 1000


def test_a_negative_sequence_index_is_refused():
    with pytest.raises(ValueError, match="index"):
        sequence_name(-1)


# ------------------------------------------------------------------------------------ the player


CAPTIONS = ["empty", "A arrives", "B arrives", "C arrives"]


@pytest.fixture
def player() -> AllocationPlayer:
    return AllocationPlayer(handmade_frames(CAPTIONS), interval_ms=250)


def test_the_player_stacks_one_picture_per_frame(player):
    assert len(player.frames) == 4
    assert len(player.stack.children) == 4
    assert all(isinstance(child, widgets.HTML) for child in player.stack.children)
    assert player.stack.selected_index == 0
    assert len({child.value for child in player.stack.children}) == 4


def test_play_slider_and_frame_number_span_the_frames(player):
    for control in (player.play, player.slider, player.frame_number):
        assert (control.min, control.max, control.value) == (0, 3, 0)
    assert isinstance(player.play, widgets.Play)
    assert isinstance(player.slider, widgets.IntSlider)
    assert isinstance(player.frame_number, widgets.BoundedIntText)
    assert player.play.interval == 250


def test_each_frame_shows_its_caption_with_its_number(player):
    for i, caption in enumerate(CAPTIONS):
        assert player.frame_caption(i) == f"{i}/3 · {caption}"
        assert shows(player.frame_caption(i), player.frame_html(i))
        assert player.frame_html(i) == player.stack.children[i].value
    assert not shows(player.frame_caption(1), player.frame_html(2))


def test_each_frame_is_rendered_from_its_own_snapshot(player):
    for i, frame in enumerate(player.frames):
        expected = render_allocator(
            frame.snapshot, caption=player.frame_caption(i), highlight=frame.highlight, width=760, inline=True
        )
        assert player.frame_html(i) == expected


def test_play_slider_frame_number_and_stack_are_linked_in_the_browser(player):
    """jslinks, not kernel links: they are what keeps the player moving in static HTML."""
    assert all(type(link) is Link for link in player.links)  # two-way, not jsdlink
    assert {endpoints(link) for link in player.links} == {
        frozenset({(id(player.play), "value"), (id(player.slider), "value")}),
        frozenset({(id(player.slider), "value"), (id(player.frame_number), "value")}),
        frozenset({(id(player.slider), "value"), (id(player.stack), "selected_index")}),
    }


def test_the_player_holds_the_picture_and_its_controls(player):
    assert player.children[0] is player.stack
    controls = player.children[1].children
    assert controls == (
        player.play,
        player.back_button,
        player.forward_button,
        player.slider,
        player.frame_number,
    )
    assert (player.back_button.description, player.forward_button.description) == ("◀", "▶")


def test_moving_the_slider_moves_the_frame_and_its_caption(player):
    player.slider.value = 2
    assert player.frame == 2
    assert player.caption == "2/3 · B arrives"
    assert shows(player.caption, player.frame_html(player.frame))


def test_the_step_buttons_move_the_slider_and_stop_at_the_ends(player):
    seen = []
    for _ in range(5):
        press(player.forward_button)
        seen.append(player.slider.value)
    assert seen == [1, 2, 3, 3, 3]
    seen = []
    for _ in range(5):
        press(player.back_button)
        seen.append(player.slider.value)
    assert seen == [2, 1, 0, 0, 0]


def test_the_step_buttons_work_through_click_too(player):
    player.forward_button.click()
    player.forward_button.click()
    player.back_button.click()
    assert player.slider.value == 1


def test_stepping_pauses_play(player):
    player.play.playing = True
    press(player.forward_button)
    assert player.play.playing is False


def test_a_player_replays_a_recorded_trace():
    cache = recorded_cache()
    player = AllocationPlayer.from_allocator(cache, interval_ms=100, width=500)
    assert player.frames == tuple(cache.trace)
    assert player.frames[0].event == "start"
    assert len(player.stack.children) == len(cache.trace) >= 2
    assert player.play.max == len(cache.trace) - 1
    assert shows(player.frame_caption(len(cache.trace) - 1), player.frame_html(len(cache.trace) - 1))


def test_a_single_frame_is_enough():
    player = AllocationPlayer(handmade_frames(["empty"]))
    assert (player.slider.min, player.slider.max) == (0, 0)
    press(player.forward_button)
    press(player.back_button)
    assert player.slider.value == 0


def test_an_empty_trace_is_refused():
    with pytest.raises(ValueError, match=r"frames .*record=True"):
        AllocationPlayer([])
    with pytest.raises(ValueError, match="frames"):
        AllocationPlayer(iter(()))


@pytest.mark.parametrize("argument", ["interval_ms", "width"])
@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_bad_interval_or_width_is_refused(argument, bad):
    with pytest.raises(ValueError, match=argument):
        AllocationPlayer(handmade_frames(["empty"]), **{argument: bad})


def still_svg(bundle: dict) -> str:
    """The SVG of a display bundle's ``text/html`` still, from its image's ``data:`` URI."""
    source = re.search(r'src="data:image/svg\+xml;base64,([^"]+)"', bundle["text/html"]).group(1)
    return base64.b64decode(source).decode("utf-8")


def test_the_players_display_carries_a_still_of_its_fullest_frame():
    player = AllocationPlayer(recorded_cache().trace, width=500)
    bundle = player._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", "application/vnd.jupyter.widget-view+json"}
    # The frames: start, A's prompt (2 blocks), B's (1), A's 4th token, A's 5th (a third block), B freed.
    free = [len(frame.snapshot.free_block_ids) for frame in player.frames]
    assert player.still_frame == free.index(min(free)) == 4
    frame = player.frames[4]
    caption = f"{player.frame_caption(4)} · a still: run the cell to play all 6 frames"
    assert bundle["text/html"] == render_allocator(
        frame.snapshot, caption=caption, highlight=frame.highlight, width=500
    )
    assert "<svg" not in bundle["text/html"] and "<svg" in still_svg(bundle)  # the image form


def test_the_playgrounds_display_carries_a_still_of_its_allocator():
    playground = AllocatorPlayground(8, 2)
    add(playground, 3)
    bundle = playground._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", "application/vnd.jupyter.widget-view+json"}
    caption = "seq A: 3-token prompt takes blocks [0, 1] · a still: run the cell to use the buttons"
    assert bundle["text/html"] == render_allocator(
        playground.cache.snapshot(), caption=caption, highlight=(0, 1), width=760
    )
    assert bundle["text/html"] == playground._repr_mimebundle_()["text/html"]  # deterministic, for nbval


def test_the_player_repr_is_short(player):
    """nbval compares a widget output's text/plain, which is this repr: no SVG, no children."""
    assert repr(player) == "AllocationPlayer(frames=4)"
    assert player._repr_mimebundle_()["text/plain"] == "AllocationPlayer(frames=4)"


# -------------------------------------------------------------------------------- the playground


def lengths_and_blocks(cache: PagedKVCacheAllocator) -> dict[str, tuple[int, int]]:
    tables = {seq_id: cache.get_block_table(seq_id) for seq_id in cache.seq_ids}
    return {seq_id: (table.num_tokens, table.num_blocks) for seq_id, table in tables.items()}


def add(playground: AllocatorPlayground, prompt: int) -> None:
    playground.prompt.value = prompt
    press(playground.add_button)


def test_a_new_playground_is_empty():
    playground = AllocatorPlayground()
    assert (playground.cache.num_blocks, playground.cache.block_size) == (32, 4)
    assert (playground.cache.num_heads, playground.cache.head_dim) == (1, 1)
    assert playground.cache.seq_ids == ()
    assert playground.sequence.options == ()
    assert playground.sequence.value is None
    assert (playground.prompt.min, playground.prompt.max) == (1, 24)
    assert "0 of 32 blocks used, 32 free" in playground.status.value
    assert "out of blocks" not in playground.status.value
    assert "<svg" in playground.picture.value
    assert playground.decode_button.disabled and playground.finish_button.disabled


def test_adding_sequences_allocates_their_prompts():
    playground = AllocatorPlayground(16, 4)
    add(playground, 5)
    add(playground, 4)
    cache = playground.cache
    assert cache.seq_ids == ("A", "B")
    assert lengths_and_blocks(cache) == {"A": (5, 2), "B": (4, 1)}
    assert cache.get_block_mapping("A") == [0, 1]
    assert cache.get_block_mapping("B") == [2]
    assert playground.sequence.options == ("A", "B")
    assert playground.sequence.value == "A"
    assert "3 of 16 blocks used, 13 free" in playground.status.value
    assert "9 tokens in 12 slots" in playground.status.value
    assert shows("seq B: 4-token prompt takes blocks [2]", playground.picture.value)
    assert not playground.decode_button.disabled and not playground.finish_button.disabled


def test_decode_steps_take_a_block_exactly_at_the_boundary():
    playground = AllocatorPlayground(16, 4)
    add(playground, 5)
    add(playground, 4)  # B's only block is full: its next token needs a new block
    press(playground.decode_button)
    assert lengths_and_blocks(playground.cache) == {"A": (6, 2), "B": (5, 2)}
    assert playground.cache.get_block_mapping("B") == [2, 3]
    assert shows("seq B, token 5: block 3 appended", playground.picture.value)
    press(playground.decode_button)
    press(playground.decode_button)
    assert lengths_and_blocks(playground.cache) == {"A": (8, 2), "B": (7, 2)}
    assert shows("every token fits in its last block", playground.picture.value)
    press(playground.decode_button)  # A's 9th token starts its third block
    assert lengths_and_blocks(playground.cache) == {"A": (9, 3), "B": (8, 2)}
    assert playground.cache.get_block_mapping("A") == [0, 1, 4]


def test_finishing_frees_the_blocks_and_updates_the_dropdown():
    playground = AllocatorPlayground(16, 4)
    add(playground, 5)
    add(playground, 4)
    add(playground, 9)
    playground.sequence.value = "B"
    press(playground.finish_button)
    assert playground.cache.seq_ids == ("A", "C")
    assert playground.cache.num_free_blocks == 16 - 2 - 3
    assert playground.sequence.options == ("A", "C")
    assert playground.sequence.value == "A"
    assert shows("seq B finished: blocks [2] back to the free list", playground.picture.value)
    press(playground.finish_button)
    press(playground.finish_button)
    assert playground.cache.seq_ids == ()
    assert playground.sequence.options == ()
    assert playground.sequence.value is None
    assert playground.cache.num_free_blocks == 16
    assert playground.decode_button.disabled and playground.finish_button.disabled


def test_a_finished_id_is_not_reused():
    playground = AllocatorPlayground(16, 4)
    add(playground, 1)
    press(playground.finish_button)
    add(playground, 1)
    assert playground.cache.seq_ids == ("B",)


def test_reset_empties_everything():
    playground = AllocatorPlayground(8, 2)
    add(playground, 3)
    add(playground, 5)
    press(playground.decode_button)
    press(playground.reset_button)
    assert playground.cache.seq_ids == ()
    assert playground.cache.num_free_blocks == 8
    assert (playground.cache.num_blocks, playground.cache.block_size) == (8, 2)
    assert playground.sequence.options == ()
    assert "0 of 8 blocks used, 8 free" in playground.status.value
    add(playground, 1)
    assert playground.cache.seq_ids == ("A",)  # the names start again


def refused(playground: AllocatorPlayground, caption: str) -> str:
    """The picture the playground must show after a refusal: its allocator, the caption, no highlight."""
    return render_allocator(playground.cache.snapshot(), caption=caption, width=playground.width, inline=True)


def test_a_prompt_too_long_for_the_free_blocks_shows_the_message_and_changes_nothing():
    playground = AllocatorPlayground(4, 4, max_prompt=24)
    add(playground, 6)
    before = playground.cache.snapshot()
    add(playground, 24)
    assert playground.cache.snapshot() == before
    # The picture is the same allocator, captioned with the refusal itself, not the last success.
    caption = "seq B: 24-token prompt refused: it needs 6 free blocks, 2 are free; nothing changed"
    assert playground.picture.value == refused(playground, caption)
    assert not shows("seq A: 6-token prompt takes blocks [0, 1]", playground.picture.value)
    assert playground.sequence.options == ("A",)
    status = playground.status.value
    assert "out of blocks" in status
    assert "needs 6 free blocks but only 2 are free" in status
    assert "color:#8A0010;background-color:#FDECEE" in status  # a warning on its own background
    add(playground, 1)  # a success clears the message
    assert "out of blocks" not in playground.status.value
    assert playground.cache.seq_ids == ("A", "B")  # the refused sequence did not use up a name


def test_a_decode_step_is_all_or_nothing_across_the_batch():
    """A and B both need a new block and only one is free: neither grows."""
    playground = AllocatorPlayground(3, 4)
    add(playground, 4)
    add(playground, 4)
    before = playground.cache.snapshot()
    press(playground.decode_button)
    assert playground.cache.snapshot() == before
    caption = "decode step for 2 sequences refused: it needs 2 free blocks, 1 is free; nothing changed"
    assert playground.picture.value == refused(playground, caption)
    assert "a decode step for 2 sequences needs 2 free blocks but only 1 is free" in playground.status.value


def test_a_decode_step_with_no_free_block_shows_the_message():
    playground = AllocatorPlayground(2, 2)
    add(playground, 4)
    before = playground.cache.snapshot()
    press(playground.decode_button)
    assert playground.cache.snapshot() == before
    assert "needs 1 free block but only 0 are free" in playground.status.value
    caption = "decode step for 1 sequence refused: it needs 1 free block, 0 are free; nothing changed"
    assert playground.picture.value == refused(playground, caption)
    assert not any(c in playground.picture.value for c in ("1 blocks", "1 sequences", "1 tokens"))


def test_decode_and_finish_with_no_sequence_explain_instead_of_raising():
    playground = AllocatorPlayground(4, 2)
    before = playground.cache.snapshot()
    press(playground.decode_button)
    assert "no sequence is running" in playground.status.value
    caption = "decode step refused: no sequence is running: add a sequence first; nothing changed"
    assert playground.picture.value == refused(playground, caption)
    press(playground.finish_button)
    assert "no sequence to finish" in playground.status.value
    caption = "finish refused: no sequence to finish: add a sequence first; nothing changed"
    assert playground.picture.value == refused(playground, caption)
    assert playground.cache.snapshot() == before


def test_a_success_after_a_refusal_captions_and_highlights_the_success():
    playground = AllocatorPlayground(3, 4)
    add(playground, 12)
    press(playground.decode_button)  # refused: A's 13th token needs a block and none is free
    press(playground.finish_button)
    assert shows("seq A finished: blocks [0, 1, 2] back to the free list", playground.picture.value)
    assert "refused" not in playground.picture.value and "out of blocks" not in playground.status.value


def test_the_refusal_caption_says_what_why_and_that_nothing_changed():
    from paged_kv.errors import OutOfBlocksError, UnknownSequenceError

    assert (
        refusal_caption("x", OutOfBlocksError(1, 1))
        == "x refused: it needs 1 free block, 1 is free; nothing changed"
    )
    assert (
        refusal_caption("x", OutOfBlocksError(2, 0))
        == "x refused: it needs 2 free blocks, 0 are free; nothing changed"
    )
    assert refusal_caption("finish seq Q", UnknownSequenceError("Q")).startswith(
        "finish seq Q refused: unknown sequence 'Q': it was never allocated"
    )


def test_the_status_and_captions_count_one_in_the_singular():
    playground = AllocatorPlayground(1, 1, max_prompt=1)
    assert shows("1 free block of 1 token", playground.picture.value)
    assert "0 of 1 block used, 1 free · 0 tokens in 0 slots" in playground.status.value
    add(playground, 1)
    assert "1 of 1 block used, 0 free · 1 token in 1 slot" in playground.status.value
    press(playground.reset_button)
    assert shows("reset: all 1 block free", playground.picture.value)


def test_the_warning_contrasts_on_a_light_and_on_a_dark_page():
    from tests.test_viz import contrast

    playground = AllocatorPlayground(1, 1, max_prompt=1)
    add(playground, 1)
    add(playground, 1)
    style = re.search(r'<div style="([^"]+)">⚠', playground.status.value).group(1)
    declared = dict(d.split(":", 1) for d in style.split(";"))
    assert contrast(declared["color"], declared["background-color"]) >= 7  # whatever the page behind it


def test_the_picture_changes_after_each_action():
    playground = AllocatorPlayground(16, 4)
    pictures = [playground.picture.value]
    for action in (
        lambda: add(playground, 5),
        lambda: add(playground, 3),
        lambda: press(playground.decode_button),
        lambda: press(playground.decode_button),
        lambda: press(playground.finish_button),
        lambda: press(playground.reset_button),
    ):
        action()
        pictures.append(playground.picture.value)
    assert len(set(pictures)) == len(pictures)


def test_the_picture_is_the_allocator_with_the_last_action_highlighted():
    playground = AllocatorPlayground(16, 4, width=500)
    add(playground, 5)
    expected = render_allocator(
        playground.cache.snapshot(),
        caption="seq A: 5-token prompt takes blocks [0, 1]",
        highlight=(0, 1),
        width=500,
        inline=True,
    )
    assert playground.picture.value == expected


def test_the_buttons_work_through_click_too():
    playground = AllocatorPlayground(16, 4)
    playground.add_button.click()
    playground.decode_button.click()
    assert playground.cache.sequence_length("A") == playground.prompt.value + 1


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"max_prompt": 0}, "max_prompt"),
        ({"width": -1}, "width"),
    ],
)
def test_a_bad_playground_size_is_refused(arguments, name):
    with pytest.raises(ValueError, match=name):
        AllocatorPlayground(**arguments)


def test_the_playground_repr_is_short():
    playground = AllocatorPlayground(16, 4)
    add(playground, 5)
    text = "AllocatorPlayground(num_blocks=16, block_size=4, sequences=1, free=14)"
    assert repr(playground) == text
    assert playground._repr_mimebundle_()["text/plain"] == text

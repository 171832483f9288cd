"""The player animates in a notebook exported to static HTML, with no kernel and no network.

The notebook is executed (widget state stored), exported with ``jupyter nbconvert --to html``
pointing at the widget JavaScript vendored from npm, and opened in headless Chromium from a
file:// URL. Clicking Play must move the slider and change the frame the ``Stack`` shows: both
run in the browser, through the player's jslinks.
"""

from __future__ import annotations

import pytest

from tests.browser import harness

pytestmark = [pytest.mark.browser, pytest.mark.lesson04]


def test_clicking_play_advances_the_player_in_a_static_html_export(
    page, widget_js, widget_notebook, tmp_path, screenshot
):
    notebook, name = widget_notebook
    html = harness.export_static_html(notebook, tmp_path / "export", widget_js)

    page.goto(html.as_uri())
    player = harness.player(page)
    try:
        player.locator(harness.FRAME_HTML).first.wait_for(state="attached")
        player.locator(".widget-text input").first.wait_for(state="visible")
    except Exception as error:
        shot = screenshot(page, "no-widgets")
        console = "\n".join(page.console_lines[-20:])
        raise AssertionError(
            f"the widgets of {name} did not render in the static HTML export ({shot}); console:\n{console}"
        ) from error
    player.scroll_into_view_if_needed()
    start, start_html = harness.player_frame(player)
    screenshot(page, "before-play")
    assert "<svg" in start_html, f"the player's first frame has no SVG picture: {start_html[:300]!r}"

    play_button = player.locator(f"{harness.PLAY} button").filter(has=page.locator("i.fa-play")).first
    play_button.click()

    def advanced():
        frame, frame_html = harness.player_frame(player)
        return (frame, frame_html) if frame > start and frame_html != start_html else None

    _frame, frame_html = harness.wait_until(
        page, advanced, f"Play to move the player of {name} past frame {start} and change the picture"
    )
    screenshot(page, "after-play")
    assert "<svg" in frame_html
    assert harness.caption(frame_html) != harness.caption(start_html), "the caption did not change"

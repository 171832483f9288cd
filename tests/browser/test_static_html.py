"""The player animates in a notebook exported to static HTML, with no kernel and no network.

The notebook is executed (widget state stored), exported with ``jupyter nbconvert --to html``
pointing at the widget JavaScript vendored from npm, and opened in headless Chromium from a
file:// URL. Clicking Play must move the slider and change the frame the ``Stack`` shows: both
run in the browser, through the player's jslinks. (``test_site.py`` does the same on the committed
lessons as ``make site`` exports them; this test runs the widgets' current code.)
"""

from __future__ import annotations

import pytest

from tests.browser import harness, playback

pytestmark = [pytest.mark.browser, pytest.mark.lesson04]


def test_clicking_play_advances_the_player_in_a_static_html_export(
    page, widget_js, widget_notebook, tmp_path, screenshot
):
    notebook, name = widget_notebook
    html = harness.export_static_html(notebook, tmp_path / "export", widget_js)

    page.goto(html.as_uri())
    try:
        player = playback.wait_for_player(page, f"{name} in its static HTML export")
    except AssertionError as error:
        raise AssertionError(f"{error}\n(screenshot: {screenshot(page, 'no-widgets')})") from error
    screenshot(page, "before-play")
    start_html, frame_html = playback.press_play(page, player, name)
    screenshot(page, "after-play")
    assert "<svg" in start_html, f"the player's first frame has no SVG picture: {start_html[:300]!r}"
    assert "<svg" in frame_html
    assert harness.caption(frame_html) != harness.caption(start_html), "the caption did not change"

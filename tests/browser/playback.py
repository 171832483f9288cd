"""Pressing Play on a player in a page with no kernel, shared by the static-export and site tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.browser import harness

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page


def wait_for_player(page: Page, what: str) -> Locator:
    """The first player of ``page`` once its widgets render; fails naming ``what``, with the console."""
    player = harness.player(page)
    try:
        player.locator(harness.FRAME_HTML).first.wait_for(state="attached")
        player.locator(".widget-text input").first.wait_for(state="visible")
    except Exception as error:
        console = "\n".join(page.console_lines[-20:])
        raise AssertionError(f"the widgets of {what} did not render; console:\n{console}") from error
    player.scroll_into_view_if_needed()
    return player


def press_play(page: Page, player: Locator, what: str) -> tuple[str, str]:
    """Click ``player``'s Play button and wait until it shows a later frame with another picture.

    Returns the HTML of the frame before and of the later frame. The player's ``Play``, slider and
    ``Stack`` are jslinked, so this works in a page with no kernel.
    """
    start, start_html = harness.player_frame(player)
    play_button = player.locator(f"{harness.PLAY} button").filter(has=page.locator("i.fa-play")).first
    play_button.click()

    def advanced() -> str | None:
        frame, frame_html = harness.player_frame(player)
        return frame_html if frame > start and frame_html != start_html else None

    later_html = harness.wait_until(
        page, advanced, f"Play to move the player of {what} past frame {start} and change the picture"
    )
    return start_html, later_html

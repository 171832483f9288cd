"""In a live JupyterLab, the lesson's widgets render, read well, and the playground answers its buttons.

JupyterLab (one server for the session, tests/browser/conftest.py) serves a copy of the notebook
from a temporary root directory on a free loopback port (its autosave never touches the
repository), in its light theme and in its dark one. The test
opens it, waits for the kernel, runs all cells through the Run menu, waits for the player and the
playground, then clicks "add sequence": the click goes to the kernel, and the playground's picture
must change. It goes on clicking until the pool runs out: the refusal's own caption and the
warning must show. Every visible text of the player and the playground (the pictures' SVG text,
captions, status lines, controls) must contrast with what is painted behind it (WCAG AA, 4.5:1),
computed from the browser's styles. The blocks' colours, which the pictures draw straight on the
notebook's background, must keep 3:1 against it (WCAG's minimum for graphics): the playground's
full pool holds eight sequences, A to H, so every colour of the palette is measured, in the light
theme and in the dark one.
"""

from __future__ import annotations

import re
import time

import pytest

from paged_kv.pictures.plots import MIN_PAGE_CONTRAST, PAGE_BACKGROUNDS, PALETTE
from tests.browser import harness

pytestmark = [pytest.mark.browser, pytest.mark.lesson04]

THEMES = {"light": harness.LIGHT_THEME, "dark": harness.DARK_THEME}
MIN_CONTRAST = 4.5  # WCAG AA for normal text
MAX_ADDS = 40  # more "add sequence" clicks than any pool of the lesson holds

RUN_ALL_S = 90
# The notebook is on screen and connected to its kernel, which is idle. The kernel name is checked
# too: before the session starts, the toolbar says "No Kernel" and the indicator may already read
# idle, and a Run All clicked then runs nothing.
KERNEL_READY = """() => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    if (!panel || !panel.querySelector('.jp-CodeCell')) return false;
    const name = panel.querySelector('.jp-Toolbar-kernelName')?.textContent.trim();
    const status = panel.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status;
    return Boolean(name) && name !== 'No Kernel' && status === 'idle';
}"""
# What the notebook shows while Run All goes on: the prompts ("[*]:" pending, "[3]:" done,
# "[ ]:" not run; textContent, which cells scrolled out of view keep too), error outputs, a dialog.
NOTEBOOK_STATE = """() => ({
    prompts: [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
        .map(p => p.textContent.trim()),
    errors: [...document.querySelectorAll(
        '.jp-Notebook .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
        .map(e => e.textContent).filter(text => text.includes('Traceback')),
    dialog: document.querySelector('.jp-Dialog')?.textContent ?? null,
    idle: document.querySelector(
        ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator[data-status='idle']") !== null,
})"""


def run_all_cells(page):
    """Run > Run All Cells, through the menu as a reader would."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


def run_all_and_wait(page, name, screenshot):
    """Run all cells and wait until every code cell has run; fail on the first error output."""
    run_all_cells(page)
    deadline = time.monotonic() + RUN_ALL_S
    while True:
        state = page.evaluate(NOTEBOOK_STATE)
        if state["errors"]:
            shot = screenshot(page, "error")
            raise AssertionError(
                f"a cell of {name} failed in JupyterLab ({shot}):\n{state['errors'][0][-2000:]}"
            )
        if state["dialog"]:
            shot = screenshot(page, "dialog")
            raise AssertionError(f"JupyterLab shows a dialog over {name} ({shot}): {state['dialog'][:300]}")
        done = [bool(re.fullmatch(r"\[\d+\]:", prompt)) for prompt in state["prompts"]]
        if state["idle"] and done and all(done):
            return
        if time.monotonic() > deadline:
            shot = screenshot(page, "run-all")
            raise AssertionError(
                f"Run All Cells did not finish for {name} within {RUN_ALL_S} s ({shot}); "
                f"prompts {state['prompts']}"
            )
        page.wait_for_timeout(200)


def assert_readable(output, what):
    """Every visible text in ``output`` contrasts with its backdrop; at least ``10`` were checked."""
    output.scroll_into_view_if_needed()
    failures, checked = harness.low_contrast(output, MIN_CONTRAST)
    assert checked >= 10, f"only {checked} texts found in {what}"
    assert not failures, (
        f"{len(failures)} of {checked} texts of {what} below {MIN_CONTRAST}:1: {failures[:5]}"
    )


def assert_colours_stand_out(output, what, theme, expected=None):
    """Every sequence colour drawn in ``output`` keeps 3:1 against the page behind the picture.

    The page is measured too: white in the light theme, one of the dark theme's backgrounds in the
    dark one (``PAGE_BACKGROUNDS``, which the palette is chosen against). ``expected``: the colours
    that must all be there.
    """
    faint, colours, pages = harness.faint_sequence_fills(output, MIN_PAGE_CONTRAST)
    dark = {
        PAGE_BACKGROUNDS["jupyterlab-dark-layout-color0"],
        PAGE_BACKGROUNDS["jupyterlab-dark-layout-color1"],
    }
    allowed = dark if theme == harness.DARK_THEME else {PAGE_BACKGROUNDS["white"]}
    assert pages and pages <= allowed, f"{what} sits on {pages} in {theme}, not on {allowed}"
    assert colours, f"{what} shows no sequence colour"
    if expected is not None:
        assert colours == set(expected), f"{what} shows the colours {sorted(colours)}, not {sorted(expected)}"
    assert not faint, f"sequence colours of {what} below {MIN_PAGE_CONTRAST}:1 in {theme}: {faint}"


@pytest.mark.parametrize("theme", THEMES.values(), ids=THEMES.keys())
def test_the_widgets_render_and_the_playground_answers_in_jupyterlab(
    page, jupyterlab, widget_notebook, screenshot, theme
):
    _notebook, name = widget_notebook
    page.goto(f"{jupyterlab}/widgets.ipynb?reset")
    try:
        page.wait_for_function(KERNEL_READY, timeout=60_000, polling=200)
    except Exception as error:
        shot = screenshot(page, "no-kernel")
        raise AssertionError(f"the kernel of {name} never became idle in JupyterLab ({shot})") from error
    screenshot(page, "opened")

    run_all_and_wait(page, name, screenshot)

    player = harness.player(page)
    player.scroll_into_view_if_needed()
    player.locator(harness.PLAY).wait_for(state="visible")
    player.locator(harness.FRAME_HTML).first.wait_for(state="visible")
    player.locator(harness.PLAY).scroll_into_view_if_needed()
    frame, frame_html = harness.player_frame(player)
    screenshot(page, "player")
    assert frame == 0
    assert "<svg" in frame_html, f"the player of {name} shows no SVG picture: {frame_html[:300]!r}"
    assert player.locator(".widget-slider").count() >= 1, "the player has no slider"
    assert_readable(player, f"the player of {name}")
    assert_colours_stand_out(player, f"the player of {name}", theme)

    playground = harness.playground(page)
    playground.scroll_into_view_if_needed()
    add = playground.get_by_role("button", name=harness.ADD_SEQUENCE, exact=True)
    add.wait_for(state="visible")
    before = harness.wait_until(page, lambda: harness.picture_html(playground), "the playground's picture")
    screenshot(page, "playground-before")

    add.click()
    after = harness.wait_until(
        page,
        lambda: html if (html := harness.picture_html(playground)) != before else None,
        f"the playground of {name} to redraw its picture after 'add sequence'",
    )
    screenshot(page, "playground-after")
    assert "<svg" in after
    assert harness.caption(after) != harness.caption(before)
    assert_readable(playground, f"the playground of {name}")

    # Fill the pool: the refused click captions the picture with the refusal, and warns. The loop
    # reads the caption, not the warning: the warning is a widget of its own and may be drawn a
    # moment after the picture, and a second refused click would leave the picture as it was.
    for _click in range(MAX_ADDS):
        shown = harness.picture_html(playground)
        if "refused" in harness.caption(shown):
            break
        add.click()
        harness.wait_until(
            page,
            lambda shown=shown: harness.picture_html(playground) != shown,
            "the playground's picture to answer 'add sequence'",
        )
    else:
        raise AssertionError(
            f"{MAX_ADDS} clicks on 'add sequence' never ran the playground of {name} out of blocks"
        )
    refused = harness.caption(harness.picture_html(playground))
    warning = playground.locator("div", has_text="⚠").last
    warning.wait_for(state="visible")
    screenshot(page, "playground-refused")
    assert "refused: it needs" in refused and "nothing changed" in refused, refused
    assert "1 blocks" not in refused
    assert "out of blocks" in warning.inner_text()
    assert_readable(playground, f"the refused playground of {name}")
    # The full pool holds sequences A to H: all eight colours, on the notebook's own background.
    assert_colours_stand_out(playground, f"the full playground of {name}", theme, expected=PALETTE)

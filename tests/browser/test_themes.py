"""Pictures in JupyterLab's light and dark themes, and in a lesson opened before any cell runs.

A lesson opened fresh is untrusted: JupyterLab sanitises its HTML outputs (an inline ``<svg>``
would be stripped to run-together text) and draws no widget view (a widget output falls back to
the best safe format it holds). This test copies the committed lessons 08 (two
``render_allocator`` pictures and a player) and 04 (a player and a playground) into a fresh
JupyterLab, opens them without running anything and checks that every committed picture is
there: an ``<img>`` that loaded, drawn at its size, on its own white paper with dark ink, its
caption in contrast, its
texts styled inside the image. It does so in the light theme and in the dark one.

A page without JupyterLab's CSS variables, as VS Code's output view is, gets both forms of a
picture of sequences A to H and a full playground's picture, drawn fresh in its dark and its light
colours: every text must contrast with what lies behind it, and every sequence colour keep 3:1
against the page (inline: the blocks' computed fills against the page's background) or against the
image's own paper (its pixels). The committed lessons are not measured so: their pictures are only
as new as the last rebuild.

The live widgets in both themes are checked by ``test_jupyterlab.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest

from paged_kv.pictures.plots import MIN_PAGE_CONTRAST, PAGE_BACKGROUNDS, PALETTE, contrast_ratio
from tests.browser import harness

pytestmark = [pytest.mark.browser, pytest.mark.lesson04, pytest.mark.lesson08]

THEMES = {"light": harness.LIGHT_THEME, "dark": harness.DARK_THEME}
FRESH = ("08_sharing.ipynb", "04_decode_allocation.ipynb")
WHITE = [255, 255, 255, 255]
INK = "rgb(34, 34, 34)"  # paged_kv.pictures.pool.CARD_INK, the image's ink


def committed_pictures(path) -> list[str]:
    """What each picture output of the notebook holds: ``image/png`` or an SVG image in ``text/html``."""
    kinds = []
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            html = "".join(data.get("text/html", ""))
            if "image/png" in data:
                kinds.append("png")
            elif "data:image/svg+xml;base64," in html:
                kinds.append("widget still" if "application/vnd.jupyter.widget-view+json" in data else "svg")
    return kinds


@pytest.mark.parametrize("theme", THEMES)
def test_a_lesson_opened_before_it_runs_shows_every_picture(
    browser, lab_server, lab_folder, theme, screenshot
):
    root = lab_server.root / lab_folder
    for name in FRESH:
        shutil.copy(harness.ROOT / "lessons" / name, root / name)
    lab_server.select_theme(THEMES[theme])
    with harness.new_page(browser) as page:
        for name in FRESH:
            expected = committed_pictures(root / name)
            assert expected.count("svg") + expected.count("widget still") >= 2, f"{name} has no SVG picture"
            # ?reset: the workspace holds this notebook alone
            page.goto(f"{lab_server.url}/lab/tree/{lab_folder}/{name}?reset")
            outputs = page.locator(f".jp-NotebookPanel:not(.lm-mod-hidden) {harness.OUTPUT}")
            pictures = outputs.filter(has=page.locator("img"))
            harness.wait_until(
                page,
                lambda pictures=pictures, expected=expected: (
                    pictures.count() >= len(expected)
                    and all(i["loaded"] for i in harness.images(pictures.last))
                ),
                f"the {len(expected)} pictures of {name}",
            )
            # Untrusted: no inline SVG and no widget view; the widgets' stills stand in for them.
            assert outputs.locator("svg").count() == 0 and page.locator(".jupyter-widgets").count() == 0
            assert page.get_by_text("AllocationPlayer(frames=").count() == 0
            assert pictures.count() == len(expected)
            for index, kind in enumerate(expected):
                picture = pictures.nth(index)
                picture.scroll_into_view_if_needed()
                (image,) = harness.images(picture)
                assert image["loaded"] and image["width"] >= 300 and image["height"] >= 150, (
                    name,
                    kind,
                    image,
                )
                if kind == "png":
                    continue
                # The SVG image carries its own paper (white) and ink, in either theme.
                seen = (name, kind, image["corner"], image["dark_share"])
                assert image["corner"] == WHITE and image["dark_share"] > 0.002, seen  # a few % of ink
                assert image["alt"].startswith("KV cache pool: ")
                failures = harness.low_contrast_in_view(page, picture, f"{name}'s picture {index}")
                assert not failures, (name, kind, failures)
                if index == 0:  # drawn as a document of its own, the image's text has its styles
                    styles = harness.svg_image_styles(browser, image["src"])
                    assert styles["title"] == ["12px", INK] and styles["small"] == ["9px", INK], styles
                if index == 0 or kind == "widget still":
                    screenshot(page, f"{name[:2]}-{kind.replace(' ', '-')}-{index}")


# A page with none of JupyterLab's CSS variables, as VS Code's output view is: its own text colour
# on its own background (VS Code's default dark and light editor colours).
HOSTS = {"vscode-dark": (PAGE_BACKGROUNDS["vscode-dark"], "#CCCCCC"), "vscode-light": ("#FFFFFF", "#3B3B3B")}


def eight_sequences():
    """A pool of 16 blocks holding sequences A to H, one colour each; B is a fork of A."""
    from paged_kv import PagedKVCacheAllocator

    cache = PagedKVCacheAllocator(16, 4, 1, 1)
    cache.allocate_for_sequence("A", 10)
    cache.fork("A", "B")
    for seq_id in "CDEFGH":
        cache.allocate_for_sequence(seq_id, 3)
    return cache.snapshot()


def full_playground():
    """A playground's picture (the widget's inline HTML) after eight 'add sequence': A to H."""
    from paged_kv.pictures.widgets import AllocatorPlayground

    playground = AllocatorPlayground(num_blocks=16, block_size=4)
    for _ in range(8):
        playground.add_sequence()
    assert playground.cache.seq_ids == tuple("ABCDEFGH")
    return playground.picture.value


@pytest.mark.parametrize("host", HOSTS)
def test_both_forms_read_well_on_a_page_without_jupyterlabs_variables(page, host, screenshot):
    from paged_kv.pictures.pool import render_allocator

    snapshot = eight_sequences()
    background, colour = HOSTS[host]
    pictures = [
        render_allocator(snapshot, caption=f"inline={inline}", highlight=[1], inline=inline)
        for inline in (True, False)
    ]
    pictures.append(full_playground())
    page.set_content(
        f'<body style="margin:8px;background-color:{background};color:{colour};font-family:sans-serif">'
        + "".join(f'<div class="picture">{picture}</div>' for picture in pictures)
        + "</body>"
    )
    page.wait_for_function("() => [...document.images].every(i => i.complete && i.naturalWidth > 0)")
    screenshot(page, host)
    described = ("the inline picture", "the image on its card", "the playground's picture")
    for index, what in enumerate(described):
        picture = page.locator(".picture").nth(index)
        picture.scroll_into_view_if_needed()
        failures, checked = harness.low_contrast(picture, 4.5)
        assert checked >= (10 if index != 1 else 1) and not failures, (what, failures[:5])

    # Every sequence's colour stands out on the page (3:1): inline, the blocks' computed fills
    # against the page's background; in the image, its pixels against its own paper.
    for index in (0, 2):
        faint, colours, pages = harness.faint_sequence_fills(page.locator(".picture").nth(index))
        assert pages == {background} and colours == set(PALETTE), (described[index], pages, colours)
        assert not faint, (described[index], faint)
    (image,) = harness.images(page.locator(".picture").nth(1))
    paper = harness.hex_colour(image["corner"][:3])
    fills = {harness.hex_colour(fill) for fill in image["fills"]}
    assert paper == "#FFFFFF" and fills == set(PALETTE), (paper, fills)
    assert all(contrast_ratio(fill, paper) >= MIN_PAGE_CONTRAST for fill in fills)

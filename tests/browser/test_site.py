"""The offline site (``make site``) in headless Chromium, opened from disk with no network.

The whole site is built once (about 5 s: the committed lessons are exported, not re-run). Every
page must load with no failed request and no console error and have its maths typeset by the
vendored MathJax (no raw ``$…$`` left in the prose); Play must move each lesson's first player;
the index and a lesson must be readable in the light and the dark colour scheme.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tests.browser import harness, playback
from tools import build_site, vendor_widget_js

pytestmark = pytest.mark.browser

LESSONS = build_site.lesson_paths()
PAGES = [build_site.INDEX, *(f"{path.stem}.html" for path in LESSONS)]
WITH_PLAYER = [
    f"{path.stem}.html"
    for path in LESSONS
    if "AllocationPlayer(" in harness.code_sources(nbformat.read(path, as_version=4))
]
MATHS = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# The prose of the rendered markdown, without code, scripts and MathJax's own output.
PROSE_JS = """() => [...document.querySelectorAll('.jp-RenderedMarkdown')].map(element => {
    const copy = element.cloneNode(true);
    const notProse = 'code, pre, script, .MathJax_CHTML, .MJX_Assistive_MathML';
    copy.querySelectorAll(notProse).forEach(e => e.remove());
    return copy.textContent;
}).join('\\n')"""
TYPESET_JS = "() => new Promise(resolve => MathJax.Hub.Queue(() => resolve(true)))"


def maths_count(page_name: str) -> int:
    """How many ``$…$`` and ``$$…$$`` expressions the page's markdown holds (code spans left out)."""
    if page_name == build_site.INDEX:
        return 0
    notebook = nbformat.read(build_site.LESSONS / page_name.replace(".html", ".ipynb"), as_version=4)
    markdown = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    return len(MATHS.findall(CODE_SPAN.sub("", markdown)))


@pytest.fixture(scope="module")
def site(browser, widget_js, once_per_run) -> Path:
    """The whole site, built into a temporary folder once for the test run, not once per xdist
    worker (``browser`` first: skipped without Chromium)."""
    try:
        mathjax = vendor_widget_js.vendor_mathjax()
    except vendor_widget_js.NpmMissingError as error:
        pytest.skip(str(error))

    def build(folder: Path) -> Path:
        return build_site.build_site(folder / "site", LESSONS, widget_js, mathjax).parent

    return once_per_run("offline_site", build)


def open_offline(page, url: str) -> list[str]:
    """Go to ``url`` and wait for MathJax to finish; returns the requests that failed."""
    failed: list[str] = []
    page.on("requestfailed", lambda request: failed.append(f"{request.url} ({request.failure})"))
    page.goto(url)
    page.wait_for_function("() => window.MathJax && window.MathJax.isReady")
    page.evaluate(TYPESET_JS)
    return failed


def relative_luminance(css_colour: str) -> float:
    red, green, blue = (int(part) / 255 for part in re.findall(r"\d+(?:\.\d+)?", css_colour)[:3])

    def linear(channel: float) -> float:
        return channel / 12.92 if channel <= 0.03928 else ((channel + 0.055) / 1.055) ** 2.4

    return 0.2126 * linear(red) + 0.7152 * linear(green) + 0.0722 * linear(blue)


def contrast(foreground: str, background: str) -> float:
    """The WCAG contrast ratio of two CSS ``rgb(...)`` colours (1 to 21)."""
    light, dark = sorted((relative_luminance(foreground), relative_luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.parametrize("page_name", PAGES)
def test_every_page_loads_offline_with_its_maths_typeset(page, site, page_name):
    failed = open_offline(page, (site / page_name).as_uri())

    errors = [line for line in page.console_lines if line.startswith(("error:", "pageerror:"))]
    assert not failed, f"{page_name}: requests failed: {failed}"
    assert not errors, f"{page_name}: console errors: {errors}"
    expected = maths_count(page_name)
    typeset = page.locator(".MathJax_CHTML").count()
    assert typeset >= expected, f"{page_name}: {typeset} of {expected} maths expressions typeset"
    assert page.locator(".MathJax_CHTML merror, .MathJax_Error").count() == 0, f"{page_name}: a TeX error"
    prose = page.evaluate(PROSE_JS)
    assert "$" not in prose, f"{page_name}: raw maths left: ...{prose[prose.find('$') - 60 :][:160]}..."


@pytest.mark.parametrize("page_name", WITH_PLAYER)
def test_play_moves_the_player_of_a_lesson_page(page, site, page_name):
    page.goto((site / page_name).as_uri())
    player = playback.wait_for_player(page, page_name)
    start_html, later_html = playback.press_play(page, player, page_name)
    assert "<svg" in start_html and "<svg" in later_html, f"{page_name}: a frame without its picture"


def test_the_index_lists_every_lesson_with_its_outcomes_and_recap(page, site):
    page.goto((site / build_site.INDEX).as_uri())
    rows = page.locator("table tbody tr")
    assert rows.count() == len(LESSONS)
    for row, path in zip(rows.all(), LESSONS, strict=True):
        summary = build_site.summarize(nbformat.read(path, as_version=4), path.stem)
        link = row.locator("a").first
        assert link.get_attribute("href") == summary.page and (site / summary.page).is_file()
        assert link.inner_text() == summary.title
        row_text = " ".join(row.inner_text().split())
        for outcome in summary.outcomes:
            words = " ".join(re.sub(r"[`*]", "", outcome).split()[:5])
            assert words in row_text, f"{summary.label}: outcome {outcome!r} not in its row"
        recap = page.locator("h3", has=page.locator(f"a[href='{summary.page}']"))
        assert recap.count() == 1, f"{summary.label}: no recap heading"
        items = recap.locator("xpath=following-sibling::ul[1]/li")
        assert items.count() == len(summary.recap), f"{summary.label}: recap items"
        assert items.first.is_visible()


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("page_name", [build_site.INDEX, "04_decode_allocation.html"])
def test_both_colour_schemes_are_readable(browser, site, page_name, scheme, screenshot):
    context = browser.new_context(viewport=harness.VIEWPORT, color_scheme=scheme)
    try:
        page = context.new_page()
        page.console_lines = []  # for the screenshot fixture's callers' messages
        open_offline(page, (site / page_name).as_uri())
        body = page.locator("body")
        assert body.get_attribute("data-jp-theme-light") == ("true" if scheme == "light" else "false")
        background = body.evaluate("element => getComputedStyle(element).backgroundColor")
        is_dark = relative_luminance(background) < 0.1
        assert is_dark == (scheme == "dark"), f"{page_name} in {scheme}: background {background}"
        for selector in (".jp-RenderedMarkdown p", ".jp-RenderedMarkdown code", "a"):
            element = page.locator(selector).first
            colour = element.evaluate("element => getComputedStyle(element).color")
            ratio = contrast(colour, background)
            assert ratio >= 4.5, f"{page_name} in {scheme}: {selector} {colour} on {background}: {ratio:.1f}"
        if page_name != build_site.INDEX:
            playback.wait_for_player(page, page_name)
        screenshot(page, f"{page_name.removesuffix('.html')}-{scheme}")
    finally:
        context.close()

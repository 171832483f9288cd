"""``make site`` (tools/build_site.py) without a browser: what it takes from the lessons, what it writes.

The pages are exported with stand-ins for the vendored JavaScript (the real files come from npm;
``tests/browser/test_site.py`` opens the real site in Chromium).
"""

from __future__ import annotations

import json
import re

import nbformat
import pytest

from paged_kv import course_map
from tools import build_site, vendor_widget_js

pytestmark = pytest.mark.setup

LESSONS = build_site.lesson_paths()


def lesson(*cells: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(source) for source in cells])


FIRST_CELL = """\
# Lesson 03 · Logical to physical

Why it matters.

**By the end of this lesson you can**

1. compute `position // block_size`
   and the offset;
2. write K/V.

Nothing needs a GPU."""
RECAP_CELL = """\
## Recap

* a slot is `block * block_size + offset`;
* writes are one scatter.

**Next, lesson 04:** decoding."""


def test_a_lesson_summary_has_its_title_outcomes_and_recap():
    summary = build_site.summarize(lesson(FIRST_CELL, "## 1. Section", RECAP_CELL), "03_logical_to_physical")

    assert summary == build_site.LessonSummary(
        number="03",
        title="Logical to physical",
        page="03_logical_to_physical.html",
        outcomes=("compute `position // block_size` and the offset;", "write K/V."),
        recap=("a slot is `block * block_size + offset`;", "writes are one scatter."),
    )
    assert summary.label == "03 · Logical to physical"


@pytest.mark.parametrize(
    ("cells", "missing"),
    [
        (
            (FIRST_CELL.replace("# Lesson 03 · ", "# "), RECAP_CELL),
            "does not start with '# Lesson NN · Title'",
        ),
        ((FIRST_CELL.replace("By the end of this lesson you can", "Goals"), RECAP_CELL), "no numbered list"),
        ((FIRST_CELL, "## Summary\n\n* one"), "no '## Recap' cell"),
        ((FIRST_CELL, "## Recap\n\nProse only."), "no '## Recap' cell"),
        ((), "does not start"),
    ],
)
def test_a_lesson_without_what_the_site_shows_is_named(cells, missing):
    with pytest.raises(build_site.SiteError, match=f"^03_x: .*{re.escape(missing)}"):
        build_site.summarize(lesson(*cells), "03_x")


def test_list_items_join_continuation_lines_and_stop_at_the_next_paragraph():
    lines = ["1. one", "   more", "", "2. two", "Then prose.", "3. not this list"]
    assert build_site.list_items(lines) == ("one more", "two")
    assert build_site.list_items(["Just prose.", "* first", "* second"]) == ("first", "second")
    assert build_site.list_items(["No list here."]) == ()


@pytest.mark.parametrize("path", LESSONS, ids=lambda path: path.stem)
def test_every_lesson_has_a_title_outcomes_and_a_recap(path):
    summary = build_site.summarize(nbformat.read(path, as_version=4), path.stem)
    assert summary.number == path.name[:2]
    assert len(summary.outcomes) >= 3, "course/STYLE.md asks for 3 to 5 outcomes"
    assert len(summary.recap) >= 2
    assert all(item and "\n" not in item for item in summary.outcomes + summary.recap)


def test_navigation_links_the_neighbours_the_index_and_the_recap():
    first, second, third = (
        build_site.LessonSummary(n, f"Title {n}", f"{n}_t.html", ("o",), ("r",)) for n in ("00", "01", "02")
    )
    assert build_site.navigation(None, first, second) == (
        "[Course index](index.html) · [Recap](#Recap) · [01 · Title 01 →](01_t.html)"
    )
    assert build_site.navigation(first, second, third).startswith("[← 00 · Title 00](00_t.html) · [Course")
    assert build_site.navigation(second, third, None).endswith("[Recap](#Recap)")


def test_the_index_has_one_row_per_lesson_and_every_recap():
    summaries = [
        build_site.LessonSummary("00", "Why", "00_why.html", ("compute a | b", "explain"), ("r0",)),
        build_site.LessonSummary("01", "Blocks", "01_blocks.html", ("build",), ("r1a", "r1b")),
    ]
    index = build_site.index_notebook(summaries)
    text = "\n".join(cell.source for cell in index.cells)

    assert all(cell.cell_type == "markdown" for cell in index.cells)
    assert "| 00 | [Why](00_why.html) | 1. compute a \\| b<br>2. explain |" in text
    assert "| 01 | [Blocks](01_blocks.html) | 1. build |" in text
    assert "### [01 · Blocks](01_blocks.html)\n\n* r1a\n* r1b" in text
    assert index.metadata["title"] == build_site.COURSE_TITLE


def test_navigation_is_added_around_a_lesson_without_changing_it():
    original = lesson(FIRST_CELL, RECAP_CELL)
    original.metadata["widgets"] = {"state": {}}
    framed = build_site.with_navigation(original, "[Course index](index.html)", "03 · Logical")

    navigation = "[Course index](index.html)"
    assert [cell.source for cell in framed.cells] == [navigation, FIRST_CELL, RECAP_CELL, navigation]
    assert framed.metadata["title"] == "03 · Logical" and framed.metadata["widgets"] == {"state": {}}
    assert len(original.cells) == 2 and "title" not in original.metadata


@pytest.fixture
def vendored(tmp_path):
    """Stand-ins for the vendored widget JavaScript and MathJax, in their real layout."""
    widget_js, mathjax = tmp_path / "widget-js", tmp_path / "mathjax-js"
    (widget_js / vendor_widget_js.WIDGET_RENDERER_URL).parent.mkdir(parents=True)
    (widget_js / vendor_widget_js.WIDGET_RENDERER_URL).write_text("// renderer")
    (widget_js / vendor_widget_js.REQUIRE_JS_URL).write_text("// require")
    (mathjax / vendor_widget_js.MATHJAX_SCRIPT).parent.mkdir(parents=True)
    (mathjax / vendor_widget_js.MATHJAX_SCRIPT).write_text("// mathjax")
    return widget_js, mathjax


def test_the_site_is_built_offline_with_copies_of_the_vendored_files(tmp_path, vendored):
    paths = build_site.lesson_paths(["00", "04"])
    index = build_site.build_site(tmp_path / "site", paths, *vendored)
    site = index.parent

    assert index == site / "index.html"
    assert sorted(p.name for p in site.glob("*.html")) == [
        "00_why_paging.html",
        "04_decode_allocation.html",
        "index.html",
    ]
    for entry in ("require.js", "@jupyter-widgets", "mathjax"):
        assert (site / entry).exists() and not (site / entry).is_symlink(), entry
    assert (site / vendor_widget_js.MATHJAX_SCRIPT).read_text() == "// mathjax"
    page = (site / "04_decode_allocation.html").read_text()
    assert '<script src="require.js"></script>' in page
    assert f'<script src="{vendor_widget_js.MATHJAX_URL}"> </script>' in page
    assert f"var widgetRendererSrc = '{vendor_widget_js.WIDGET_RENDERER_URL}';" in page
    assert f"require.config({{paths: {json.dumps(vendor_widget_js.REQUIRE_PATHS)}}});" in page
    assert "@media (prefers-color-scheme: dark) {" in page and "--jp-layout-color0: #111;" in page
    assert "application/vnd.jupyter.widget-state+json" in page, "the lesson's widget state was not kept"
    assert re.findall(r"<script[^>]+src=\"https?://", page) == [], "a script is loaded from the network"
    assert "<title>04 · On-demand decode allocation</title>" in page
    assert page.count('href="00_why_paging.html"') == 2 and 'href="index.html"' in page


def test_a_rebuild_replaces_the_site_but_a_foreign_folder_is_kept(tmp_path, vendored):
    paths = build_site.lesson_paths(["00"])
    site = build_site.build_site(tmp_path / "site", paths, *vendored).parent
    (site / "stale.html").write_text("from an older build")
    build_site.build_site(site, paths, *vendored)
    assert not (site / "stale.html").exists()

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(build_site.SiteError, match="is not a site built by tools/build_site"):
        build_site.build_site(foreign, paths, *vendored)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_lessons_are_chosen_by_number_and_an_unknown_one_is_named():
    assert [path.name for path in build_site.lesson_paths(["04", "00"])] == [
        "00_why_paging.ipynb",
        "04_decode_allocation.ipynb",
    ]
    assert build_site.lesson_paths() == LESSONS and len(LESSONS) == len(course_map.LESSONS)
    with pytest.raises(build_site.SiteError, match="no lesson numbered 42, 99"):
        build_site.lesson_paths(["99", "00", "42"])
    with pytest.raises(build_site.SiteError, match="no lessons"):
        build_site.build_site(build_site.ROOT / "never-written", [], build_site.ROOT, build_site.ROOT)

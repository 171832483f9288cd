"""Build the course into a static site to read offline: ``make site``.

Every lesson of ``lessons/`` becomes one HTML page, exported from its committed, executed notebook
(outputs and widget state as nbval checks them, nothing is re-run), plus an index page with the
course table: for each lesson its title, what you can do by the end of it and its recap, taken
from the lesson's first cell and its ``## Recap`` cell. The pages load everything from the site's
own folder, so it opens from disk with no network and no kernel:

* the widgets (``AllocationPlayer``, ``AllocatorPlayground``) through require.js and the widget
  renderer vendored from npm, so Play animates a player in the browser;
* the maths through MathJax 2.7.7 vendored from npm, the version and configuration that
  nbconvert's templates set up (``tools/vendor_widget_js.py`` fetches both, once, into ``.cache/``);
* JupyterLab's light theme, and its dark theme when the reader's system asks for dark
  (``prefers-color-scheme``), with ``data-jp-theme-light`` set on the body to match, as
  JupyterLab does, so theme-following styles of the outputs follow too.

The output folder holds the pages and copies of the vendored files; it is replaced on each build
(a folder that is not a site this tool built is never deleted).

Usage:
    python tools/build_site.py [--out site] [--only 04 ...]   prints the path of the index page
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python tools/build_site.py`
    sys.path.insert(0, str(ROOT))

from tools import vendor_widget_js  # noqa: E402

LESSONS = ROOT / "lessons"
DEFAULT_OUT = ROOT / "site"
TEMPLATE = Path(__file__).resolve().parent / "site_template" / "page.html.j2"
MARKER = ".paged-kv-site"  # marks a folder this tool built, which it may replace
INDEX = "index.html"
COURSE_TITLE = "paged_kv: how LLM inference engines manage the KV cache in blocks"

TITLE_LINE = re.compile(r"^# Lesson (?P<number>\d\d) · (?P<title>.+?)\s*$")
OUTCOMES_INTRO = "By the end of this lesson you can"
RECAP_HEADING = "## Recap"
LIST_ITEM = re.compile(r"^(?:\d+\.|[*-])\s+(?P<text>.*)$")


class SiteError(ValueError):
    """A lesson lacks what the site shows of it (its title, outcomes or recap); the message names it."""


@dataclass(frozen=True)
class LessonSummary:
    """What the index shows of one lesson; ``outcomes`` and ``recap`` are markdown, one item each."""

    number: str  # "04"
    title: str  # "On-demand decode allocation"
    page: str  # "04_decode_allocation.html"
    outcomes: tuple[str, ...]
    recap: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.number} · {self.title}"


def list_items(lines: list[str]) -> tuple[str, ...]:
    """The items of the first markdown list in ``lines``, each joined onto one line.

    An item's continuation lines are the indented ones after it; the list ends at the first line
    that is neither an item nor indented (a blank line between items does not end it).
    """
    items: list[str] = []
    for line in lines:
        item = LIST_ITEM.match(line)
        if item:
            items.append(item["text"].strip())
        elif items and line.startswith((" ", "\t")) and line.strip():
            items[-1] += " " + line.strip()
        elif items and line.strip():
            break
    return tuple(items)


def summarize(notebook: nbformat.NotebookNode, name: str) -> LessonSummary:
    """The title, outcomes and recap of the lesson ``notebook`` (whose file stem is ``name``).

    The course's style (course/STYLE.md) puts ``# Lesson NN · Title`` and the **By the end of
    this lesson you can** list in the first cell, and a ``## Recap`` cell of bullets at the end.

    Raises:
        SiteError: one of the three is missing, naming ``name`` and what is missing.
    """
    markdown = [cell.source for cell in notebook.cells if cell.cell_type == "markdown"]
    first = markdown[0].splitlines() if markdown else []
    heading = TITLE_LINE.match(first[0]) if first else None
    if heading is None:
        raise SiteError(f"{name}: the first cell does not start with '# Lesson NN · Title'")
    intro = next((i for i, line in enumerate(first) if OUTCOMES_INTRO in line), None)
    outcomes = list_items(first[intro + 1 :]) if intro is not None else ()
    if not outcomes:
        raise SiteError(f"{name}: the first cell has no numbered list after '{OUTCOMES_INTRO}'")
    recap_cell = next((source for source in markdown if source.startswith(RECAP_HEADING)), None)
    recap = list_items(recap_cell.splitlines()[1:]) if recap_cell is not None else ()
    if not recap:
        raise SiteError(f"{name}: no '{RECAP_HEADING}' cell with a list of bullets")
    return LessonSummary(heading["number"], heading["title"], f"{name}.html", outcomes, recap)


def navigation(
    previous: LessonSummary | None, current: LessonSummary, following: LessonSummary | None
) -> str:
    """The markdown of a lesson page's navigation line: previous, index, recap, next."""
    links = [f"[← {previous.label}]({previous.page})"] if previous else []
    links += [f"[Course index]({INDEX})", "[Recap](#Recap)"]
    links += [f"[{following.label} →]({following.page})"] if following else []
    return " · ".join(links)


def index_notebook(lessons: list[LessonSummary]) -> nbformat.NotebookNode:
    """The index page as a notebook of markdown cells: the course table, then every lesson's recap."""
    rows = [
        f"| {lesson.number} | [{lesson.title}]({lesson.page}) | "
        + "<br>".join(f"{n}. {_table_cell(item)}" for n, item in enumerate(lesson.outcomes, start=1))
        + " |"
        for lesson in lessons
    ]
    table = "\n".join(["| # | lesson | by the end of it you can |", "|---|---|---|", *rows])
    intro = (
        f"# {COURSE_TITLE}\n\n"
        "The course to read offline: each lesson as it ran, with its pictures, its maths and its "
        "widgets (press Play on a player: it animates in the page, with no kernel). To run the code "
        "and do the exercises, open the course in JupyterLab with `make lab`."
    )
    recaps = [
        f"### [{lesson.label}]({lesson.page})\n\n" + "\n".join(f"* {item}" for item in lesson.recap)
        for lesson in lessons
    ]
    cells = [intro, f"## The lessons\n\n{table}", "## Recap of each lesson", *recaps]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(source) for source in cells])
    notebook.metadata["title"] = COURSE_TITLE
    return notebook


def _table_cell(text: str) -> str:
    return text.replace("|", "\\|")


def with_navigation(notebook: nbformat.NotebookNode, line: str, title: str) -> nbformat.NotebookNode:
    """A copy of ``notebook`` with the navigation ``line`` as its first and last cell, titled ``title``."""
    cells = [nbformat.v4.new_markdown_cell(line), *notebook.cells, nbformat.v4.new_markdown_cell(line)]
    return nbformat.from_dict({**notebook, "cells": cells, "metadata": {**notebook.metadata, "title": title}})


class SiteExporter(HTMLExporter):
    """nbconvert's lab template, offline: vendored JavaScript, and dark when the reader's system is.

    The page template (``site_template/page.html.j2``) extends the lab template and adds
    JupyterLab's dark theme variables under ``@media (prefers-color-scheme: dark)``.
    """

    def __init__(self) -> None:
        super().__init__(
            template_name="lab",
            template_file=str(TEMPLATE),
            require_js_url=vendor_widget_js.REQUIRE_JS_URL,
            widget_renderer_url=vendor_widget_js.WIDGET_RENDERER_URL,
            mathjax_url=vendor_widget_js.MATHJAX_URL,
            theme="light",
        )

    def _init_resources(self, resources: dict) -> dict:
        resources = super()._init_resources(resources)
        env = self.environment
        resources["dark_theme_css"] = env.loader.get_source(env, "static/theme-dark.css")[0]
        resources["require_paths"] = json.dumps(vendor_widget_js.REQUIRE_PATHS)
        return resources


def build_site(
    out: Path,
    lessons: list[Path],
    widget_js: Path,
    mathjax: Path,
) -> Path:
    """Write the site for ``lessons`` (lesson notebooks, in course order) into ``out``; returns the index.

    ``widget_js`` and ``mathjax`` are the vendored folders (:func:`vendor_widget_js.vendor` and
    :func:`vendor_widget_js.vendor_mathjax`); their files are copied into ``out``. Each page
    links the previous and the next lesson of ``lessons`` and the index, which lists them all.

    Raises:
        SiteError: ``lessons`` is empty, a lesson lacks its title, outcomes or recap, or ``out``
            is a non-empty folder this tool did not build.
    """
    if not lessons:
        raise SiteError("no lessons to build a site from")
    out = Path(out)
    summaries = [summarize(nbformat.read(path, as_version=4), path.stem) for path in lessons]
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise SiteError(
            f"{out} is not empty and is not a site built by tools/build_site.py: not replacing it"
        )
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    exporter = SiteExporter()
    for i, (path, summary) in enumerate(zip(lessons, summaries, strict=True)):
        previous = summaries[i - 1] if i > 0 else None
        following = summaries[i + 1] if i + 1 < len(summaries) else None
        notebook = with_navigation(
            nbformat.read(path, as_version=4), navigation(previous, summary, following), summary.label
        )
        _write(exporter, notebook, out / summary.page)
    _write(exporter, index_notebook(summaries), out / INDEX)
    vendor_widget_js.install_next_to(out, widget_js, vendor_widget_js.ENTRIES, copy=True)
    vendor_widget_js.install_next_to(out, mathjax, vendor_widget_js.MATHJAX_ENTRIES, copy=True)
    (out / MARKER).write_text("built by tools/build_site.py; `make site` replaces this folder\n")
    return out / INDEX


def _write(exporter: SiteExporter, notebook: nbformat.NotebookNode, path: Path) -> None:
    html, _resources = exporter.from_notebook_node(notebook, resources={"metadata": {"name": path.stem}})
    path.write_text(html, encoding="utf-8")


def lesson_paths(only: list[str] | None = None) -> list[Path]:
    """The lesson notebooks in course order, or those whose number is in ``only`` (``["04"]``).

    Raises:
        SiteError: a number in ``only`` matches no lesson.
    """
    paths = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
    if only is None:
        return paths
    chosen = [path for path in paths if path.name[:2] in only]
    missing = sorted(set(only) - {path.name[:2] for path in chosen})
    if missing:
        raise SiteError(f"no lesson numbered {', '.join(missing)} in {LESSONS}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the site's folder ({DEFAULT_OUT})")
    parser.add_argument("--only", nargs="+", metavar="NN", help="build only these lessons (and the index)")
    args = parser.parse_args(argv)
    try:
        index = build_site(
            args.out,
            lesson_paths(args.only),
            vendor_widget_js.vendor(),
            vendor_widget_js.vendor_mathjax(),
        )
    except (SiteError, vendor_widget_js.NpmMissingError, RuntimeError) as error:
        print(f"build_site: {error}", file=sys.stderr)
        return 1
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())

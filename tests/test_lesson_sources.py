"""Every lesson source ends with where its concept lives in vLLM, checked against one named release.

The form (course/STYLE.md and issue 15): a markdown cell ``## In vLLM``, the last section before the
recap, that opens with "Checked against vLLM 0.33.0.", lists 3 to 8 bullets each naming a file of
vLLM's repository, and says what the course leaves out or does differently. Whether the cited files
and names exist is checked by hand against the vLLM tree (``tools/check_vllm_refs.py``).

The glossary (docs/glossary.md) defines the course's terms, each with the lesson that teaches it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.build_course import parse_percent

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "course").glob("*.lesson.py"))
VERSION = "vLLM 0.33.0"
FILE_BULLET = re.compile(r"^\* `vllm/[\w./-]+\.py`", re.MULTILINE)


def sections(path: Path) -> list[tuple[str, str]]:
    """The lesson's ``## `` headings, each with the markdown of the cell it opens."""
    cells = parse_percent(path.read_text(encoding="utf-8"), path.name)
    texts = ["\n".join(cell.lines) for cell in cells if cell.kind == "markdown"]
    return [(text.splitlines()[0], text) for text in texts if text.startswith("## ")]


def test_there_are_lessons():
    assert len(LESSONS) >= 11


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name[:2])
def test_a_lesson_says_where_its_concept_lives_in_vllm(path):
    headings = [heading for heading, _ in sections(path)]
    assert headings.count("## In vLLM") == 1, f"{path.name}: one '## In vLLM' section, got {headings}"
    assert headings[-2:] == ["## In vLLM", "## Recap"], "'## In vLLM' comes right before '## Recap'"
    text = dict(sections(path))["## In vLLM"]
    assert f"Checked against {VERSION}." in text, (
        f"the section names the release it was checked against: {VERSION}"
    )
    bullets = FILE_BULLET.findall(text)
    assert 3 <= len(bullets) <= 8, (
        f"3 to 8 bullets, each starting with a `vllm/...py` path; got {len(bullets)}"
    )
    assert "What the course leaves out or does differently:" in text


def test_the_section_test_reads_headings_from_markdown_cells_only(tmp_path):
    source = tmp_path / "99_x.lesson.py"
    source.write_text(
        "# %% [markdown]\n# # Lesson 99\n\n# %%\nx = '## In vLLM'\n\n"
        "# %% [markdown]\n# ## In vLLM\n# text\n\n# %% [markdown]\n# ## Recap\n"
    )
    assert [heading for heading, _ in sections(source)] == ["## In vLLM", "## Recap"]


GLOSSARY = ROOT / "docs" / "glossary.md"
TERMS = (  # issue 15's list: each needs a row
    "block", "block size", "block table", "slot", "logical block", "physical block", "slot mapping",
    "free queue", "ref count", "fork", "copy-on-write", "prefix caching", "chained block hash",
    "eviction", "preemption", "recompute", "swap", "watermark", "admission", "continuous batching",
    "token budget", "chunked prefill", "computed tokens", "reservation", "internal fragmentation",
    "external fragmentation", "GQA, MQA", "prefill", "decode",
)  # fmt: skip


def glossary_rows() -> dict[str, list[str]]:
    """The glossary's table rows by term: meaning, lesson, vLLM's name."""
    rows = {}
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[0] not in ("term", "---"):
            rows[cells[0]] = cells[1:]
    return rows


def test_the_glossary_defines_every_term_of_the_course():
    rows = glossary_rows()
    assert not [term for term in TERMS if term not in rows], "terms without a row"
    assert all(meaning.endswith(".") for meaning, _, _ in rows.values()), "each meaning is a sentence"


def test_the_glossary_names_lessons_that_exist():
    lessons = {path.name[:2] for path in LESSONS}
    for term, (_, taught_in, _) in glossary_rows().items():
        if taught_in != "—":
            named = {number.strip() for number in taught_in.split(",")}
            assert named <= lessons, f"{term}: lessons {sorted(named - lessons)} do not exist"


def test_the_architecture_page_links_to_the_glossary():
    top = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("\n## ")[0]
    assert "(glossary.md)" in top, "the top paragraph links to the glossary"

"""Every lesson source ends with where its concept lives in vLLM, checked against one named release.

The form (course/STYLE.md and issue 15): a markdown cell ``## In vLLM``, the last section before the
recap, that opens with "Checked against vLLM 0.33.0.", lists 3 to 8 bullets each naming a file of
vLLM's repository, and says what the course leaves out or does differently. Whether the cited files
and names exist is checked by hand against the vLLM tree (``tools/check_vllm_refs.py``).
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

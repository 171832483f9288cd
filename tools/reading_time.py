"""How long each lesson takes to read: its words of prose and its lines of code.

A lesson is read at 200 words a minute of prose (its markdown cells) and 1.5 s a line of code (every
line of its code cells, blank ones included: a reader's eye passes over them too). The course keeps
every lesson under 25 minutes by this measure, so that each is one sitting; ``tests/test_course.py``
checks it, and the table in ``lessons/README.md``, from the committed notebooks. Cell time, which
depends on the machine, is measured by ``bench/notebook_times.py``.

    .venv/bin/python tools/reading_time.py            # the table, from lessons/*.ipynb
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
WORDS_PER_MINUTE = 200
SECONDS_PER_CODE_LINE = 1.5
LIMIT_MINUTES = 25


@dataclass(frozen=True)
class Reading:
    """What one lesson asks of its reader."""

    words: int
    code_lines: int

    @property
    def minutes(self) -> float:
        return self.words / WORDS_PER_MINUTE + self.code_lines * SECONDS_PER_CODE_LINE / 60


def reading(notebook: nbformat.NotebookNode) -> Reading:
    """The words of the notebook's markdown cells and the lines of its code cells."""
    words = sum(len(c.source.split()) for c in notebook.cells if c.cell_type == "markdown")
    lines = sum(len(c.source.splitlines()) for c in notebook.cells if c.cell_type == "code")
    return Reading(words, lines)


def lesson_readings(folder: Path = ROOT / "lessons") -> dict[str, Reading]:
    """Each lesson notebook of ``folder``, by its stem, and what it asks of its reader."""
    return {p.stem: reading(nbformat.read(p, as_version=4)) for p in sorted(folder.glob("*.ipynb"))}


def main() -> int:
    readings = lesson_readings()
    print(f"{'lesson':<40}{'words':>7}{'code lines':>12}{'minutes':>9}")
    for stem, r in readings.items():
        flag = "  over the limit" if r.minutes >= LIMIT_MINUTES else ""
        print(f"{stem:<40}{r.words:>7,}{r.code_lines:>12}{r.minutes:>9.1f}{flag}")
    total = sum(r.minutes for r in readings.values())
    print(f"{'all lessons':<40}{'':>19}{total:>9.1f}  ({total / 60:.1f} hours; each under {LIMIT_MINUTES})")
    return 1 if any(r.minutes >= LIMIT_MINUTES for r in readings.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

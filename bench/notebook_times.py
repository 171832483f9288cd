"""How long each lesson and solution notebook takes to run, cell by cell, against the course's limits.

A lesson's cells must run in under 30 s in all, and no cell in over 20 s, on a 2-core CPU; each
notebook, kernel start included, in under 60 s, and all lessons and solutions together in under
5 minutes. This executes each notebook in a fresh kernel (as nbval does), records every cell's time
(nbclient's timing: from the cell's input reaching the kernel to its reply) and prints a table; it
exits 1 when a limit is broken. Timings vary with the machine and with what else runs on it, so they
live here, not in tests: the course states the range of a quiet and of a busy machine
(``lessons/README.md``).

    .venv/bin/python bench/notebook_times.py [--only 03 ...] [--lessons-only] [--slowest 3]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.build_course import ROOT, execute

NOTEBOOK_LIMIT_S = 60
TOTAL_LIMIT_S = 5 * 60
LESSON_CELLS_LIMIT_S = 30
CELL_LIMIT_S = 20


def cell_seconds(notebook: nbformat.NotebookNode) -> list[tuple[int, float]]:
    """``(index, seconds)`` of every code cell of an executed notebook, from nbclient's timing."""
    times = []
    for index, cell in enumerate(notebook.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if cell.cell_type == "code" and start and end:
            seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
            times.append((index, seconds))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers to time")
    parser.add_argument("--lessons-only", action="store_true", help="time the lessons, not the solutions")
    parser.add_argument("--slowest", type=int, default=2, help="how many of the slowest cells to show")
    args = parser.parse_args(argv)
    folders = ("lessons",) if args.lessons_only else ("lessons", "solutions")
    paths = [p for folder in folders for p in sorted((ROOT / folder).glob("*.ipynb"))]
    if args.only:
        paths = [p for p in paths if p.name[:2] in args.only]
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{'notebook':<52}{'wall s':>8}{'cells s':>9}  slowest cells (index: s)")
    total, broken = 0.0, []
    for path in paths:
        start = time.perf_counter()
        notebook = execute(nbformat.read(path, as_version=4), path.parent, record_timing=True)
        seconds = time.perf_counter() - start
        total += seconds
        cells = cell_seconds(notebook)
        in_cells = sum(s for _, s in cells)
        slowest = sorted(cells, key=lambda c: -c[1])[: args.slowest]
        limits = [(seconds > NOTEBOOK_LIMIT_S, f"notebook over {NOTEBOOK_LIMIT_S} s")]
        if path.parent.name == "lessons":
            limits.append((in_cells > LESSON_CELLS_LIMIT_S, f"cells over {LESSON_CELLS_LIMIT_S} s"))
            limits.append((any(s > CELL_LIMIT_S for _, s in cells), f"a cell over {CELL_LIMIT_S} s"))
        flags = [text for broke, text in limits if broke]
        if flags:
            broken.append(path)
        shown = ", ".join(f"{i}: {s:.1f}" for i, s in slowest)
        name = f"{path.parent.name}/{path.name}"
        print(f"{name:<52}{seconds:>8.1f}{in_cells:>9.1f}  {shown}{'  ' + '; '.join(flags) if flags else ''}")
    print(f"{'total':<52}{total:>8.1f}  (limit {TOTAL_LIMIT_S} s for lessons and solutions together)")
    over_total = not args.only and not args.lessons_only and total > TOTAL_LIMIT_S
    return 1 if broken or over_total else 0


if __name__ == "__main__":
    sys.exit(main())

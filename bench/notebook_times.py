"""How long each lesson and solution notebook takes to run, against the course's limits.

Every notebook must run in under 60 s on a 2-core CPU, and all lessons and solutions together in
under 5 minutes. This executes each one in a fresh kernel (as nbval does) and prints a table; it
exits 1 when a limit is broken. Timings vary with the machine, so they live here, not in tests.

    .venv/bin/python bench/notebook_times.py [--only 03 ...]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.build_course import ROOT, execute

NOTEBOOK_LIMIT_S = 60
TOTAL_LIMIT_S = 5 * 60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers to time")
    args = parser.parse_args(argv)
    paths = [p for folder in ("lessons", "solutions") for p in sorted((ROOT / folder).glob("*.ipynb"))]
    if args.only:
        paths = [p for p in paths if p.name[:2] in args.only]
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"{'notebook':<44}{'seconds':>8}")
    total = 0.0
    slow = []
    for path in paths:
        start = time.perf_counter()
        execute(nbformat.read(path, as_version=4), path.parent)
        seconds = time.perf_counter() - start
        total += seconds
        flag = "  over the limit" if seconds > NOTEBOOK_LIMIT_S else ""
        if flag:
            slow.append(path)
        print(f"{path.parent.name + '/' + path.name:<44}{seconds:>8.1f}{flag}")
    print(f"{'total':<44}{total:>8.1f}  (limit {TOTAL_LIMIT_S} s; each notebook {NOTEBOOK_LIMIT_S} s)")
    return 1 if slow or total > TOTAL_LIMIT_S else 0


if __name__ == "__main__":
    sys.exit(main())

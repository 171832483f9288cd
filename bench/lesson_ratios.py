"""The ratios the lessons' timing cells print, measured again and again, on a quiet and on a busy machine.

A lesson that times something (lessons 03 and 06) prints only ratios, from ``paged_kv.timing``, and
its prose states the range they fell in over several runs, quiet and under load. This script is how
those ranges are measured: it executes each lesson ``--runs`` times in a fresh kernel, reads every
ratio its cells print ("3.2 times faster than ..."), and prints the smallest and largest of each.
``--busy N`` starts ``N`` other processes that keep the cores busy (single-threaded matrix products,
which compete for the memory bus as well) for the whole measurement, and stops them at the end.

    .venv/bin/python bench/lesson_ratios.py --runs 6              # quiet
    .venv/bin/python bench/lesson_ratios.py --runs 6 --busy 2     # two busy processes on 2 cores
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.build_course import ROOT, execute

TIMED_LESSONS = ("03_logical_to_physical", "06_attention_at_scale")
RATIO = re.compile(r"(?P<ratio>\d+(?:\.\d+)?) times (?P<way>faster|slower) than")


def busy_loop() -> None:
    """Keep one core busy until killed: single-threaded matrix products."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


def ratios(notebook: nbformat.NotebookNode) -> dict[str, float]:
    """Each ratio the notebook's cells printed, by the text of its line around the number.

    A ratio is returned as the first contender's time over the second's: "3 times slower than" is
    3, "4 times faster than" is 1/4.
    """
    found = {}
    for index, cell in enumerate(notebook.cells):
        for output in cell.get("outputs", []):
            for line in output.get("text", "").splitlines():
                match = RATIO.search(line)
                if match:
                    value = float(match["ratio"])
                    key = f"cell {index}: {line[: match.start()].strip()} ... {line[match.end() :].strip()}"
                    found[key] = value if match["way"] == "slower" else 1 / value
    return found


def described(low: float, high: float) -> str:
    """A range of time ratios in the lessons' words: "13 to 27 times slower", "2.1 to 3 times faster"."""
    if low >= 1:
        return f"{low:.3g} to {high:.3g} times slower"
    if high <= 1:
        return f"{1 / high:.3g} to {1 / low:.3g} times faster"
    return f"{1 / low:.3g} times faster to {high:.3g} times slower"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="executions of each lesson")
    parser.add_argument("--busy", type=int, default=0, help="processes that keep the cores busy meanwhile")
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers (default: 03 and 06)")
    args = parser.parse_args(argv)
    stems = [s for s in TIMED_LESSONS if not args.only or s[:2] in args.only]
    burners = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for burner in burners:
        burner.start()
    try:
        print(f"{os.cpu_count()} cores, {args.busy} busy processes, {args.runs} runs of each lesson")
        for stem in stems:
            seen = defaultdict(list)
            path = ROOT / "lessons" / f"{stem}.ipynb"
            for _ in range(args.runs):
                for key, value in ratios(execute(nbformat.read(path, as_version=4), path.parent)).items():
                    seen[key].append(value)
            print(f"\n{stem}: time of the first over the second (above 1: slower)")
            for key, values in seen.items():
                print(f"  {described(min(values), max(values)):<36} {key}")
    finally:
        for burner in burners:
            burner.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

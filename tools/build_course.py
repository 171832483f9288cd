"""Build the course notebooks from their sources in ``course/``. Nobody edits a generated notebook.

Each lesson ``NN_topic`` has two sources, in the py:percent format (cells start at ``# %%`` lines;
``# %% [markdown]`` cells are comment lines):

    course/NN_topic.lesson.py    -> lessons/NN_topic.ipynb    executed, outputs committed
    course/NN_topic.exercise.py  -> exercises/NN_topic.ipynb  solution regions replaced by stubs
                                 -> solutions/NN_topic.ipynb  solution markers removed

A solution region in an exercise source is marked, inside a code cell, by

    ### BEGIN SOLUTION: a hint of what to do
    ...the solution...
    ### END SOLUTION

and the exercise gets, at the same indentation, ``raise NotImplementedError("a hint of what to do")``.
Exercises and solutions are written without outputs. Every notebook carries its lesson and the
course's map in its metadata, ``{"paged_kv": {"lesson": "NN", "course_map": 2}}``
(:mod:`paged_kv.course_map`), so that ``python -m paged_kv.grade`` grades a renamed copy and
``make lab`` recognises a learner's copy made before the course was renumbered.

Usage:
    python tools/build_course.py               build everything, executing the lessons
    python tools/build_course.py --only 03     build lesson 03's three notebooks
    python tools/build_course.py --no-execute  build exercises and solutions only
    python tools/build_course.py --check       exit 1 if a committed notebook differs from its source
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from paged_kv.course_map import COURSE_MAP, LESSONS, METADATA_KEY

ROOT = Path(__file__).resolve().parent.parent
COURSE = ROOT / "course"
CELL_MARKER = re.compile(r"^# %%(?P<markdown> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")
BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION(?::\s*(?P<hint>.*\S))?\s*$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
EXECUTION_TIMEOUT_S = 120


class SourceError(ValueError):
    """A course source breaks the format; the message names the file and line."""


@dataclass
class Cell:
    kind: str  # "markdown" or "code"
    lines: list[str]
    line_number: int
    tags: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        return "\n".join(self.lines)


def parse_percent(text: str, name: str) -> list[Cell]:
    """Split a py:percent source into cells, with markdown comment prefixes removed."""
    cells: list[Cell] = []
    for number, line in enumerate(text.splitlines(), start=1):
        marker = CELL_MARKER.match(line)
        if marker:
            tags = json.loads(marker["tags"]) if marker["tags"] else []
            cells.append(Cell("markdown" if marker["markdown"] else "code", [], number, tags))
        elif not cells:
            if line.strip():
                raise SourceError(f"{name}:{number}: text before the first '# %%' cell marker")
        elif cells[-1].kind == "markdown":
            if line.strip() and line != "#" and not line.startswith("# "):
                raise SourceError(f"{name}:{number}: a markdown cell line must start with '# '")
            cells[-1].lines.append(line[2:])
        else:
            cells[-1].lines.append(line)
    for cell in cells:
        while cell.lines and not cell.lines[-1].strip():
            cell.lines.pop()
        while cell.lines and not cell.lines[0].strip():
            cell.lines.pop(0)
        if not cell.lines:
            raise SourceError(f"{name}:{cell.line_number}: empty cell")
    return cells


def split_solutions(cell: Cell, name: str) -> tuple[list[str], list[str]]:
    """The cell's lines as the exercise shows them and as the solution shows them."""
    exercise: list[str] = []
    solution: list[str] = []
    inside = False
    for offset, line in enumerate(cell.lines):
        where = f"{name}:{cell.line_number + 1 + offset}"
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if inside:
                raise SourceError(f"{where}: BEGIN SOLUTION inside a solution region")
            if not begin["hint"]:
                raise SourceError(f"{where}: BEGIN SOLUTION needs a hint: '### BEGIN SOLUTION: what to do'")
            inside = True
            indent, hint = begin["indent"], begin["hint"]
            exercise.append(f"{indent}# YOUR CODE HERE")
            exercise.append(f"{indent}raise NotImplementedError({json.dumps(hint, ensure_ascii=False)})")
        elif end:
            if not inside:
                raise SourceError(f"{where}: END SOLUTION without BEGIN SOLUTION")
            inside = False
        else:
            solution.append(line)
            if not inside:
                exercise.append(line)
    if inside:
        raise SourceError(f"{name}:{cell.line_number}: a solution region is never closed")
    return exercise, solution


def new_notebook(cells: list[tuple[str, str, list[str]]]) -> nbformat.NotebookNode:
    """A notebook of (kind, source, tags) cells with stable ids and no outputs."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    for index, (kind, source, tags) in enumerate(cells):
        factory = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = factory(source, id=f"cell-{index:03d}")
        if tags:
            cell.metadata["tags"] = list(tags)
        notebook.cells.append(cell)
    return notebook


def lesson_number(source: Path) -> str:
    """The two digits a source's name starts with: its lesson."""
    lesson = re.match(r"(\d\d)_", source.name)
    if lesson is None:
        raise SourceError(f"{source.name}: a course source's name starts with its lesson, NN_")
    return lesson.group(1)


def recorded(notebook: nbformat.NotebookNode, source: Path) -> nbformat.NotebookNode:
    """``notebook`` with its lesson and the course's map in its metadata."""
    notebook.metadata[METADATA_KEY] = {"lesson": lesson_number(source), "course_map": COURSE_MAP}
    return notebook


def lesson_notebook(source: Path) -> nbformat.NotebookNode:
    cells = parse_percent(source.read_text(), source.name)
    for cell in cells:
        if any(BEGIN.match(line) or END.match(line) for line in cell.lines):
            raise SourceError(
                f"{source.name}:{cell.line_number}: solution markers belong in exercise sources"
            )
    return recorded(new_notebook([(c.kind, c.source, c.tags) for c in cells]), source)


def exercise_and_solution(source: Path) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode]:
    cells = parse_percent(source.read_text(), source.name)
    exercise, solution = [], []
    for cell in cells:
        if cell.kind == "markdown":
            exercise.append((cell.kind, cell.source, cell.tags))
            solution.append((cell.kind, cell.source, cell.tags))
            continue
        exercise_lines, solution_lines = split_solutions(cell, source.name)
        exercise.append((cell.kind, "\n".join(exercise_lines), cell.tags))
        solution.append((cell.kind, "\n".join(solution_lines), cell.tags))
    if exercise == solution:
        raise SourceError(f"{source.name}: an exercise needs at least one '### BEGIN SOLUTION' region")
    return recorded(new_notebook(exercise), source), recorded(new_notebook(solution), source)


def execute(notebook: nbformat.NotebookNode, cwd: Path, record_timing: bool = False) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel of this interpreter; a failing cell raises.

    ``record_timing`` keeps nbclient's timestamps in each cell's metadata (``bench/notebook_times.py``
    reads them); the course's notebooks are written without them.
    """
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    class CurrentInterpreter(KernelSpecManager):
        def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
            argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            return KernelSpec(argv=argv, display_name="Python 3", language="python", resource_dir=str(cwd))

    manager = KernelManager(kernel_spec_manager=CurrentInterpreter(), kernel_name="python3")
    client = NotebookClient(
        notebook,
        km=manager,
        timeout=EXECUTION_TIMEOUT_S,
        record_timing=record_timing,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()
    notebook.metadata["kernelspec"] = dict(KERNELSPEC)
    return notebook


def write(notebook: nbformat.NotebookNode, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.validate(notebook)
    path.write_text(nbformat.writes(notebook) + "\n")


def stems(only: list[str] | None) -> list[str]:
    found = sorted({p.name.split(".")[0] for p in COURSE.glob("*.py")})
    unmapped = sorted(set(found) - {lesson.stem for lesson in LESSONS})
    if unmapped:
        raise SourceError(f"{', '.join(unmapped)}: not a lesson of paged_kv.course_map.LESSONS")
    if only:
        found = [s for s in found if s.split("_")[0] in only or s in only]
        if not found:
            raise SystemExit(f"no lesson matches {only}")
    return found


def sources_of(notebook: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def check(only: list[str] | None = None) -> list[str]:
    """What differs between the committed notebooks and their sources (empty when all agree).

    Exercises and solutions must match byte for byte; a lesson must have its source's cells (its
    outputs are nbval's to check) and every code cell executed.
    """
    problems = []
    for stem in stems(only):
        exercise_source = COURSE / f"{stem}.exercise.py"
        if exercise_source.exists():
            for folder, notebook in zip(
                ("exercises", "solutions"), exercise_and_solution(exercise_source), strict=True
            ):
                path = ROOT / folder / f"{stem}.ipynb"
                expected = nbformat.writes(notebook) + "\n"
                if not path.exists() or path.read_text() != expected:
                    problems.append(f"{folder}/{stem}.ipynb differs from course/{exercise_source.name}")
        lesson_source = COURSE / f"{stem}.lesson.py"
        if lesson_source.exists():
            path = ROOT / "lessons" / f"{stem}.ipynb"
            if not path.exists():
                problems.append(f"lessons/{stem}.ipynb is missing")
                continue
            committed, built = nbformat.read(path, as_version=4), lesson_notebook(lesson_source)
            if sources_of(committed) != sources_of(built):
                problems.append(f"lessons/{stem}.ipynb differs from course/{lesson_source.name}")
            if committed.metadata.get(METADATA_KEY) != built.metadata[METADATA_KEY]:
                problems.append(f"lessons/{stem}.ipynb records another lesson or map than its source")
            unrun = [c for c in committed.cells if c.cell_type == "code" and c.execution_count is None]
            if unrun:
                problems.append(f"lessons/{stem}.ipynb has {len(unrun)} code cells that were never executed")
    return problems


def build(only: list[str] | None, run_lessons: bool) -> None:
    for stem in stems(only):
        exercise_source = COURSE / f"{stem}.exercise.py"
        if exercise_source.exists():
            exercise, solution = exercise_and_solution(exercise_source)
            write(exercise, ROOT / "exercises" / f"{stem}.ipynb")
            write(solution, ROOT / "solutions" / f"{stem}.ipynb")
            print(f"wrote exercises/{stem}.ipynb and solutions/{stem}.ipynb")
        lesson_source = COURSE / f"{stem}.lesson.py"
        if lesson_source.exists() and run_lessons:
            start = time.perf_counter()
            notebook = execute(lesson_notebook(lesson_source), ROOT / "lessons")
            write(notebook, ROOT / "lessons" / f"{stem}.ipynb")
            print(f"executed lessons/{stem}.ipynb in {time.perf_counter() - start:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers (or stems) to build")
    parser.add_argument("--no-execute", action="store_true", help="do not execute the lesson notebooks")
    parser.add_argument("--check", action="store_true", help="compare committed notebooks with their sources")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check(args.only)
            for problem in problems:
                print(problem, file=sys.stderr)
            if problems:
                print("regenerate with: make course", file=sys.stderr)
            return 1 if problems else 0
        build(args.only, run_lessons=not args.no_execute)
    except SourceError as error:
        print(f"build_course: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m paged_kv.grade NOTEBOOK_OR_FILE``: grade an exercise, task by task.

    python -m paged_kv.grade exercises/02_the_allocator.ipynb        # the lesson from its metadata
    python -m paged_kv.grade mine.ipynb                              # a renamed copy: the same
    python -m paged_kv.grade my_allocator.py --lesson 02
    python -m paged_kv.grade package --lesson 02 --json              # the finished package, as JSON

The lesson comes from ``--lesson`` when given, else from the notebook's metadata (every exercise
and solution notebook carries ``{"paged_kv": {"lesson": "NN"}}``, kept in any copy), else from the
two digits the file name starts with.

Prints a table of the tasks with their points and the total, then what went wrong in each task
that lost points. Exits 0 only when every task passes, 1 otherwise, 2 when the input is unusable.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from paged_kv.cli import USAGE_ERROR, _Parser
from paged_kv.course_map import current_lesson, lesson_of_name, notebook_lesson
from paged_kv.grading import PACKAGE, GradeReport, grade, lessons
from paged_kv.grading.runner import DEFAULT_MEMORY_LIMIT_BYTES, DEFAULT_TIME_LIMIT_S, STATUS_TEXT

MARK = {"passed": "\N{CHECK MARK}"}


def lesson_of(source: str) -> str | None:
    """The lesson of a notebook's metadata, else the one its file name says, else ``None``.

    ``02_the_allocator.ipynb`` gives ``02``, and so does a copy of it under any name. A notebook
    built before the course was renumbered records its first-map number, which gives the lesson its
    tasks belong to now (``06``, a concurrent workload, gives ``07``), and so does its old name
    (:mod:`paged_kv.course_map`). A file that cannot be read gives what its name says: grading it
    reports why it cannot be read.
    """
    path = Path(source)
    if path.suffix == ".ipynb":
        try:
            recorded = notebook_lesson(json.loads(path.read_text(encoding="utf-8"))["metadata"])
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
        if recorded is not None and (lesson := current_lesson(*recorded)) is not None:
            return lesson
    return lesson_of_name(path.name)


def format_report(report: GradeReport) -> str:
    """The table of tasks and points, then the feedback of every task that lost points."""
    width = max([len(r.task_id) for r in report.results] + [4])
    lines = [f"grading {report.source} (lesson {report.lesson})", ""]
    lines.append(f"{'task':<{width}}  {'points':>7}  result")
    for result in report.results:
        mark = MARK.get(result.status, "\N{BALLOT X}")
        points = f"{result.points:>3} / {result.max_points:<2}"
        through = f", through {', '.join(result.blocked_by)}" if result.blocked_by else ""
        lines.append(f"{result.task_id:<{width}}  {points} {mark} {STATUS_TEXT[result.status]}{through}")
    lines.append(f"{'total':<{width}}  {report.score:>3} / {report.max_score:<2}")
    for result in report.results:
        if not result.passed:
            lines += ["", f"{result.task_id} · {result.title}: {STATUS_TEXT[result.status]}", result.message]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m paged_kv.grade", description="Grade an exercise notebook, a .py file or the package."
    )
    parser.add_argument("source", help="an exercise notebook, a solution notebook, a .py file, or 'package'")
    parser.add_argument(
        "--lesson",
        help="the lesson to grade (default: the notebook's metadata, else the two digits the file name "
        "starts with)",
    )
    parser.add_argument("--json", action="store_true", help="print the grade as JSON, for tools")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"seconds per task ({DEFAULT_TIME_LIMIT_S:g})",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=DEFAULT_MEMORY_LIMIT_BYTES / 2**30,
        help=f"GiB of memory the graded code may use ({DEFAULT_MEMORY_LIMIT_BYTES / 2**30:g}; 0: no limit)",
    )
    args = parser.parse_args(argv)
    lesson = args.lesson or (None if args.source == PACKAGE else lesson_of(args.source))
    if lesson is None:
        parser.error(
            f"cannot tell the lesson from {args.source!r}: no lesson in its metadata and no NN_ at the "
            f"start of its name; pass --lesson, one of {', '.join(lessons())}"
        )
    if not re.fullmatch(r"\d\d", lesson) or lesson not in lessons():
        parser.error(f"--lesson must be one of {', '.join(lessons())}, got {lesson!r}")
    if not args.time_limit > 0:
        parser.error(f"--time-limit must be positive, got {args.time_limit:g}")
    if args.memory_limit < 0:
        parser.error(f"--memory-limit must be 0 (no limit) or positive, got {args.memory_limit:g}")
    memory_limit = int(args.memory_limit * 2**30) or None
    report = grade(args.source, lesson, args.time_limit, memory_limit)
    if report.error:
        parser.exit(USAGE_ERROR, f"{parser.prog}: error: {report.error}\n")
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

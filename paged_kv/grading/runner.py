"""Grade an implementation of one lesson, task by task, with a time and a memory limit per task.

:func:`grade` starts a worker process (:mod:`paged_kv.grading.worker`) and reads its results one
task at a time. When a task runs past its time limit the worker is killed, that task is reported as
timed out, and a fresh worker grades the remaining tasks; a worker that dies is reported the same
way. The worker's memory is capped (``memory_limit``), so a runaway allocation in learner code
fails its task with a ``MemoryError`` instead of taking the machine's memory. The grader itself
never runs learner code, so it never crashes with a traceback of its own.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field

from paged_kv.checks import TASKS

DEFAULT_TIME_LIMIT_S = 30.0
LOAD_TIME_LIMIT_S = 120.0  # importing torch and the learner's code, once per worker
# The worker's data memory (heap and private mappings, RLIMIT_DATA on Linux): the course's tasks
# need a few hundred MiB with torch loaded; a learner's runaway list or tensor stops here.
DEFAULT_MEMORY_LIMIT_BYTES = 4 << 30

STATUS_TEXT = {
    "passed": "passed",
    "failed": "wrong answer",
    "not_implemented": "not implemented yet",
    "missing": "missing",
    "timeout": "timed out",
    "crashed": "crashed",
}


@dataclass(frozen=True)
class TaskResult:
    """The grade of one task. ``status`` is a key of ``STATUS_TEXT``; ``message`` says why.

    ``blocked_by`` names the earlier tasks whose failing code this task's code used: fixing those
    first may be all this task needs.
    """

    task_id: str
    title: str
    status: str
    points: int
    max_points: int
    message: str
    blocked_by: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass(frozen=True)
class GradeReport:
    """Every task of a lesson, graded on one implementation."""

    source: str
    lesson: str
    results: list[TaskResult] = field(default_factory=list)
    error: str = ""  # set when the implementation could not be read at all

    @property
    def score(self) -> int:
        return sum(result.points for result in self.results)

    @property
    def max_score(self) -> int:
        return sum(result.max_points for result in self.results)

    @property
    def passed(self) -> bool:
        return not self.error and all(result.passed for result in self.results)

    def result(self, task_id: str) -> TaskResult:
        return next(result for result in self.results if result.task_id == task_id)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "score": self.score, "max_score": self.max_score, "passed": self.passed}


def lessons() -> list[str]:
    """The lessons that have graded tasks."""
    return sorted({task.lesson for task in TASKS.values()})


def tasks_of(lesson: str) -> list[str]:
    """The task ids of a lesson, in the order the exercise asks them."""
    return [task_id for task_id, task in TASKS.items() if task.lesson == lesson]


def grade(
    source: str,
    lesson: str,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
    memory_limit: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
) -> GradeReport:
    """Grade every task of ``lesson`` on ``source`` (``"package"``, a notebook or a ``.py`` file).

    Each task may run ``time_limit`` seconds; the worker may use ``memory_limit`` bytes of data
    memory (``None``: no limit; where the platform has no such limit, none is set).
    """
    remaining = tasks_of(lesson)
    if not remaining:
        return GradeReport(
            source, lesson, error=f"lesson {lesson} has no graded tasks; try {', '.join(lessons())}"
        )
    outcomes: dict[str, dict] = {}
    while remaining:
        worker = _Worker(lesson, source, remaining, memory_limit)
        first = worker.next_line(LOAD_TIME_LIMIT_S)
        if first is None or "load_error" in first:
            worker.stop()
            if first is not None:
                return GradeReport(source, lesson, error=first["load_error"])
            for task_id in remaining:
                outcomes[task_id] = {
                    "status": "timeout",
                    "message": worker.failure("loading the code", LOAD_TIME_LIMIT_S),
                }
            break
        while remaining:
            task_id = remaining[0]
            line = worker.next_line(time_limit)
            if line is None:
                outcomes[task_id] = {
                    "status": worker.status(),
                    "message": worker.failure(task_id, time_limit),
                }
                remaining.pop(0)
                break
            outcomes[line["task_id"]] = line
            remaining.remove(line["task_id"])
        worker.stop()
    results = []
    for task_id in tasks_of(lesson):
        task, outcome = TASKS[task_id], outcomes[task_id]
        points = task.points if outcome["status"] == "passed" else 0
        blocked_by = tuple(outcome.get("blocked_by", ()))
        results.append(
            TaskResult(
                task_id, task.title, outcome["status"], points, task.points, outcome["message"], blocked_by
            )
        )
    return GradeReport(source, lesson, results)


class _Worker:
    """A worker process and a thread that hands its output lines over through a queue."""

    def __init__(self, lesson: str, source: str, task_ids: list[str], memory_limit: int | None) -> None:
        environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
        limit = [] if memory_limit is None else [f"--memory-limit={memory_limit}"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "paged_kv.grading.worker", *limit, lesson, source, *task_ids],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=environment,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self.timed_out = False
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _drain_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr = [*self.stderr[-20:], line]

    def next_line(self, timeout: float) -> dict | None:
        """The next JSON line, or ``None`` when the worker hung past ``timeout`` or died."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.timed_out = True
            return None
        if line is None:
            return None
        try:
            return json.loads(line)
        except ValueError:  # something wrote to the real stdout: skip it
            return self.next_line(timeout)

    def status(self) -> str:
        return "timeout" if self.timed_out else "crashed"

    def failure(self, what: str, limit: float) -> str:
        if self.timed_out:
            return f"{what} did not finish within {limit:g} s: look for a loop that never ends"
        self.stop()
        tail = [line.strip() for line in self.stderr[-3:] if line.strip()]
        return f"the process running your code died while grading {what}" + (
            f": {' '.join(tail)}" if tail else ""
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

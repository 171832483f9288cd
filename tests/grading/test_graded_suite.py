"""The graded suite: every task of every lesson, on one implementation, through the grader's seam.

By default it grades the finished package. Point it at any implementation with ``--impl``:

    pytest tests/grading/test_graded_suite.py --impl exercises/02_the_allocator.ipynb
    pytest tests/grading/test_graded_suite.py --impl my_code.py -m lesson03
    pytest tests/grading/test_graded_suite.py -m task_02_block_allocator

Each lesson is graded once (every task, in a worker process with a time limit) and each task is a
test, marked ``lessonNN`` and ``task_NN_name``.
"""

from __future__ import annotations

import pytest

from paged_kv.checks import TASKS
from paged_kv.grade import lesson_of
from paged_kv.grading import PACKAGE, grade
from paged_kv.grading.runner import STATUS_TEXT

from ..conftest import task_marker
from ..helpers import lesson_marks


def graded_tasks():
    for task_id, task in TASKS.items():
        marks = [getattr(pytest.mark, f"lesson{task.lesson}"), getattr(pytest.mark, task_marker(task_id))]
        marks += lesson_marks(task.lesson)
        yield pytest.param(task_id, id=task_id, marks=marks)


@pytest.fixture(scope="session")
def graded(request: pytest.FixtureRequest):
    implementation = request.config.getoption("--impl")
    reports = {}

    def report_of(lesson: str):
        if implementation != PACKAGE and lesson_of(implementation) not in (None, lesson):
            pytest.skip(f"{implementation} is lesson {lesson_of(implementation)}'s, not lesson {lesson}'s")
        if lesson not in reports:
            reports[lesson] = grade(implementation, lesson)
        return reports[lesson]

    return report_of


@pytest.mark.parametrize("task_id", list(graded_tasks()))
def test_task(graded, task_id):
    report = graded(TASKS[task_id].lesson)
    assert not report.error, report.error
    result = report.result(task_id)
    if not result.passed:
        pytest.fail(f"{task_id}: {STATUS_TEXT[result.status]}\n{result.message}", pytrace=False)

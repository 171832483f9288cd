"""The pytest markers: one per lesson of the course map, registered by tests/conftest.py, and no other
name allowed (``--strict-markers``), so ``pytest -m lessonNN`` works for every lesson, new ones too."""

from __future__ import annotations

import pytest

from paged_kv.checks import TASKS
from paged_kv.course_map import LESSONS

from .conftest import task_marker

pytestmark = pytest.mark.setup


def registered(config: pytest.Config) -> set[str]:
    return {line.split(":", 1)[0].strip() for line in config.getini("markers")}


def test_every_lesson_of_the_course_map_and_every_graded_task_has_a_marker(pytestconfig):
    names = registered(pytestconfig)
    missing = [f"lesson{lesson.number}" for lesson in LESSONS if f"lesson{lesson.number}" not in names]
    assert not missing, f"markers not registered: {missing}"
    assert not [task for task in TASKS if task_marker(task) not in names]
    assert {"setup", "browser"} <= names


def test_strict_markers_are_on_so_a_marker_of_no_lesson_is_an_error(pytestconfig):
    assert "--strict-markers" in pytestconfig.getini("addopts")
    assert pytestconfig.getoption("strict_markers")
    assert f"lesson{int(LESSONS[-1].number) + 1:02d}" not in registered(pytestconfig)

"""The course notebooks: generated from their sources, well formed, and exercises that stop at task 1."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from paged_kv.checks import TASKS
from paged_kv.course_map import COURSE_MAP
from tools import build_course, reading_time
from tools.build_course import SourceError, exercise_and_solution, parse_percent, split_solutions

from .helpers import by_lesson

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
STUB = "raise NotImplementedError("
CHECK_CALL = re.compile(r"""^check\("(?P<task>\d\d\.\w+)\"""", re.MULTILINE)


def test_the_course_has_its_notebooks():
    stems = sorted(p.stem for p in LESSONS)
    assert stems, "no lesson notebooks"
    for folder in ("exercises", "solutions"):
        assert sorted(p.stem for p in (ROOT / folder).glob("*.ipynb")) == stems, folder


@pytest.mark.parametrize("path", LESSONS + EXERCISES + SOLUTIONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_notebook_carries_its_lesson_and_the_courses_map_in_its_metadata(path):
    # paged_kv.grade reads it, so that a renamed copy of the notebook still grades as its lesson, and
    # make lab tells a notebook of this map from one made before the renumbering
    expected = {"lesson": path.name[:2], "course_map": COURSE_MAP}
    assert nbformat.read(path, as_version=4).metadata["paged_kv"] == expected


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_is_one_sitting_to_read(path):
    reading = reading_time.reading(nbformat.read(path, as_version=4))
    assert reading.minutes < reading_time.LIMIT_MINUTES, (reading.words, reading.code_lines)


def test_the_lesson_plan_gives_each_lessons_reading_as_the_notebooks_have_it():
    plan = (ROOT / "lessons" / "README.md").read_text()
    for stem, reading in reading_time.lesson_readings().items():
        row = next((line for line in plan.splitlines() if line.startswith(f"| {stem[:2]} |")), None)
        assert row is not None, f"lessons/README.md has no row for lesson {stem[:2]}"
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert f"{reading.words:,}" in cells and str(reading.code_lines) in cells, (stem, cells)
        assert f"{reading.minutes:.1f}" in cells, (stem, reading.minutes, cells)


def test_committed_notebooks_match_their_sources():
    problems = build_course.check()
    assert not problems, "\n".join(problems) + "\nregenerate with: make course"


def stub_cells(notebook) -> list[int]:
    return [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code" and STUB in cell.source]


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_every_task_is_followed_by_its_check(path):
    notebook = nbformat.read(path, as_version=4)
    stubs = stub_cells(notebook)
    assert stubs, "an exercise without a task"
    for this, following in zip(stubs, [*stubs[1:], len(notebook.cells)], strict=True):
        between = "\n".join(c.source for c in notebook.cells[this:following] if c.cell_type == "code")
        tasks = CHECK_CALL.findall(between)
        assert tasks, f"{path.name}: the task in cell {this} has no check(...) cell after it"
        assert all(task in TASKS for task in tasks), f"{path.name}: unknown task in {tasks}"


def test_every_registered_task_is_used_by_an_exercise():
    notebooks = [nbformat.read(path, as_version=4) for path in EXERCISES]
    sources = [cell.source for notebook in notebooks for cell in notebook.cells if cell.cell_type == "code"]
    used = {task for source in sources for task in CHECK_CALL.findall(source)}
    assert set(TASKS) <= used, f"tasks no exercise checks: {sorted(set(TASKS) - used)}"


@pytest.mark.parametrize("path", by_lesson(EXERCISES), ids=lambda p: p.stem)
def test_an_untouched_exercise_stops_at_its_first_task(path):
    notebook = nbformat.read(path, as_version=4)
    stubs = stub_cells(notebook)
    with pytest.raises(CellExecutionError) as caught:
        build_course.execute(notebook, path.parent)
    assert caught.value.ename == "NotImplementedError", caught.value
    failed = [
        i for i, c in enumerate(notebook.cells) if any(o.output_type == "error" for o in c.get("outputs", []))
    ]
    assert len(failed) == 1
    second_task = stubs[1] if len(stubs) > 1 else len(notebook.cells)
    assert stubs[0] <= failed[0] < second_task, "the exercise ran past its first task"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_states_outcomes_asks_predictions_and_ends_with_a_recap(path):
    notebook = nbformat.read(path, as_version=4)
    markdown = [c.source for c in notebook.cells if c.cell_type == "markdown"]
    assert markdown[0].startswith("# Lesson "), "a lesson opens with its title"
    assert "By the end of this lesson you can" in markdown[0]
    assert any("Predict, then run" in text for text in markdown)
    assert any(text.startswith("## Recap") for text in markdown[-2:])
    assert any(
        o.output_type == "display_data" and "image/png" in o.data
        for c in notebook.cells
        for o in c.get("outputs", [])
    ), "a lesson shows at least one picture"


# ------------------------------------------------------------------------------ the generator


def test_parse_percent_splits_cells_and_strips_markdown_prefixes():
    cells = parse_percent(
        '# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n\n# %% tags=["a"]\ny = 2\n', "t.py"
    )
    assert [(c.kind, c.source, c.tags) for c in cells] == [
        ("markdown", "# Title\n\ntext", []),
        ("code", "x = 1", []),
        ("code", "y = 2", ["a"]),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x = 1\n# %%\ny = 2\n", "before the first"),
        ("# %% [markdown]\nnot a comment\n", "must start with '# '"),
        ("# %%\n\n# %%\nx = 1\n", "empty cell"),
    ],
)
def test_parse_percent_names_the_line_of_a_malformed_source(text, message):
    with pytest.raises(SourceError, match=message):
        parse_percent(text, "t.py")


def test_a_solution_region_becomes_a_stub_with_its_hint():
    source = "def f(x):\n    ### BEGIN SOLUTION: double it\n    return 2 * x\n    ### END SOLUTION\n"
    (cell,) = parse_percent("# %%\n" + source, "t.py")
    exercise, solution = split_solutions(cell, "t.py")
    assert exercise == ["def f(x):", "    # YOUR CODE HERE", '    raise NotImplementedError("double it")']
    assert solution == ["def f(x):", "    return 2 * x"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "needs a hint"),
        ("### BEGIN SOLUTION: a\nx = 1", "never closed"),
        ("x = 1\n### END SOLUTION", "without BEGIN"),
        ("### BEGIN SOLUTION: a\n### BEGIN SOLUTION: b\n### END SOLUTION", "inside a solution region"),
    ],
)
def test_malformed_solution_regions_are_refused(body, message):
    (cell,) = parse_percent("# %%\n" + body + "\n", "t.py")
    with pytest.raises(SourceError, match=message):
        split_solutions(cell, "t.py")


def test_exercise_and_solution_carry_the_lesson_of_their_source(tmp_path):
    source = tmp_path / "07_anything.exercise.py"
    source.write_text(
        "# %%\ndef f():\n    ### BEGIN SOLUTION: return 1\n    return 1\n    ### END SOLUTION\n"
    )
    for notebook in exercise_and_solution(source):
        assert notebook.metadata["paged_kv"] == {"lesson": "07", "course_map": COURSE_MAP}


def test_an_exercise_source_not_named_after_its_lesson_is_refused(tmp_path):
    source = tmp_path / "anything.exercise.py"
    source.write_text(
        "# %%\ndef f():\n    ### BEGIN SOLUTION: return 1\n    return 1\n    ### END SOLUTION\n"
    )
    with pytest.raises(SourceError, match="starts with its lesson"):
        exercise_and_solution(source)


def test_an_exercise_source_without_a_task_is_refused(tmp_path):
    source = tmp_path / "99_nothing.exercise.py"
    source.write_text("# %%\nx = 1\n")
    with pytest.raises(SourceError, match="at least one"):
        exercise_and_solution(source)

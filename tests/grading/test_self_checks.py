"""The grader grades itself: solutions score full marks, untouched exercises zero, wrong code the right zero.

The package's own full marks are the graded suite's default run (test_graded_suite.py).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

try:
    import resource
except ImportError:  # Windows
    resource = None

from paged_kv.checks import TASKS
from paged_kv.grade import lesson_of
from paged_kv.grade import main as grade_command
from paged_kv.grading import grade, tasks_of
from paged_kv.grading.loader import load
from paged_kv.grading.worker import run_task

from ..helpers import by_lesson

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
WRONG = sorted((Path(__file__).parent / "wrong").glob("lesson*.py"))


@pytest.mark.parametrize("path", by_lesson(SOLUTIONS), ids=lambda p: p.stem)
def test_every_solution_scores_full_marks(path):
    report = grade(str(path), lesson_of(path.name))
    assert report.passed, [(r.task_id, r.status, r.message) for r in report.results if not r.passed]
    assert report.score == report.max_score > 0


@pytest.mark.parametrize("path", by_lesson(EXERCISES), ids=lambda p: p.stem)
def test_every_untouched_exercise_scores_zero_with_not_implemented_on_each_task(path):
    report = grade(str(path), lesson_of(path.name))
    assert report.score == 0
    for result in report.results:
        assert result.status == "not_implemented", (result.task_id, result.status, result.message)
        assert "not implemented yet" in result.message


def constants_of(path: Path) -> dict[str, object]:
    """A wrong file's constants: ``BREAKS``, ``MESSAGE``, and ``INTERPRETED_ONLY`` where its mistake
    shows only in Triton's interpreter (lesson 12's check sees a kernel's loads there only)."""
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }


def wrong_implementation(path: Path) -> tuple[str, str, str]:
    """The lesson, the task a wrong file must break and the text its feedback must contain."""
    constants = constants_of(path)
    return path.name[len("lesson") : len("lesson") + 2], constants["BREAKS"], constants["MESSAGE"]


def test_every_lesson_has_wrong_implementations():
    lessons = {wrong_implementation(path)[0] for path in WRONG}
    assert lessons == {path.name[:2] for path in EXERCISES}


@pytest.mark.parametrize(
    "path", by_lesson(WRONG, lambda path: wrong_implementation(path)[0]), ids=lambda p: p.stem
)
def test_a_wrong_implementation_loses_points_on_its_task_with_the_named_mistake(path):
    # The grader's own loader and task runner, in this process: the worker processes around them
    # are tested above and below, and a process per file would make this the slowest test here.
    lesson, breaks, message = wrong_implementation(path)
    if constants_of(path).get("INTERPRETED_ONLY"):
        from paged_kv.checks.lesson12 import loads_seen
        from paged_kv.device import default_device

        if not loads_seen(default_device()):
            pytest.skip(
                "its mistake shows only in the loads Triton's interpreter records on the CPU; here Triton "
                "compiles (CUDA), and the check skips that expectation"
            )
    assert breaks in tasks_of(lesson)
    implementation = load(str(path), lesson)
    for task_id in tasks_of(lesson):
        outcome = run_task(implementation, task_id)
        if task_id == breaks:
            assert outcome["status"] == "failed", outcome
            assert message in outcome["message"], outcome["message"]
        else:
            assert outcome["status"] == "passed", (task_id, outcome)


# ------------------------------------------------------------------- robust against learner code

REFERENCE = "from paged_kv.reference.lesson00 import paged_usage, contiguous_usage\n"


def write_notebook(path: Path, *cells: str) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nbformat.write(notebook, path)
    return path


def statuses(report) -> dict[str, str]:
    return {result.task_id: result.status for result in report.results}


def test_code_that_raises_fails_its_task_only(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(REFERENCE + "def blocks_for_tokens(n, b):\n    return n // 0\n")
    report = grade(str(source), "00")
    assert statuses(report) == {
        "00.blocks_for_tokens": "failed",
        "00.paged_usage": "passed",
        "00.contiguous_usage": "passed",
    }
    message = report.result("00.blocks_for_tokens").message.splitlines()
    assert "  got:      ZeroDivisionError: integer division or modulo by zero" in message
    assert "  where:    mine.py, line 3, in blocks_for_tokens" in message
    assert (
        message[message.index("  where:    mine.py, line 3, in blocks_for_tokens") + 1].strip()
        == "return n // 0"
    )


def test_code_that_never_returns_times_out_and_the_other_tasks_are_still_graded(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(
        "from paged_kv.reference.lesson00 import blocks_for_tokens, contiguous_usage\n"
        "def paged_usage(request_tokens, block_size):\n    while True:\n        pass\n"
    )
    report = grade(str(source), "00", time_limit=3)
    assert statuses(report) == {
        "00.blocks_for_tokens": "passed",
        "00.paged_usage": "timeout",
        "00.contiguous_usage": "passed",
    }
    assert "did not finish within 3 s" in report.result("00.paged_usage").message


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_DATA"), reason="no RLIMIT_DATA on this platform")
@pytest.mark.parametrize(
    "runaway",
    [
        "    grown = []\n    while True:\n        grown.append(bytearray(1 << 24))\n",  # a list without end
        "    import torch\n    return torch.empty(1 << 34).numel()\n",  # 64 GiB of float32
    ],
    ids=["growing-list", "huge-tensor"],
)
def test_code_that_runs_out_of_memory_fails_its_task_only(tmp_path, runaway):
    source = tmp_path / "mine.py"
    source.write_text(REFERENCE + "def blocks_for_tokens(n, b):\n" + runaway)
    report = grade(str(source), "00", memory_limit=2 << 30)
    assert statuses(report) == {
        "00.blocks_for_tokens": "failed",
        "00.paged_usage": "passed",
        "00.contiguous_usage": "passed",
    }
    message = report.result("00.blocks_for_tokens").message
    assert "where:    mine.py, line" in message
    assert "your code ran out of memory (the grader caps each task's memory)" in message


def test_the_worker_caps_its_own_data_memory_and_never_raises_a_lower_hard_limit():
    script = (
        "import resource\n"
        "from paged_kv.grading.worker import limit_memory\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))\n"
        "print(limit_memory(8 << 30), resource.getrlimit(resource.RLIMIT_DATA))\n"
        "print(limit_memory(1 << 30), resource.getrlimit(resource.RLIMIT_DATA))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[:2] == [
        f"True ({3 << 30}, {3 << 30})",
        f"True ({1 << 30}, {3 << 30})",
    ]


def test_a_process_that_dies_is_reported_and_the_other_tasks_are_still_graded(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(REFERENCE + "import os\ndef blocks_for_tokens(n, b):\n    os._exit(3)\n")
    report = grade(str(source), "00")
    assert statuses(report)["00.blocks_for_tokens"] == "crashed"
    assert "died" in report.result("00.blocks_for_tokens").message
    assert report.result("00.paged_usage").passed and report.result("00.contiguous_usage").passed


def test_a_syntax_error_costs_only_the_names_of_its_cell(tmp_path):
    notebook = write_notebook(
        tmp_path / "00_mine.ipynb", REFERENCE, "def blocks_for_tokens(n, b):\n    return (n +\n"
    )
    report = grade(str(notebook), "00")
    assert statuses(report) == {
        "00.blocks_for_tokens": "missing",
        "00.paged_usage": "passed",
        "00.contiguous_usage": "passed",
    }
    assert "cell 2 has a syntax error" in report.result("00.blocks_for_tokens").message


def test_an_exception_in_a_notebook_cell_shows_the_cell_its_line_and_its_source(tmp_path):
    notebook = write_notebook(
        tmp_path / "00_mine.ipynb",
        REFERENCE,
        "%matplotlib inline\n"
        "def blocks_for_tokens(n, b):\n    blocks = [0] * (n // b)\n    return blocks[n]\n",
    )
    message = grade(str(notebook), "00").result("00.blocks_for_tokens").message.splitlines()
    assert "  where:    cell 2, line 4, in blocks_for_tokens" in message
    assert "                return blocks[n]" in message


LATE_RULE_AND_ITS_DECODE_STEP = """\
from paged_kv.reference.lesson04 import BlockManager, finish_and_admit


def needs_new_block(num_tokens, num_blocks_held, block_size):
    return num_tokens > num_blocks_held * block_size


def decode_step(cache, seq_ids):
    taken = {}
    for seq_id in seq_ids:
        tokens, blocks = cache.sequence_length(seq_id), len(cache.get_block_mapping(seq_id))
        needed = needs_new_block(tokens, blocks, cache.block_size)
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needed else None
        cache.append_tokens(seq_id, 1)
    return taken
"""


def test_a_task_that_fails_through_an_earlier_task_is_graded_as_such(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(LATE_RULE_AND_ITS_DECODE_STEP)
    result = run_grade(str(source), "--lesson", "04")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert "04.needs_new_block     0 / 10 \N{BALLOT X} wrong answer" in lines
    assert "04.decode_step         0 / 10 \N{BALLOT X} wrong answer, through 04.needs_new_block" in lines
    assert (
        "  first:    this uses your `needs_new_block`, which failed above (04.needs_new_block): "
        "fix that task first"
    ) in lines
    assert (
        "  hint:     your rule takes the block one token late: num_tokens > num_blocks_held * block_size"
        in (result.stdout)
    )
    report = json.loads(run_grade(str(source), "--lesson", "04", "--json").stdout)
    blocked = {task["task_id"]: task["blocked_by"] for task in report["results"]}
    assert blocked == {
        "04.needs_new_block": [],
        "04.append_block": [],
        "04.decode_step": ["04.needs_new_block"],
        "04.finish_and_admit": [],
    }


def test_an_exception_while_defining_a_name_shows_the_learners_line(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(REFERENCE + "class blocks_for_tokens:\n    SIZE = 1 // 0\n")
    message = grade(str(source), "00").result("00.blocks_for_tokens").message.splitlines()
    assert message[0] == (
        "defining blocks_for_tokens in mine.py raised ZeroDivisionError: integer division or modulo by zero"
    )
    assert message[-2:] == [
        "            mine.py, line 3, in blocks_for_tokens",
        "                SIZE = 1 // 0",
    ]


def test_a_missing_name_is_named(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text("from paged_kv.reference.lesson00 import blocks_for_tokens, paged_usage\n")
    report = grade(str(source), "00")
    assert statuses(report)["00.contiguous_usage"] == "missing"
    assert "contiguous_usage is not defined" in report.result("00.contiguous_usage").message


def test_demo_cells_magics_and_prints_are_not_run(tmp_path):
    notebook = write_notebook(
        tmp_path / "00_mine.ipynb",
        "%matplotlib inline\n!echo hello\n" + REFERENCE,
        "from paged_kv import blocks_for_tokens\nprint('defining')",
        "raise SystemExit('a demo cell that must not run')",
        "blocks_for_tokens(1, 0)",
    )
    assert grade(str(notebook), "00").passed


def test_an_unreadable_source_is_an_error_not_a_crash(tmp_path):
    assert "is not a file" in grade(str(tmp_path / "nothing.ipynb"), "00").error
    (tmp_path / "broken.ipynb").write_text("{not json")
    assert "not a valid notebook" in grade(str(tmp_path / "broken.ipynb"), "00").error
    assert "no graded tasks" in grade("package", "42").error


# ---------------------------------------------------------------------------- the command line


def run_grade_command(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m paged_kv.grade ARGS`` run from the repository root, as a learner runs it."""
    command = [sys.executable, "-m", "paged_kv.grade", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)


def run_grade(*args: str) -> subprocess.CompletedProcess[str]:
    """The same command in this process: the module's ``main``, whose return value its ``__main__``
    block exits with (the two tests just below run the real command, and see that exit status).
    The grading worker is a process either way; this saves starting the command's own, torch and
    all, for each of the tests of its output."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            returncode = grade_command(list(args))
        except SystemExit as stop:  # argparse's usage errors
            returncode = 0 if stop.code is None else stop.code
    return subprocess.CompletedProcess(
        ["python", "-m", "paged_kv.grade", *args], returncode, stdout.getvalue(), stderr.getvalue()
    )


def test_the_command_prints_a_table_and_exits_1_until_every_task_passes():
    result = run_grade_command("exercises/00_why_paging.ipynb")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "grading exercises/00_why_paging.ipynb (lesson 00)"
    assert "00.blocks_for_tokens    0 / 10 \N{BALLOT X} not implemented yet" in lines
    assert "total                   0 / 30" in lines


def test_the_command_exits_0_on_full_marks_and_speaks_json():
    result = run_grade_command("solutions/01_block_and_block_table.ipynb", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert (report["lesson"], report["score"], report["max_score"], report["passed"]) == ("01", 30, 30, True)
    assert [task["status"] for task in report["results"]] == ["passed"] * 3


def test_the_command_takes_the_lesson_from_an_option(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text("from paged_kv.reference.lesson00 import *\n")
    assert run_grade(str(source), "--lesson", "00").returncode == 0


def copy_of(notebook: str, path: Path) -> Path:
    path.write_bytes((ROOT / notebook).read_bytes())
    return path


def test_a_renamed_copy_of_an_exercise_grades_as_its_lesson(tmp_path):
    copy = copy_of("exercises/02_the_allocator.ipynb", tmp_path / "mine.ipynb")
    result = run_grade(str(copy))
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines()[0] == f"grading {copy} (lesson 02)"
    total = next(line for line in result.stdout.splitlines() if line.startswith("total"))
    assert total.split() == ["total", "0", "/", "30"]


def test_a_renamed_copy_of_a_solution_scores_full_marks(tmp_path):
    copy = copy_of("solutions/04_decode_allocation.ipynb", tmp_path / "03_not_what_it_says.ipynb")
    assert lesson_of(str(copy)) == "04", "the metadata wins over the file name"
    report = json.loads(run_grade(str(copy), "--json").stdout)
    assert (report["lesson"], report["score"], report["max_score"]) == ("04", 40, 40)


def test_the_lesson_option_wins_over_the_metadata(tmp_path):
    copy = copy_of("solutions/02_the_allocator.ipynb", tmp_path / "mine.ipynb")
    result = run_grade(str(copy), "--lesson", "00")
    assert result.stdout.splitlines()[0] == f"grading {copy} (lesson 00)"
    assert "00.paged_usage          0 / 10 \N{BALLOT X} missing" in result.stdout.splitlines()


def test_a_notebook_without_a_lesson_in_its_metadata_or_its_name_is_refused(tmp_path):
    notebook = write_notebook(tmp_path / "mine.ipynb", REFERENCE)
    assert lesson_of(str(notebook)) is None
    result = run_grade(str(notebook))
    assert result.returncode == 2
    assert "cannot tell the lesson from" in result.stderr and "pass --lesson" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_readme_states_the_graders_totals():
    tasks = [task for task in TASKS.values()]
    stated = re.search(r"\((\d+) tasks, (\d+) points in all\)", (ROOT / "README.md").read_text())
    assert stated, "the README says how many tasks and points the exercises have"
    assert (int(stated[1]), int(stated[2])) == (len(tasks), sum(task.points for task in tasks))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["mine.py"], "cannot tell the lesson"),
        (["exercises/00_why_paging.ipynb", "--lesson", "42"], "--lesson must be one of"),
        (["no_such_file.ipynb", "--lesson", "00"], "is not a file"),
        (["package", "--lesson", "00", "--memory-limit", "-1"], "--memory-limit must be 0 (no limit)"),
    ],
)
def test_the_command_refuses_unusable_input_in_one_line(args, message):
    result = run_grade(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr

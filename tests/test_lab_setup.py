"""``make lab``'s set-up (tools/lab_setup.py): the learner's working copy and JupyterLab's settings."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from paged_kv.course_map import LESSONS
from tools import lab_setup

pytestmark = pytest.mark.setup

ROOT = Path(__file__).resolve().parent.parent


def course_files(root: Path) -> set[str]:
    return {
        str(path.relative_to(root))
        for folder in lab_setup.COURSE_FOLDERS
        for pattern in lab_setup.COPIED
        for path in (root / folder).glob(pattern)
    }


def small_course(root: Path) -> Path:
    """A clone-like folder with one lesson, one exercise and one solution."""
    for folder in lab_setup.COURSE_FOLDERS:
        (root / folder).mkdir(parents=True)
        (root / folder / "00_why_paging.ipynb").write_text(f'{{"committed": "{folder}"}}')
    return root


def test_the_working_copy_holds_every_lesson_exercise_and_solution_unchanged(tmp_path):
    copied = lab_setup.sync_working_copy(ROOT, tmp_path / "work")

    expected = course_files(ROOT)
    assert {str(path.relative_to(tmp_path / "work")) for path in copied} == expected
    assert (
        "lessons/04_decode_allocation.ipynb" in expected
        and "exercises/04_decode_allocation.ipynb" in expected
    )
    for name in expected:
        assert (tmp_path / "work" / name).read_bytes() == (ROOT / name).read_bytes(), name


def test_a_second_run_copies_nothing_and_keeps_the_learners_work(tmp_path):
    source, work = small_course(tmp_path / "clone"), tmp_path / "work"
    lab_setup.sync_working_copy(source, work)
    mine = work / "exercises" / "00_why_paging.ipynb"
    mine.write_text('{"the learner": "wrote this"}')

    assert lab_setup.sync_working_copy(source, work) == []
    assert mine.read_text() == '{"the learner": "wrote this"}'


def test_a_notebook_a_later_pull_brings_is_added_and_a_deleted_one_starts_over(tmp_path):
    source, work = small_course(tmp_path / "clone"), tmp_path / "work"
    lab_setup.sync_working_copy(source, work)
    (work / "lessons" / "00_why_paging.ipynb").unlink()  # start lesson 00 over
    (work / "exercises" / "00_why_paging.ipynb").write_text("mine")
    (source / "lessons" / "01_block_and_block_table.ipynb").write_text('{"new": "lesson"}')

    copied = lab_setup.sync_working_copy(source, work)

    assert sorted(path.relative_to(work).as_posix() for path in copied) == [
        "lessons/00_why_paging.ipynb",
        "lessons/01_block_and_block_table.ipynb",
    ]
    assert (work / "lessons" / "00_why_paging.ipynb").read_text() == '{"committed": "lessons"}'
    assert (work / "exercises" / "00_why_paging.ipynb").read_text() == "mine"


def test_checkpoints_and_other_folders_are_not_copied(tmp_path):
    source, work = small_course(tmp_path / "clone"), tmp_path / "work"
    (source / "lessons" / ".ipynb_checkpoints").mkdir()
    (source / "lessons" / ".ipynb_checkpoints" / "00_why_paging-checkpoint.ipynb").write_text("{}")
    (source / "course").mkdir()
    (source / "course" / "00_why_paging.lesson.py").write_text("# %%\n")

    lab_setup.sync_working_copy(source, work)

    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*") if p.is_file()) == sorted(
        f"{folder}/00_why_paging.ipynb" for folder in lab_setup.COURSE_FOLDERS
    )


@pytest.mark.parametrize("inside", [".", "lessons", "exercises/mine"])
def test_a_working_copy_inside_the_course_itself_is_refused(tmp_path, inside):
    source = small_course(tmp_path / "clone")
    with pytest.raises(ValueError, match=r"^work: .* would be the course itself"):
        lab_setup.sync_working_copy(source, source / inside)
    assert (source / "lessons" / "00_why_paging.ipynb").read_text() == '{"committed": "lessons"}'


def test_a_source_without_the_course_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^source: .* has none of the course folders"):
        lab_setup.sync_working_copy(tmp_path, tmp_path / "work")


def test_the_overrides_switch_off_the_news_and_the_update_check(tmp_path):
    path = lab_setup.write_lab_overrides(tmp_path / "settings")

    assert path == tmp_path / "settings" / "overrides.json"
    assert json.loads(path.read_text()) == {
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}
    }


def test_the_overrides_keep_what_was_there_and_rewrite_nothing_the_second_time(tmp_path):
    path = tmp_path / "overrides.json"
    before = {
        "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
        lab_setup.NOTIFICATION_PLUGIN: {"doNotDisturbMode": True, "fetchNews": "true"},
    }
    path.write_text(json.dumps(before))

    lab_setup.write_lab_overrides(tmp_path)
    merged = json.loads(path.read_text())
    path.write_text(json.dumps(merged))  # the same settings, unindented: a rewrite would indent them
    text = path.read_text()
    lab_setup.write_lab_overrides(tmp_path)

    assert merged["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert merged[lab_setup.NOTIFICATION_PLUGIN] == {
        "doNotDisturbMode": True,
        "fetchNews": "false",
        "checkForUpdates": False,
    }
    assert path.read_text() == text, "an up-to-date overrides.json was rewritten"


@pytest.mark.parametrize(
    ("content", "message"), [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list")]
)
def test_a_broken_overrides_file_is_reported_and_left_alone(tmp_path, content, message):
    path = tmp_path / "overrides.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"^settings_dir: .*{message}"):
        lab_setup.write_lab_overrides(tmp_path)
    assert path.read_text() == content


def test_the_settings_go_to_the_environments_jupyterlab(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTERLAB_DIR", str(tmp_path / "lab"))
    assert lab_setup.lab_settings_dir() == tmp_path / "lab" / "settings"


def test_the_command_reports_the_copy_and_the_settings(tmp_path, capsys):
    work, settings = tmp_path / "work", tmp_path / "settings"
    assert lab_setup.main(["--work", str(work), "--settings", str(settings)]) == 0
    first = capsys.readouterr().out
    assert lab_setup.main(["--work", str(work), "--settings", str(settings)]) == 0
    second = capsys.readouterr().out

    assert f"copied {len(course_files(ROOT))} course files into {work}" in first
    assert "up to date (nothing copied)" in second
    assert (settings / "overrides.json").is_file()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_sets_up_the_working_copy_and_opens_jupyterlab_there(tmp_path):
    plan = subprocess.run(
        ["make", "--no-print-directory", "-n", "lab", f"WORK={tmp_path / 'mine'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    setup = plan.index(f'tools/lab_setup.py --work "{tmp_path / "mine"}"')
    server = plan.index("jupyter lab")
    assert setup < server, "the working copy must be ready before JupyterLab starts"
    assert f'--ServerApp.root_dir="{tmp_path / "mine"}"' in plan
    assert "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate" in plan


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git clone")
def test_git_ignores_the_working_copy_and_the_site():
    ignored = subprocess.run(
        ["git", "check-ignore", "my_course/lessons/00_why_paging.ipynb", "site/index.html"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert ignored == ["my_course/lessons/00_why_paging.ipynb", "site/index.html"]


# ------------------------------------------------------------------ a copy made before the renumbering


def notebook(path: Path, metadata: dict | None, body: str = "") -> Path:
    """A minimal notebook file with ``metadata["paged_kv"]`` (none when ``metadata`` is None)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {} if metadata is None else {"paged_kv": metadata}
    path.write_text(
        json.dumps({"cells": [], "metadata": meta, "nbformat": 4, "nbformat_minor": 5, "b": body})
    )
    return path


def first_map_copy(work: Path) -> Path:
    """A working copy of the first map: lessons recorded nothing, exercises and solutions no map."""
    notebook(work / "lessons" / "06_concurrent_workload.ipynb", None)
    notebook(work / "lessons" / "05_paged_attention.ipynb", None)
    notebook(work / "exercises" / "06_concurrent_workload.ipynb", {"lesson": "06"}, "my work")
    notebook(work / "exercises" / "05_paged_attention.ipynb", {"lesson": "05"}, "my attention")
    notebook(work / "exercises" / "mine.ipynb", {"lesson": "08"}, "renamed by me")
    notebook(work / "solutions" / "10_writing_the_kernel.ipynb", {"lesson": "10"})
    (work / "lessons" / "README.md").write_text("the first map's plan")
    return work


def test_a_first_map_copy_is_brought_to_this_map_and_nothing_is_lost(tmp_path):
    work = first_map_copy(tmp_path / "work")
    before = {p.read_bytes() for p in work.rglob("*") if p.is_file()}

    moves = lab_setup.migrate_to_this_map(work)

    moved = {m.source.relative_to(work).as_posix(): m.target.relative_to(work).as_posix() for m in moves}
    assert moved == {
        "exercises/06_concurrent_workload.ipynb": "exercises/07_concurrent_workload.ipynb",  # the work
        "lessons/06_concurrent_workload.ipynb": "first_map/lessons/06_concurrent_workload.ipynb",
        "lessons/05_paged_attention.ipynb": "first_map/lessons/05_paged_attention.ipynb",
        "solutions/10_writing_the_kernel.ipynb": "first_map/solutions/10_writing_the_kernel.ipynb",
        "lessons/README.md": "first_map/lessons/README.md",
    }
    # the same bytes, under their new names: the learner's own names and same-named exercises stay
    assert {p.read_bytes() for p in work.rglob("*") if p.is_file()} == before
    assert (work / "exercises" / "mine.ipynb").exists()
    assert (work / "exercises" / "05_paged_attention.ipynb").exists()
    assert lab_setup.migrate_to_this_map(work) == []  # a second run moves nothing


def test_a_move_whose_target_exists_is_not_made(tmp_path):
    work = first_map_copy(tmp_path / "work")
    notebook(work / "exercises" / "07_concurrent_workload.ipynb", {"lesson": "07", "course_map": 2}, "new")

    moves = lab_setup.migrate_to_this_map(work)

    assert "exercises/06_concurrent_workload.ipynb" not in {
        m.source.relative_to(work).as_posix() for m in moves
    }
    assert json.loads((work / "exercises" / "07_concurrent_workload.ipynb").read_text())["b"] == "new"
    assert json.loads((work / "exercises" / "06_concurrent_workload.ipynb").read_text())["b"] == "my work"


def test_a_copy_of_this_map_moves_nothing(tmp_path):
    work = tmp_path / "work"
    lab_setup.sync_working_copy(ROOT, work)
    assert lab_setup.migrate_to_this_map(work) == []


def test_make_lab_says_what_moved_in_a_first_map_copy(tmp_path, capsys):
    work, settings = first_map_copy(tmp_path / "work"), tmp_path / "settings"
    assert lab_setup.main(["--work", str(work), "--settings", str(settings)]) == 0
    out = capsys.readouterr().out

    assert f"your copy predates the course's map of {len(LESSONS)} lessons" in out
    assert "exercises/06_concurrent_workload.ipynb -> exercises/07_concurrent_workload.ipynb" in out
    assert "lesson 05 was split" in out and "nothing was deleted" in out
    assert (work / "lessons" / "07_concurrent_workload.ipynb").read_bytes() == (
        ROOT / "lessons" / "07_concurrent_workload.ipynb"
    ).read_bytes()


def second_map_copy(work: Path) -> Path:
    """A working copy of map 2 (lessons 00-15): every notebook records its lesson and map 2."""
    notebook(work / "lessons" / "00_why_paging.ipynb", {"lesson": "00", "course_map": 2})
    notebook(work / "lessons" / "14_settings_and_metrics.ipynb", {"lesson": "14", "course_map": 2})
    notebook(work / "exercises" / "00_why_paging.ipynb", {"lesson": "00", "course_map": 2}, "my waste")
    notebook(
        work / "exercises" / "14_settings_and_metrics.ipynb", {"lesson": "14", "course_map": 2}, "my line"
    )
    notebook(work / "exercises" / "15_serving_it.ipynb", {"lesson": "15", "course_map": 2}, "my server")
    notebook(work / "solutions" / "15_serving_it.ipynb", {"lesson": "15", "course_map": 2})
    (work / "lessons" / "README.md").write_text("map 2's plan")
    return work


def test_a_second_map_copy_is_brought_to_this_map_and_its_exercises_keep_their_work(tmp_path, capsys):
    work, settings = second_map_copy(tmp_path / "work"), tmp_path / "settings"
    before = {p.read_bytes() for p in work.rglob("*") if p.is_file()}

    moves = lab_setup.migrate_to_this_map(work)

    moved = {m.source.relative_to(work).as_posix(): m.target.relative_to(work).as_posix() for m in moves}
    assert moved == {
        "exercises/14_settings_and_metrics.ipynb": "exercises/15_settings_and_metrics.ipynb",
        "exercises/15_serving_it.ipynb": "exercises/16_serving_it.ipynb",
        "lessons/00_why_paging.ipynb": "second_map/lessons/00_why_paging.ipynb",
        "lessons/14_settings_and_metrics.ipynb": "second_map/lessons/14_settings_and_metrics.ipynb",
        "solutions/15_serving_it.ipynb": "second_map/solutions/15_serving_it.ipynb",
        "lessons/README.md": "second_map/lessons/README.md",
    }
    assert {p.read_bytes() for p in work.rglob("*") if p.is_file()} == before
    assert json.loads((work / "exercises" / "00_why_paging.ipynb").read_text())["b"] == "my waste"
    assert lab_setup.migrate_to_this_map(work) == []

    work = second_map_copy(tmp_path / "fresh")
    assert lab_setup.main(["--work", str(work), "--settings", str(settings)]) == 0
    out = capsys.readouterr().out
    assert "(block_bytes, startup_line) and the old exercise 14's task 1 (common_block_size)" in out
    assert (work / "lessons" / "14_sizing_the_cache.ipynb").exists()

"""The course's map (paged_kv/course_map.py): the lessons in order and in parts, and the notebooks,
names and task ids of the two earlier maps still finding their lessons, so that a learner's work
from before either renumbering grades and checks as it did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_kv import course_map
from paged_kv.checks import TASKS, check
from paged_kv.course_map import (
    EARLIER_MAPS,
    FIRST_MAP,
    LESSONS,
    PARTS,
    current_lesson,
    current_task_id,
    lesson,
    lesson_of_name,
    notebook_lesson,
)
from paged_kv.grade import lesson_of
from paged_kv.grading import grade

ROOT = Path(__file__).resolve().parent.parent

# Every graded task of the first map, as its exercises' check cells named them (December 2026).
FIRST_MAP_TASKS = (
    "00.blocks_for_tokens",
    "00.paged_usage",
    "00.contiguous_usage",
    "01.block",
    "01.block_table",
    "01.physical_block",
    "02.block_allocator",
    "02.sequence_allocator",
    "02.kv_cache",
    "03.physical_location",
    "03.slot_mapping",
    "03.write_read_kv",
    "04.needs_new_block",
    "04.append_block",
    "04.decode_step",
    "04.finish_and_admit",
    "05.gather_kv",
    "05.decode_attention",
    "05.paged_decode_attention",
    "06.next_power_of_two",
    "06.reserved_tokens",
    "06.continuous_batcher",
    "07.fork",
    "07.copy_on_write",
    "07.prefix_lookup",
    "08.admit_with_watermark",
    "08.choose_victims",
    "08.swap_round_trip",
    "09.can_admit",
    "09.decode_slots",
    "09.paged_cache",
    "10.paged_decode_kernel",
)
# Every graded task of map 2 (lessons 00-15), as its exercises' check cells named them.
SECOND_MAP_TASKS = (
    *("00.blocks_for_tokens", "00.paged_usage", "00.contiguous_usage", "00.block_bytes", "00.startup_line"),
    *("01.block", "01.block_table", "01.physical_block", "02.block_allocator", "02.sequence_allocator"),
    *("02.kv_cache", "03.physical_location", "03.slot_mapping", "03.write_read_kv", "04.needs_new_block"),
    *("04.append_block", "04.decode_step", "04.finish_and_admit", "05.gather_kv", "05.decode_attention"),
    *("05.paged_decode_attention", "06.gqa_decode_attention", "06.chunk_attention", "06.packed_attention"),
    *("07.next_power_of_two", "07.reserved_tokens", "07.continuous_batcher", "08.fork", "08.copy_on_write"),
    *("08.prefix_lookup", "09.can_admit", "09.decode_slots", "09.paged_cache", "10.kv_bytes_per_token"),
    *("10.schedule_step", "10.first_token_steps", "11.admit_with_watermark", "11.choose_victims"),
    *("11.swap_round_trip", "12.paged_decode_kernel", "13.num_skipped_tokens", "13.remove_skipped_blocks"),
    *("13.hybrid_hit", "14.common_block_size", "14.log_line", "14.CachingMetrics", "15.child_requests"),
    *("15.abort", "15.stop_strings"),
)


def test_the_lessons_are_numbered_in_order_with_no_gap_and_each_has_its_notebooks():
    assert [lesson.number for lesson in LESSONS] == [f"{n:02d}" for n in range(len(LESSONS))]
    for folder in ("lessons", "exercises", "solutions"):
        assert sorted(p.stem for p in (ROOT / folder).glob("*.ipynb")) == [x.stem for x in LESSONS], folder
    sources = sorted({p.name.split(".")[0] for p in (ROOT / "course").glob("*.py")})
    assert sources == [x.stem for x in LESSONS]
    missing = f"{len(LESSONS):02d}"
    with pytest.raises(ValueError, match=rf"^number: no lesson '{missing}'"):
        lesson(missing)


def test_every_first_map_lesson_maps_to_lessons_of_this_map_and_keeps_its_tasks():
    for number, (stem, now) in FIRST_MAP.items():
        assert stem.startswith(number) and all(n in course_map.BY_NUMBER for n in now)
    assert len(FIRST_MAP_TASKS) == 32
    for old in FIRST_MAP_TASKS:
        new = current_task_id(old, TASKS)
        assert new in TASKS, old
        assert TASKS[new].lesson == current_lesson(old[:2], None), old
        assert new.split(".")[1] == old.split(".")[1]


def test_every_second_map_task_is_a_task_of_a_lesson_its_exercise_went_to():
    assert len(SECOND_MAP_TASKS) == len(set(SECOND_MAP_TASKS)) == 49
    for old in SECOND_MAP_TASKS:
        new = current_task_id(old, TASKS)
        assert new in TASKS, old
        assert new.split(".")[1] == old.split(".")[1]
        assert TASKS[new].lesson in EARLIER_MAPS[2][old[:2]][1], old
    assert current_task_id("00.startup_line", TASKS) == "14.startup_line"
    assert current_task_id("14.log_line", TASKS) == "15.log_line"
    assert current_task_id("14.common_block_size", TASKS) == "14.common_block_size"
    assert current_task_id("15.abort", TASKS) == "16.abort"


def test_the_parts_cover_the_lessons_in_order_each_once():
    assert [number for part in PARTS for number in part.lessons] == [x.number for x in LESSONS]
    assert all(part.lessons or part.coming for part in PARTS)


def test_an_id_of_this_map_and_an_unknown_id_are_left_as_they_are():
    assert current_task_id("07.reserved_tokens", TASKS) == "07.reserved_tokens"
    assert current_task_id("06.no_such_task", TASKS) == "06.no_such_task"
    assert current_task_id("no dot", TASKS) == "no dot"


@pytest.mark.parametrize(
    ("recorded", "course_map", "expected"),
    [
        ("06", None, "07"),
        ("08", None, "11"),
        ("10", None, "12"),
        ("06", 2, "06"),
        ("00", 2, "00"),
        ("14", 2, "15"),
        ("15", 2, "16"),
        ("14", 3, "14"),
        ("15", 3, "15"),
        ("99", 2, None),
        ("06", 9, None),
    ],
)
def test_a_recorded_lesson_is_read_in_the_map_it_was_recorded_in(recorded, course_map, expected):
    assert current_lesson(recorded, course_map) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("08_running_out_of_blocks.ipynb", "11"),  # a first-map name
        ("11_running_out_of_blocks.ipynb", "11"),
        ("09_end_to_end.py", "09"),
        ("10_real_models_and_the_token_budget.ipynb", "10"),
        ("14_settings_and_metrics.ipynb", "15"),  # a name of map 2
        ("15_serving_it.ipynb", "16"),
        ("15_settings_and_metrics.ipynb", "15"),
        ("05_my_attention.py", "05"),  # other names: the digits, in this map
        ("99_nothing.py", None),
        ("mine.ipynb", None),
    ],
)
def test_a_file_name_says_its_lesson_in_either_map(name, expected):
    assert lesson_of_name(name) == expected


def write_with_metadata(path: Path, source: Path, metadata: dict) -> Path:
    notebook = json.loads(source.read_text())
    notebook["metadata"]["paged_kv"] = metadata
    path.write_text(json.dumps(notebook))
    return path


def test_a_notebook_of_the_first_map_grades_as_the_lesson_its_tasks_belong_to_now(tmp_path):
    solution = ROOT / "solutions" / "11_running_out_of_blocks.ipynb"
    old = write_with_metadata(tmp_path / "mine.ipynb", solution, {"lesson": "08"})  # as built before
    assert notebook_lesson(json.loads(old.read_text())["metadata"]) == ("08", None)
    assert lesson_of(str(old)) == "11"
    report = grade(str(old), lesson_of(str(old)))
    assert report.passed and report.lesson == "11", report.as_dict()
    now = write_with_metadata(tmp_path / "theirs.ipynb", solution, {"lesson": "11", "course_map": 2})
    assert lesson_of(str(now)) == "11"


def test_a_check_cell_of_the_first_map_finds_its_task(capsys):
    from paged_kv.reference import lesson08

    check("07.fork", lesson08.SharedCache, lesson08.fork)  # exercise 07's first check, before the renumbering
    assert "08.fork" in capsys.readouterr().out


def test_a_notebook_of_the_second_map_grades_as_the_lesson_its_tasks_belong_to_now(tmp_path):
    solution = ROOT / "solutions" / "16_serving_it.ipynb"
    old = write_with_metadata(tmp_path / "15_serving_it.ipynb", solution, {"lesson": "15", "course_map": 2})
    assert lesson_of(str(old)) == "16"
    report = grade(str(old), lesson_of(str(old)))
    assert report.passed and report.lesson == "16", report.as_dict()


def test_a_check_cell_of_the_second_map_finds_its_task(capsys):
    from paged_kv.reference import lesson14

    check("00.startup_line", lesson14.startup_line)  # map 2's exercise 00, task 5
    assert "14.startup_line" in capsys.readouterr().out

"""The course's map: its lessons in order, in three parts, and where each lesson of an earlier map went.

The course was renumbered twice (December 2026). The first time, two lessons that took two sittings
each were split (05 became *paged attention* and *attention at scale*, 09 *the engine* and *real
models and the token budget*), and the lessons were put in an order in which none uses what a later
one teaches (map 2). The second time, vLLM's start-up sizing left lesson 00, which could only state
what lessons 13 and 14 teach, for a lesson of its own after the hybrid models (14, *sizing the
cache*), which also took the block size and tensor parallelism from the old lesson 14; settings and
metrics became 15 and serving it 16 (map 3, this one).

Every notebook the course builds records its lesson and the map it belongs to in its metadata,
``{"paged_kv": {"lesson": "07", "course_map": 3}}``. A notebook built before the first change records
no map: its number is the first map's. :func:`current_lesson` translates a number of any earlier map,
so a learner's old exercise still grades as the lesson its tasks now belong to, and an old check cell
still finds its task: ``check("06.next_power_of_two", ...)`` (first-map exercise 06) is now
``"07.next_power_of_two"``, and ``check("00.startup_line", ...)`` (map 2's exercise 00) is
``"14.startup_line"`` (:func:`current_task_id`).

Invariants: the numbers of :data:`LESSONS` are ``00``, ``01``, ... in order, with no gap; every lesson
of an earlier map maps to lessons of the next map, the first of which holds most of its exercise's
tasks; every task of an earlier map's exercise is a task of one of the lessons it maps to (under the
same name); :data:`PARTS` cover :data:`LESSONS` in order, each lesson once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: The map every notebook built now belongs to; a notebook that records none is of the first map.
COURSE_MAP = 3
#: Where a notebook records its lesson: ``metadata[METADATA_KEY] = {"lesson": ..., "course_map": ...}``.
METADATA_KEY = "paged_kv"


@dataclass(frozen=True)
class Lesson:
    """One lesson: its two-digit number, the rest of its notebooks' names, and its title."""

    number: str
    slug: str
    title: str

    @property
    def stem(self) -> str:
        """The name of its notebooks and sources without the extension, ``07_concurrent_workload``."""
        return f"{self.number}_{self.slug}"


LESSONS = (
    Lesson("00", "why_paging", "Why paging?"),
    Lesson("01", "block_and_block_table", "Block and BlockTable"),
    Lesson("02", "the_allocator", "The allocator"),
    Lesson("03", "logical_to_physical", "Logical to physical"),
    Lesson("04", "decode_allocation", "On-demand decode allocation"),
    Lesson("05", "paged_attention", "Paged attention"),
    Lesson("06", "attention_at_scale", "Attention at scale"),
    Lesson("07", "concurrent_workload", "A concurrent workload"),
    Lesson("08", "sharing", "Sharing"),
    Lesson("09", "the_engine", "The engine"),
    Lesson("10", "real_models_and_the_token_budget", "Real models and the token budget"),
    Lesson("11", "running_out_of_blocks", "Running out of blocks"),
    Lesson("12", "writing_the_kernel", "Writing the kernel"),
    Lesson("13", "hybrid_models", "Hybrid models"),
    Lesson("14", "sizing_the_cache", "Sizing the cache at start-up"),
    Lesson("15", "settings_and_metrics", "Settings and metrics"),
    Lesson("16", "serving_it", "Serving it"),
)
BY_NUMBER = {lesson.number: lesson for lesson in LESSONS}


@dataclass(frozen=True)
class Part:
    """A part of the course: its lessons, in order, and the lessons it is still to get."""

    title: str
    lessons: tuple[str, ...]
    coming: tuple[str, ...] = ()


PARTS = (
    Part("The paged cache itself", ("00", "01", "02", "03", "04", "05", "06", "07", "08")),
    Part("vLLM's engine", ("09", "10", "11", "12", "13", "14", "15", "16")),
    Part(
        "Past one pool and one process",
        (),
        (
            "the KV connector and a CPU offload tier, KV-cache events",
            "past one process: tensor parallelism, prefill and decode apart",
            "tokens in flight: async scheduling and speculative decoding",
        ),
    ),
)

#: The first map's lessons, by number: their notebooks' stem and the lessons of this map they became
#: (the first one holds the old exercise's tasks).
FIRST_MAP = {
    "00": ("00_why_paging", ("00",)),
    "01": ("01_block_and_block_table", ("01",)),
    "02": ("02_the_allocator", ("02",)),
    "03": ("03_logical_to_physical", ("03",)),
    "04": ("04_decode_allocation", ("04",)),
    "05": ("05_paged_attention", ("05", "06")),
    "06": ("06_concurrent_workload", ("07",)),
    "07": ("07_sharing", ("08",)),
    "08": ("08_running_out_of_blocks", ("11",)),
    "09": ("09_end_to_end", ("09", "10")),
    "10": ("10_writing_the_kernel", ("12",)),
}
#: Map 2's lessons, by number: their notebooks' stem and the lessons of this map they became.
SECOND_MAP = {
    **{f"{n:02d}": (BY_NUMBER[f"{n:02d}"].stem, (f"{n:02d}",)) for n in range(1, 14)},
    "00": ("00_why_paging", ("00", "14")),
    "14": ("14_settings_and_metrics", ("15", "14")),
    "15": ("15_serving_it", ("16",)),
}
#: Every earlier map, by number: its lessons as above, mapped to the next map's.
EARLIER_MAPS = {1: FIRST_MAP, 2: SECOND_MAP}
#: What else moved between lessons, for the learner whose copy predates the first change.
FIRST_MAP_NOTES = (
    "the paper's Figure 2, measured, moved from lesson 00 to lesson 07, where its simulator is taught",
    "lesson 05 was split: paged attention (05), then its strategies, their cost, grouped-query attention "
    "and prompt chunks (06)",
    "lesson 09 was split: the tiny GPT and the engine (09), then Hugging Face models and the token budget "
    "with chunked prefill (10); running out of blocks (11) now comes after both, since it uses them",
)
#: The same for a copy of map 2.
SECOND_MAP_NOTES = (
    "vLLM's start-up sizing left lesson 00 for a lesson of its own, 14, sizing the cache at start-up, "
    "with the block size and tensor parallelism of the old lesson 14; exercise 00's tasks 4 and 5 "
    "(block_bytes, startup_line) and the old exercise 14's task 1 (common_block_size) are exercise 14's now "
    "(python -m paged_kv.grade your old exercise --lesson 14 grades them there)",
    "settings and metrics is lesson 15 (was 14), serving it lesson 16 (was 15)",
)
NOTES = {1: FIRST_MAP_NOTES, 2: SECOND_MAP_NOTES}

_STEM = re.compile(r"(\d\d)(?:_|\.|$)")


def lesson(number: str) -> Lesson:
    """The lesson numbered ``number`` (``"07"``).

    Raises:
        ValueError: no lesson has that number.
    """
    if number not in BY_NUMBER:
        raise ValueError(f"number: no lesson {number!r}; the lessons are {', '.join(BY_NUMBER)}")
    return BY_NUMBER[number]


def current_lesson(recorded: str, course_map: int | None) -> str | None:
    """The lesson, in this map, of a notebook that records ``recorded`` under map ``course_map``.

    ``course_map`` is ``None`` for a notebook built before maps were recorded (the first map).
    ``None`` when the number names no lesson of its map.

    >>> current_lesson("06", None), current_lesson("06", 2), current_lesson("14", 2), current_lesson("14", 3)
    ('07', '06', '15', '14')
    """
    now = _successors(recorded, 1 if course_map is None else course_map)
    return now[0] if now else None


def _successors(number: str, course_map: int) -> list[str]:
    """Every lesson of this map that lesson ``number`` of ``course_map`` went to, the one that holds
    most of its exercise's tasks first; empty when ``number`` is no lesson of that map."""
    if course_map == COURSE_MAP:
        return [number] if number in BY_NUMBER else []
    now = EARLIER_MAPS.get(course_map, {}).get(number, (None, ()))[1]
    return [lesson for n in now for lesson in _successors(n, course_map + 1)]


def lesson_of_name(name: str) -> str | None:
    """The lesson a file name says, in this map: a stem of any map decides, the newest map first
    (``06_concurrent_workload`` is 07, ``14_settings_and_metrics`` 15), else the two digits it starts
    with are read as this map's; ``None`` without them.

    >>> lesson_of_name("06_concurrent_workload.ipynb"), lesson_of_name("06_attention_at_scale.ipynb")
    ('07', '06')
    >>> lesson_of_name("10_writing_the_kernel.py"), lesson_of_name("15_serving_it.ipynb")
    ('12', '16')
    >>> lesson_of_name("03_mine.ipynb"), lesson_of_name("x.py")
    ('03', None)
    """
    stem = Path(name).name.split(".")[0]
    for current in LESSONS:
        if stem == current.stem:
            return current.number
    for course_map in sorted(EARLIER_MAPS, reverse=True):
        for number, (old_stem, _) in EARLIER_MAPS[course_map].items():
            if stem == old_stem:
                return current_lesson(number, course_map)
    match = _STEM.match(Path(name).name)
    return match.group(1) if match and match.group(1) in BY_NUMBER else None


def notebook_lesson(metadata: dict) -> tuple[str, int | None] | None:
    """``(lesson, course_map)`` as a notebook's metadata records them, or ``None`` when it records none."""
    entry = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("lesson"), str):
        return None
    if not re.fullmatch(r"\d\d", entry["lesson"]):
        return None
    course_map = entry.get("course_map")
    return entry["lesson"], course_map if isinstance(course_map, int) else None


def current_task_id(task_id: str, known: set[str] | dict) -> str:
    """``task_id`` as this map names it: an id of an earlier map (``"07.fork"``, from a first-map
    exercise, is ``"08.fork"``; ``"00.startup_line"``, from map 2's, is ``"14.startup_line"``) becomes
    the id of the same task in a lesson it went to, when that id is ``known`` and the given one is not,
    the newest map read first; any other id is returned as it is.

    >>> from paged_kv.checks import TASKS
    >>> current_task_id("07.fork", TASKS), current_task_id("00.startup_line", TASKS)
    ('08.fork', '14.startup_line')
    """
    if task_id in known or "." not in task_id:
        return task_id
    number, name = task_id.split(".", 1)
    for course_map in sorted(EARLIER_MAPS, reverse=True):
        for lesson in _successors(number, course_map):
            if f"{lesson}.{name}" in known:
                return f"{lesson}.{name}"
    return task_id

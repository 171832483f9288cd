"""The course's map: its lessons in order, and where each lesson of the first map went.

The course was renumbered once (December 2026): two lessons that took two sittings each were split
(05 became *paged attention* and *attention at scale*, 09 *the engine* and *real models and the
token budget*), and the lessons were put in an order in which none uses what a later one teaches.
Every notebook the course builds records its lesson and the map it belongs to in its metadata,
``{"paged_kv": {"lesson": "07", "course_map": 2}}``. A notebook built before the change records no
map: its number is the first map's, and :func:`current_lesson` translates it, so a learner's old
exercise still grades as the lesson its tasks now belong to, and an old ``check("06.next_power_of_two", ...)``
cell (old exercise 06's first task) still finds its task, now ``"07.next_power_of_two"``
(:func:`current_task_id`).

Invariants: the numbers of :data:`LESSONS` are ``00``, ``01``, ... in order, with no gap; every
lesson of the first map maps to a lesson of this one, and the graded tasks of a first-map exercise
are all tasks of the lesson it maps to (the split lessons' new halves, 06 and 10, have new tasks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: The map every notebook built now belongs to; a notebook that records none is of the first map.
COURSE_MAP = 2
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
    Lesson("14", "settings_and_metrics", "Settings and metrics"),
    Lesson("15", "serving_it", "Serving it"),
)
BY_NUMBER = {lesson.number: lesson for lesson in LESSONS}

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
#: What else moved between lessons, for the learner whose copy predates the change.
FIRST_MAP_NOTES = (
    "the paper's Figure 2, measured, moved from lesson 00 to lesson 07, where its simulator is taught",
    "lesson 05 was split: paged attention (05), then its strategies, their cost, grouped-query attention "
    "and prompt chunks (06)",
    "lesson 09 was split: the tiny GPT and the engine (09), then Hugging Face models and the token budget "
    "with chunked prefill (10); running out of blocks (11) now comes after both, since it uses them",
)

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

    >>> current_lesson("06", None), current_lesson("06", 2), current_lesson("09", None)
    ('07', '06', '09')
    """
    if course_map is None or course_map == 1:
        return FIRST_MAP[recorded][1][0] if recorded in FIRST_MAP else None
    if course_map == COURSE_MAP:
        return recorded if recorded in BY_NUMBER else None
    return None


def lesson_of_name(name: str) -> str | None:
    """The lesson a file name says, in this map: a stem of either map decides (``06_concurrent_workload``
    is 07), else the two digits it starts with are read as this map's; ``None`` without them.

    >>> lesson_of_name("06_concurrent_workload.ipynb"), lesson_of_name("06_attention_at_scale.ipynb")
    ('07', '06')
    >>> lesson_of_name("10_writing_the_kernel.py"), lesson_of_name("03_mine.ipynb"), lesson_of_name("x.py")
    ('12', '03', None)
    """
    stem = Path(name).name.split(".")[0]
    for current in LESSONS:
        if stem == current.stem:
            return current.number
    for number, (old_stem, _) in FIRST_MAP.items():
        if stem == old_stem:
            return current_lesson(number, None)
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
    """``task_id`` as this map names it: a first-map id (``"07.fork"``, from an exercise built before
    the change) becomes its lesson's current one (``"08.fork"``) when that id is ``known`` and the
    given one is not; any other id is returned as it is.
    """
    if task_id in known or "." not in task_id:
        return task_id
    number, name = task_id.split(".", 1)
    moved = current_lesson(number, None)
    return f"{moved}.{name}" if moved and f"{moved}.{name}" in known else task_id

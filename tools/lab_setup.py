"""Prepare JupyterLab for a learner: ``make lab`` runs this before it starts the server.

Two things:

* **The learner's working copy.** JupyterLab saves a notebook as soon as it runs (autosave), so a
  learner working in ``lessons/`` would overwrite the committed, nbval-checked notebooks and
  ``make test`` would fail on their clone. ``make lab`` therefore opens JupyterLab in a git-ignored
  copy of the course, ``my_course/`` (``lessons/``, ``exercises/``, ``solutions/``). A file is
  copied only when the copy lacks it: the learner's work is never overwritten, and a notebook that
  a later ``git pull`` brings is added. Deleting a file of the copy and running ``make lab`` again
  starts that lesson over. A copy made before the course was renumbered (twice, December 2026,
  :mod:`paged_kv.course_map`) is brought to this map first, and the learner is told what moved
  (:func:`migrate_to_this_map`).
* **JupyterLab's settings.** The news pop-up ("Would you like to receive official Jupyter news?")
  and the update check are switched off in the environment's ``overrides.json`` (the defaults of
  every user of this ``.venv``; a user's own settings still win).

Usage:
    python tools/lab_setup.py [--work my_course] [--settings DIR]   prints what it did
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from paged_kv.course_map import COURSE_MAP, EARLIER_MAPS, LESSONS, METADATA_KEY, NOTES, current_lesson, lesson

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORK = ROOT / "my_course"
COURSE_FOLDERS = ("lessons", "exercises", "solutions")
COPIED = ("*.ipynb", "*.md")  # the notebooks, and the lesson plan lessons/README.md
# JupyterLab's notification plugin: no news pop-up, no update check.
NOTIFICATION_PLUGIN = "@jupyterlab/apputils-extension:notification"
LAB_OVERRIDES = {NOTIFICATION_PLUGIN: {"fetchNews": "false", "checkForUpdates": False}}
# Where a working copy's notebooks of an earlier map go, as they were, when it is brought to this one.
MAP_FOLDERS = {1: "first_map", 2: "second_map"}


@dataclass(frozen=True)
class Move:
    """One file of the working copy moved by :func:`migrate_to_this_map`, and why."""

    source: Path
    target: Path
    why: str
    course_map: int  # the earlier map the file was of


def check_working_copy(source: Path, work: Path) -> list[Path]:
    """The course folders of ``source``; raises unless ``work`` can be a working copy of them.

    Raises:
        ValueError: ``source`` has none of the course folders, or ``work`` is ``source`` or one
            of its course folders (the copy would be the committed notebooks themselves).
    """
    source, work = Path(source).resolve(), Path(work).resolve()
    folders = [source / name for name in COURSE_FOLDERS if (source / name).is_dir()]
    if not folders:
        raise ValueError(f"source: {source} has none of the course folders {', '.join(COURSE_FOLDERS)}")
    if work == source or any(work == folder or work.is_relative_to(folder) for folder in folders):
        raise ValueError(f"work: {work} would be the course itself; choose a folder of its own")
    return folders


def sync_working_copy(source: Path, work: Path) -> list[Path]:
    """Copy the course files of ``source`` (a clone's root) that ``work`` lacks; return those copied.

    The files are those matching :data:`COPIED` directly inside each of :data:`COURSE_FOLDERS`,
    copied to the same relative path under ``work``. Invariants: a file that exists in ``work``
    is never written (running it twice copies nothing the second time), and nothing is deleted.

    Raises:
        ValueError: ``source`` has none of the course folders, or ``work`` is ``source`` or one
            of its course folders (the copy would be the committed notebooks themselves).
    """
    source, work = Path(source).resolve(), Path(work).resolve()
    folders = check_working_copy(source, work)
    copied = []
    for folder in folders:
        for pattern in COPIED:
            for path in sorted(folder.glob(pattern)):
                target = work / folder.name / path.name
                if target.exists():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
                copied.append(target)
    return copied


def _earlier_map_lesson(path: Path) -> tuple[str, int] | None:
    """``(lesson, map)`` of a working copy's notebook of an earlier map, or ``None`` when it is of this one.

    Every notebook the course builds records ``{"lesson": ..., "course_map": N}``. The first map's
    exercises and solutions recorded a lesson without a map, and its lessons recorded nothing, so a
    lesson notebook is of the first map when it records nothing and bears a first-map name.
    """
    try:
        metadata = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    except (OSError, ValueError, AttributeError):
        return None
    entry = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
    if isinstance(entry, dict):
        course_map = entry.get("course_map", 1)
        if course_map == COURSE_MAP or entry.get("lesson") not in EARLIER_MAPS.get(course_map, {}):
            return None
        return entry["lesson"], course_map
    first_map_names = {stem: number for number, (stem, _) in EARLIER_MAPS[1].items()}
    if entry is None and path.parent.name == "lessons" and path.stem in first_map_names:
        return first_map_names[path.stem], 1
    return None


def migrate_to_this_map(work: Path) -> list[Move]:
    """Bring a working copy made before the course was renumbered to this map; return what moved.

    * An exercise of an earlier map is the learner's work: when it bears its lesson's name in that
      map and its lesson's name now differs (``06_concurrent_workload`` is ``07_concurrent_workload``,
      ``14_settings_and_metrics`` is ``15_settings_and_metrics``), it is renamed to the new name,
      unchanged; the grader reads its metadata and grades it as the lesson its tasks belong to now.
      Under any other name it stays where it is.
    * A lesson or a solution of an earlier map is course material: it moves, unchanged, to
      ``work/first_map/<folder>/`` (or ``second_map``), and :func:`sync_working_copy` then copies the
      new notebooks in. When any notebook was of an earlier map, so is ``lessons/README.md``, the
      plan it follows.

    Invariants: nothing is deleted or overwritten (a move whose target exists is not made), and a
    copy already on this map moves nothing.
    """
    work = Path(work)
    moves: list[Move] = []
    maps_seen: set[int] = set()
    for folder in COURSE_FOLDERS:
        for path in sorted((work / folder).glob("*.ipynb")):
            found = _earlier_map_lesson(path)
            if found is None:
                continue
            old, course_map = found
            maps_seen.add(course_map)
            now = lesson(current_lesson(old, course_map))
            if folder == "exercises":
                if path.stem != EARLIER_MAPS[course_map][old][0] or path.stem == now.stem:
                    continue
                target = path.with_name(f"{now.stem}.ipynb")
                why = f"your work on lesson {now.number}, {now.title.lower()}, as you left it"
            else:
                target = work / MAP_FOLDERS[course_map] / folder / path.name
                why = f"lesson {old} of the {MAP_FOLDERS[course_map].replace('_', ' ')}, kept as it was"
                why += f"; lesson {now.number} replaces it"
            if not target.exists():
                moves.append(Move(path, target, why, course_map))
    plan = work / "lessons" / "README.md"
    if maps_seen and plan.exists():
        newest = max(maps_seen)
        kept = work / MAP_FOLDERS[newest] / "lessons" / "README.md"
        if not kept.exists():
            moves.append(Move(plan, kept, f"the {MAP_FOLDERS[newest].replace('_', ' ')}'s plan", newest))
    for move in moves:
        move.target.parent.mkdir(parents=True, exist_ok=True)
        move.source.rename(move.target)
    return moves


def migration_report(moves: list[Move], work: Path) -> list[str]:
    """What :func:`migrate_to_this_map` did, in words, for the learner."""
    lines = [f"lab_setup: your copy predates the course's map of {len(LESSONS)} lessons; it now follows it:"]
    for course_map in range(min(move.course_map for move in moves), COURSE_MAP):  # every change since
        lines += [f"  {note}" for note in NOTES[course_map]]
    for move in moves:
        lines.append(f"  {move.source.relative_to(work)} -> {move.target.relative_to(work)} ({move.why})")
    lines.append("  the notebooks of the new map are copied in beside your work; nothing was deleted")
    return lines


def lab_settings_dir() -> Path:
    """The folder of the environment's JupyterLab ``overrides.json`` (``<app dir>/settings``)."""
    from jupyterlab.commands import get_app_dir

    return Path(get_app_dir()) / "settings"


def write_lab_overrides(settings_dir: Path) -> Path:
    """Merge :data:`LAB_OVERRIDES` into ``settings_dir/overrides.json``; return its path.

    Other plugins' overrides, and other settings of the notification plugin, are kept.

    Raises:
        ValueError: the existing file is not a JSON object (it is left as it was).
    """
    path = Path(settings_dir) / "overrides.json"
    try:
        overrides = json.loads(path.read_text())
    except FileNotFoundError:
        overrides = {}
    except ValueError as error:
        raise ValueError(f"settings_dir: {path} is not valid JSON ({error}); fix or remove it") from error
    if not isinstance(overrides, dict):
        raise ValueError(f"settings_dir: {path} holds a JSON {type(overrides).__name__}, not an object")
    merged = dict(overrides)
    for plugin, values in LAB_OVERRIDES.items():
        merged[plugin] = {**overrides.get(plugin, {}), **values}
    if merged != overrides:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"the working copy ({DEFAULT_WORK})")
    parser.add_argument("--settings", type=Path, help="where overrides.json goes (the environment's)")
    args = parser.parse_args(argv)
    try:
        check_working_copy(ROOT, args.work)
        moved = migrate_to_this_map(args.work)
        copied = sync_working_copy(ROOT, args.work)
        overrides = write_lab_overrides(args.settings or lab_settings_dir())
    except (ValueError, OSError) as error:
        print(f"lab_setup: {error}", file=sys.stderr)
        return 1
    where = args.work.resolve()
    if moved:
        print("\n".join(migration_report(moved, where)))
    if copied:
        print(f"lab_setup: copied {len(copied)} course files into {where} (your work lives there)")
    else:
        print(f"lab_setup: your working copy {where} is up to date (nothing copied)")
    print(f"lab_setup: no news pop-up or update check ({overrides})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prepare JupyterLab for a learner: ``make lab`` runs this before it starts the server.

Two things:

* **The learner's working copy.** JupyterLab saves a notebook as soon as it runs (autosave), so a
  learner working in ``lessons/`` would overwrite the committed, nbval-checked notebooks and
  ``make test`` would fail on their clone. ``make lab`` therefore opens JupyterLab in a git-ignored
  copy of the course, ``my_course/`` (``lessons/``, ``exercises/``, ``solutions/``). A file is
  copied only when the copy lacks it: the learner's work is never overwritten, and a notebook that
  a later ``git pull`` brings is added. Deleting a file of the copy and running ``make lab`` again
  starts that lesson over.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORK = ROOT / "my_course"
COURSE_FOLDERS = ("lessons", "exercises", "solutions")
COPIED = ("*.ipynb", "*.md")  # the notebooks, and the lesson plan lessons/README.md
# JupyterLab's notification plugin: no news pop-up, no update check.
NOTIFICATION_PLUGIN = "@jupyterlab/apputils-extension:notification"
LAB_OVERRIDES = {NOTIFICATION_PLUGIN: {"fetchNews": "false", "checkForUpdates": False}}


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
    folders = [source / name for name in COURSE_FOLDERS if (source / name).is_dir()]
    if not folders:
        raise ValueError(f"source: {source} has none of the course folders {', '.join(COURSE_FOLDERS)}")
    if work == source or any(work == folder or work.is_relative_to(folder) for folder in folders):
        raise ValueError(f"work: {work} would be the course itself; choose a folder of its own")
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
        copied = sync_working_copy(ROOT, args.work)
        overrides = write_lab_overrides(args.settings or lab_settings_dir())
    except (ValueError, OSError) as error:
        print(f"lab_setup: {error}", file=sys.stderr)
        return 1
    where = args.work.resolve()
    if copied:
        print(f"lab_setup: copied {len(copied)} course files into {where} (your work lives there)")
    else:
        print(f"lab_setup: your working copy {where} is up to date (nothing copied)")
    print(f"lab_setup: no news pop-up or update check ({overrides})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instant feedback for the exercises: ``check("02.allocate", BlockAllocator)`` after each task.

Each lesson registers its tasks in its own module, ``lessonNN.py``, with :func:`task`; every such
module is imported here, so ``check`` knows all tasks.
"""

from __future__ import annotations

import importlib
import pkgutil

from paged_kv.checks._core import TASKS, Checker, CheckFailed, check, task

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith("lesson"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["TASKS", "CheckFailed", "Checker", "check", "task"]

"""Grading: any implementation of an exercise, graded task by task with the checks of the notebooks.

``grade(source, lesson)`` takes ``"package"``, a notebook or a ``.py`` file through one seam
(:mod:`.loader`), runs each task's check in a worker process with a time limit (:mod:`.runner`),
and returns a :class:`GradeReport`. ``python -m paged_kv.grade`` is its command line.
"""

from paged_kv.grading.loader import PACKAGE, LoadError
from paged_kv.grading.runner import GradeReport, TaskResult, grade, lessons, tasks_of

__all__ = ["PACKAGE", "GradeReport", "LoadError", "TaskResult", "grade", "lessons", "tasks_of"]

"""The finished package, seen through each exercise's names: the reference every graded task passes.

``lessonNN.py`` defines exactly the names the tasks of lesson NN need (``TASKS[id].needs``), each a
thin adapter over the package, so grading ``"package"`` grades the package itself.

The course's three folders stand one on another, and no arrow runs back up (``tests/test_layout.py``):
``reference`` stands on the package's layers alone; :mod:`paged_kv.checks` on the package and on
``reference``, where a check compares a learner's answer with the package's (lessons 11, 13, 14 and
15); :mod:`paged_kv.grading` on both, loading ``reference`` as the implementation ``"package"`` and
running the checks.
"""

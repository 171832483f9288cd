"""The finished package, seen through each exercise's names: the reference every graded task passes.

``lessonNN.py`` defines exactly the names the tasks of lesson NN need (``TASKS[id].needs``), each a
thin adapter over the package, so grading ``"package"`` grades the package itself.
"""

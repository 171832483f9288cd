"""The process that runs learner code, for the grader of every exercise.

    python -m paged_kv.grading.worker [--memory-limit=BYTES] LESSON SOURCE TASK...

It loads the implementation once, then runs each task's check and writes one JSON line per task to
stdout (first a line for the load itself). Whatever the learner's code prints is swallowed. The
grader reads the lines with a time limit per task and starts a new worker when one hangs or dies,
so no learner code ever runs in the grader's own process. With ``--memory-limit`` the worker caps
its own data memory before it loads anything, so an allocation past it raises ``MemoryError`` (or
torch's "can't allocate memory") inside the learner's code, and the task fails with that error.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

try:
    import resource
except ImportError:  # Windows: no resource limits; the time limit still holds
    resource = None

from paged_kv.checks import TASKS, CheckFailed, check
from paged_kv.checks._core import where_raised
from paged_kv.grading.loader import Implementation, LoadError, load


def run_task(implementation: Implementation, task_id: str) -> dict[str, object]:
    """Grade one task: ``status`` is passed, failed, not_implemented or missing; ``message`` says why.

    ``blocked_by`` lists the earlier tasks whose failing code this task used (see ``check``).
    """
    task = TASKS[task_id]
    objects = []
    for name in task.needs:
        problem = implementation.problems.get(name)
        if problem is not None and problem.not_implemented:
            message = f"task {task_id} ({task.title}) is not implemented yet: {problem.message}"
            return {"status": "not_implemented", "message": message}
        if problem is not None:
            return {"status": "missing", "message": problem.message}
        if name not in implementation.namespace:
            return {"status": "missing", "message": f"{name} is not defined: write it in the task's cell"}
        objects.append(implementation.namespace[name])
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            check(task_id, *objects)
    except NotImplementedError as error:
        return {"status": "not_implemented", "message": str(error)}
    except CheckFailed as error:
        return {"status": "failed", "message": str(error), "blocked_by": list(error.blocked_by)}
    except BaseException as error:  # SystemExit and the like, which the check lets through
        if isinstance(error, KeyboardInterrupt):
            raise
        lines = [f"your code raised {type(error).__name__}: {error}", *where_raised(error)]
        return {"status": "failed", "message": "\n".join(lines)}
    return {"status": "passed", "message": output.getvalue().strip().splitlines()[-1]}


def limit_memory(limit: int) -> bool:
    """Cap this process's data memory at ``limit`` bytes (never raising a hard limit already lower).

    Returns whether a limit was set: ``False`` where the platform has no ``RLIMIT_DATA``.
    """
    if resource is None or not hasattr(resource, "RLIMIT_DATA"):
        return False
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return True


def main(argv: list[str]) -> int:
    if argv and argv[0].startswith("--memory-limit="):
        limit_memory(int(argv[0].split("=", 1)[1]))
        argv = argv[1:]
    lesson, source, *task_ids = argv
    out = sys.stdout
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            implementation = load(source, lesson)
    except LoadError as error:
        print(json.dumps({"load_error": str(error)}), file=out, flush=True)
        return 0
    print(json.dumps({"loaded": True}), file=out, flush=True)
    for task_id in task_ids:
        result = run_task(implementation, task_id)
        print(json.dumps({"task_id": task_id, **result}), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

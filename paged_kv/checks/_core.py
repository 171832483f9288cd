"""The machinery of the notebook checks: a registry of tasks and a :class:`Checker` of expectations.

A check runs the learner's code on concrete cases and stops at the first expectation that fails,
saying what was called, what was expected, what came back and a hint. A stub that still raises
``NotImplementedError`` is reported as "not implemented yet", never as a wrong answer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PASS, FAIL = "\N{CHECK MARK}", "\N{BALLOT X}"


class CheckFailed(AssertionError):
    """A task's code gave a wrong answer; the message says which call, what was expected, what came back."""


@dataclass(frozen=True)
class Task:
    """A graded task: its check, the names it takes from an implementation, and its points.

    ``needs`` are the names the exercise passes to ``check`` (``check("02.block_allocator",
    BlockAllocator)`` needs ``("BlockAllocator",)``); the grader looks them up in whatever
    implementation it grades.
    """

    task_id: str
    title: str
    run: Callable[..., None]
    needs: tuple[str, ...]
    points: int = 10

    @property
    def lesson(self) -> str:
        """The lesson number, the two digits before the dot."""
        return self.task_id.split(".")[0]


TASKS: dict[str, Task] = {}


def task(
    task_id: str, title: str, *, needs: tuple[str, ...] | None = None, points: int = 10
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a check: ``@task("02.allocate", "allocate and free blocks")`` on ``def _(c, obj): ...``.

    ``needs`` defaults to the names of the check's parameters after the :class:`Checker`.
    """

    def register(run: Callable[..., None]) -> Callable[..., None]:
        if task_id in TASKS:
            raise ValueError(f"task {task_id!r} is registered twice")
        names = needs if needs is not None else tuple(inspect.signature(run).parameters)[1:]
        TASKS[task_id] = Task(task_id, title, run, names, points)
        return run

    return register


class Checker:
    """The expectations a task's check states; each one that holds is counted."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.passed = 0

    def fail(self, call: str, expected: object, got: object, hint: str) -> None:
        __tracebackhide__ = True
        lines = [
            f"{FAIL} {self.task.task_id} ({self.task.title})",
            f"  called:   {call}",
            f"  expected: {expected}",
            f"  got:      {got}",
        ]
        if hint:
            lines.append(f"  hint:     {hint}")
        raise CheckFailed("\n".join(lines))

    def run(self, call: str, thunk: Callable[[], Any], hint: str = "") -> Any:
        """Evaluate the learner's code; an unexpected exception becomes a failed check."""
        __tracebackhide__ = True
        try:
            return thunk()
        except NotImplementedError:
            raise
        except Exception as error:  # the learner's bug, reported as such
            self.fail(call, "no exception", f"{type(error).__name__}: {error}", hint)

    def equal(self, call: str, thunk: Callable[[], Any], expected: object, hint: str = "") -> Any:
        """``thunk()`` must return ``expected``."""
        __tracebackhide__ = True
        got = self.run(call, thunk, hint)
        if not _same(got, expected):
            self.fail(call, repr(expected), repr(got), hint)
        self.passed += 1
        return got

    def holds(self, call: str, condition: bool, expected: str, got: object, hint: str = "") -> None:
        """A condition the learner's results must meet, described in words."""
        __tracebackhide__ = True
        if not condition:
            self.fail(call, expected, got, hint)
        self.passed += 1

    def raises(
        self, call: str, thunk: Callable[[], Any], error: type[BaseException], hint: str = "", match: str = ""
    ) -> BaseException:
        """``thunk()`` must raise ``error`` (whose message contains ``match``)."""
        __tracebackhide__ = True
        try:
            result = thunk()
        except NotImplementedError:
            raise
        except error as raised:
            if match and match not in str(raised):
                self.fail(call, f"{error.__name__} mentioning {match!r}", f"{error.__name__}: {raised}", hint)
            self.passed += 1
            return raised
        except Exception as raised:
            self.fail(call, error.__name__, f"{type(raised).__name__}: {raised}", hint)
        self.fail(call, error.__name__, f"no exception (returned {result!r})", hint)
        raise AssertionError("unreachable")


def classic_mistake(
    fn: Callable[..., object],
    cases: list[tuple],
    mistakes: list[tuple[Callable[..., bool], str]],
    default: str,
) -> str:
    """The hint of the first known mistake that ``fn`` repeats on every case, else ``default``.

    Each mistake is a ``(wrong_rule, hint)`` pair; ``fn`` makes it when ``bool(fn(*case))`` equals
    ``wrong_rule(*case)`` for all ``cases``. An ``fn`` that raises gets ``default``: the failing
    expectation reports the error itself.
    """
    try:
        answers = [bool(fn(*case)) for case in cases]
    except Exception:  # the learner's bug; the case at hand reports it
        return default
    for mistake, hint in mistakes:
        if answers == [mistake(*case) for case in cases]:
            return hint
    return default


def _same(got: object, expected: object) -> bool:
    try:
        import torch

        if isinstance(got, torch.Tensor) or isinstance(expected, torch.Tensor):
            return (
                isinstance(got, torch.Tensor)
                and isinstance(expected, torch.Tensor)
                and got.shape == expected.shape
                and bool(torch.equal(got.cpu(), expected.cpu().to(got.dtype)))
            )
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return bool(got == expected)


def check(task_id: str, *objects: object) -> None:
    """Run the check of one task on the learner's ``objects`` and print a tick, or raise.

    Raises:
        NotImplementedError: the task's code is still a stub.
        CheckFailed: an expectation failed (the message says which, and how to look into it).
        KeyError: ``task_id`` names no task.
    """
    __tracebackhide__ = True
    if task_id not in TASKS:
        raise KeyError(f"no task {task_id!r}; the tasks are {', '.join(sorted(TASKS))}")
    current = TASKS[task_id]
    checker = Checker(current)
    try:
        current.run(checker, *objects)
    except NotImplementedError as error:
        raise NotImplementedError(
            f"task {task_id} ({current.title}) is not implemented yet: {error or 'replace the stub'}"
        ) from None
    print(f"{PASS} {task_id} {current.title}: all {checker.passed} checks passed")

"""The machinery of every exercise's checks: a registry of tasks and a :class:`Checker` of expectations.

A check runs the learner's code on concrete cases and stops at the first expectation that fails,
saying what was called, what was expected, what came back and a hint. Three things keep the
feedback about the learner's own code:

* a hint can be derived from what the code did (:func:`diagnose` runs it on neighbouring cases and
  compares it with implementations that make known mistakes), instead of one fixed per case;
* an exception raised in the learner's code shows the learner's own lines (:func:`learner_frames`:
  the traceback trimmed to their cells or files), with a hint for the common error types;
* a task that fails while it uses an earlier task's function or class that fails its own check
  says so ("this uses your ``needs_new_block``, which failed above"), instead of blaming the later
  task (:func:`failed_dependencies`).

A stub that still raises ``NotImplementedError`` is reported as "not implemented yet", never as a
wrong answer.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_kv.course_map import current_task_id

PASS, FAIL = "\N{CHECK MARK}", "\N{BALLOT X}"
Hint = str | Callable[[], str]
"""A hint, or a function that derives it from the learner's code; it is only called on a failure."""
Mistake = tuple[Callable[..., object], str]
"""An implementation that makes a known mistake, and the hint that names the mistake."""

# Code under these folders is not the learner's: the standard library, installed packages, paged_kv.
_NOT_LEARNER = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {str(Path(__file__).resolve().parents[1])}
)
_MAX_FRAMES = 4


class CheckFailed(AssertionError):
    """A task's code gave a wrong answer; the message says which call, what was expected, what came back.

    ``blocked_by`` lists the earlier tasks whose code this task used and that fail their own checks.
    """

    def __init__(self, message: str, blocked_by: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.blocked_by = blocked_by


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

    def fail(self, call: str, expected: object, got: object, hint: Hint, error: BaseException | None = None):
        """Raise :class:`CheckFailed`; with ``error``, show where in the learner's code it was raised."""
        __tracebackhide__ = True
        lines = [
            f"{FAIL} {self.task.task_id} ({self.task.title})",
            f"  called:   {call}",
            f"  expected: {expected}",
            f"  got:      {got}",
        ]
        if error is not None:
            lines += where_raised(error)
        text = hint() if callable(hint) else hint
        if error is not None:
            text = "; ".join(part for part in (error_hint(error), text) if part)
        if text:
            lines.append(f"  hint:     {text}")
        raise CheckFailed("\n".join(lines))

    def run(self, call: str, thunk: Callable[[], Any], hint: Hint = "") -> Any:
        """Evaluate the learner's code; an unexpected exception becomes a failed check."""
        __tracebackhide__ = True
        try:
            return thunk()
        except NotImplementedError:
            raise
        except Exception as error:  # the learner's bug, reported as such
            self.fail(call, "no exception", f"{type(error).__name__}: {error}", hint, error)

    def equal(self, call: str, thunk: Callable[[], Any], expected: object, hint: Hint = "") -> Any:
        """``thunk()`` must return ``expected``."""
        __tracebackhide__ = True
        got = self.run(call, thunk, hint)
        if not _same(got, expected):
            self.fail(call, repr(expected), repr(got), hint)
        self.passed += 1
        return got

    def holds(self, call: str, condition: bool, expected: str, got: object, hint: Hint = "") -> None:
        """A condition the learner's results must meet, described in words."""
        __tracebackhide__ = True
        if not condition:
            self.fail(call, expected, got, hint)
        self.passed += 1

    def raises(
        self,
        call: str,
        thunk: Callable[[], Any],
        error: type[BaseException],
        hint: Hint = "",
        match: str = "",
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
            self.fail(call, error.__name__, f"{type(raised).__name__}: {raised}", hint, raised)
        self.fail(call, error.__name__, f"no exception (returned {result!r})", hint)
        raise AssertionError("unreachable")


# ------------------------------------------------------------------ hints from what the code did


def diagnose(
    learner: Callable[..., object],
    mistakes: Sequence[Mistake],
    probe: Callable[[Callable[..., object]], object],
    default: str = "",
) -> str:
    """The hint of the first mistake whose implementation behaves like ``learner``, else ``default``.

    ``probe(implementation)`` runs an implementation on the cases around the one that failed and
    returns what it observed (answers, the tensors it wrote...); ``learner`` makes a mistake when
    its observations equal those of the mistake's implementation. A ``learner`` that raises under
    the probe gets ``default``: the failing expectation reports the error itself.
    """
    try:
        seen = probe(learner)
    except Exception:  # the learner's bug; the case at hand reports it
        return default
    for wrong, hint in mistakes:
        try:
            if _same(probe(wrong), seen):
                return hint
        except Exception:  # this mistake cannot even run on the probe: it is not the learner's
            continue
    return default


def answers(cases: Sequence[tuple], convert: Callable[[object], object] = bool) -> Callable[..., list]:
    """A probe for :func:`diagnose`: the answers of a function on ``cases``, each through ``convert``."""

    def probe(fn: Callable[..., object]) -> list:
        return [convert(fn(*case)) for case in cases]

    return probe


def outcome(thunk: Callable[[], object]) -> object:
    """What a call returned, or the name of the exception it raised, for comparing behaviours in a
    :func:`diagnose` probe; ``NotImplementedError`` (a task not done yet) still propagates."""
    try:
        return thunk()
    except NotImplementedError:
        raise
    except Exception as error:  # a mistake's (or the learner's) error is part of its behaviour
        return type(error).__name__


# ----------------------------------------------------------------- exceptions in the learner's code


def learner_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``error``'s traceback that run the learner's code, outermost first.

    The learner's code is whatever is not the standard library, an installed package or
    ``paged_kv``: a notebook cell, a cell the grader loaded (``cell 5``) or a file of theirs.
    """
    return [frame for frame in traceback.extract_tb(error.__traceback__) if _is_learner(frame.filename)]


def _is_learner(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith("<ipython-input")
    try:
        resolved = str(Path(filename).resolve())
    except (OSError, ValueError):
        return True
    return not resolved.startswith(_NOT_LEARNER)


def _place(filename: str) -> str:
    """``Cell In[7]`` for a notebook cell, the grader's own label (``cell 5``), or a file's name."""
    shell = sys.modules.get("IPython")
    ipython = shell.get_ipython() if shell is not None else None  # type: ignore[attr-defined]
    number = getattr(getattr(ipython, "compile", None), "_filename_map", {}).get(filename)
    if number is not None:
        return f"Cell In[{number}]"
    return filename if filename.startswith("cell ") else Path(filename).name


def where_raised(error: BaseException) -> list[str]:
    """Lines that show where in the learner's code ``error`` was raised: place, line and source."""
    frames = learner_frames(error)[-_MAX_FRAMES:]
    lines = []
    for number, frame in enumerate(frames):
        label = "  where:    " if number == 0 else "            "
        lines.append(f"{label}{_place(frame.filename)}, line {frame.lineno}, in {frame.name}")
        if frame.line:
            lines.append(f"                {frame.line.strip()}")
    return lines


def error_hint(error: BaseException) -> str:
    """What a common exception usually means in this course's code, or ``""``."""
    text = str(error)
    if isinstance(error, TypeError) and "float" in text and ("integer" in text or "indices" in text):
        return "a float where an integer belongs: / always gives a float, // an int"
    if isinstance(error, IndexError) and "empty" in text:
        return "something was taken from an empty list or deque: check that it holds an item first"
    if isinstance(error, AttributeError) and "has no attribute" in text:
        return "an attribute is read before it is set: assign it in __init__, or check its spelling"
    if isinstance(error, NameError):
        return "a name is not defined here: run the cell that defines it, or check its spelling"
    out_of_memory = isinstance(error, RuntimeError) and "can't allocate memory" in text  # torch's
    if isinstance(error, MemoryError) or out_of_memory:
        return (
            "your code ran out of memory (the grader caps each task's memory): look for a list that "
            "grows without end, or a tensor far larger than the task needs"
        )
    if isinstance(error, RecursionError):
        return "a function calls itself without end (a method that calls itself instead of super()?)"
    return ""


# ------------------------------------------------------------------ the earlier tasks a task uses


def failed_dependencies(current: Task, objects: Sequence[object]) -> list[tuple[str, tuple[str, ...], str]]:
    """The earlier tasks whose learner code ``objects`` use and that fail their own checks.

    Exercise code calls the learner's own earlier functions (``decode_step`` calls their
    ``needs_new_block``). The names ``objects`` reach, directly or through other code of the
    learner, are looked up where that code is defined; an earlier task of the same lesson whose
    every needed name is found there, as the learner's code, has its check run again, quietly.
    Returns ``(task_id, names, outcome)`` triples, ``outcome`` ``"failed"`` or ``"is not implemented yet"``.
    """
    reached = _reached(objects)
    found = []
    for earlier in TASKS.values():
        if earlier is current:
            break
        if earlier.lesson != current.lesson or not all(name in reached for name in earlier.needs):
            continue
        outcome = _outcome(earlier, [reached[name] for name in earlier.needs])
        if outcome:
            found.append((earlier.task_id, earlier.needs, outcome))
    return found


def _outcome(earlier: Task, objects: list[object]) -> str:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            earlier.run(Checker(earlier), *objects)
    except NotImplementedError:
        return "is not implemented yet"
    except Exception:  # a wrong answer, or the learner's code raised
        return "failed"
    return ""


def _reached(objects: Sequence[object]) -> dict[str, object]:
    """Every global name the learner's ``objects`` use, transitively through the learner's code."""
    reached: dict[str, object] = {}
    pending = [obj for obj in objects if _is_learners(obj)]
    seen: set[int] = set()
    while pending:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for name, value in _globals_used(obj).items():
            if _is_learners(value):
                reached.setdefault(name, value)
                pending.append(value)
    return reached


def _is_learners(obj: object) -> bool:
    """Whether ``obj`` is a function or class the learner wrote (in a cell, or a file of theirs)."""
    if isinstance(obj, types.FunctionType):
        return _is_learner(obj.__code__.co_filename)
    if not isinstance(obj, type) or obj.__module__ == "builtins":
        return False
    methods = _functions(obj)
    if methods:
        return any(_is_learner(method.__code__.co_filename) for method in methods)
    filename = getattr(sys.modules.get(obj.__module__), "__file__", None)
    return filename is None or _is_learner(filename)  # the grader's module has no file


def _globals_used(obj: object) -> dict[str, object]:
    """The global names ``obj``'s code reads (a class: its methods' and its bases'), with their values."""
    used: dict[str, object] = {}
    if isinstance(obj, type):
        used = {base.__name__: base for base in obj.__bases__ if _is_learners(base)}
    for function in _functions(obj):
        for name in _names_in(function.__code__):
            if name in function.__globals__:
                used[name] = function.__globals__[name]
    return used


def _functions(obj: object) -> list[types.FunctionType]:
    """A function itself, or a class's own methods (properties, static and class methods included)."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    return [function for value in vars(obj).values() for function in _functions_of(value)]


def _functions_of(value: object) -> list[types.FunctionType]:
    """The functions behind one attribute of a class."""
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)]
    return [value] if isinstance(value, types.FunctionType) else []


def _names_in(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_in(constant)
    return names


def _code_of(obj: object) -> set[types.CodeType]:
    """Every code object of a learner's function or class (its methods, nested functions included)."""
    codes: set[types.CodeType] = set()
    pending = [function.__code__ for function in _functions(obj)]
    while pending:
        code = pending.pop()
        codes.add(code)
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return codes


def _blocked_note(blocked: list[tuple[str, tuple[str, ...], str]]) -> str:
    return "; ".join(
        f"this uses your {' and '.join(f'`{name}`' for name in names)}, which "
        f"{'failed above' if outcome == 'failed' else outcome} ({task_id})"
        for task_id, names, outcome in blocked
    )


# ---------------------------------------------------------------------------------------- check


def _same(got: object, expected: object) -> bool:
    """Equality that compares tensors by shape and values, also inside lists, tuples and dicts."""
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
    if isinstance(expected, list | tuple) and type(got) is type(expected):
        return len(got) == len(expected) and all(map(_same, got, expected))  # type: ignore[arg-type]
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(_same(got[key], expected[key]) for key in expected)
    try:
        return bool(got == expected)
    except Exception:  # a learner's object whose == raises, or a tensor inside a dict
        return False


def check(task_id: str, *objects: object) -> None:
    """Run the check of one task on the learner's ``objects`` and print a tick, or raise.

    When the task fails while its code uses the learner's code of an earlier task that fails too,
    the message starts by saying so, and :attr:`CheckFailed.blocked_by` names those tasks.

    Raises:
        NotImplementedError: the task's code is still a stub (or calls an earlier task's stub).
        CheckFailed: an expectation failed (the message says which, and how to look into it).
        KeyError: ``task_id`` names no task.
    """
    __tracebackhide__ = True
    task_id = current_task_id(task_id, TASKS)  # a check cell of an exercise built before the renumbering
    if task_id not in TASKS:
        raise KeyError(f"no task {task_id!r}; the tasks are {', '.join(sorted(TASKS))}")
    current = TASKS[task_id]
    checker = Checker(current)
    try:
        try:
            current.run(checker, *objects)
        except (NotImplementedError, CheckFailed):
            raise
        except Exception as error:  # the learner's code raised where the check did not expect it
            if not learner_frames(error):
                raise  # a bug of the check itself: let it show
            checker.fail(
                f"the check of {task_id}", "no exception", f"{type(error).__name__}: {error}", "", error
            )
    except NotImplementedError as error:
        stubs = [
            dependency
            for dependency in failed_dependencies(current, objects)
            if any(_raised_in(error, name, objects) for name in dependency[1])
        ]
        note = f" ({_blocked_note(stubs)})" if stubs else ""
        raise NotImplementedError(
            f"task {task_id} ({current.title}) is not implemented yet{note}: {error or 'replace the stub'}"
        ) from None
    except CheckFailed as error:
        # Raised afresh from here: a notebook shows the check cell and this message, not the frames
        # of the check's own code (the message already shows the learner's lines).
        blocked = failed_dependencies(current, objects)
        message = str(error)
        if blocked:
            header, _, details = message.partition("\n")
            message = f"{header}\n  first:    {_blocked_note(blocked)}: fix that task first\n{details}"
        raise CheckFailed(message, tuple(task_id for task_id, _, _ in blocked)) from None
    print(f"{PASS} {task_id} {current.title}: all {checker.passed} checks passed")


def _raised_in(error: BaseException, name: str, objects: Sequence[object]) -> bool:
    """Whether ``error`` was raised by the code of the learner's ``name`` that ``objects`` use."""
    innermost = error.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    return innermost is not None and innermost.tb_frame.f_code in _code_of(_reached(objects)[name])

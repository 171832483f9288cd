"""The grader's single seam: turn any implementation into a namespace of names (every exercise).

An implementation is one of

* ``"package"``: the finished package, through :mod:`paged_kv.reference`;
* a notebook (``.ipynb``), a learner's exercise or a solution;
* a plain Python file (``.py``).

From a notebook or a file the loader keeps only what defines things: imports, functions, classes
and UPPER_CASE constants, each top-level statement run on its own, in order, so demo and check cells
never run and one broken cell does not hide the rest. What could not be defined is recorded, per
name, with the reason (a syntax error, an exception, a stub that raised ``NotImplementedError``).
Each chunk's source is registered under its label (``cell 5``, ``mine.py``) in :mod:`linecache`, so
a traceback through the learner's code shows their own lines.
"""

from __future__ import annotations

import ast
import importlib
import json
import linecache
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paged_kv.checks._core import where_raised

PACKAGE = "package"
MAGIC = re.compile(r"^\s*[%!]")
DEFINITION = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)
KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass
class Problem:
    """Why a name is missing: ``not_implemented`` when a stub raised while defining it."""

    message: str
    not_implemented: bool = False


@dataclass
class Implementation:
    """The names an implementation defines, and what went wrong defining the others."""

    source: str
    namespace: dict[str, Any]
    problems: dict[str, Problem] = field(default_factory=dict)


class LoadError(ValueError):
    """The implementation cannot be read at all (no such file, not a notebook, unknown lesson)."""


def load(source: str, lesson: str) -> Implementation:
    """Load ``source`` (``"package"``, a ``.ipynb`` or a ``.py`` path) for grading lesson ``lesson``."""
    if source == PACKAGE:
        try:
            module = importlib.import_module(f"paged_kv.reference.lesson{lesson}")
        except ModuleNotFoundError:
            raise LoadError(f"the package has no reference for lesson {lesson}") from None
        return Implementation(source, dict(vars(module)))
    return load_chunks(source, read_chunks(Path(source)))


def read_chunks(path: Path) -> list[tuple[str, str]]:
    """The code of a notebook, cell by cell, or of a Python file, as ``(label, code)`` pairs."""
    if not path.is_file():
        raise LoadError(f"{path} is not a file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return [(path.name, text)]
    if path.suffix != ".ipynb":
        raise LoadError(f"{path} is neither a notebook (.ipynb) nor a Python file (.py)")
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, KeyError, TypeError):
        raise LoadError(f"{path} is not a valid notebook") from None
    chunks = []
    for number, cell in enumerate(cells, start=1):
        if cell.get("cell_type") == "code":
            code = cell.get("source", "")
            chunks.append((f"cell {number}", "".join(code) if isinstance(code, list) else code))
    return chunks


def load_chunks(source: str, chunks: list[tuple[str, str]]) -> Implementation:
    module = types.ModuleType("learner_implementation")
    sys.modules[module.__name__] = module  # dataclasses and pickling look modules up here
    loaded = Implementation(source, module.__dict__)
    for label, code in chunks:
        code = "\n".join("" if MAGIC.match(line) else line for line in code.splitlines())
        linecache.cache[label] = (len(code), None, [line + "\n" for line in code.splitlines()], label)
        try:
            tree = ast.parse(code, filename=label)
        except SyntaxError as error:
            where = f"{label} has a syntax error (line {error.lineno}: {error.msg})"
            for name in DEFINITION.findall(code):
                loaded.problems[name] = Problem(f"{name} is defined in {where}")
            continue
        for statement in tree.body:
            if _defines_something(statement):
                _run(statement, label, loaded)
    return loaded


def _defines_something(statement: ast.stmt) -> bool:
    if isinstance(statement, KEPT):
        return True
    if isinstance(statement, ast.Assign | ast.AnnAssign):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return all(isinstance(t, ast.Name) and t.id.isupper() for t in targets)
    return False


def _names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return [(alias.asname or alias.name).split(".")[0] for alias in statement.names if alias.name != "*"]
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id]
    return [statement.name]  # type: ignore[attr-defined]


def _run(statement: ast.stmt, label: str, loaded: Implementation) -> None:
    names = _names(statement)
    try:
        exec(compile(ast.Module([statement], type_ignores=[]), label, "exec"), loaded.namespace)
    except NotImplementedError as error:
        for name in names:
            loaded.problems[name] = Problem(
                f"defining {name} in {label} raised NotImplementedError: {error}", True
            )
    except BaseException as error:  # the learner's code: report it, never crash
        if isinstance(error, KeyboardInterrupt):
            raise
        where = "".join(f"\n{line}" for line in where_raised(error))
        for name in names:
            loaded.problems[name] = Problem(
                f"defining {name} in {label} raised {type(error).__name__}: {error}{where}"
            )
    else:
        for name in names:
            loaded.problems.pop(name, None)

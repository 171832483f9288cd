"""The package's layout: each layer imports only the layers below it, and every module names its lesson."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

import paged_kv
from paged_kv.course_map import LESSONS

PACKAGE = Path(paged_kv.__file__).parent

# Each layer and what it may import besides itself; the shared helpers at the top level
# (validate, errors, device, progress, timing) are below every layer.
BASE = {"validate", "errors", "device", "progress", "timing"}
LAYERS = {
    "core": set(),
    "kv": {"core"},
    "attention": {"core", "kv"},  # attention reads the cache's formats (fp8, lesson 10)
    "model": {"core", "kv", "attention"},
    "distributed": {"core", "kv", "kv_offload"},  # KV-cache events; the KV connector over the host tier
    "kv_offload": {"core", "kv"},  # the host tier of KV offloading
    "serving": {"core", "kv", "attention", "model", "distributed", "kv_offload"},
    "simulation": {"core", "kv", "serving"},
    "pictures": {"core", "kv"},
    # the server of lesson 15 (entrypoints/openai/, entrypoints/kv_page.py): the top of the stack
    "entrypoints": {"core", "kv", "attention", "model", "serving", "pictures", "distributed"},
}
LAYERED = sorted(path for layer in LAYERS for path in (PACKAGE / layer).rglob("*.py"))


def layer_of(path: Path) -> str:
    """The layer a module belongs to: the first folder under the package (a sub-package is its layer's)."""
    return path.relative_to(PACKAGE).parts[0]


def module_id(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def imported_parts(path: Path) -> set[str]:
    """The first component after ``paged_kv.`` of every module ``path`` imports, at any depth."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        parts |= {name.split(".")[1] for name in names if name.startswith("paged_kv.")}
    return parts


@pytest.mark.parametrize("path", LAYERED, ids=module_id)
def test_a_layer_imports_only_the_layers_below_it(path: Path) -> None:
    layer = layer_of(path)
    allowed = LAYERS[layer] | BASE | {layer}
    assert imported_parts(path) <= allowed, f"{module_id(path)} imports {imported_parts(path) - allowed}"


@pytest.mark.parametrize("path", LAYERED, ids=module_id)
def test_every_module_names_the_lessons_it_belongs_to(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert re.search(r"[Ll]essons? \d\d", docstring), f"{module_id(path)}'s docstring names no lesson"
    if layer_of(path) == "entrypoints":  # the server is the lesson "serving it"'s
        serving = next(lesson.number for lesson in LESSONS if lesson.slug == "serving_it")
        named = re.search(rf"[Ll]essons? [\d, and]*\b{serving}\b", docstring)
        assert named, f"{module_id(path)}'s docstring does not name lesson {serving}"


def test_the_server_layer_is_the_top_of_the_stack() -> None:
    """Nothing below the server imports it: the engine never knows it is served over HTTP."""
    for path in LAYERED:
        if layer_of(path) != "entrypoints":
            assert "entrypoints" not in imported_parts(path), f"{module_id(path)} imports the server"


# The course's own folders beside the layers, lowest first: the package's answer to each exercise,
# the expectations behind the check cells (some compare with that answer), then the grader, which
# loads the answer as the implementation "package" and runs the checks.
COURSE = ("reference", "checks", "grading")
COURSE_MODULES = sorted(path for folder in COURSE for path in (PACKAGE / folder).rglob("*.py"))


@pytest.mark.parametrize("path", COURSE_MODULES, ids=module_id)
def test_no_course_folder_imports_one_above_it(path: Path) -> None:
    above = set(COURSE[COURSE.index(layer_of(path)) + 1 :])
    assert not imported_parts(path) & above, f"{module_id(path)} imports {imported_parts(path) & above}"


def test_the_course_folders_are_ordered_as_they_import() -> None:
    """Each folder imports the one below it, so the order above is the code's, not a wish."""
    for lower, upper in itertools.pairwise(COURSE):
        modules = (PACKAGE / upper).rglob("*.py")
        assert any(lower in imported_parts(p) for p in modules), f"nothing in {upper}/ imports {lower}/"


def test_the_top_level_exports_what_a_learner_imports() -> None:
    for name in paged_kv.__all__:
        assert getattr(paged_kv, name) is not None
    assert paged_kv.__all__ == sorted(paged_kv.__all__)
    assert {"Engine", "generate", "TinyGPT", "BlockManager", "KVStorage", "PagedKVCacheAllocator"} <= set(
        paged_kv.__all__
    )


def test_one_name_per_concept() -> None:
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert "_checks.py" not in modules  # argument checks are validate.py, beside checks/
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert "utilisation" not in sources  # one spelling: utilization
    assert not re.search(r"^class Block\(nn\.Module\)", sources, re.M)  # the model's is DecoderLayer


def imported_modules(path: Path) -> set[str]:
    """Every ``paged_kv`` module ``path`` imports by name, type-only imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paged_kv"):
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("paged_kv")}
    return names


def test_no_two_modules_import_each_other() -> None:
    modules = {
        ".".join(("paged_kv", *p.relative_to(PACKAGE).with_suffix("").parts)): p
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: imported_modules(path) & set(modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            assert state.get(other) != 1, " -> ".join([*path[path.index(other) :], other])
            if other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])

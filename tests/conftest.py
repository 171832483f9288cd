"""Shared fixtures: the ``device`` every tensor test runs on, the hypothesis profiles, Triton's mode."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from filelock import FileLock
from hypothesis import HealthCheck, settings

# "dev" keeps the edit-test loop quick; CI (HYPOTHESIS_PROFILE=ci) tries more examples.
settings.register_profile("dev", max_examples=60, deadline=None)
settings.register_profile(
    "ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Triton fixes its mode, compiler or interpreter, when it is first imported (from TRITON_INTERPRET).
# Without a GPU the kernel tests (tests/test_triton.py) run in its interpreter, so the variable is
# set here, in every pytest-xdist worker before any test module is collected. With a GPU it stays
# unset: Triton compiles for CUDA, torch.compile's Triton kernels included.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One CPU thread per test process. The tests' tensors are tiny, so a second thread only costs its
# hand-offs, and `make test` already runs a pytest-xdist worker per core (-n 2 on two cores): two
# threads in each worker made them wait on each other, the engine's property tests taking several
# times longer on a busy machine. The results are the same (no tensor here is large enough for
# torch to split a kernel between threads); tests/test_timing.py checks its own thread settings.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--impl",
        default="package",
        help="what tests/grading/test_graded_suite.py grades: 'package' (default), a notebook or a .py file",
    )


def pytest_configure(config: pytest.Config) -> None:
    from paged_kv.checks import TASKS
    from paged_kv.course_map import LESSONS

    for lesson in LESSONS:
        config.addinivalue_line("markers", f"lesson{lesson.number}: lesson {lesson.number}, {lesson.title}")
    for task_id in TASKS:
        config.addinivalue_line("markers", f"{task_marker(task_id)}: the graded task {task_id}")


def task_marker(task_id: str) -> str:
    """The marker of a graded task: ``02.block_allocator`` is ``task_02_block_allocator``."""
    return "task_" + task_id.replace(".", "_")


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each tensor test runs on the CPU, and again on CUDA when a GPU is present."""
    return torch.device(request.param)


T = TypeVar("T")


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], T]], T]:
    """``once_per_run(name, make)``: ``make(folder)`` run once for the whole test run, not once per
    pytest-xdist worker. The first worker that asks runs it, under a lock, with ``folder`` a
    directory every worker of this run shares, and pickles the result there; the others wait for
    it and read it back. Without xdist it is ``make`` with a fresh temporary folder.

    For what several test files or workers need and costs seconds to make (the quick run of every
    bench, the offline site): under ``-n 2`` a module fixture runs in each worker that gets one of
    its tests, and the machine is two cores.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return lambda name, make: make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # this run's folder, above each worker's own

    def once(name: str, make: Callable[[Path], T]) -> T:
        with FileLock(shared / f"{name}.lock"):
            cached = shared / f"{name}.pickle"
            if cached.exists():
                return pickle.loads(cached.read_bytes())
            folder = shared / name
            folder.mkdir()
            value = make(folder)
            cached.write_bytes(pickle.dumps(value))
            return value

    return once

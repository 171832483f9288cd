"""The set-up files agree with each other: pyproject, constraints, environment.yml, Makefile, CI."""

from __future__ import annotations

import doctest
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from paged_kv.env_check import MINIMUM_PYTHON, REQUIREMENTS, TRITON

pytestmark = pytest.mark.setup

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def declared_requirements() -> dict[str, str]:
    """Every requirement of pyproject.toml, name -> specifier (and marker), the project's own extras
    left out."""
    requirements = list(PYPROJECT["dependencies"])
    for extra in PYPROJECT["optional-dependencies"].values():
        requirements += [r for r in extra if not r.startswith("paged_kv")]
    return {requirement_name(r): r[len(requirement_name(r)) :] for r in requirements}


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_constraints_pin_the_cpu_torch_build_and_every_requirement():
    pins = constraints()
    assert pins["torch"] == "2.13.0"
    for name in declared_requirements():
        assert name in pins, f"{name} is required by pyproject.toml but not pinned in constraints.txt"


def test_the_pins_satisfy_the_stated_minimums():
    pins = constraints()
    for distribution, minimum, _extra in (*REQUIREMENTS, TRITON):
        pinned = tuple(int(p) for p in pins[distribution].split(".")[:2])
        assert pinned >= tuple(int(p) for p in minimum.split(".")), distribution


def test_check_env_uses_the_minimums_of_pyproject():
    declared = declared_requirements()
    for distribution, minimum, _extra in (*REQUIREMENTS, TRITON):
        assert f">={minimum}" in declared[distribution], distribution
    assert PYPROJECT["requires-python"] == f">={MINIMUM_PYTHON}"


def test_triton_is_a_course_requirement_on_linux_only():
    """Triton publishes Linux wheels only: the course extra asks for it there alone, and check-env
    requires it there alone (paged_kv.env_check.check_triton)."""
    (triton,) = [r for r in PYPROJECT["optional-dependencies"]["course"] if requirement_name(r) == "triton"]
    assert triton.split(";")[1].strip() == "sys_platform == 'linux'"
    assert TRITON[2] == "course"


def test_environment_yml_uses_conda_forge_only_and_the_same_ranges():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge", "nodefaults"]
    conda = {requirement_name(d): d for d in env["dependencies"] if isinstance(d, str)}
    declared = declared_requirements()
    conda_names = {"torch": "pytorch", "prometheus-client": "prometheus_client"}
    for name, specifier in declared.items():
        entry = conda[conda_names.get(name, name)]
        ranges = specifier.split(";")[0].strip()  # conda has no environment markers
        assert entry.endswith(ranges), f"environment.yml has {entry!r}, pyproject.toml {name}{specifier}"
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip_section == ["-e ."]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.MULTILINE)
    assert "make test" in (ROOT / "README.md").read_text()
    assert "make lab" in (ROOT / "README.md").read_text()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve() or shutil.which("make") is None,
    reason="runs `make lab` only from the project's own .venv",
)
def test_make_lab_serves_jupyterlab_on_loopback(tmp_path):
    """As a learner runs it: no --allow-root in LAB_ARGS, so as root (CI's containers) it is the
    Makefile that lets JupyterLab start."""
    port = free_port()
    flags = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token= --ServerApp.password="
    output = tmp_path / "make_lab.log"
    with output.open("w") as log:  # the child keeps its own copy of the file
        lab = subprocess.Popen(  # in a working copy of its own, not the repository's my_course/
            ["make", "--no-print-directory", "lab", f"WORK={tmp_path / 'my_course'}", f"LAB_ARGS={flags}"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/lab/tree/lessons", timeout=5) as page:
                    assert page.status == 200
                    assert "JupyterLab" in page.read().decode()
                break
            except OSError:
                assert lab.poll() is None, "make lab exited before the server answered"
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents/lessons", timeout=5) as listing:
            assert b"README.md" in listing.read()
        assert (tmp_path / "my_course" / "lessons" / "README.md").is_file(), "it served another folder"
    finally:
        os.killpg(lab.pid, signal.SIGTERM)
        lab.wait(timeout=30)
    assert (ROOT_NOTE in output.read_text().splitlines()) == (os.geteuid() == 0)


ROOT_NOTE = "make lab: running as root (uid 0), so JupyterLab is started with --allow-root"


@pytest.mark.skipif(shutil.which("make") is None or not hasattr(os, "geteuid"), reason="needs make and a uid")
@pytest.mark.parametrize("uid", [0, 1000])
def test_make_lab_passes_allow_root_as_root_only_and_keeps_lab_args(tmp_path, uid):
    """``make -n`` prints what ``make lab`` would run, here under an ``id`` that says ``uid``."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (fake / "id").chmod(0o755)
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-n",
            "lab",
            f"WORK={tmp_path / 'w'}",
            "LAB_ARGS=--port 8899 --no-browser",
        ],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        check=True,
    )
    (command,) = [line for line in result.stdout.splitlines() if "NeverCheckForUpdate" in line]
    assert command.endswith("--port 8899 --no-browser"), "LAB_ARGS come last, untouched"
    assert ("--allow-root" in command.split()) == (uid == 0)
    assert (ROOT_NOTE in result.stdout) == (uid == 0)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("lesson", ["2", "99"])
def test_make_test_lesson_refuses_a_lesson_not_in_the_course_map_with_its_usage(lesson):
    result = subprocess.run(  # this interpreter's bin, and no stamp: nothing is installed
        [
            "make",
            "--no-print-directory",
            "test-lesson",
            f"LESSON={lesson}",
            "STAMP=",
            f"BIN={Path(sys.executable).parent}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "usage: make test-lesson LESSON=NN, NN one of the lessons 00 01 02" in result.stderr
    assert f"got LESSON={lesson!r}" in result.stderr
    assert "pytest" not in result.stdout, "it ran tests for a lesson that is not in the map"


def test_the_readme_example_runs_and_prints_what_it_shows():
    results = doctest.testfile(str(ROOT / "README.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 8
    assert results.failed == 0

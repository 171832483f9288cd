"""``python -m paged_kv check-env``: the versions a bug report needs, and whether each is good enough.

The README's troubleshooting section and every lesson's set-up point to it.

The minimum versions here are the ones ``pyproject.toml`` states (a test keeps them in step).
Whether the Hugging Face Hub answers is reported for information only: the course runs offline
(lesson 09 then serves a random-weight stand-in instead of real weights,
:func:`paged_kv.model.hub.load_model`), so it never fails the check. Triton, lesson 12's kernel, is
a requirement on Linux and information elsewhere: it publishes Linux wheels only, so ``pyproject.toml``
installs it on Linux alone, and lesson 12's kernel cells and the Triton tests skip without it.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import dataclass
from importlib import metadata

from paged_kv.model.hub import HUB_URL, hub_offline_by_setting, hub_reachable

# (distribution, minimum version, the extra of pyproject.toml that installs it)
REQUIREMENTS: tuple[tuple[str, str, str], ...] = (
    ("torch", "2.4", "core"),
    ("msgspec", "0.18", "core"),
    ("pyzmq", "25", "core"),
    ("ipywidgets", "8.0", "course"),
    ("matplotlib", "3.7", "course"),
    ("jupyterlab", "4.0", "course"),
    ("transformers", "5.0", "course"),
    ("nbval", "0.11", "dev"),
)
MINIMUM_PYTHON = "3.11"
# Required on Linux only: pyproject.toml's marker ``sys_platform == 'linux'``.
TRITON: tuple[str, str, str] = ("triton", "3.7", "course")


@dataclass(frozen=True)
class Check:
    """One line of the report: a name, what was found, and whether it meets the minimum.

    A check that is not ``required`` is information: its line says ``INFO`` and it never fails the
    report.
    """

    name: str
    found: str
    ok: bool
    note: str = ""
    required: bool = True

    def line(self) -> str:
        status = ("OK" if self.ok else "FAIL") if self.required else "INFO"
        note = f"  ({self.note})" if self.note else ""
        return f"{self.name:<12} {self.found:<24} {status}{note}"


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``'2.13.0+cpu'`` gives ``(2, 13, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_python() -> Check:
    found = platform.python_version()
    ok = version_tuple(found) >= version_tuple(MINIMUM_PYTHON)
    return Check("Python", found, ok, f"needs >= {MINIMUM_PYTHON}")


def check_package(distribution: str, minimum: str, extra: str) -> Check:
    install = "pip install -e ." if extra == "core" else f"pip install -e '.[{extra}]'"
    try:
        found = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return Check(distribution, "not installed", False, f"needs >= {minimum}: {install}")
    ok = version_tuple(found) >= version_tuple(minimum)
    return Check(distribution, found, ok, f"needs >= {minimum}" + ("" if ok else f": {install}"))


def check_triton(platform_name: str = sys.platform) -> Check:
    """Triton, a requirement on Linux; on any other ``sys.platform``, where it has no wheels, information."""
    check = check_package(*TRITON)
    if platform_name == "linux":
        return check
    note = f"Linux wheels only: on {platform_name} lesson 12's kernel cells and the Triton tests skip"
    return Check(check.name, check.found, check.ok, note, required=False)


def check_device() -> Check:
    try:
        import torch

        from paged_kv.device import default_device

        device = default_device()
    except (ImportError, ValueError) as error:
        return Check("device", "none", False, str(error))
    details = []
    if torch.cuda.is_available():
        details.append(f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    else:
        details.append("no CUDA GPU visible")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        details.append("Apple MPS available (opt in with PAGED_KV_DEVICE=mps)")
    return Check("device", str(device), True, "; ".join(details))


def check_hub(timeout: float = 3.0) -> Check:
    """Whether the Hub is reachable, as information: the course works offline."""
    if hub_offline_by_setting():
        note = f"HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}: lesson 09 uses a random-weight stand-in"
        return Check("HF Hub", "offline by setting", False, note, required=False)
    if hub_reachable(timeout):
        return Check("HF Hub", "reachable", True, f"{HUB_URL}: real weights can be downloaded", False)
    note = f"no answer from {HUB_URL}: lesson 09 serves a random-weight stand-in instead of real weights"
    return Check("HF Hub", "not reachable", False, note, required=False)


def run_checks() -> list[Check]:
    """Every check, in report order: the requirements (Triton's is information off Linux), then the Hub."""
    packages = (check_package(*requirement) for requirement in REQUIREMENTS)
    return [check_python(), *packages, check_triton(), check_device(), check_hub()]


def report() -> tuple[str, bool]:
    """The text to print and whether every required check passed."""
    checks = run_checks()
    required = [check for check in checks if check.required]
    passed = sum(check.ok for check in required)
    lines = [
        "paged_kv environment check",
        f"{'platform':<12} {platform.platform()} ({platform.machine()})",
        f"{'executable':<12} {sys.executable}",
        *(check.line() for check in checks),
        f"result: {'OK' if passed == len(required) else 'FAIL'} ({passed}/{len(required)} checks passed)",
    ]
    return "\n".join(lines), passed == len(required)

"""tools/gpu_check.sh, the check to run on a GPU: valid bash, and harmless where there is no GPU.

The stages themselves need a CUDA device (CI has none); here the script is run with every GPU
hidden (``CUDA_VISIBLE_DEVICES=``), as on the CPU machines CI runs on: it must say "no CUDA device",
exit 0 in seconds and leave bench/GPU_RESULTS.md alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.setup

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
NEEDS_BASH = pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")


def run_check(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@NEEDS_BASH
def test_the_script_is_valid_bash_and_executable():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK), "tools/gpu_check.sh is not executable (chmod +x, and commit the mode)"


@NEEDS_BASH
def test_without_a_gpu_it_says_so_exits_0_and_leaves_the_committed_report_alone(tmp_path):
    committed = ROOT / "bench" / "GPU_RESULTS.md"
    before = committed.read_bytes() if committed.exists() else None
    report = tmp_path / "report.md"
    result = run_check("--output", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no CUDA device" in result.stderr
    text = report.read_text()
    assert "no CUDA device" in text and "## Machine" in text and "nvidia-smi" in text
    assert "## Stages" not in text  # nothing was run
    assert (committed.read_bytes() if committed.exists() else None) == before


@NEEDS_BASH
def test_the_dry_run_plans_the_three_stages_and_runs_none(tmp_path):
    result = run_check("--dry-run")
    assert result.returncode == 0, result.stdout + result.stderr
    plan = result.stdout
    assert "dry run" in plan and "no CUDA device" in plan
    assert "-k cuda" in plan and "tests/test_triton.py" in plan and "--only triton" in plan
    assert "attention slot_mapping" in plan  # the CUDA benches first
    assert "## Stages" not in plan


@NEEDS_BASH
def test_an_unknown_argument_is_refused():
    result = run_check("--frobnicate", timeout=30)
    assert result.returncode == 2 and "unknown argument --frobnicate" in result.stderr

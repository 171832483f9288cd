"""``make lab`` in a live JupyterLab, in headless Chromium: the working copy, and no news pop-up.

A plain JupyterLab asks "Would you like to get notified about official Jupyter news?" in a toast
that covers the lower right of the notebook, where the widgets are. The first test shows that it
does here, so that the second, which runs the real ``make lab``, is not passing by looking for the
wrong thing. Both servers keep off the user's own Jupyter settings (temporary config, data and
settings folders).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import harness

pytestmark = [pytest.mark.browser, pytest.mark.setup]

TOAST = ".Toastify__toast"
NEWS_QUESTION = "official Jupyter news"
LESSON = "lessons/04_decode_allocation.ipynb"
QUIET_S = 6  # after the notebook is shown; the question came within 2 s of it here
VENV_ONLY = pytest.mark.skipif(
    Path(sys.prefix).resolve() != (harness.ROOT / ".venv").resolve() or shutil.which("make") is None,
    reason="runs `make lab` only from the project's own .venv",
)


def isolated_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
    }


def server_flags(home: Path, port: int) -> list[str]:
    return [
        "--no-browser",
        "--allow-root",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        f"--LabApp.user_settings_dir={home / 'user-settings'}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
    ]


@contextlib.contextmanager
def serving(command: list[str], url: str, home: Path) -> Iterator[str]:
    """Run ``command`` (a JupyterLab server) until the block ends; yields ``url`` once it answers."""
    log = (home / "server.log").open("wb")
    server = subprocess.Popen(
        command,
        cwd=harness.ROOT,
        env=isolated_env(home),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        if not harness._wait_for_server(server, url):
            raise RuntimeError(f"{command[:3]} exited; its log:\n{harness._tail(home / 'server.log')}")
        yield url
    finally:
        harness._stop(server)
        log.close()


def open_in_lab(page, url: str) -> None:
    page.goto(url)
    page.locator(".jp-LabShell").wait_for(state="visible")
    page.locator(".jp-NotebookPanel .jp-Notebook").first.wait_for(state="visible")


def test_a_plain_jupyterlab_asks_about_news_in_a_toast(browser, tmp_path):
    lab_root = tmp_path / "root"
    (lab_root / "lessons").mkdir(parents=True)
    shutil.copy2(harness.ROOT / LESSON, lab_root / LESSON)
    port = harness.free_port()
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        *server_flags(tmp_path, port),
        f"--ServerApp.root_dir={lab_root}",
        f"--LabApp.app_settings_dir={tmp_path / 'no-overrides'}",
    ]
    with serving(command, f"http://127.0.0.1:{port}", tmp_path) as url, harness.new_page(browser) as page:
        open_in_lab(page, f"{url}/lab/tree/{LESSON}")
        page.locator(TOAST, has_text=NEWS_QUESTION).wait_for(state="visible")


@VENV_ONLY
def test_make_lab_opens_the_working_copy_with_no_news_pop_up(browser, tmp_path, screenshot):
    work = tmp_path / "my_course"
    committed = (harness.ROOT / LESSON).read_bytes()
    port = harness.free_port()
    flags = " ".join(server_flags(tmp_path, port))
    command = ["make", "--no-print-directory", "lab", f"WORK={work}", f"LAB_ARGS={flags}"]
    with serving(command, f"http://127.0.0.1:{port}", tmp_path) as url, harness.new_page(browser) as page:
        with urllib.request.urlopen(
            f"{url}/lab/api/settings/@jupyterlab/apputils-extension:notification"
        ) as reply:
            defaults = json.loads(reply.read())["schema"]["properties"]  # overrides.json sets defaults
        assert (defaults["fetchNews"]["default"], defaults["checkForUpdates"]["default"]) == ("false", False)
        with urllib.request.urlopen(f"{url}/api/contents/lessons") as reply:
            served = {item["name"] for item in json.loads(reply.read())["content"]}
        assert "04_decode_allocation.ipynb" in served and "README.md" in served

        open_in_lab(page, f"{url}/lab/tree/{LESSON}")
        page.wait_for_timeout(QUIET_S * 1000)
        shot = screenshot(page, "lesson-04")
        toasts = page.locator(TOAST).all_inner_texts()
        assert toasts == [], f"make lab showed {toasts} ({shot})"

    assert (work / LESSON).read_bytes() == committed, "the working copy is the committed lesson"
    assert (harness.ROOT / LESSON).read_bytes() == committed, "make lab changed the committed lesson"

"""Fixtures of the browser tests: Chromium, the vendored widget JavaScript, a JupyterLab server.

Every browser test is skipped, with the reason in pytest's summary, when this machine has no
Chromium (/usr/bin/chromium, from the Debian package ``chromium``), no Playwright, or no ``npm``
to fetch the widget JavaScript with. ``.ci/run`` installs Chromium, so CI runs them.
Screenshots go to ``$PAGED_KV_SCREENSHOTS`` when it is set, else to the test's ``tmp_path``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat
import pytest

from tests.browser import harness
from tools import vendor_widget_js

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

# ---------------------------------------------------------------------------------------------
# THE NOTEBOOK UNDER TEST: lesson 04 shows both widgets, an AllocationPlayer and an
# AllocatorPlayground. While it shows neither, the tests use harness.generated_notebook() instead,
# and say so in a warning.
LESSON = harness.ROOT / "lessons" / "04_decode_allocation.ipynb"
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """Headless Chromium, one per test session (per xdist worker); skips when there is none."""
    reason = harness.missing_browser_reason()
    if reason:
        pytest.skip(reason)
    with harness.chromium() as chromium:
        yield chromium


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page (its own context: no cookies or storage from another test)."""
    with harness.new_page(browser) as fresh:
        yield fresh


@pytest.fixture(scope="session")
def widget_js() -> Path:
    """The directory of the vendored require.js and widget renderer (fetched once with npm)."""
    try:
        return vendor_widget_js.vendor()
    except vendor_widget_js.NpmMissingError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def widget_notebook() -> tuple[nbformat.NotebookNode, str]:
    """The notebook under test (lesson 04, or a generated one while it shows no widget) and its name."""
    notebook, name = harness.widget_notebook(LESSON)
    if not harness.lesson_has_widgets(LESSON):
        warnings.warn(f"the browser tests use {name}", stacklevel=1)
    return notebook, name


@pytest.fixture(scope="session")
def lab_server(browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.LabServer]:
    """One JupyterLab server for the session (per xdist worker) on a free loopback port, serving a
    temporary folder (autosave never reaches the repo). Each test works in a folder of its own
    (``lab_folder``), picks its theme and ends its kernels; starting a server took 4 to 7 s here.

    It depends on ``browser`` so that it is not started on a machine where the tests are skipped.
    """
    with harness.lab_server(tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture
def lab_folder(request: pytest.FixtureRequest, lab_server: harness.LabServer) -> Iterator[str]:
    """A fresh folder in the shared server's root, named after the test (its path under the root);
    the sessions the test's pages opened are ended after it."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in request.node.name)
    (lab_server.root / name).mkdir()
    yield name
    lab_server.shut_down_kernels()


@pytest.fixture
def lab_root(lab_server: harness.LabServer, lab_folder: str, widget_notebook) -> Path:
    """The test's folder in the server's root, holding a copy of the notebook as widgets.ipynb."""
    root = lab_server.root / lab_folder
    notebook, _name = widget_notebook
    (root / "widgets.ipynb").write_text(nbformat.writes(notebook))
    return root


@pytest.fixture
def theme() -> str:
    """The JupyterLab theme of the ``jupyterlab`` fixture; a test parametrizes it to try another."""
    return harness.LIGHT_THEME


@pytest.fixture
def jupyterlab(lab_server: harness.LabServer, lab_root: Path, theme: str) -> str:
    """The URL of ``lab_root`` in the shared JupyterLab, in ``theme``: ``f"{jupyterlab}/widgets.ipynb"``
    opens the notebook, in a workspace of its own (``?reset`` clears what another test left open)."""
    lab_server.select_theme(theme)
    return f"{lab_server.url}/lab/tree/{lab_root.relative_to(lab_server.root).as_posix()}"


@pytest.fixture
def screenshot(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[Page, str], Path]:
    """``screenshot(page, "name")`` saves a PNG of what the page shows and returns its path."""
    configured = os.environ.get("PAGED_KV_SCREENSHOTS")
    directory = Path(configured) if configured else tmp_path / "screenshots"
    directory.mkdir(parents=True, exist_ok=True)
    test_name = request.node.name.replace("/", "_")

    def take(page: Page, name: str) -> Path:
        path = directory / f"{test_name}-{name}.png"
        page.screenshot(path=str(path), full_page=False)
        return path

    return take

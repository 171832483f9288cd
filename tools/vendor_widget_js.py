"""Vendor the JavaScript that renders Jupyter widgets in a notebook exported to static HTML.

``jupyter nbconvert --to html`` stores the widget state in the page, but by default the page loads
require.js and the widget renderer from a CDN, which an offline machine (or CI) cannot reach: the
widget area stays empty. This tool fetches the two npm packages once, from the npm registry, with
``npm pack``, and keeps them in ``.cache/widget-js/`` (gitignored) in the layout the exported page
expects next to itself:

    .cache/widget-js/require.js                                   from requirejs
    .cache/widget-js/@jupyter-widgets/html-manager/dist/...       embed-amd.js, its chunks, the icon fonts

Export with the same relative URLs, then put (or link) these two entries next to the HTML file:

    jupyter nbconvert --to html NB.ipynb --HTMLExporter.require_js_url=require.js \\
        --HTMLExporter.widget_renderer_url=@jupyter-widgets/html-manager/dist/embed-amd.js \\
        --HTMLExporter.mathjax_url=''

Running it again does nothing once the files are there. It needs ``npm`` (Node.js) on PATH.

Usage:
    python tools/vendor_widget_js.py [--dest DIR]     prints the directory that holds the files
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ROOT / ".cache" / "widget-js"
# The html-manager 1.0.x line renders the widgets of ipywidgets 8 (@jupyter-widgets/controls 5).
PACKAGES = ("@jupyter-widgets/html-manager@1.0.15", "requirejs@2.3.8")
# The relative URLs to export with; both resolve against the directory of the HTML file.
REQUIRE_JS_URL = "require.js"
WIDGET_RENDERER_URL = "@jupyter-widgets/html-manager/dist/embed-amd.js"
NBCONVERT_FLAGS = (
    f"--HTMLExporter.require_js_url={REQUIRE_JS_URL}",
    f"--HTMLExporter.widget_renderer_url={WIDGET_RENDERER_URL}",
    "--HTMLExporter.mathjax_url=",
)
# What a directory next to an exported page needs: these two entries of the vendored directory.
ENTRIES = ("require.js", "@jupyter-widgets")
MARKER = "vendored.json"


class NpmMissingError(RuntimeError):
    """``npm`` is not on PATH, so the packages cannot be fetched."""


def is_complete(dest: Path) -> bool:
    """Whether ``dest`` holds the files of exactly :data:`PACKAGES`."""
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("packages") == list(PACKAGES)
        and (dest / REQUIRE_JS_URL).is_file()
        and (dest / WIDGET_RENDERER_URL).is_file()
    )


def vendor(dest: Path = DEFAULT_DEST) -> Path:
    """Fetch and unpack :data:`PACKAGES` into ``dest`` unless they are there already; returns ``dest``.

    The files are unpacked into a temporary directory beside ``dest`` and moved into place in one
    rename, so two processes running at once (pytest-xdist workers) never see a half-written tree.

    Raises:
        NpmMissingError: ``npm`` is not on PATH.
        RuntimeError: ``npm pack`` failed (its output is in the message).
    """
    dest = Path(dest)
    if is_complete(dest):
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissingError(
            "npm is not on PATH: install Node.js (it brings npm), e.g. `apt-get install nodejs npm`, "
            f"then run `python tools/vendor_widget_js.py` to fetch {' and '.join(PACKAGES)}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}-", dir=dest.parent) as work:
        work_dir = Path(work)
        packed = subprocess.run(
            [npm, "pack", "--silent", *PACKAGES],
            cwd=work_dir,
            capture_output=True,
            text=True,
            env={**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false"},
            check=False,
        )
        if packed.returncode != 0:
            raise RuntimeError(
                f"`npm pack {' '.join(PACKAGES)}` failed with exit code {packed.returncode}:\n"
                f"{packed.stdout}{packed.stderr}"
            )
        staging = work_dir / dest.name
        html_manager = staging / "@jupyter-widgets" / "html-manager"
        _unpack(_tarball(work_dir, "jupyter-widgets-html-manager-"), work_dir / "html-manager")
        _unpack(_tarball(work_dir, "requirejs-"), work_dir / "requirejs")
        html_manager.mkdir(parents=True)
        shutil.copytree(work_dir / "html-manager" / "package" / "dist", html_manager / "dist")
        shutil.copy2(work_dir / "html-manager" / "package" / "package.json", html_manager / "package.json")
        shutil.copy2(work_dir / "requirejs" / "package" / "require.js", staging / REQUIRE_JS_URL)
        (staging / MARKER).write_text(json.dumps({"packages": list(PACKAGES)}, indent=2) + "\n")
        if dest.exists():
            if is_complete(dest):  # another process finished first
                return dest
            shutil.rmtree(dest)  # an older or broken copy
        try:
            staging.rename(dest)
        except OSError:
            if not is_complete(dest):
                raise
    return dest


def install_next_to(directory: Path, source: Path = DEFAULT_DEST) -> None:
    """Make the vendored files available next to a page exported into ``directory``.

    Symbolic links when the file system allows them, copies otherwise.
    """
    for entry in ENTRIES:
        target = Path(directory) / entry
        if target.exists() or target.is_symlink():
            continue
        try:
            target.symlink_to(Path(source).resolve() / entry, target_is_directory=(source / entry).is_dir())
        except OSError:
            if (source / entry).is_dir():
                shutil.copytree(source / entry, target)
            else:
                shutil.copy2(source / entry, target)


def _tarball(directory: Path, prefix: str) -> Path:
    found = sorted(directory.glob(f"{prefix}*.tgz"))
    if len(found) != 1:
        names = sorted(p.name for p in directory.iterdir())
        raise RuntimeError(f"expected one {prefix}*.tgz from npm pack, found {names}")
    return found[0]


def _unpack(tarball: Path, into: Path) -> None:
    with tarfile.open(tarball) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(into, filter="data")
        else:  # Python without the extraction filters (before 3.11.4)
            archive.extractall(into)  # paths are checked below
    for path in into.rglob("*"):
        if not path.resolve().is_relative_to(into.resolve()):
            raise RuntimeError(f"{tarball.name} has a path outside its package: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dest", type=Path, default=DEFAULT_DEST, help=f"where to put the files ({DEFAULT_DEST})"
    )
    args = parser.parse_args(argv)
    try:
        dest = vendor(args.dest)
    except (NpmMissingError, RuntimeError) as error:
        print(f"vendor_widget_js: {error}", file=sys.stderr)
        return 1
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Vendor the JavaScript a notebook exported to static HTML loads: the widget renderer and MathJax.

``jupyter nbconvert --to html`` stores the widget state in the page, but by default the page loads
require.js, the widget renderer and MathJax from a CDN, which an offline machine (or CI) cannot
reach: the widget area stays empty and the maths stays raw ``$$…$$``. This tool fetches the npm
packages once, from the npm registry, with ``npm pack``, and keeps them in ``.cache/`` (gitignored)
in the layout the exported page expects next to itself:

    .cache/widget-js/require.js                                   from requirejs
    .cache/widget-js/@jupyter-widgets/html-manager/dist/...       embed-amd.js, its chunks, the icon fonts
    .cache/mathjax-js/mathjax/MathJax.js, config/, jax/, fonts/   from mathjax 2.7.7 (nbconvert's version)

A page exported with :data:`NBCONVERT_FLAGS` (relative URLs) finds them once these entries are
put next to it (:func:`install_next_to`). ``make site`` (``tools/build_site.py``) does all of this
for every lesson; the browser tests do it for one notebook.

Running it again does nothing once the files are there. It needs ``npm`` (Node.js) on PATH.

Usage:
    python tools/vendor_widget_js.py [--dest DIR] [--mathjax-dest DIR]   prints the two directories
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
from collections.abc import Callable
from dataclasses import dataclass
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
)  # no maths: pages that need it add MATHJAX_URL and the MathJax entries
# require.js paths for the page: the renderer's bundled modules compute where their icon fonts are
# from their own module URL, which without these paths is the folder above dist/ (fonts not found).
REQUIRE_PATHS = {
    name: f"@jupyter-widgets/html-manager/dist/{file}"
    for name, file in (
        ("@jupyter-widgets/html-manager", "html-manager"),
        ("@jupyter-widgets/html-manager/dist/libembed-amd", "libembed-amd"),
    )
}
# What a directory next to an exported page needs: these two entries of the vendored directory.
ENTRIES = ("require.js", "@jupyter-widgets")
MARKER = "vendored.json"

# MathJax for the maths of an exported page. nbconvert's templates (base/mathjax.html.j2) configure
# MathJax 2 (MathJax.Hub.Config, tex2jax) and load it with ?config=TeX-AMS_CHTML-full,Safe: the same
# major version and configuration, loaded from next to the page.
MATHJAX_PACKAGE = "mathjax@2.7.7"
DEFAULT_MATHJAX_DEST = ROOT / ".cache" / "mathjax-js"
MATHJAX_SCRIPT = "mathjax/MathJax.js"
MATHJAX_URL = f"{MATHJAX_SCRIPT}?config=TeX-AMS_CHTML-full,Safe"
# What that configuration loads: the TeX input, the CommonHTML output and its web fonts, the
# extensions the -full configuration and Safe pull in, and the English messages.
MATHJAX_PARTS = (
    "MathJax.js",
    "LICENSE",
    "config/TeX-AMS_CHTML-full.js",
    "config/Safe.js",
    "extensions",
    "jax/element",
    "jax/input/TeX",
    "jax/output/CommonHTML",
    "fonts/HTML-CSS/TeX/woff",
    "fonts/HTML-CSS/TeX/otf",
    "localization/en",
)
MATHJAX_ENTRIES = ("mathjax",)


class NpmMissingError(RuntimeError):
    """``npm`` is not on PATH, so the packages cannot be fetched."""


@dataclass(frozen=True)
class Bundle:
    """npm packages, and how the files an exported page loads are laid out from them.

    ``assemble(unpacked, staging)`` gets ``unpacked``, which holds one folder per package (named
    after the package without its scope and version: ``html-manager``, ``requirejs``, ``mathjax``)
    with the tarball's ``package/`` inside, and fills the empty folder ``staging``. ``required``
    are paths, relative to the vendored folder, that must exist for it to count as complete.
    """

    packages: tuple[str, ...]
    required: tuple[str, ...]
    assemble: Callable[[Path, Path], None]


def _assemble_widget_js(unpacked: Path, staging: Path) -> None:
    html_manager = staging / "@jupyter-widgets" / "html-manager"
    html_manager.mkdir(parents=True)
    shutil.copytree(unpacked / "html-manager" / "package" / "dist", html_manager / "dist")
    shutil.copy2(unpacked / "html-manager" / "package" / "package.json", html_manager / "package.json")
    shutil.copy2(unpacked / "requirejs" / "package" / "require.js", staging / REQUIRE_JS_URL)


def _assemble_mathjax(unpacked: Path, staging: Path) -> None:
    package = unpacked / "mathjax" / "package"
    for part in MATHJAX_PARTS:
        target = staging / "mathjax" / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if (package / part).is_dir():
            shutil.copytree(package / part, target)
        else:
            shutil.copy2(package / part, target)


WIDGET_JS = Bundle(PACKAGES, (REQUIRE_JS_URL, WIDGET_RENDERER_URL), _assemble_widget_js)
MATHJAX = Bundle((MATHJAX_PACKAGE,), tuple(f"mathjax/{part}" for part in MATHJAX_PARTS), _assemble_mathjax)


def is_complete(dest: Path, bundle: Bundle = WIDGET_JS) -> bool:
    """Whether ``dest`` holds the files of exactly ``bundle``'s packages (by default the widget JS)."""
    try:
        marker = json.loads((Path(dest) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("packages") == list(bundle.packages) and all(
        (Path(dest) / path).exists() for path in bundle.required
    )


def vendor(dest: Path = DEFAULT_DEST, bundle: Bundle = WIDGET_JS) -> Path:
    """Fetch and lay out ``bundle`` (the widget JavaScript by default) into ``dest`` unless it is there.

    Returns ``dest``. The files are unpacked into a temporary directory beside ``dest`` and moved
    into place in one rename, so two processes running at once (pytest-xdist workers) never see a
    half-written tree; an older or broken copy is replaced.

    Raises:
        NpmMissingError: ``npm`` is not on PATH.
        RuntimeError: ``npm pack`` failed (its output is in the message).
    """
    dest = Path(dest)
    if is_complete(dest, bundle):
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise NpmMissingError(
            "npm is not on PATH: install Node.js (it brings npm), e.g. `apt-get install nodejs npm`, "
            f"then run `python tools/vendor_widget_js.py` to fetch {' and '.join(bundle.packages)}"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}-", dir=dest.parent) as work:
        work_dir = Path(work)
        packed = subprocess.run(
            [npm, "pack", "--silent", *bundle.packages],
            cwd=work_dir,
            capture_output=True,
            text=True,
            env={**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false"},
            check=False,
        )
        if packed.returncode != 0:
            raise RuntimeError(
                f"`npm pack {' '.join(bundle.packages)}` failed with exit code {packed.returncode}:\n"
                f"{packed.stdout}{packed.stderr}"
            )
        unpacked = work_dir / "unpacked"
        for spec in bundle.packages:
            name = _package_name(spec)  # npm pack names the file @scope/name@1.0 -> scope-name-1.0.tgz
            tarball = _tarball(work_dir, name.lstrip("@").replace("/", "-") + "-")
            _unpack(tarball, unpacked / name.rpartition("/")[2])
        staging = work_dir / dest.name
        staging.mkdir()
        bundle.assemble(unpacked, staging)
        (staging / MARKER).write_text(json.dumps({"packages": list(bundle.packages)}, indent=2) + "\n")
        if dest.exists():
            if is_complete(dest, bundle):  # another process finished first
                return dest
            shutil.rmtree(dest)  # an older or broken copy
        try:
            staging.rename(dest)
        except OSError:
            if not is_complete(dest, bundle):
                raise
    return dest


def vendor_mathjax(dest: Path = DEFAULT_MATHJAX_DEST) -> Path:
    """Fetch MathJax (:data:`MATHJAX_PACKAGE`) into ``dest`` unless it is there; returns ``dest``.

    Only the parts the nbconvert templates' configuration loads are kept (about 5 MB of 71).
    Raises as :func:`vendor` does.
    """
    return vendor(dest, MATHJAX)


def install_next_to(
    directory: Path, source: Path = DEFAULT_DEST, entries: tuple[str, ...] = ENTRIES, copy: bool = False
) -> None:
    """Make the vendored ``entries`` of ``source`` available next to a page exported into ``directory``.

    Symbolic links when the file system allows them and ``copy`` is false, copies otherwise (a
    folder that must work once moved elsewhere, such as the offline site, asks for copies). An
    entry that is already there is left alone.
    """
    for entry in entries:
        target = Path(directory) / entry
        origin = Path(source).resolve() / entry
        if target.exists() or target.is_symlink():
            continue
        if not copy:
            try:
                target.symlink_to(origin, target_is_directory=origin.is_dir())
                continue
            except OSError:
                pass
        if origin.is_dir():
            shutil.copytree(origin, target)
        else:
            shutil.copy2(origin, target)


def _package_name(spec: str) -> str:
    """``@scope/name@1.0`` -> ``@scope/name``; every package here is pinned to a version."""
    name, at, version = spec.rpartition("@")
    if not at or not name or not version:
        raise ValueError(f"package {spec!r} is not pinned: write it as name@version")
    return name


def _tarball(directory: Path, prefix: str) -> Path:
    found = sorted(directory.glob(f"{prefix}[0-9]*.tgz"))
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
        "--dest", type=Path, default=DEFAULT_DEST, help=f"where to put the widget JavaScript ({DEFAULT_DEST})"
    )
    parser.add_argument(
        "--mathjax-dest",
        type=Path,
        default=DEFAULT_MATHJAX_DEST,
        help=f"where to put MathJax ({DEFAULT_MATHJAX_DEST})",
    )
    args = parser.parse_args(argv)
    try:
        print(vendor(args.dest))
        print(vendor_mathjax(args.mathjax_dest))
    except (NpmMissingError, RuntimeError) as error:
        print(f"vendor_widget_js: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

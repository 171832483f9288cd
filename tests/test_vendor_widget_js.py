"""tools/vendor_widget_js.py with a stand-in ``npm`` on PATH: the layouts it builds, once, and its errors."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from tools import vendor_widget_js as vendor

pytestmark = pytest.mark.setup

# `npm pack SPEC...` as npm names and lays out the tarballs, with a file in every path a bundle
# uses (and, for mathjax, the parts of the real package the site leaves out). It logs each call.
FAKE_NPM = textwrap.dedent(
    f"""\
    #!{sys.executable}
    import io, os, sys, tarfile
    CONTENT = {{
        "@jupyter-widgets/html-manager": ["dist/embed-amd.js", "dist/a1b2.woff2", "package.json"],
        "requirejs": ["require.js"],
        "mathjax": {[*vendor.MATHJAX_PARTS, "unpacked/MathJax.js", "test/index.html"]!r},
    }}
    with open(os.environ["FAKE_NPM_LOG"], "a") as log:
        log.write(" ".join(sys.argv[1:]) + "\\n")
    if os.environ.get("FAKE_NPM_FAIL"):
        print("npm error 404 Not Found", file=sys.stderr)
        sys.exit(1)
    for spec in sys.argv[3:]:
        name, _, version = spec.rpartition("@")
        with tarfile.open(name.lstrip("@").replace("/", "-") + f"-{{version}}.tgz", "w:gz") as tar:
            for path in CONTENT[name]:
                if "." not in path.rsplit("/", 1)[-1] and path != "LICENSE":  # a folder: one file in it
                    path += "/inside.js"
                data = f"{{spec}}:{{path}}".encode()
                info = tarfile.TarInfo("package/" + path)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    """
)


@pytest.fixture
def npm(tmp_path, monkeypatch):
    """A stand-in npm first on PATH; returns the path of its log of calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(FAKE_NPM)
    (bin_dir / "npm").chmod(0o755)
    log = tmp_path / "npm.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    return log


def test_the_widget_javascript_is_laid_out_as_the_exported_page_expects(tmp_path, npm):
    dest = vendor.vendor(tmp_path / "widget-js")

    assert dest == tmp_path / "widget-js"
    assert (dest / "require.js").read_text() == "requirejs@2.3.8:require.js"
    assert (dest / vendor.WIDGET_RENDERER_URL).read_text() == (
        "@jupyter-widgets/html-manager@1.0.15:dist/embed-amd.js"
    )
    assert (dest / "@jupyter-widgets/html-manager/dist/a1b2.woff2").is_file(), "the icon fonts beside it"
    assert json.loads((dest / vendor.MARKER).read_text()) == {"packages": list(vendor.PACKAGES)}
    assert vendor.is_complete(dest)
    assert npm.read_text().splitlines() == [f"pack --silent {' '.join(vendor.PACKAGES)}"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "a staging folder was left"


def test_a_complete_folder_is_not_fetched_again_and_an_older_one_is_replaced(tmp_path, npm):
    dest = vendor.vendor(tmp_path / "widget-js")
    vendor.vendor(dest)
    assert len(npm.read_text().splitlines()) == 1

    (dest / vendor.MARKER).write_text(json.dumps({"packages": ["@jupyter-widgets/html-manager@0.20.0"]}))
    assert not vendor.is_complete(dest)
    vendor.vendor(dest)
    assert vendor.is_complete(dest) and len(npm.read_text().splitlines()) == 2


def test_mathjax_keeps_only_what_the_nbconvert_configuration_loads(tmp_path, npm):
    dest = vendor.vendor_mathjax(tmp_path / "mathjax-js")

    root = dest / "mathjax"
    assert (dest / vendor.MATHJAX_SCRIPT).read_text() == "mathjax@2.7.7:MathJax.js"
    assert (root / "jax/output/CommonHTML/inside.js").is_file()
    assert not (root / "unpacked").exists() and not (root / "test").exists()
    assert vendor.is_complete(dest, vendor.MATHJAX) and not vendor.is_complete(dest)
    assert vendor.MATHJAX_URL == "mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"


def test_a_failing_npm_is_reported_with_its_output(tmp_path, npm, monkeypatch):
    monkeypatch.setenv("FAKE_NPM_FAIL", "1")
    with pytest.raises(RuntimeError, match=r"(?s)failed with exit code 1.*404 Not Found"):
        vendor.vendor(tmp_path / "widget-js")
    assert not (tmp_path / "widget-js").exists()


def test_without_npm_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(vendor.NpmMissingError, match=r"install Node\.js"):
        vendor.vendor(tmp_path / "widget-js")
    assert vendor.main(["--dest", str(tmp_path / "w"), "--mathjax-dest", str(tmp_path / "m")]) == 1


def test_an_unpinned_package_is_refused():
    assert vendor._package_name("@jupyter-widgets/html-manager@1.0.15") == "@jupyter-widgets/html-manager"
    assert vendor._package_name("mathjax@2.7.7") == "mathjax"
    for spec in ("mathjax", "@jupyter-widgets/html-manager", "mathjax@"):
        with pytest.raises(ValueError, match="is not pinned"):
            vendor._package_name(spec)


@pytest.mark.parametrize("copy", [False, True])
def test_the_files_are_put_next_to_a_page_linked_or_copied(tmp_path, npm, copy):
    source = vendor.vendor(tmp_path / "widget-js")
    page_dir = tmp_path / "export"
    page_dir.mkdir()
    (page_dir / "require.js").write_text("already here")

    vendor.install_next_to(page_dir, source, copy=copy)

    assert (page_dir / "require.js").read_text() == "already here", "an existing entry was replaced"
    renderer = page_dir / vendor.WIDGET_RENDERER_URL
    assert renderer.read_text() == (source / vendor.WIDGET_RENDERER_URL).read_text()
    assert (page_dir / "@jupyter-widgets").is_symlink() is not copy

"""Redraw the README's screenshots of the widgets: docs/images/player.png and playground.png.

Both come from the real widgets rendered by headless Chromium, from a small notebook executed
and exported to static HTML with the widget JavaScript vendored from npm (the same path as
``tests/browser/test_static_html.py``):

* the player, over a recorded trace, moved to an interesting frame through its frame-number box
  (the jslinks carry it to the slider and the picture, with no kernel);
* the playground, after a few actions made through the methods its buttons call.

Each PNG is a screenshot of the widget's output area, reduced to a palette to keep it small.

Usage:
    python tools/screenshots.py [--out docs/images]

It needs Chromium (/usr/bin/chromium, the Debian package ``chromium``), Playwright and ``npm``.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python tools/screenshots.py`
    sys.path.insert(0, str(ROOT))

from tests.browser import harness  # noqa: E402
from tools import vendor_widget_js  # noqa: E402
from tools.build_course import new_notebook  # noqa: E402

OUT = ROOT / "docs" / "images"
WIDTH = 760  # the widgets' picture width, in CSS pixels
PLAYER_FRAME = 14  # "seq B, token 9: block 6 appended": A's and B's blocks interleaved in the pool
VIEWPORT = {"width": 940, "height": 1000}  # narrow enough that the output area hugs the widget

CELLS = [
    (
        "code",
        f"""\
from paged_kv import PagedKVCacheAllocator
from paged_kv.pictures.widgets import AllocationPlayer, AllocatorPlayground

cache = PagedKVCacheAllocator(num_blocks=12, block_size=4, num_heads=1, head_dim=1, record=True)
cache.allocate_for_sequence("A", 7)
cache.allocate_for_sequence("B", 3)
for _ in range(6):
    cache.append_tokens("A")
    cache.append_tokens("B")
cache.allocate_for_sequence("C", 5)
cache.free_sequence("A")
AllocationPlayer(cache.trace, width={WIDTH})""",
    ),
    (
        "code",
        f"""\
playground = AllocatorPlayground(num_blocks=16, block_size=4, width={WIDTH})
playground.prompt.value = 6
playground.add_sequence()
playground.prompt.value = 3
playground.add_sequence()
for _ in range(3):
    playground.decode_step()
playground.prompt.value = 9
playground.add_sequence()
playground.decode_step()
playground""",
    ),
]


def shrink(png: bytes, colours: int = 128) -> bytes:
    """The PNG reduced to a palette of ``colours``: a third of the size, no visible change."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    reduced = image.quantize(colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    out = io.BytesIO()
    reduced.save(out, format="PNG", optimize=True)
    return out.getvalue()


def take(out: Path) -> list[Path]:
    reason = harness.missing_browser_reason()
    if reason:
        raise SystemExit(f"screenshots: {reason}")
    try:
        widget_js = vendor_widget_js.vendor()
    except vendor_widget_js.NpmMissingError as error:
        raise SystemExit(f"screenshots: {error}") from error
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="paged-kv-screenshots-") as work:
        notebook = new_notebook([(kind, source, []) for kind, source in CELLS])
        html = harness.export_static_html(notebook, Path(work), widget_js)
        with harness.chromium() as browser, harness.new_page(browser, VIEWPORT) as page:
            page.goto(html.as_uri())

            player = harness.player(page)
            player.locator(harness.FRAME_HTML).first.wait_for(state="visible")
            number = player.locator(".widget-text input").first
            number.fill(str(PLAYER_FRAME))
            number.press("Enter")
            harness.wait_until(
                page, lambda: harness.player_frame(player)[0] == PLAYER_FRAME, f"frame {PLAYER_FRAME}"
            )
            number.blur()
            written.append(_save(player, out / "player.png"))

            playground = harness.playground(page)
            harness.wait_until(page, lambda: harness.picture_html(playground), "the playground's picture")
            written.append(_save(playground, out / "playground.png"))
    return written


def _save(element, path: Path) -> Path:
    element.scroll_into_view_if_needed()
    path.write_bytes(shrink(element.screenshot(animations="disabled")))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write the PNGs ({OUT})")
    args = parser.parse_args(argv)
    for path in take(args.out):
        print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

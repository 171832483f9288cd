"""The allocator's picture: render_allocator draws pool, block tables, free list and usage as one SVG.

Most tests read the inline form (``picture``), whose SVG is plain markup; the tests of the two
forms check that the default image form holds exactly the same SVG, on a card of its own colours.
"""

from __future__ import annotations

import base64
import itertools
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv import AllocatorSnapshot, BlockTable, PagedKVCacheAllocator
from paged_kv.pictures.plots import MIN_PAGE_CONTRAST, PAGE_BACKGROUNDS, PALETTE, contrast_ratio
from paged_kv.pictures.pool import (
    CARD_BORDER,
    CARD_INK,
    CARD_PAPER,
    INK,
    PAPER,
    allocator_svg,
    block_tokens,
    plural,
    render_allocator,
    seq_colour,
    short_label,
    snapshot_usage,
    text_colour,
)

pytestmark = [pytest.mark.lesson02, pytest.mark.lesson04]

SVG = "{http://www.w3.org/2000/svg}"
BLOG_SEED = dict(zip("ABCDEF", (9, 17, 33, 5, 41, 12), strict=True))


def cache_with(num_blocks: int, block_size: int, prompts: dict) -> PagedKVCacheAllocator:
    cache = PagedKVCacheAllocator(num_blocks, block_size, 1, 1)
    for seq_id, num_tokens in prompts.items():
        cache.allocate_for_sequence(seq_id, num_tokens)
    return cache


def blog_seed() -> AllocatorSnapshot:
    """The six requests of the blog post in 64 blocks of 16: 11 blocks used, 117 tokens."""
    return cache_with(64, 16, BLOG_SEED).snapshot()


def twelve_sequences() -> AllocatorSnapshot:
    """12 sequences in a 64-block pool, two of the first ones finished so the blocks scatter."""
    cache = cache_with(64, 16, {f"seq-{i}": 5 + 7 * i for i in range(14)})
    cache.free_sequence("seq-1")
    cache.free_sequence("seq-4")
    cache.append_tokens("seq-0", 40)
    return cache.snapshot()


def picture(snapshot: AllocatorSnapshot, **options) -> str:
    """The inline form of the picture, whose SVG and text the tests read directly."""
    return render_allocator(snapshot, inline=True, **options)


def image_svg(markup: str) -> str:
    """The SVG inside the image form's ``data:`` URI."""
    source = re.search(r'<img src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', markup).group(1)
    return base64.b64decode(source).decode("utf-8")


def paint(element: ET.Element, name: str) -> str | None:
    """An element's ``fill`` or ``stroke``: the attribute, or the declaration in its ``style``."""
    declared = dict(d.split(":", 1) for d in element.get("style", "").split(";") if d)
    return element.get(name, declared.get(name))


def parse(markup: str) -> ET.Element:
    """The picture as XML: it must be well formed, whatever the ids and captions held."""
    return ET.fromstring(markup)


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def pool_blocks(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if g.get("data-block") is not None]


def band(block: ET.Element) -> tuple[str, str | None]:
    """A pool block's first rect fill and its label (``None`` for a block with no label)."""
    rect = block.find(f"{SVG}rect")
    label = block.find(f"{SVG}text[@fill]")
    return paint(rect, "fill"), None if label is None else label.text


def outlined(element: ET.Element) -> bool:
    return any(r.get("stroke-width") == "2.5" and r.get("fill") == "none" for r in element.iter(f"{SVG}rect"))


# ------------------------------------------------------------------------------ the pool


def test_each_used_block_has_its_owners_colour_and_label_and_free_blocks_are_paper():
    snapshot = blog_seed()
    blocks = pool_blocks(parse(picture(snapshot)))
    assert [int(b.get("data-block")) for b in blocks] == list(range(64))
    for seq_id, table in snapshot.tables.items():
        owned = [b for b in blocks if band(b) == (seq_colour(seq_id), seq_id)]
        assert sorted(int(b.get("data-block")) for b in owned) == table.block_ids
    free = [b for b in blocks if band(b) == (PAPER, None)]
    assert [int(b.get("data-block")) for b in free] == list(range(11, 64))


def test_a_blocks_bar_is_filled_in_proportion_to_its_tokens_and_the_tail_is_hatched():
    # A holds 9 of 16 slots in block 0: a coloured bar 9/16 of the block, then a hatched tail.
    root = parse(picture(blog_seed()))
    block = pool_blocks(root)[0]
    rects = block.findall(f"{SVG}rect")
    width = float(rects[0].get("width"))
    bar = rects[1]
    assert bar.get("fill") == seq_colour("A")
    assert float(bar.get("width")) == pytest.approx(width * 9 / 16, abs=0.01)
    assert any(r.get("fill", "").startswith("url(#") for r in rects)
    full = pool_blocks(root)[1]  # B's first block: 16 of 16, no tail
    assert not any(r.get("fill", "").startswith("url(#") for r in full.findall(f"{SVG}rect"))


def test_a_shared_block_counts_once_and_shows_its_ref_count():
    snapshot = AllocatorSnapshot(
        num_blocks=4,
        block_size=4,
        free_block_ids=(2, 3),
        ref_counts=(2, 1, 0, 0),
        tables={"A": BlockTable([0, 1], 8), "B": BlockTable([0], 4)},
    )
    markup = picture(snapshot)
    assert "0 \u00d72" in texts(parse(markup))
    assert block_tokens(snapshot) == {0: 4, 1: 4}
    usage = snapshot_usage(snapshot)
    assert (usage.used_blocks, usage.allocated_tokens, usage.internal_fragmentation_tokens) == (2, 8, 0)
    assert "utilization 100.0 %" in markup


def forked() -> AllocatorSnapshot:
    """A of 10 tokens in [0, 1, 2], B forked from it and grown by one: B holds [0, 1, 3]."""
    cache = cache_with(8, 4, {"A": 10})
    cache.fork("A", "B")
    cache.append_tokens("B")
    return cache.snapshot()


def dashed(element: ET.Element) -> bool:
    return any(r.get("stroke-dasharray") for r in element.iter(f"{SVG}rect"))


def test_a_forked_pool_shows_its_shared_blocks_in_the_pool_and_in_every_table():
    snapshot = forked()
    markup = picture(snapshot)
    root = parse(markup)
    blocks = pool_blocks(root)
    assert [int(b.get("data-block")) for b in blocks if dashed(b)] == [0, 1]  # the shared blocks
    assert [band(b) for b in blocks[:4]] == [
        (seq_colour("A"), "A+1"),
        (seq_colour("A"), "A+1"),
        (seq_colour("A"), "A"),
        (seq_colour("B"), "B"),
    ]
    all_texts = texts(root)
    assert (
        all_texts[: all_texts.index("block tables · logical block → physical block")].count("0 \u00d72") == 1
    )
    assert "1 \u00d72" in all_texts and "2 \u00d72" not in all_texts
    # Each table lists block 0 and 1, drawn dashed in both rows.
    tables = [
        g for g in root.iter(f"{SVG}g") if g.get("data-block") is None and g.find(f"{SVG}title") is not None
    ]
    shared_boxes = [g.find(f"{SVG}title").text for g in tables if dashed(g)]
    assert shared_boxes == [
        "seq A: logical block 0 → physical block 0, shared \u00d72",
        "seq A: logical block 1 → physical block 1, shared \u00d72",
        "seq B: logical block 0 → physical block 0, shared \u00d72",
        "seq B: logical block 1 → physical block 1, shared \u00d72",
    ]
    assert "block 0: seq A, B, 4 / 4 slots used (shared by 2 sequences)" in markup
    assert "shared by several sequences (\u00d7n: how many)" in all_texts
    # The gauge counts blocks 0 and 1 once: 4 blocks, 13 tokens (4 + 4 + 2 + 3) in 16 slots.
    assert "used 4 / 8 blocks · 4 free · 2 shared, each counted once" in markup
    assert "utilization 81.2 % · 13 tokens in 16 reserved slots" in markup
    assert picture(forked()) == markup


def test_an_unshared_pool_has_no_dashes_and_no_shared_legend():
    markup = picture(blog_seed())
    assert "stroke-dasharray" not in markup and "shared" not in markup


def test_twelve_sequences_in_64_blocks_keep_twelve_distinct_labels():
    snapshot = twelve_sequences()
    assert len(snapshot.tables) == 12
    root = parse(picture(snapshot))
    labels = {band(b)[1] for b in pool_blocks(root)} - {None}
    assert len(labels) == 12
    # colours cycle after eight, so the label (not only the colour) tells sequences apart
    pairs = {band(b) for b in pool_blocks(root) if band(b)[1]}
    assert len(pairs) == 12 and len({fill for fill, _ in pairs}) == len(PALETTE)


# ------------------------------------------------------------------------------ tables, free list, gauge


def test_the_block_tables_list_each_sequences_physical_blocks_in_logical_order():
    cache = cache_with(6, 4, {"a": 6, "b": 3})
    cache.free_sequence("a")
    cache.allocate_for_sequence("c", 13)  # [3, 4, 5, 0]: scattered
    all_texts = texts(parse(picture(cache.snapshot())))
    start = all_texts.index("c", all_texts.index("block tables · logical block → physical block"))
    assert all_texts[start : start + 6] == ["c", "3", "4", "5", "0", "13 tokens"]
    assert [t for t in all_texts if re.fullmatch(r"L\d+", t)] == ["L0", "L1", "L2", "L3"]


def test_the_free_list_is_drawn_head_first():
    cache = cache_with(6, 4, {"a": 6, "b": 3})
    cache.free_sequence("a")  # free list (3, 4, 5, 0, 1)
    all_texts = texts(parse(picture(cache.snapshot())))
    start = all_texts.index("free list · head first · 5 blocks")
    assert all_texts[start + 1 : start + 6] == ["3", "4", "5", "0", "1"]
    assert all_texts[start + 6 : start + 8] == ["head", "tail"]


def test_a_long_free_list_elides_its_middle_and_says_how_many():
    all_texts = texts(parse(picture(blog_seed())))
    start = all_texts.index("free list · head first · 53 blocks")
    shown = all_texts[start + 1 : all_texts.index("head")]
    gap = shown.index("… 31 more …")
    assert shown[:gap] == [str(b) for b in range(11, 11 + gap)]
    assert shown[gap + 1 :] == [str(b) for b in range(64 - gap, 64)]
    assert len(shown) - 1 + 31 == 53


def test_the_gauge_of_the_blog_seed():
    # 117 tokens in 11 blocks of 16: 176 slots reserved, 59 empty, 66.5 % used.
    markup = picture(blog_seed())
    assert "used 11 / 64 blocks · 53 free" in markup
    assert "utilization 66.5 % · 117 tokens in 176 reserved slots" in markup
    assert "fragmentation 59 slots wasted" in markup


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.integers(0, 6)), max_size=10))
def test_snapshot_usage_is_the_caches_usage(steps):
    # Each step allocates a prompt, then forks the sequence and grows the fork (sharing, copying).
    cache = PagedKVCacheAllocator(32, 4, 1, 1)
    for i, (num_tokens, forks, grow) in enumerate(steps):
        if cache.num_free_blocks * 4 < num_tokens:
            continue
        cache.allocate_for_sequence(i, num_tokens)
        for j in range(forks):
            cache.fork(i, (i, j))
            if cache.num_free_blocks >= 3:
                cache.append_tokens((i, j), grow)
    assert snapshot_usage(cache.snapshot()) == cache.usage()


# ------------------------------------------------------------------------------ highlight and caption


def test_highlighted_blocks_get_a_thick_outline_in_every_section():
    cache = cache_with(8, 4, {"A": 5, "B": 2})
    cache.free_sequence("B")  # block 2 is free again, at the tail
    root = parse(picture(cache.snapshot(), highlight=[1, 2]))
    assert [int(b.get("data-block")) for b in pool_blocks(root) if outlined(b)] == [1, 2]
    frames = [r for r in root.iter(f"{SVG}rect") if r.get("stroke-width") == "2.5" and r.get("rx")]
    assert len(frames) == 4  # pool 1 and 2, A's logical block 1, block 2 on the free list
    assert not any(outlined(b) for b in pool_blocks(parse(picture(cache.snapshot()))))


@pytest.mark.parametrize("bad", [[8], [-1], ["1"], [True]])
def test_a_highlight_outside_the_pool_is_a_value_error(bad):
    with pytest.raises(ValueError, match="highlight"):
        picture(cache_with(8, 4, {}).snapshot(), highlight=bad)


@pytest.mark.parametrize("bad", [0, -5, 7.5, "760"])
def test_the_width_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="width"):
        picture(cache_with(8, 4, {}).snapshot(), width=bad)


def test_the_caption_sits_under_the_picture_escaped():
    root = parse(picture(blog_seed(), caption="seq B, token 17: block 5 appended <b>&"))
    assert root.tag == "div"
    svg, caption = list(root)
    assert svg.tag == f"{SVG}svg"
    assert caption.tag == "div" and caption.text == "seq B, token 17: block 5 appended <b>&"


def test_sequence_ids_and_captions_are_escaped():
    evil = '<script>alert("x")</script>'
    cache = cache_with(8, 4, {evil: 5, "a\x00b\nc": 1, "q\"&'": 2})
    markup = picture(cache.snapshot(), caption=evil + "\n<img src=x onerror=alert(1)>")
    assert "<script" not in markup and "<img" not in markup
    assert "&lt;script&gt;" in markup
    root = parse(markup)  # control characters removed, quotes escaped: still well formed
    assert "".join(list(root)[1].itertext()).startswith('<script>alert("x")</script> <img')


# ------------------------------------------------------------------------------ the HTML itself


def test_the_output_is_deterministic():
    first = picture(twelve_sequences(), caption="c", highlight=[5, 3])
    again = picture(twelve_sequences(), caption="c", highlight={3, 5})
    assert first == again
    assert first != picture(twelve_sequences(), caption="c")


def test_self_contained_one_svg_no_script_no_external_resource():
    markup = picture(twelve_sequences(), caption="x")
    assert markup.count("<svg") == 1
    for forbidden in ("<script", "javascript:", "href", "<img", "<link", "@import", "http://", "https://"):
        assert forbidden not in markup.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_ids_and_css_are_scoped_so_two_pictures_never_clash():
    one, two = picture(cache_with(8, 4, {}).snapshot()), picture(blog_seed())
    scopes = [re.match(r'<div class="pkv (pkv-[0-9a-f]{10})"', m).group(1) for m in (one, two)]
    assert scopes[0] != scopes[1]
    assert picture(blog_seed(), caption="a")[:40] != picture(blog_seed(), caption="b")[:40]
    for markup, scope in zip((one, two), scopes, strict=True):
        assert set(re.findall(r'id="([^"]+)"', markup)) == {f"{scope}-hatch"}
        classes = set(re.findall(r'class="([^"]+)"', markup))
        assert all(c.startswith(f"{scope}-") for c in classes - {f"pkv {scope}", scope})
        rules = re.search(r"<style>(.*)</style>", markup).group(1)
        assert all(rule.startswith(f".{scope} ") for rule in rules.split("}") if rule)


def test_the_picture_is_as_wide_as_asked_and_grows_with_the_rows():
    def size(markup):
        svg = parse(markup).find(f"{SVG}svg")
        return int(svg.get("width")), int(svg.get("height"))

    small, large = size(picture(blog_seed())), size(picture(twelve_sequences()))
    assert small[0] == large[0] == 760
    assert large[1] > small[1]
    assert size(picture(cache_with(256, 16, {}).snapshot()))[1] > size(picture(blog_seed()))[1]
    narrow = picture(twelve_sequences(), width=200)
    assert size(narrow)[0] == 200 and len({band(b)[1] for b in pool_blocks(parse(narrow))} - {None}) == 12


def test_an_empty_and_a_full_pool():
    empty = picture(cache_with(8, 4, {}).snapshot())
    assert "no sequences: every block is free" in empty
    assert "used 0 / 8 blocks · 8 free" in empty and "utilization 0.0 %" in empty
    assert all(band(b) == (PAPER, None) for b in pool_blocks(parse(empty)))
    full = picture(cache_with(4, 4, {"x": 16}).snapshot())
    assert "free list · empty: every block is in use" in full and "fragmentation 0 slots wasted" in full


def test_a_sequence_with_no_block_still_has_its_row():
    all_texts = texts(parse(picture(cache_with(8, 4, {"idle": 0}).snapshot())))
    assert all_texts[all_texts.index("idle") + 1] == "0 tokens · no block"


# ------------------------------------------------------------------------------ colours and labels


def test_a_sequence_keeps_its_colour_from_its_id():
    assert [seq_colour(c) for c in "ABCDEFGH"] == list(PALETTE)
    assert [seq_colour(i) for i in range(8)] == list(PALETTE)
    assert seq_colour("req-3") == seq_colour(3) == seq_colour("D")
    assert seq_colour("I") == seq_colour("A")  # the palette cycles after eight
    assert seq_colour(("any", "id")) in PALETTE and seq_colour(("any", "id")) == seq_colour(("any", "id"))


def test_label_text_contrasts_with_its_fill():
    assert text_colour("#000000") == "#FFFFFF" and text_colour("#0072B2") == "#FFFFFF"
    assert text_colour("#F0E442") == "#000000" and text_colour("#E69F00") == "#000000"
    labels = {fill: round(contrast(text_colour(fill), fill), 2) for fill in PALETTE}
    assert min(labels.values()) >= 4.5, labels  # WCAG AA for text, on every sequence colour


def test_every_sequence_colour_stands_out_on_every_page_light_or_dark():
    # The widgets and the inline picture have no paper of their own: a block's fill sits on the
    # page, white or near black. 3:1 is WCAG's minimum for graphics (1.4.11).
    assert MIN_PAGE_CONTRAST == 3 and len(set(PALETTE)) == len(PALETTE) == 8
    assert CARD_PAPER in PAGE_BACKGROUNDS.values()  # the image form's card is one of the pages
    low = [
        (fill, page, round(contrast(fill, background), 2))
        for fill in PALETTE
        for page, background in PAGE_BACKGROUNDS.items()
        if contrast(fill, background) < MIN_PAGE_CONTRAST
    ]
    assert not low, low
    assert all(0.165 <= luminance(fill) <= 0.28 for fill in PALETTE)  # the band the palette states
    assert contrast_ratio("#0F70D6", "#212121") == pytest.approx(contrast("#0F70D6", "#212121"))


def css_colour(css: str, variable: str) -> str:
    """A theme variable's colour as ``#RRGGBB``: ``#111``, ``white`` or ``var(--md-grey-900,#212121)``."""
    value = re.search(rf"{variable}:\s*([^;]+);", css).group(1).strip()
    value = re.sub(r"^var\(--[\w-]+,\s*(.+)\)$", r"\1", value).strip()
    value = {"white": "#FFFFFF", "black": "#000000"}.get(value, value)
    if re.fullmatch(r"#[0-9a-fA-F]{3}", value):
        value = "#" + "".join(c * 2 for c in value[1:])
    return value.upper()


def test_the_page_backgrounds_are_those_of_the_installed_jupyterlab_themes():
    jupyterlab = pytest.importorskip("jupyterlab")
    themes = Path(jupyterlab.__file__).parent / "themes" / "@jupyterlab"
    dark = (themes / "theme-dark-extension" / "index.css").read_text()
    light = (themes / "theme-light-extension" / "index.css").read_text()
    seen = {
        "dark 0": css_colour(dark, "--jp-layout-color0"),
        "dark 1": css_colour(dark, "--jp-layout-color1"),
        "light 0": css_colour(light, "--jp-layout-color0"),
        "light 1": css_colour(light, "--jp-layout-color1"),
    }
    assert seen == {"dark 0": "#111111", "dark 1": "#212121", "light 0": "#FFFFFF", "light 1": "#FFFFFF"}
    assert set(seen.values()) <= set(PAGE_BACKGROUNDS.values())


# Simulated colour vision deficiency (Machado, Oliveira and Fernandes 2009, severity 1), applied to
# linear RGB.
CVD = {
    "protanopia": (
        (0.152286, 1.052583, -0.204868),
        (0.114503, 0.786281, 0.099216),
        (-0.003882, -0.048116, 1.051998),
    ),
    "deuteranopia": (
        (0.367322, 0.860646, -0.227968),
        (0.280085, 0.672501, 0.047413),
        (-0.011820, 0.042940, 0.968881),
    ),
}


def cielab(colour: str, deficiency: str | None = None) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of ``#RRGGBB``, as a reader with ``deficiency`` sees it (roughly)."""

    def linear(pair: str) -> float:
        c = int(pair, 16) / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    rgb = [linear(colour[i : i + 2]) for i in (1, 3, 5)]
    if deficiency:
        rgb = [
            min(1.0, max(0.0, sum(m * c for m, c in zip(row, rgb, strict=True)))) for row in CVD[deficiency]
        ]
    r, g, b = rgb
    xyz = (
        (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047,
        0.2126729 * r + 0.7151522 * g + 0.0721750 * b,
        (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883,
    )
    fx, fy, fz = (t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def test_the_sequence_colours_stay_apart_for_colour_blind_readers_too():
    # CIE76 distances (2.3 is a just noticeable difference): the closest pair is blue and violet
    # (25), and in the simulations blue and violet, then orange and olive (11, protanopia), and red
    # and olive (11, deuteranopia). Okabe-Ito's closest were 26, 21 and 17.
    for deficiency, minimum in ((None, 20), ("protanopia", 9), ("deuteranopia", 9)):
        closest = min(
            (math.dist(cielab(one, deficiency), cielab(two, deficiency)), one, two)
            for one, two in itertools.combinations(PALETTE, 2)
        )
        assert closest[0] >= minimum, (deficiency, closest)


def test_short_labels_keep_both_ends():
    assert short_label("A") == "A"
    assert short_label("request-17") == "re…-17"
    assert short_label("request-17", 5) == "re…17"
    assert short_label("request-17", 12) == "request-17"
    assert short_label(12345678) == "12…678"
    assert short_label("tab\there") == "ta…ere"


# ------------------------------------------------------------------------------ the two forms and themes


def luminance(colour: str) -> float:
    """WCAG relative luminance of ``#RRGGBB``."""

    def channel(pair: str) -> float:
        c = int(pair, 16) / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(colour[i : i + 2]) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(one: str, two: str) -> float:
    high, low = sorted((luminance(one), luminance(two)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def test_the_default_form_is_an_image_of_the_same_svg_on_a_card_of_its_own_colours():
    snapshot, options = forked(), {"caption": "after fork", "highlight": [3]}
    markup, inline = render_allocator(snapshot, **options), picture(snapshot, **options)
    assert "<svg" not in markup and markup.count("<img") == 1  # an untrusted notebook keeps an <img>
    # Inside the image, which is a document of its own, the style rules still find their elements.
    svg = ET.fromstring(image_svg(markup))
    scope = svg.get("class")
    assert re.match(r"pkv-[0-9a-f]{10}$", scope) and markup.startswith(f'<div class="pkv {scope}"')
    rules = [rule for rule in svg.find(f"{SVG}defs/{SVG}style").text.split("}") if rule]
    assert rules and all(rule.startswith(f".{scope} ") for rule in rules)
    inline_svg = re.search(r"<svg.*</svg>", inline).group(0)
    assert image_svg(markup) == inline_svg  # one drawing, two wrappers
    card = parse(markup)
    style = card.get("style")
    assert f"color:{CARD_INK}" in style and f"background-color:{CARD_PAPER}" in style
    assert f"border:1px solid {CARD_BORDER}" in style
    img, caption = list(card)
    assert img.get("alt") == "KV cache pool: 4 of 8 blocks used by 2 sequences"
    assert (img.get("width"), img.get("height")) == (
        ET.fromstring(inline_svg).get("width"),
        ET.fromstring(inline_svg).get("height"),
    )
    assert caption.text == "after fork" and "color" not in caption.get("style")  # the card's own ink


def test_the_inline_form_paints_ink_and_paper_with_the_pages_colours():
    markup = picture(forked(), caption="c")
    root = parse(markup)
    assert root.get("style").endswith("--pkv-ink:currentColor;--pkv-paper:transparent")
    assert "color:" not in list(root)[1].get("style")  # the caption inherits the page's text colour
    svg = root.find(f"{SVG}svg")
    background = svg.find(f"{SVG}rect")
    assert paint(background, "fill") == PAPER and background.get("width") == svg.get("viewBox").split()[2]
    rules = re.search(r"<style>(.*)</style>", markup).group(1)
    assert rules.count(f"fill:{INK}") == 3  # titles, notes and small print


def test_every_text_contrasts_with_what_it_sits_on_in_the_image():
    # In the image the custom properties are undefined: ink and paper are their fallbacks. A text
    # is either ink on paper (the class rules) or a label on a block's fixed fill, in text_colour.
    assert INK.endswith(f", {CARD_INK})") and PAPER.endswith(f", {CARD_PAPER})")
    assert contrast(CARD_INK, CARD_PAPER) >= 7
    root = ET.fromstring(allocator_svg(forked(), highlight=[0]))
    for group in root.iter(f"{SVG}g"):
        fill = paint(group.find(f"{SVG}rect"), "fill")
        for label in group.findall(f"{SVG}text[@fill]"):
            assert label.get("fill") == text_colour(fill) and contrast(label.get("fill"), fill) >= 3
    unpainted = [t for t in root.iter(f"{SVG}text") if t.get("fill") is None]
    assert unpainted and all(t.get("class").split("-")[-1] in {"title", "note", "small"} for t in unpainted)
    strokes = {paint(r, "stroke") for r in root.iter(f"{SVG}rect")} - {None}
    assert strokes <= {INK, "#BBBBBB"}  # outlines in ink; free blocks' light edge


def test_allocator_svg_is_the_picture_alone_and_checks_its_arguments():
    svg = allocator_svg(blog_seed(), width=400)
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg" and root.get("width") == "400"
    assert "used 11 / 64 blocks · 53 free" in svg
    with pytest.raises(ValueError, match="width"):
        allocator_svg(blog_seed(), width=0)
    with pytest.raises(ValueError, match="highlight"):
        allocator_svg(blog_seed(), highlight=[64])


def test_one_block_one_slot_one_token_are_singular():
    cache = cache_with(2, 1, {"A": 1})  # one block used, one free, one slot a block
    markup = picture(cache.snapshot())
    for words in (
        "physical pool · 2 blocks of 1 slot",
        "free list · head first · 1 block<",
        "1 token<",
        "1 token in 1 reserved slot",
        "fragmentation 0 slots wasted",
    ):
        assert words in markup
    assert "1 blocks" not in markup and "1 slots" not in markup and "1 tokens" not in markup
    assert [plural(n, "block") for n in (0, 1, 2)] == ["0 blocks", "1 block", "2 blocks"]

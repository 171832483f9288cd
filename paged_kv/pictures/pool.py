"""A picture of the block pool, drawn as one SVG from an :class:`AllocatorSnapshot` (lessons 00-09, 13).

:func:`render_allocator` is a pure function: the same snapshot, caption, highlight and width always
give the same HTML string, with no JavaScript, no external resource, no random id and no timestamp.
From top to bottom it draws:

* **the physical pool**, a grid of blocks (16 to a row at the default width). A used block has a
  band in its owner's colour holding the owner's short label, so colour is never the only cue, and
  under it a bar filled in that colour in proportion to the tokens the block holds; the unused tail
  of the bar is grey and hatched (wasted slots). A free block is empty, with a light border. The
  block id sits under each block (with its ref count, ``\u00d72``, when tables share it), and the blocks
  an event touched (``highlight``) get a thick outline in the ink colour here and in the sections below. A
  shared block (after a fork) has a dashed frame, here and in every table that holds it, and the
  label of its first holder followed by how many more (``A+1``);
* **the block tables**, one row per sequence: its label, its logical blocks L0, L1, ... in order,
  each a box in the owner's colour showing the physical block id, and the number of tokens; a
  shared block appears in the row of every sequence that holds it;
* **the free list** in order, head first, eliding the middle when it does not fit the width;
* **a usage gauge**: a bar of used against free blocks, the utilization (tokens held / slots
  reserved) and the fragmentation (slots reserved but empty), as
  :meth:`~paged_kv.kv.cache.PagedKVCacheAllocator.usage` measures them (a shared block counts once,
  and the gauge says how many are shared: :func:`snapshot_usage`);
* the caption, under the picture, in its own ``<div>``.

**The null block.** A snapshot whose ``null_block`` is set (a hybrid model's pool, lesson 13) draws
that block in grey, labelled ``null``: it belongs to no table and is never free. A table entry that
names it (a block that left a sliding window) is a grey ``null`` box, not a block the tables
share; the gauge counts neither the null block nor its entries, as vLLM's usage leaves it out.

**Two forms, one SVG.** The drawing's text, outlines and background are painted with two CSS
custom properties, ``--pkv-ink`` and ``--pkv-paper``, whose fallbacks are dark grey on white; the
block fills (the palette, grey waste) are fixed colours whose labels are black or white to match.

* By default (``inline=False``) the SVG goes into an ``<img>`` as a ``data:`` URI, on a card that
  carries its own white background and dark text. An image cannot see the page's CSS, so the
  fallbacks apply: the picture reads the same in every theme. This is the form for outputs kept in
  a notebook: an untrusted notebook (one opened before its cells run) sanitises HTML and strips an
  inline ``<svg>``, but keeps an ``<img>`` with a ``data:`` URI and the card's colours.
* With ``inline=True`` the SVG is inline and follows the page: ink is the page's text colour
  (``currentColor``) and paper the page's background (transparent), so text and background come
  from the same source and contrast whatever the theme (JupyterLab light or dark, Notebook 7, VS
  Code). Blocks show tooltips on hover. The widgets use it: a widget view is only ever drawn
  where the notebook is trusted.

Colours are the :data:`~paged_kv.pictures.plots.PALETTE` of :mod:`paged_kv.pictures.plots`, eight
colours that each keep 3:1 contrast against every page the picture meets, white or dark
(:data:`~paged_kv.pictures.plots.PAGE_BACKGROUNDS`): the inline form has no paper of its own, so a
block stands out in JupyterLab's dark theme as in its light one. A sequence keeps its colour from one
frame of an animation to the next because the colour comes from its id, not from its position: a
trailing number or letter picks the palette entry (``A``, ``B``, ``C`` and ``req-0``, ``req-1``,
``req-2`` get consecutive colours, cycling after eight), any other id a stable hash. A label on a
fill is black or white, whichever contrasts more (:func:`text_colour`, 4.5:1 or more on each colour).
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import re
import zlib
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from paged_kv.core.block import BlockTable
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.core.usage import BlockUsage
from paged_kv.core.usage import block_tokens as tokens_per_block
from paged_kv.pictures.plots import FREE, PALETTE, WASTE, text_colour
from paged_kv.validate import check_count

__all__ = [
    "allocator_svg",
    "block_tokens",
    "plural",
    "render_allocator",
    "seq_colour",
    "short_label",
    "snapshot_usage",
    "text_colour",
]

FONT = "DejaVu Sans, Verdana, Helvetica, Arial, sans-serif"
CARD_INK, CARD_PAPER, CARD_BORDER = "#222222", "#FFFFFF", "#D0D0D0"  # the image form's own colours
INK = f"var(--pkv-ink, {CARD_INK})"  # text, outlines, frames: the page's text colour when inline
PAPER = f"var(--pkv-paper, {CARD_PAPER})"  # the background, and a free block: the page's when inline
INLINE_COLOURS = "--pkv-ink:currentColor;--pkv-paper:transparent"
USED_GAUGE = "#888888"  # mid grey: it stands out on a light and on a dark background
NULL_FILL = "#808080"  # the null block: 3.9:1 or more against every page, 5.3:1 under its black label
MARGIN = 12
MIN_LAYOUT_WIDTH = 320  # narrower pictures are laid out at this width and scaled down
BLOCKS_PER_ROW = 16
POOL_LABEL_CHARS = 6
BAND_H, BAR_H, POOL_ROW_H = 15.0, 19.0, 50.0  # a pool block: label band, fill bar, row pitch
TABLE_LABEL_CHARS = 12
TABLE_BOX_W, TABLE_BOX_H = 30.0, 20.0  # a logical block in a block table


# ------------------------------------------------------------------------------ public helpers


def snapshot_usage(snapshot: AllocatorSnapshot) -> BlockUsage:
    """The pool's metrics from a snapshot: exactly what the allocator's ``usage()`` measured then.

    Used blocks are the blocks off the free list; a block shared by several tables (a fork, a
    cached prefix) counts once, and so do the tokens it holds (:meth:`BlockUsage.of_tables`). A
    pool's null block is left out of the blocks and of the used ones, and a table's null entries
    hold no token, as vLLM's ``BlockPool.get_usage`` counts.
    """
    null, size = snapshot.null_block, snapshot.block_size
    tables = snapshot.tables.values()
    return BlockUsage.of_tables(
        tables if null is None else [_without_nulls(table, null, size) for table in tables],
        num_blocks=snapshot.num_blocks - (null is not None),
        free_blocks=len(snapshot.free_block_ids),
        block_size=size,
    )


def _without_nulls(table: BlockTable, null: int, block_size: int) -> BlockTable:
    """The table without its null entries, and without the tokens they stood for.

    The null entries lead a table (the blocks before a window), so the blocks left keep their tokens.
    """
    nulled = sum(
        min(block_size, max(0, table.num_tokens - logical * block_size))
        for logical, block_id in enumerate(table.block_ids)
        if block_id == null
    )
    return BlockTable([b for b in table.block_ids if b != null], table.num_tokens - nulled)


def block_tokens(snapshot: AllocatorSnapshot) -> dict[int, int]:
    """How many tokens each block held by a table stores: the most any of its holders keeps there.

    >>> from paged_kv.core.block import BlockTable
    >>> block_tokens(AllocatorSnapshot(4, 16, (3,), (1, 1, 1, 0), {"A": BlockTable([2, 0, 1], 40)}))
    {2: 16, 0: 16, 1: 8}

    A pool's null block stores nothing: it is left out.
    """
    tokens = tokens_per_block(snapshot.tables.values(), snapshot.block_size)
    tokens.pop(snapshot.null_block, None)
    return tokens


def seq_colour(seq_id: Hashable) -> str:
    """The palette colour of a sequence, fixed by its id (so it never changes between frames).

    An ``int`` id, or a string ending in digits, picks entry ``number % 8``; a string ending in a
    letter picks its place in the alphabet; anything else a CRC-32 of its text.

    >>> [seq_colour(x) == seq_colour(y) for x, y in [("A", 0), ("req-b", "B"), ("seq-9", 1), ("A", "B")]]
    [True, True, True, False]
    """
    text = str(seq_id)
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):
        index = seq_id
    elif match := re.search(r"(\d+)$", text):
        index = int(match.group(1)[-6:])
    elif text and text[-1].isascii() and text[-1].isalpha():
        index = ord(text[-1].lower()) - ord("a")
    else:
        index = zlib.crc32(text.encode("utf-8", "replace"))
    return PALETTE[index % len(PALETTE)]


def short_label(seq_id: Hashable, limit: int = POOL_LABEL_CHARS) -> str:
    """The id as text, at most ``limit`` characters: the middle of a longer one becomes ``…``.

    Both ends are kept, since ids often differ only at the end (``req-17``, ``req-18``).

    >>> short_label("A"), short_label("request-17"), short_label("request-17", 12)
    ('A', 're…-17', 'request-17')
    """
    text = _printable(str(seq_id))
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head) :]


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, with an ``s`` unless the count is exactly one.

    >>> plural(1, "block"), plural(2, "block"), plural(0, "free slot")
    ('1 block', '2 blocks', '0 free slots')
    """
    return f"{count} {noun}{'' if count == 1 else 's'}"


# ------------------------------------------------------------------------------ the picture


def render_allocator(
    snapshot: AllocatorSnapshot,
    *,
    caption: str = "",
    highlight: Iterable[int] = (),
    width: int = 760,
    inline: bool = False,
) -> str:
    """A self-contained HTML string picturing the snapshot: a ``<div>``, the picture, the caption.

    Args:
        snapshot: what to draw, usually ``cache.snapshot()`` or a trace frame's ``snapshot``.
        caption: one line shown under the picture (HTML-escaped).
        highlight: ids of blocks to outline, such as the blocks the last event touched.
        width: the picture's width in pixels; the height grows with the rows it needs.
        inline: ``False`` (the default) puts the SVG in an ``<img>`` on a card with its own white
            background and dark text, which shows in any theme and survives the sanitiser of an
            untrusted notebook. ``True`` draws the SVG inline, in the page's own text colour on the
            page's background, with tooltips; an untrusted notebook strips it, so keep it for
            widgets and other trusted views.

    Raises:
        ValueError: ``width`` is not a positive integer, or a highlighted id is not a block of the pool.
    """
    width = check_count("width", width, minimum=1)
    scene = _scene(snapshot, highlight, width)
    # The ids of the hatch pattern and the CSS scope come from a hash of the picture and caption:
    # the output stays deterministic, and different pictures on one page never share an id (a
    # hidden frame's pattern, found first by id, could otherwise blank the hatching of a shown one).
    drawn = _svg(scene, "pkv", width) + "\0" + caption
    scope = "pkv-" + hashlib.sha1(drawn.encode("utf-8", "replace")).hexdigest()[:10]
    svg = _svg(scene, scope, width)
    caption_div = (
        f'<div class="{scope}-caption" style="font-family:{FONT};font-size:13px;line-height:1.4;'
        f'min-height:1.4em;padding:2px {MARGIN}px 4px">{_esc(caption)}</div>'
    )
    if inline:
        return (
            f'<div class="pkv {scope}" style="width:{width}px;max-width:100%;{INLINE_COLOURS}">'
            f"{svg}{caption_div}</div>"
        )
    height = re.search(r'height="(\d+)"', svg).group(1)
    source = "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return (
        f'<div class="pkv {scope}" style="width:{width}px;max-width:100%;color:{CARD_INK};'
        f'background-color:{CARD_PAPER};border:1px solid {CARD_BORDER};border-radius:4px">'
        f'<img src="{source}" alt="{_esc(_summary(scene))}" width="{width}" height="{height}" '
        f'style="display:block;max-width:100%;height:auto"/>{caption_div}</div>'
    )


def allocator_svg(snapshot: AllocatorSnapshot, *, highlight: Iterable[int] = (), width: int = 760) -> str:
    """The picture alone: the ``<svg>`` document that both forms of :func:`render_allocator` show.

    Its ids and CSS are scoped ``pkv-``; in an HTML page with several pictures, use
    :func:`render_allocator`, which scopes each picture apart.

    Raises:
        ValueError: as :func:`render_allocator`.
    """
    width = check_count("width", width, minimum=1)
    return _svg(_scene(snapshot, highlight, width), "pkv", width)


def _scene(snapshot: AllocatorSnapshot, highlight: Iterable[int], width: int) -> _Scene:
    """The checked layout: every highlighted id must be a block of the pool."""
    marked = frozenset(check_count("highlight", b) for b in highlight)
    outside = sorted(b for b in marked if b >= snapshot.num_blocks)
    if outside:
        raise ValueError(f"highlight holds {outside}, not blocks of a pool of {snapshot.num_blocks}")
    return _Scene(snapshot, marked, max(width, MIN_LAYOUT_WIDTH))


def _summary(scene: _Scene) -> str:
    """One sentence for screen readers: the SVG's label and the image's alternative text."""
    usage = snapshot_usage(scene.snapshot)
    counted = usage.used_blocks + usage.free_blocks  # the null block is not counted
    return (
        f"KV cache pool: {usage.used_blocks} of {plural(counted, 'block')} used "
        f"by {plural(len(scene.snapshot.tables), 'sequence')}"
    )


@dataclass(frozen=True)
class _Scene:
    """What every section needs: the snapshot, the outlined blocks, the layout width, the owners."""

    snapshot: AllocatorSnapshot
    marked: frozenset[int]
    width: int

    @property
    def inner(self) -> float:
        return self.width - 2 * MARGIN

    def owners(self) -> dict[int, list[Hashable]]:
        """Each used block's holders, in table order (the null block has none: it stands in)."""
        owners: dict[int, list[Hashable]] = {}
        for seq_id, table in self.snapshot.tables.items():
            for block_id in table.block_ids:
                if block_id != self.snapshot.null_block:
                    owners.setdefault(block_id, []).append(seq_id)
        return owners

    def refs(self, block_id: int) -> int:
        """The block's ref count (0 when the snapshot has none for it, and for the null block)."""
        counts = self.snapshot.ref_counts
        if block_id == self.snapshot.null_block:
            return 0
        return counts[block_id] if block_id < len(counts) else 0

    def any_shared(self) -> bool:
        """Whether some block has more than one holder."""
        return any(self.refs(block_id) > 1 for block_id in range(len(self.snapshot.ref_counts)))

    def tokens_in(self, seq_id: Hashable, logical: int) -> int:
        """How many of the sequence's tokens its ``logical``-th block holds."""
        size = self.snapshot.block_size
        return min(size, max(0, self.snapshot.tables[seq_id].num_tokens - logical * size))


def _svg(scene: _Scene, scope: str, width: int) -> str:
    """The ``<svg>`` element: the four sections stacked, each returning its elements and height."""
    parts: list[str] = []
    y = 6.0
    for section in (_pool, _tables, _free_list, _gauge):
        elements, height = section(scene, scope, y)
        parts += elements
        y += height + 14
    height = math.ceil(y)
    label = _esc(_summary(scene))
    scale = width / scene.width
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{math.ceil(height * scale)}" '
        f'viewBox="0 0 {scene.width} {height}" class="{scope}" role="img" aria-label="{label}" '
        'style="display:block">'
        f"<title>{label}</title>{_defs(scope)}"
        + _rect(0, 0, scene.width, height, PAPER)
        + "".join(parts)
        + "</svg>"
    )


def _defs(scope: str) -> str:
    """The hatch pattern of wasted slots and the text styles, both scoped by ``scope``.

    The rules select descendants of the class ``scope``, which the ``<svg>`` element itself carries:
    they apply inside an image (a document of its own) as well as inline.
    """
    style = (
        f".{scope} text{{font-family:{FONT}}}"
        f".{scope} .{scope}-title{{font-size:12px;font-weight:bold;fill:{INK}}}"
        f".{scope} .{scope}-note{{font-size:11px;fill:{INK}}}"
        f".{scope} .{scope}-small{{font-size:9px;fill:{INK}}}"
        f".{scope} .{scope}-label{{font-size:10px;font-weight:bold}}"
        f".{scope} .{scope}-label-long{{font-size:9px;font-weight:bold}}"
    )
    return (
        f"<defs><style>{style}</style>"
        f'<pattern id="{scope}-hatch" patternUnits="userSpaceOnUse" width="5" height="5" '
        f'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="5" '
        f'stroke="{WASTE["edgecolor"]}" stroke-width="1.6"/></pattern></defs>'
    )


# ------------------------------------------------------------------------------ the sections


def _pool(scene: _Scene, scope: str, top: float) -> tuple[list[str], float]:
    """The physical pool as a grid, ``BLOCKS_PER_ROW`` blocks a row (fewer in a narrow picture)."""
    snap = scene.snapshot
    cols = BLOCKS_PER_ROW if scene.inner / BLOCKS_PER_ROW >= 34 else max(4, int(scene.inner // 34))
    pitch = scene.inner / cols
    title = f"physical pool · {plural(snap.num_blocks, 'block')} of {plural(snap.block_size, 'slot')}"
    out = [_text(MARGIN, top + 12, title, scope, "title")]
    legend, legend_h = _legend(scene, scope, top + 20)
    out += legend
    grid_top = top + 26 + legend_h
    owners, stored = scene.owners(), block_tokens(snap)
    for block_id in range(snap.num_blocks):
        x = MARGIN + (block_id % cols) * pitch
        y = grid_top + (block_id // cols) * POOL_ROW_H
        holders = owners.get(block_id, [])
        out.append(_pool_block(scene, scope, block_id, x, y, pitch - 5, holders, stored.get(block_id, 0)))
    rows = math.ceil(snap.num_blocks / cols)
    return out, grid_top - top + rows * POOL_ROW_H - 6


def _pool_block(
    scene: _Scene,
    scope: str,
    block_id: int,
    x: float,
    y: float,
    w: float,
    holders: list[Hashable],
    tokens: int,
) -> str:
    """One block: the first holder's band and label over a bar of the tokens it holds, or white when free.

    The id (and the ref count, when tables share the block) goes under it; a marked block is outlined.
    A block several tables share gets a dashed frame and the label ``A+1`` (its first holder and how
    many more); the tooltip names every holder.
    """
    snap = scene.snapshot
    height = BAND_H + BAR_H
    refs = scene.refs(block_id) or len(holders)
    if block_id == snap.null_block:
        tip = (
            f"block {block_id}: the null block, never allocated nor freed; a table names it for a block "
            "that left a sliding window, and the attention never reads it"
        )
        body = [
            _rect(x, y, w, height, NULL_FILL, INK, 0.8),
            _text(x + w / 2, y + 11, "null", scope, "label", "middle", text_colour(NULL_FILL)),
        ]
    elif holders:
        fill = seq_colour(holders[0])
        more = f"+{len(holders) - 1}" if len(holders) > 1 else ""
        room = max(2, min(POOL_LABEL_CHARS, int(w // 6)) - len(more))  # 6px a character
        label = short_label(holders[0], room) + more
        kind = "label" if len(label) <= 4 else "label-long"  # a smaller font keeps 6 characters inside
        names = ", ".join(short_label(h, 40) for h in holders)
        tip = f"block {block_id}: seq {names}, {tokens} / {plural(snap.block_size, 'slot')} used"
        if len(holders) > 1:
            tip += f" (shared by {len(holders)} sequences)"
        body = [
            _rect(x, y, w, BAND_H, fill),
            _text(x + w / 2, y + 11, label, scope, kind, "middle", text_colour(fill)),
            *_bar(x, y + BAND_H + 1, w, BAR_H - 1, tokens / snap.block_size, fill, scope),
            _dashed(x, y, w, height) if refs > 1 else _rect(x, y, w, height, "none", INK, 0.8),
        ]
    elif refs:  # held by something other than a table (a cache of prefixes, say)
        tip = f"block {block_id}: in use, held by no table"
        body = [_rect(x, y, w, height, WASTE["facecolor"], INK, 0.8)]
    else:
        tip = f"block {block_id}: free"
        body = [_rect(x, y, w, height, PAPER, FREE["edgecolor"], 1)]
    shared = f" \u00d7{refs}" if refs > 1 else ""
    body.append(_text(x + w / 2, y + height + 10, f"{block_id}{shared}", scope, "small", "middle"))
    if block_id in scene.marked:
        body.append(_outline(x, y, w, height))
    return f'<g class="{scope}-block" data-block="{block_id}"><title>{_esc(tip)}</title>{"".join(body)}</g>'


def _legend(scene: _Scene, scope: str, top: float) -> tuple[list[str], float]:
    """What the fills and the outline mean, on as many lines as the width needs; returns its height."""
    entries = [
        ("held", "tokens held (colour and label: the sequence)"),
        ("waste", "reserved, empty: wasted"),
        ("free", "free"),
        ("mark", "touched by this step"),
    ]
    if scene.any_shared():
        entries.append(("shared", "shared by several sequences (\u00d7n: how many)"))
    if scene.snapshot.null_block is not None:
        entries.append(("null", "the null block: stands in for blocks that left a window"))
    x, y, out = float(MARGIN), top, []
    for kind, words in entries:
        advance = 18 + 4.8 * len(words) + 16
        if x > MARGIN and x + advance > scene.width - MARGIN:
            x, y = float(MARGIN), y + 16
        if kind == "held":
            out += [_rect(x, y + 2, 7, 10, PALETTE[0]), _rect(x + 7, y + 2, 7, 10, PALETTE[1])]
        elif kind == "waste":
            out += _bar(x, y + 2, 14, 10, 0.0, "none", scope)
        elif kind == "free":
            out.append(_rect(x, y + 2, 14, 10, PAPER, FREE["edgecolor"], 1))
        elif kind == "shared":
            out.append(_dashed(x, y + 2, 14, 10))
        elif kind == "null":
            out.append(_rect(x, y + 2, 14, 10, NULL_FILL, INK, 0.6))
        else:
            out.append(_rect(x, y + 2, 14, 10, "none", INK, 2.5))
        out.append(_text(x + 18, y + 11, words, scope, "small"))
        x += advance
    return out, y - top + 16


def _tables(scene: _Scene, scope: str, top: float) -> tuple[list[str], float]:
    """One row per sequence: label, logical blocks L0, L1, ... as boxes of physical ids, tokens."""
    snap = scene.snapshot
    out = [_text(MARGIN, top + 12, "block tables · logical block → physical block", scope, "title")]
    if not snap.tables:
        out.append(_text(MARGIN, top + 32, "no sequences: every block is free", scope, "note"))
        return out, 38
    label_w, tokens_w, pitch, line_h = 104.0, 78.0, TABLE_BOX_W + 3, 26.0
    per_line = max(1, int((scene.inner - label_w - tokens_w) // pitch))
    longest = max(table.num_blocks for table in snap.tables.values())
    x0 = MARGIN + label_w
    for logical in range(min(longest, per_line)):
        out.append(
            _text(x0 + logical * pitch + TABLE_BOX_W / 2, top + 30, f"L{logical}", scope, "small", "middle")
        )
    y = top + 36
    for seq_id, table in snap.tables.items():
        fill = seq_colour(seq_id)
        out += [
            _rect(MARGIN, y + 4, 12, 12, fill, INK, 0.6),
            _text(MARGIN + 17, y + 14, short_label(seq_id, TABLE_LABEL_CHARS), scope, "note"),
        ]
        lines = max(1, math.ceil(table.num_blocks / per_line))
        for logical in range(table.num_blocks):
            line, col = divmod(logical, per_line)
            if col == 0 and line:
                out.append(_text(x0 - 6, y + line * line_h + 14, f"L{logical} →", scope, "small", "end"))
            out.append(_table_block(scene, scope, seq_id, logical, x0 + col * pitch, y + line * line_h))
        end_col = table.num_blocks - (lines - 1) * per_line
        tx = x0 + (end_col * pitch if table.num_blocks else 0) + 4
        words = plural(table.num_tokens, "token")
        if not table.num_blocks:
            words += " · no block"
        out.append(_text(tx, y + (lines - 1) * line_h + 14, words, scope, "note"))
        y += lines * line_h + 4
    return out, y - top


def _table_block(scene: _Scene, scope: str, seq_id: Hashable, logical: int, x: float, y: float) -> str:
    """Logical block ``logical`` of a sequence: a box in its colour showing the physical block id.

    A block the sequence has not filled gets a hatched strip along the bottom, as long as its tail.
    """
    block_id = scene.snapshot.tables[seq_id].block_ids[logical]
    fill, w, h = seq_colour(seq_id), TABLE_BOX_W, TABLE_BOX_H
    if block_id == scene.snapshot.null_block:
        box = [
            _rect(x, y, w, h, NULL_FILL, INK, 0.8),
            _text(x + w / 2, y + 13, "null", scope, "label", "middle", text_colour(NULL_FILL)),
        ]
        if block_id in scene.marked:
            box.append(_outline(x, y, w, h))
        tip = (
            f"seq {short_label(seq_id, 40)}: logical block {logical} → the null block "
            f"(block {block_id}): its block left the window, and it is never read"
        )
        return f"<g><title>{_esc(tip)}</title>{''.join(box)}</g>"
    box = [
        _rect(x, y, w, h, fill),
        _text(x + w / 2, y + 13, str(block_id), scope, "label", "middle", text_colour(fill)),
    ]
    used = w * scene.tokens_in(seq_id, logical) / scene.snapshot.block_size
    if used < w:
        box += _bar(x + used, y + h - 5, w - used, 5, 0.0, "none", scope)
    refs = scene.refs(block_id)
    box.append(_dashed(x, y, w, h) if refs > 1 else _rect(x, y, w, h, "none", INK, 0.8))
    if block_id in scene.marked:
        box.append(_outline(x, y, w, h))
    tip = f"seq {short_label(seq_id, 40)}: logical block {logical} → physical block {block_id}"
    if refs > 1:
        tip += f", shared \u00d7{refs}"
    return f"<g><title>{_esc(tip)}</title>{''.join(box)}</g>"


def _free_list(scene: _Scene, scope: str, top: float) -> tuple[list[str], float]:
    """The free list in order, head first; the middle elided ("… 29 more …") when it does not fit."""
    free = scene.snapshot.free_block_ids
    if not free:
        title = "free list · empty: every block is in use"
        return [_text(MARGIN, top + 12, title, scope, "title")], 16
    out = [_text(MARGIN, top + 12, f"free list · head first · {plural(len(free), 'block')}", scope, "title")]
    box_w, box_h, pitch = 26.0, 18.0, 29.0
    fit = int((scene.inner + pitch - box_w) // pitch)
    if len(free) <= fit:
        shown: list[int | None] = list(free)
        gap_slots = 0
    else:
        keep = (fit - 3) // 2
        shown = [*free[:keep], None, *free[len(free) - keep :]]
        gap_slots = fit - 2 * keep
    x, y = float(MARGIN), top + 20
    for block_id in shown:
        if block_id is None:
            gap_w = gap_slots * pitch - (pitch - box_w)
            hidden = len(free) - (len(shown) - 1)
            out.append(_text(x + gap_w / 2, y + 13, f"… {hidden} more …", scope, "note", "middle"))
            x += gap_w + (pitch - box_w)
            continue
        out += [
            _rect(x, y, box_w, box_h, PAPER, FREE["edgecolor"], 1),
            _text(x + box_w / 2, y + 13, str(block_id), scope, "note", "middle"),
        ]
        if block_id in scene.marked:
            out.append(_outline(x, y, box_w, box_h))
        x += pitch
    out += [
        _text(MARGIN + box_w / 2, y + box_h + 11, "head", scope, "small", "middle"),
        _text(x - pitch + box_w / 2, y + box_h + 11, "tail", scope, "small", "middle")
        if len(free) > 1
        else "",
    ]
    return out, y - top + box_h + 12


def _gauge(scene: _Scene, scope: str, top: float) -> tuple[list[str], float]:
    """A bar of used against free blocks, with utilization and fragmentation in words."""
    snap = scene.snapshot
    usage = snapshot_usage(snap)
    counted = usage.used_blocks + usage.free_blocks  # the null block is not counted
    used_w = scene.inner * usage.used_blocks / counted if counted else 0.0
    y = top + 20
    shared = f" · {usage.shared_blocks} shared, each counted once" if usage.shared_blocks else ""
    null = "" if snap.null_block is None else f" · block {snap.null_block}, the null block, not counted"
    lines = [
        f"used {usage.used_blocks} / {plural(counted, 'block')} · {usage.free_blocks} free{shared}{null}",
        f"utilization {100 * usage.block_utilization:.1f} % · {plural(usage.allocated_tokens, 'token')} "
        f"in {plural(usage.reserved_tokens, 'reserved slot')}",
        f"fragmentation {plural(usage.internal_fragmentation_tokens, 'slot')} wasted (empty tails of blocks)",
    ]
    out = [
        _text(MARGIN, top + 12, "usage", scope, "title"),
        _rect(MARGIN, y, scene.inner, 14, PAPER, FREE["edgecolor"], 1),
        _rect(MARGIN, y, used_w, 14, USED_GAUGE) if usage.used_blocks else "",
        _rect(MARGIN, y, scene.inner, 14, "none", INK, 0.8),
    ]
    for i, line in enumerate(lines):
        out.append(_text(MARGIN, y + 30 + 15 * i, line, scope, "note"))
    return out, y - top + 30 + 15 * (len(lines) - 1) + 4


# ------------------------------------------------------------------------------ SVG elements


def _num(value: float) -> str:
    """A coordinate with at most two decimals, trailing zeros dropped: compact and deterministic."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _printable(text: str) -> str:
    """``text`` on one line: whitespace becomes a space, other control characters ``�``."""
    return "".join(
        c if c.isprintable() else " " if c.isspace() else "\N{REPLACEMENT CHARACTER}" for c in text
    )


def _esc(text: str) -> str:
    """``text`` made safe for an SVG or HTML text node or attribute value."""
    return html.escape(_printable(text))


def _rect(
    x: float, y: float, w: float, h: float, fill: str, stroke: str = "none", stroke_width: float = 0
) -> str:
    """A rectangle; a paint given as a CSS ``var()`` (ink, paper) goes in ``style``, where CSS reads it."""
    paints = [("fill", fill)]
    if stroke != "none":
        paints += [("stroke", stroke), ("stroke-width", _num(stroke_width))]
    attrs = "".join(f' {name}="{value}"' for name, value in paints if not value.startswith("var("))
    themed = ";".join(f"{name}:{value}" for name, value in paints if value.startswith("var("))
    style = f' style="{themed}"' if themed else ""
    return f'<rect x="{_num(x)}" y="{_num(y)}" width="{_num(max(w, 0))}" height="{_num(h)}"{attrs}{style}/>'


def _bar(x: float, y: float, w: float, h: float, frac: float, fill: str, scope: str) -> list[str]:
    """A bar filled with ``fill`` over ``frac`` of its width; the rest grey and hatched (wasted)."""
    used = w * min(max(frac, 0.0), 1.0)
    out = [] if used <= 0 else [_rect(x, y, used, h, fill)]
    if used < w:
        out += [
            _rect(x + used, y, w - used, h, WASTE["facecolor"]),
            _rect(x + used, y, w - used, h, f"url(#{scope}-hatch)"),
        ]
    return out


def _dashed(x: float, y: float, w: float, h: float) -> str:
    """The dashed dark frame of a block that several sequences share."""
    return _rect(x, y, w, h, "none", INK, 1.6).replace("/>", ' stroke-dasharray="3 2"/>')


def _outline(x: float, y: float, w: float, h: float) -> str:
    """The thick dark frame of a highlighted block, just outside it so any fill shows inside."""
    return _rect(x - 2.5, y - 2.5, w + 5, h + 5, "none", INK, 2.5).replace("/>", ' rx="2"/>')


def _text(
    x: float, y: float, text: str, scope: str, kind: str, anchor: str = "start", fill: str | None = None
) -> str:
    anchor_attr = f' text-anchor="{anchor}"' if anchor != "start" else ""
    fill_attr = f' fill="{fill}"' if fill else ""
    position = f'x="{_num(x)}" y="{_num(y)}" class="{scope}-{kind}"'
    return f"<text {position}{anchor_attr}{fill_attr}>{_esc(text)}</text>"

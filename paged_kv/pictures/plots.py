"""The course's static pictures, drawn with matplotlib from plain data (lessons 00-09).

Each function draws on an ``Axes`` it is given (or a new figure) and returns the ``Axes``, so lessons
can combine them. Sequence colours come from :data:`PALETTE`, eight colours that stay apart for
colour-blind readers and read on a light and on a dark page alike; wasted space is hatched as well
as grey, so it never depends on colour alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.snapshot import AllocatorSnapshot

# The pages a sequence colour is drawn on. The widgets and the inline picture paint no background
# of their own: they sit on the page of JupyterLab's light theme or VS Code's light one (white),
# JupyterLab's dark theme (--jp-layout-color0, the notebook's background, and --jp-layout-color1,
# the cells' editors and table rows, both in theme-dark-extension/index.css) or VS Code's dark one
# (its editor background). The image form of the picture and matplotlib's figures bring their own
# white paper.
PAGE_BACKGROUNDS = {
    "white": "#FFFFFF",  # JupyterLab Light, VS Code Light, the picture's card, matplotlib's figures
    "jupyterlab-dark-layout-color0": "#111111",
    "jupyterlab-dark-layout-color1": "#212121",
    "vscode-dark": "#1F1F1F",  # VS Code's Dark Modern theme
}
MIN_PAGE_CONTRAST = 3.0  # WCAG 2's minimum for graphics (1.4.11, non-text contrast)

# The sequence colours, A to H: blue, orange, green, reddish purple, sky blue, red, olive, violet.
# THE INVARIANT: each keeps MIN_PAGE_CONTRAST (3:1) against every background of PAGE_BACKGROUNDS,
# because its WCAG relative luminance lies between 0.165 and 0.28 (3.19:1 or more against white,
# 3.30:1 or more against #212121). The Okabe-Ito palette they replace did not: on white its yellow
# had 1.3:1 and its orange and sky blue 2.3:1, and on JupyterLab's dark page its black had 1.1:1.
# Within that band the hues keep any two colours apart (CIEDE2000 17 or more; 7.5 or more in
# simulations of protanopia and deuteranopia, Machado et al. 2009, and 10 in one of tritanopia):
# pairs those simulations bring together (blue and violet, orange and olive) sit at opposite ends of
# the band. A label on a fill is black or white, whichever contrasts more (:func:`text_colour`):
# 4.5:1 or more on every colour. Colour is never the only cue: every block carries its sequence's
# label too. tests/test_viz.py checks the invariant, and the browser tests measure it on the page.
PALETTE = ("#0F70D6", "#D47A00", "#13894E", "#D12F9E", "#169CC2", "#EE1F4E", "#74761C", "#897FFF")
WASTE = {"facecolor": "#DDDDDD", "edgecolor": "#888888", "hatch": "///", "linewidth": 0.5}
FREE = {"facecolor": "white", "edgecolor": "#BBBBBB", "linewidth": 0.8}


def colour(index: int) -> str:
    """The colour of the ``index``-th sequence."""
    return PALETTE[index % len(PALETTE)]


def relative_luminance(colour: str) -> float:
    """The WCAG 2 relative luminance of ``#RRGGBB``: 0 for black, 1 for white.

    >>> relative_luminance("#000000"), relative_luminance("#FFFFFF")
    (0.0, 1.0)
    """

    def channel(hex_pair: str) -> float:
        c = int(hex_pair, 16) / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(colour[i : i + 2]) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(one: str, two: str) -> float:
    """The WCAG 2 contrast ratio of two ``#RRGGBB`` colours, from 1 (the same) to 21 (black on white).

    >>> round(contrast_ratio("#000000", "#FFFFFF"), 2), round(contrast_ratio("#777777", "#FFFFFF"), 2)
    (21.0, 4.48)
    """
    high, low = sorted((relative_luminance(one), relative_luminance(two)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def text_colour(fill: str) -> str:
    """White or black, whichever contrasts more with ``fill`` (``#RRGGBB``), by WCAG luminance.

    >>> text_colour("#0F70D6"), text_colour("#D47A00")
    ('#FFFFFF', '#000000')
    """
    return "#FFFFFF" if contrast_ratio(fill, "#FFFFFF") > contrast_ratio(fill, "#000000") else "#000000"


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    return ax


def plot_reservations(
    request_tokens: Sequence[int],
    *,
    slot_tokens: int | None = None,
    block_size: int | None = None,
    labels: Sequence[str] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """One row per request: the tokens it holds, and the reserved space it does not use.

    With ``slot_tokens`` every request reserves one contiguous slot of that length; with
    ``block_size`` it reserves whole blocks, drawn as separate boxes. Exactly one must be given.
    """
    if (slot_tokens is None) == (block_size is None):
        raise ValueError("give exactly one of slot_tokens and block_size")
    labels = list(labels) if labels is not None else [chr(ord("A") + i) for i in range(len(request_tokens))]
    ax = _axes(ax, (8, 0.45 * len(request_tokens) + 1))
    for row, tokens in enumerate(request_tokens):
        y = len(request_tokens) - 1 - row
        if slot_tokens is not None:
            reserved = [(0, slot_tokens)]
        else:
            reserved = [(b * block_size, block_size) for b in range(blocks_for_tokens(tokens, block_size))]
        for start, width in reserved:
            ax.add_patch(Rectangle((start, y - 0.35), width, 0.7, **WASTE))
        ax.add_patch(Rectangle((0, y - 0.35), tokens, 0.7, facecolor=colour(row), edgecolor="none"))
        for start, width in reserved:
            ax.add_patch(Rectangle((start, y - 0.35), width, 0.7, fill=False, edgecolor="#333333", lw=0.8))
        end = sum(width for _, width in reserved)
        ax.text(end + 0.5, y, f"{tokens} / {end}", va="center", fontsize=9)
    width = max(
        [slot_tokens or 0]
        + [blocks_for_tokens(t, block_size or 1) * (block_size or 1) for t in request_tokens]
    )
    ax.set_xlim(0, width * 1.18 + 1)
    ax.set_ylim(-0.7, len(request_tokens) - 0.3)
    ax.set_yticks(range(len(request_tokens)), labels[::-1])
    ax.set_xlabel("token slots (held / reserved)")
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax


def _filled_block(ax: Axes, x: float, y: float, used: int, size: int, owner: int | None) -> None:
    """One block of ``size`` slots at ``(x, y)``: ``used`` of them in the owner's colour, the rest
    hatched as waste; a free block (``owner`` None) is white."""
    if owner is None:
        ax.add_patch(Rectangle((x, y), 0.9, 0.8, zorder=2, **FREE))
        return
    ax.add_patch(Rectangle((x, y), 0.9, 0.8, zorder=2, **WASTE))
    ax.add_patch(
        Rectangle((x, y), 0.9 * used / size, 0.8, facecolor=colour(owner), edgecolor="none", zorder=2)
    )
    ax.add_patch(Rectangle((x, y), 0.9, 0.8, fill=False, edgecolor="#333333", lw=0.8, zorder=2))


def _block_label(ax: Axes, x: float, y: float, text: str) -> None:
    """A block id in the middle of a box, on a small white label so that it reads on any fill."""
    ax.text(
        x + 0.45,
        y + 0.4,
        text,
        ha="center",
        va="center",
        fontsize=7,
        color="#222222",
        zorder=4,
        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
    )


def plot_block_tables(
    snapshot: AllocatorSnapshot,
    *,
    ax: Axes | None = None,
    blocks_per_row: int | None = None,
    title: str | None = None,
) -> Axes:
    """Block tables as arrows into the pool.

    Top: the physical pool, block 0 first, in rows of ``blocks_per_row`` (one row by default), each
    used block in its owner's colour with its unused tail hatched, free blocks white. Bottom: every
    sequence's block table, its logical blocks left to right, filled to the tokens they hold, each
    labelled with the physical block it names; the sequence's id is underneath. One straight arrow
    runs from every logical block up to its physical block. The panel titles sit above the pool and
    below the tables, where no arrow goes, and the arrows pass behind the boxes.

    Raises:
        ValueError: ``blocks_per_row`` is not ``None`` or a positive int.
    """
    if blocks_per_row is not None and (
        isinstance(blocks_per_row, bool) or not isinstance(blocks_per_row, int) or blocks_per_row < 1
    ):
        raise ValueError(f"blocks_per_row must be a positive int or None, got {blocks_per_row!r}")
    size, num_blocks = snapshot.block_size, snapshot.num_blocks
    per_row = min(num_blocks, blocks_per_row or num_blocks) or 1
    pool_rows = blocks_for_tokens(num_blocks, per_row)
    tables = list(snapshot.tables.items())
    tables_width = sum(t.num_blocks for _, t in tables) + max(0, len(tables) - 1)  # a gap between tables
    width = max(per_row, tables_width)
    gap = 2.6  # the band between the tables and the pool's lowest row, where the arrows run
    ax = _axes(ax, (min(11.0, max(6.0, 0.5 * width + 1.5)), 1.1 * pool_rows + 2.6))

    used_by: dict[int, tuple[int, int]] = {}  # physical block -> (owner's index, tokens it holds)
    for index, (_, table) in enumerate(tables):
        for logical, block_id in enumerate(table.block_ids):
            used_by[block_id] = (index, min(size, max(0, table.num_tokens - logical * size)))
    pool_left = (width - per_row) / 2
    where: dict[int, tuple[float, float]] = {}
    for block_id in range(num_blocks):
        row, column = divmod(block_id, per_row)
        x, y = pool_left + column, 0.8 + gap + (pool_rows - 1 - row) * 1.3
        where[block_id] = (x, y)
        owner, used = used_by.get(block_id, (None, 0))
        _filled_block(ax, x, y, used, size, owner)
        _block_label(ax, x, y, str(block_id))

    x = (width - tables_width) / 2
    for index, (seq_id, table) in enumerate(tables):
        start = x
        for logical, block_id in enumerate(table.block_ids):
            _filled_block(ax, x, 0, min(size, max(0, table.num_tokens - logical * size)), size, index)
            _block_label(ax, x, 0, str(block_id))
            tx, ty = where[block_id]
            ax.add_patch(
                FancyArrowPatch(
                    (x + 0.45, 0.8),
                    (tx + 0.45, ty),
                    arrowstyle="-|>",
                    mutation_scale=9,
                    color=colour(index),
                    lw=1.0,
                    alpha=0.8,
                    shrinkA=1,
                    shrinkB=1,
                    zorder=1,
                )
            )
            x += 1
        ax.text((start + x - 0.1) / 2, -0.15, str(seq_id), ha="center", va="top", fontsize=9)
        x += 1
    top = 0.8 + gap + (pool_rows - 1) * 1.3 + 0.8
    ax.text(
        pool_left, top + 0.15, f"physical pool: {num_blocks} blocks of {size} slots", fontsize=9, va="bottom"
    )
    ax.text(
        (width - tables_width) / 2,
        -0.75,
        "block tables: logical blocks left to right, each naming its physical block",
        fontsize=9,
        va="top",
    )
    ax.set_xlim(-0.5, width + 0.4)
    ax.set_ylim(-1.4, top + 0.7)
    ax.set_axis_off()
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax


def _owners(snapshot: AllocatorSnapshot) -> dict[int, Hashable]:
    """Every used block and the sequence that holds it (the first, for a shared block)."""
    owner: dict[int, Hashable] = {}
    for seq_id, table in snapshot.tables.items():
        for block_id in table.block_ids:
            owner.setdefault(block_id, seq_id)
    return owner


def plot_free_list_steps(
    steps: Sequence[tuple[str, AllocatorSnapshot]],
    *,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """The pool after each step, one row per step: the free list at work.

    ``steps`` pairs a label with the snapshot after that step. Every used block is drawn in its
    sequence's colour (sequences numbered in the order they first appear, so a sequence keeps its
    colour from row to row), every free block white with its place in the free list underneath
    (``#1`` is the block the next allocation takes), and the free list itself at the end of the row.
    A legend names the sequences.

    Raises:
        ValueError: ``steps`` is empty.
    """
    if not steps:
        raise ValueError("steps must hold at least one (label, snapshot) pair")
    ax = _axes(ax, (8, 0.8 * len(steps) + 1.0))
    index: dict[Hashable, int] = {}
    num_blocks = max(snapshot.num_blocks for _, snapshot in steps)
    for row, (label, snapshot) in enumerate(steps):
        owner = _owners(snapshot)
        place = {block_id: n + 1 for n, block_id in enumerate(snapshot.free_block_ids)}
        y = -1.5 * row
        for block_id in range(snapshot.num_blocks):
            used = block_id in owner
            fill = colour(index.setdefault(owner[block_id], len(index))) if used else "white"
            ax.add_patch(Rectangle((block_id, y), 0.9, 0.8, facecolor=fill, edgecolor="#333333", lw=0.8))
            _block_label(ax, block_id, y, str(block_id))
            if not used:
                ax.text(block_id + 0.45, y - 0.1, f"#{place[block_id]}", ha="center", va="top", fontsize=7)
        ax.text(-0.3, y + 0.4, label, ha="right", va="center", fontsize=9)
        free = f"free list {list(snapshot.free_block_ids)}"
        ax.text(snapshot.num_blocks + 0.3, y + 0.4, free, va="center", fontsize=9)
    handles = [Patch(facecolor=colour(i), edgecolor="#333333", label=str(seq)) for seq, i in index.items()]
    if handles:
        ax.legend(
            handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), frameon=False
        )
    label_room = 0.18 * max(len(label) for label, _ in steps) + 0.4  # the labels sit left of block 0
    ax.set_xlim(-label_room, num_blocks + 4.5)
    ax.set_ylim(-1.5 * len(steps) + 0.6, 1.0)
    ax.set_axis_off()
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax


def plot_positions_in_pool(snapshot: AllocatorSnapshot, seq_id: Hashable, *, ax: Axes | None = None) -> Axes:
    """One sequence's positions in its logical blocks (left) and in the pool, slot by slot (right).

    Left: the sequence's logical blocks, one row each, every slot labelled with its position. Right:
    the pool as the cache tensor lays it out, one row per physical block (the first axis of
    ``k_cache``) and one column per offset (its third axis); the sequence's slots carry its
    positions, other sequences' held slots are grey, and every slot's corner shows its flat slot
    number ``block * block_size + offset``. Each logical block is in its own colour, with an arrow
    to the row of the pool that holds it; the slots it reserves but does not hold are hatched.

    Raises:
        KeyError: ``seq_id`` is not in the snapshot.
    """
    if seq_id not in snapshot.tables:
        raise KeyError(f"{seq_id!r} is not a sequence of the snapshot; it holds {list(snapshot.tables)}")
    table, size, rows = snapshot.tables[seq_id], snapshot.block_size, snapshot.num_blocks
    ax = _axes(ax, (8, 0.45 * rows + 1.2))
    held_by_others = {}  # physical block -> tokens another sequence holds in it
    for other, other_table in snapshot.tables.items():
        if other != seq_id:
            for logical, block_id in enumerate(other_table.block_ids):
                held_by_others[block_id] = min(size, max(0, other_table.num_tokens - logical * size))
    pool_x = size + 4

    def slot(x: float, y: float, fill: str | None, hatch: bool, label: str, corner: str) -> None:
        style = WASTE if hatch else {"facecolor": fill or "white", "edgecolor": "none"}
        ax.add_patch(Rectangle((x, y), 1, 1, **style))
        ax.add_patch(Rectangle((x, y), 1, 1, fill=False, edgecolor="#444444", lw=0.8))
        strong = fill not in (None, "#BBBBBB")
        ink = text_colour(fill) if strong else "#555555"
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=10, weight="bold", color=ink)
        ax.text(x + 0.95, y + 0.05, corner, ha="right", va="bottom", fontsize=6, color=ink)

    for block_id in range(rows):  # the pool: row = physical block, column = offset
        y = rows - 1 - block_id
        ax.text(pool_x - 0.2, y + 0.5, f"block {block_id}", ha="right", va="center", fontsize=9)
        if block_id in table.block_ids:
            continue  # drawn below, in the sequence's colours (a slot's number drawn twice would blur)
        for offset in range(size):
            grey = "#BBBBBB" if offset < held_by_others.get(block_id, 0) else None
            slot(pool_x + offset, y, grey, False, "", str(block_id * size + offset))
    for logical, block_id in enumerate(table.block_ids):  # the sequence, in both views
        left_y, pool_y = rows - 2 - 2 * logical, rows - 1 - block_id
        ax.text(-0.2, left_y + 0.5, f"logical {logical}", ha="right", va="center", fontsize=9)
        for offset in range(size):
            position = logical * size + offset
            held = position < table.num_tokens
            label = str(position) if held else ""
            fill = colour(logical) if held else None
            slot(offset, left_y, fill, not held, label, "")
            slot(pool_x + offset, pool_y, fill, not held, label, str(block_id * size + offset))
        ax.add_patch(
            FancyArrowPatch(
                (size + 0.1, left_y + 0.5),
                (pool_x - 1.5, pool_y + 0.5),
                arrowstyle="-|>",
                mutation_scale=12,
                color=colour(logical),
            )
        )
    ax.text(0, rows + 0.3, f"{seq_id}: positions by logical block", fontsize=10)
    ax.text(pool_x - 1.5, rows + 0.3, "pool: row = block, column = offset", fontsize=10)
    ax.set_xlim(-2.2, pool_x + size + 0.3)
    ax.set_ylim(-0.2, rows + 1)
    ax.set_aspect("equal")
    ax.set_axis_off()
    return ax


def plot_padded_block_tables(
    block_tables: Sequence[Sequence[int]],
    labels: Sequence[str],
    *,
    highlight: int = 0,
    ax: Axes | None = None,
) -> Axes:
    """A padded ``(batch, max_blocks)`` block-table tensor as a grid: one row per sequence.

    Each entry shows its block id; padding (``-1``) is hatched as waste; the ``highlight`` row is
    coloured by logical block, the others grey.

    Raises:
        ValueError: the rows differ in length, or ``labels`` or ``highlight`` does not match them.
    """
    rows = [list(row) for row in block_tables]
    if not rows or len({len(row) for row in rows}) != 1:
        raise ValueError("block_tables must be a non-empty list of rows of the same length")
    if len(labels) != len(rows):
        raise ValueError(f"labels must name each of the {len(rows)} rows, got {len(labels)}")
    if not 0 <= highlight < len(rows):
        raise ValueError(f"highlight must be a row index below {len(rows)}, got {highlight}")
    ax = _axes(ax, (4, 0.5 * len(rows) + 1))
    width = len(rows[0])
    for r, row in enumerate(rows):
        y = len(rows) - 1 - r
        for j, block_id in enumerate(row):
            strong = r == highlight and block_id != -1
            if block_id == -1:
                ax.add_patch(Rectangle((j, y), 1, 1, **WASTE))
            else:
                fill = colour(j) if strong else "#E8E8E8"
                ax.add_patch(Rectangle((j, y), 1, 1, facecolor=fill, edgecolor="#444444"))
            ink = text_colour(colour(j)) if strong else "#222222"
            ax.text(j + 0.5, y + 0.5, str(block_id), ha="center", va="center", fontsize=9, color=ink)
    ax.set_xlim(0, width)
    ax.set_ylim(0, len(rows))
    ax.set_xticks([j + 0.5 for j in range(width)], [str(j) for j in range(width)])
    ax.set_yticks([len(rows) - 0.5 - r for r in range(len(rows))], list(labels))
    ax.set_xlabel("logical block")
    ax.set_title("block_tables (padding hatched)", loc="left", fontsize=10)
    return ax


def plot_weights_by_block(
    weights: Sequence[float],
    block_ids: Sequence[int],
    block_size: int,
    context_len: int,
    *,
    ax: Axes | None = None,
    ylabel: str = "attention weight",
) -> Axes:
    """One sequence's attention weights by position, each bar in the colour of its logical block.

    ``weights`` has one value per slot of the sequence's blocks (``len(block_ids) * block_size``);
    the slots from ``context_len`` on are masked: drawn hatched, full height, and labelled so.
    Every block is named by its physical id, and dotted lines mark the block boundaries.

    Raises:
        ValueError: ``weights`` does not have one value per slot, or ``context_len`` is not in
            ``1 .. len(weights)``.
    """
    weights = [float(w) for w in weights]
    slots = len(block_ids) * block_size
    if len(weights) != slots:
        raise ValueError(f"weights must have one value per slot, {slots}, got {len(weights)}")
    if not 1 <= context_len <= slots:
        raise ValueError(f"context_len must be in 1 .. {slots}, got {context_len}")
    ax = _axes(ax, (7, 3))
    top = max(weights[:context_len]) * 1.2
    ax.bar(
        range(context_len), weights[:context_len], color=[colour(p // block_size) for p in range(context_len)]
    )
    if context_len < slots:
        ax.bar(range(context_len, slots), top, width=0.8, **WASTE)
        middle = (context_len + slots - 1) / 2
        ax.text(middle, top * 0.45, "masked: weight 0", rotation=90, ha="center", va="center", fontsize=9)
    for boundary in range(block_size, slots, block_size):
        ax.axvline(boundary - 0.5, color="#888888", lw=0.8, ls=":")
    for logical, block_id in enumerate(block_ids):
        x = logical * block_size + (block_size - 1) / 2
        ax.text(x, top * 0.9, f"block {block_id}", ha="center", fontsize=9, color=colour(logical))
    ax.set_ylim(0, top)
    ax.set_xticks(range(slots))
    ax.set_xlabel("position")
    ax.set_ylabel(ylabel)
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def plot_held_and_reserved(
    held: Sequence[int],
    reserved: Sequence[int],
    *,
    ax: Axes | None = None,
    where: str = "post",
    xlabel: str = "step",
    reserved_label: str = "slots reserved",
) -> Axes:
    """Tokens held and slots reserved over steps, the gap between them hatched as waste.

    With on-demand blocks this is a staircase: the tokens grow by one a step, the reserved slots
    jump by a block when the tokens reach them, and the hatched gap never reaches a whole block.
    """
    ax = _axes(ax, (7, 3))
    steps = range(len(held))
    waste = {key: WASTE[key] for key in ("facecolor", "edgecolor", "hatch")}
    ax.fill_between(steps, held, reserved, step=where, lw=0, label="reserved, empty", **waste)
    ax.step(steps, reserved, where=where, color=PALETTE[5], label=reserved_label)
    ax.step(steps, held, where=where, color=PALETTE[0], label="tokens held")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("token slots")
    ax.spines[["top", "right"]].set_visible(False)
    return ax


MEMORY_SHARES = (  # key, legend label, style: the parts of the vLLM paper's Figure 2, bottom to top
    ("token_states", "token states", {"facecolor": PALETTE[0], "edgecolor": "white", "linewidth": 0.5}),
    (
        "reservation",
        "reservation",
        {"facecolor": "#F5CB7A", "edgecolor": "#A66F00", "hatch": "..", "linewidth": 0.5},
    ),
    ("internal_fragmentation", "internal fragmentation", WASTE),
    (
        "external_fragmentation",
        "external fragmentation & others",
        {"facecolor": "white", "edgecolor": "#777777", "hatch": "xx", "linewidth": 0.5},
    ),
)
LABEL_BOX = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85}
NOT_SPLIT = {"facecolor": "white", "edgecolor": "#333333", "linewidth": 0.8, "linestyle": "--"}


def plot_memory_shares(
    bars: Sequence[tuple[str, dict[str, float | None]]],
    *,
    group: int = 1,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """Stacked bars of the KV memory, one per ``(label, shares)``, as the vLLM paper's Figure 2 draws them.

    ``shares`` maps each key of :data:`MEMORY_SHARES` (token states, reservation, internal and
    external fragmentation) to a percentage; the bar stacks them bottom to top and writes each part
    of at least 4 %. A share of None is one the source does not break down: what the bar's given
    shares leave of 100 % is drawn as one dashed box. Bars come in groups of ``group`` (a system
    measured and in the paper, say), with a gap between groups.

    Raises:
        ValueError: a bar lacks a share, a share is negative, or the shares exceed 100 %.
    """
    group = max(1, int(group))
    ax = _axes(ax, (max(4.0, 1.0 * len(bars) + 2), 4))
    keys = [key for key, _, _ in MEMORY_SHARES]
    xs = [i + 0.6 * (i // group) for i in range(len(bars))]
    for x, (label, shares) in zip(xs, bars, strict=True):
        if set(shares) != set(keys):
            raise ValueError(f"bar {label!r} must give the shares {keys}, got {sorted(shares)}")
        given = [value for value in shares.values() if value is not None]
        if any(value < 0 for value in given) or sum(given) > 100.05:
            raise ValueError(f"bar {label!r}: shares must be at least 0 and sum to at most 100, got {shares}")
        bottom = 0.0
        for key, _, style in MEMORY_SHARES:
            value = shares[key]
            if not value:
                continue
            ax.add_patch(Rectangle((x - 0.4, bottom), 0.8, value, **style))
            if value >= 4:
                ax.text(
                    x,
                    bottom + value / 2,
                    f"{value:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if key == "token_states" else "#222222",
                    bbox=None if key == "token_states" else LABEL_BOX,
                )
            bottom += value
        if None in shares.values() and bottom < 100:
            ax.add_patch(Rectangle((x - 0.4, bottom), 0.8, 100 - bottom, **NOT_SPLIT))
    handles = [Patch(label=name, **style) for _, name, style in MEMORY_SHARES]
    if any(None in shares.values() for _, shares in bars):
        handles.append(Patch(label="not broken down", **NOT_SPLIT))
    ax.set_xticks(xs, [label for label, _ in bars], fontsize=8)
    ax.set_xlim(min(xs, default=0) - 0.7, max(xs, default=0) + 0.7)
    ax.set_ylim(0, 100)
    ax.set_ylabel("% of the KV cache memory")
    ax.legend(handles=handles, frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.spines[["top", "right"]].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax


def plot_metrics(result: object, ax: Axes | None = None) -> Axes:
    """Running and waiting (and swapped, if any) sequences per step, with utilization on a second
    axis, from an :class:`~paged_kv.serving.engine.EngineResult`; returns ``ax``."""
    ax = _axes(ax, (8, 3.5))
    steps = range(result.steps)
    ax.plot(steps, result.running, label="running", color="#0072B2")
    ax.plot(steps, result.waiting, label="waiting", color="#E69F00", linestyle="--")
    if any(result.swapped):
        ax.plot(steps, result.swapped, label="swapped", color="#CC79A7", linestyle="-.")
    ax.set_xlabel("step")
    ax.set_ylabel("sequences")
    reasons = ", ".join(f"{n} by {reason}" for reason, n in result.preemptions_by_reason.items() if n)
    ax.set_title(
        f"{result.mode}: {result.budget_tokens} token slots, {result.preemptions} preemptions"
        + (f" ({reasons})" if reasons else "")
    )
    twin = ax.twinx()
    twin.plot(steps, result.utilization, label="utilization", color="#009E73", linestyle=":")
    twin.set_ylim(0, 1.05 * max([1.0, *result.utilization]))  # above 1 only when blocks are shared
    twin.set_ylabel("utilization (held / reserved)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    return ax


def plot_step_batch(
    req_ids: Sequence[Hashable],
    query_start_loc: Sequence[int],
    positions: Sequence[int],
    slot_mapping: Sequence[int],
    block_table: Sequence[Sequence[int]],
    block_size: int,
    *,
    ax: Axes | None = None,
    title: str | None = None,
) -> Axes:
    """One engine step's flattened batch, as the model runner prepares it (lesson 09).

    Top: every scheduled token of the step, request after request (request ``b``'s are tokens
    ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of the batch, numbered underneath), in its
    request's colour and labelled with its position; the request's id and token count above.
    Middle: each token's slot (``slot_mapping``), where every layer writes its K/V. Bottom: each
    request's block-table row under its tokens, one box per block id, padding (``-1``) hatched; the
    blocks this step writes into are in the request's colour, those holding only earlier tokens
    grey; an arrow runs from every slot down to its block, and each row is labelled with the
    request's ``seq_len``, the tokens it attends over once the step's are in. The inputs may be
    tensors (fields of :class:`~paged_kv.attention.metadata.AttentionMetadata`) or lists.

    Raises:
        ValueError: the inputs do not describe one step: ``query_start_loc`` is not ``0`` then
            increasing to ``len(positions)``, with one entry more than there are requests;
            ``slot_mapping`` and ``positions`` differ in length; a row is missing; or a slot is
            not ``block_table[b][p // block_size] * block_size + p % block_size``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    req_ids = list(req_ids)
    starts = [int(x) for x in query_start_loc]
    positions = [int(x) for x in positions]
    slots = [int(x) for x in slot_mapping]
    rows = [[int(x) for x in row] for row in block_table]
    if not req_ids or len(starts) != len(req_ids) + 1 or starts[0] != 0 or starts[-1] != len(positions):
        raise ValueError(
            f"query_start_loc must run from 0 to the {len(positions)} tokens with one entry per request "
            f"and one more ({len(req_ids) + 1}), got {starts}"
        )
    if any(starts[i + 1] <= starts[i] for i in range(len(req_ids))):
        raise ValueError(f"every request runs a token at least: query_start_loc must increase, got {starts}")
    if len(slots) != len(positions):
        raise ValueError(f"slot_mapping must have one slot per token ({len(positions)}), got {len(slots)}")
    if len(rows) != len(req_ids):
        raise ValueError(f"block_table must have one row per request ({len(req_ids)}), got {len(rows)}")
    owner = [b for b in range(len(req_ids)) for _ in range(starts[b], starts[b + 1])]
    for t, (b, p, s) in enumerate(zip(owner, positions, slots, strict=True)):
        column = p // block_size
        block = rows[b][column] if 0 <= column < len(rows[b]) else -1
        if block < 0 or block * block_size + p % block_size != s:
            raise ValueError(
                f"token {t} (position {p} of {req_ids[b]!r}) has slot {s}, but its row {rows[b]} puts "
                f"position {p} in block {block}: slot block * {block_size} + {p % block_size}"
            )

    # Each request gets a column as wide as its tokens or its row, whichever is wider.
    widths = [max(starts[b + 1] - starts[b], len(rows[b])) for b in range(len(req_ids))]
    lefts = [sum(widths[:b]) + 0.8 * b for b in range(len(req_ids))]
    width = lefts[-1] + widths[-1]
    x_of = [lefts[b] + t - starts[b] for t, b in enumerate(owner)]
    ax = _axes(ax, (min(12.0, 0.55 * width + 2.4), 4.2))
    y_tokens, y_slots, y_rows = 0.0, -1.5, -3.6
    written = {(b, p // block_size) for b, p in zip(owner, positions, strict=True)}
    for t, (b, p, s) in enumerate(zip(owner, positions, slots, strict=True)):
        x, fill = x_of[t], colour(b)
        ax.add_patch(Rectangle((x, y_tokens), 0.9, 0.8, facecolor=fill, edgecolor="#333333", lw=0.8))
        ink = text_colour(fill)
        ax.text(x + 0.45, y_tokens + 0.4, str(p), ha="center", va="center", fontsize=8, color=ink)
        ax.text(x + 0.45, y_tokens - 0.3, str(t), ha="center", va="center", fontsize=7, color="#555555")
        ax.add_patch(Rectangle((x, y_slots), 0.9, 0.8, facecolor="white", edgecolor=fill, lw=2.0))
        ax.text(x + 0.45, y_slots + 0.4, str(s), ha="center", va="center", fontsize=8, color="#222222")
        target = lefts[b] + p // block_size + 0.45
        ax.add_patch(
            FancyArrowPatch(
                (x + 0.45, y_slots),
                (target, y_rows + 0.8),
                arrowstyle="-|>",
                mutation_scale=8,
                color=fill,
                lw=0.9,
                alpha=0.8,
                shrinkA=1,
                shrinkB=1,
                zorder=1,
            )
        )
    for b, (request, row) in enumerate(zip(req_ids, rows, strict=True)):
        n = starts[b + 1] - starts[b]
        tokens = f"{n} token" + ("s" if n > 1 else "")
        ax.text(lefts[b], y_tokens + 1.0, f"{request}: {tokens}", ha="left", va="bottom", fontsize=9)
        for j, block_id in enumerate(row):
            x = lefts[b] + j
            if block_id < 0:
                ax.add_patch(Rectangle((x, y_rows), 0.9, 0.8, zorder=2, **WASTE))
                continue
            fill = colour(b) if (b, j) in written else "#E8E8E8"
            ax.add_patch(
                Rectangle((x, y_rows), 0.9, 0.8, facecolor=fill, edgecolor="#333333", lw=0.8, zorder=2)
            )
            ink = text_colour(fill) if (b, j) in written else "#222222"
            ax.text(
                x + 0.45,
                y_rows + 0.4,
                str(block_id),
                ha="center",
                va="center",
                fontsize=8,
                color=ink,
                zorder=3,
            )
        seq_len = max(p for p, o in zip(positions, owner, strict=True) if o == b) + 1
        ax.text(
            lefts[b], y_rows - 0.15, f"{request}'s row, seq_len {seq_len}", ha="left", va="top", fontsize=8
        )
    for y, label in (
        (y_tokens + 0.4, "positions"),
        (y_tokens - 0.3, "token in the batch"),
        (y_slots + 0.4, "slot_mapping"),
        (y_rows + 0.4, "block_table rows"),
    ):
        small = label == "token in the batch"
        ax.text(
            -0.3,
            y,
            label,
            ha="right",
            va="center",
            fontsize=7 if small else 9,
            color="#555555" if small else "black",
        )
    ax.text(
        -0.3,
        y_rows - 0.75,
        f"query_start_loc {starts}: each request's first token in the batch, and the batch's end",
        ha="left",
        va="top",
        fontsize=8,
        color="#555555",
    )
    ax.set_xlim(-3.4, width + 0.2)
    ax.set_ylim(y_rows - 1.2, y_tokens + 1.6)
    ax.set_axis_off()
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    return ax

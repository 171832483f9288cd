"""The course's static pictures, drawn with matplotlib from plain data.

Each function draws on an ``Axes`` it is given (or a new figure) and returns the ``Axes``, so lessons
can combine them. Colours come from the Okabe-Ito palette, which stays distinguishable for
colour-blind readers; wasted space is hatched as well as grey, so it never depends on colour alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, Rectangle

from .block import blocks_for_tokens
from .snapshot import AllocatorSnapshot

PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
WASTE = {"facecolor": "#DDDDDD", "edgecolor": "#888888", "hatch": "///", "linewidth": 0.5}
FREE = {"facecolor": "white", "edgecolor": "#BBBBBB", "linewidth": 0.8}


def colour(index: int) -> str:
    """The colour of the ``index``-th sequence."""
    return PALETTE[index % len(PALETTE)]


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


def plot_block_tables(
    snapshot: AllocatorSnapshot,
    *,
    ax: Axes | None = None,
    blocks_per_row: int = 8,
    title: str | None = None,
) -> Axes:
    """Block tables as arrows into the pool.

    Left: each sequence's logical blocks in order, filled to the tokens they hold. Right: the
    physical pool as a grid, each used block in its owner's colour (the unused tail hatched), free
    blocks white. An arrow runs from every logical block to the physical block that holds it.
    """
    seq_ids: list[Hashable] = list(snapshot.tables)
    size = snapshot.block_size
    rows = blocks_for_tokens(snapshot.num_blocks, blocks_per_row)
    longest = max([t.num_blocks for t in snapshot.tables.values()] + [1])
    height = max(rows, len(seq_ids))
    ax = _axes(ax, (0.55 * (longest + blocks_per_row + 5), 0.75 * height + 1.2))
    pool_x = longest + 3

    def fill_box(x: float, y: float, used: int, owner: int | None) -> None:
        if owner is None:
            ax.add_patch(Rectangle((x, y), 0.9, 0.8, **FREE))
            return
        ax.add_patch(Rectangle((x, y), 0.9, 0.8, **WASTE))
        ax.add_patch(Rectangle((x, y), 0.9 * used / size, 0.8, facecolor=colour(owner), edgecolor="none"))
        ax.add_patch(Rectangle((x, y), 0.9, 0.8, fill=False, edgecolor="#333333", lw=0.8))

    where: dict[int, tuple[float, float]] = {}
    owners: dict[int, tuple[int, int]] = {}
    for index, seq_id in enumerate(seq_ids):
        table = snapshot.tables[seq_id]
        for logical, block_id in enumerate(table.block_ids):
            used = min(size, max(0, table.num_tokens - logical * size))
            owners[block_id] = (index, used)
    for block_id in range(snapshot.num_blocks):
        x = pool_x + block_id % blocks_per_row
        y = (height - 1 - block_id // blocks_per_row) * 1.5
        where[block_id] = (x, y)
        owner, used = owners.get(block_id, (None, 0))
        fill_box(x, y, used, owner)
        ax.text(x + 0.45, y + 0.4, str(block_id), ha="center", va="center", fontsize=7, color="#222222")
    for index, seq_id in enumerate(seq_ids):
        table = snapshot.tables[seq_id]
        y = (height - 1 - index) * 1.5
        ax.text(-0.2, y + 0.4, str(seq_id), ha="right", va="center", fontsize=9)
        for logical, block_id in enumerate(table.block_ids):
            used = min(size, max(0, table.num_tokens - logical * size))
            fill_box(logical, y, used, index)
            tx, ty = where[block_id]
            ax.add_patch(
                FancyArrowPatch(
                    (logical + 0.45, y + 0.8),
                    (tx + 0.45, ty + 0.8),
                    arrowstyle="-|>",
                    mutation_scale=9,
                    color=colour(index),
                    lw=1.0,
                    alpha=0.85,
                    connectionstyle="arc3,rad=-0.25",
                    shrinkA=1,
                    shrinkB=1,
                    zorder=3,
                )
            )
    top = (height - 1) * 1.5 + 1.6
    ax.text(0, top, "block tables: logical blocks", fontsize=9, va="bottom")
    ax.text(
        pool_x, top, f"physical pool: {snapshot.num_blocks} blocks of {size} slots", fontsize=9, va="bottom"
    )
    ax.set_xlim(-2.5, pool_x + blocks_per_row + 0.5)
    ax.set_ylim(-0.4, top + 0.6)
    ax.set_axis_off()
    if title:
        ax.set_title(title, loc="left", fontsize=11)
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

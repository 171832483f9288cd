"""Widgets that animate block allocation: a player over a recorded trace, and a live playground.

Lessons 00, 02, 04, 07 and 08 show them.

Both widgets draw the picture of :func:`paged_kv.pictures.pool.render_allocator`: the pool's blocks, who holds
them, and a caption under the picture.

:class:`AllocationPlayer` replays a trace recorded by ``PagedKVCacheAllocator(..., record=True)``.
Every frame is rendered once, up front, into its own ``HTML`` widget, and a ``Stack`` shows one of
them at a time. Its caption reads ``"7/41 · seq B, token 17: block 5 appended"``. Below the picture:

* ``Play``, which walks through the frames every ``interval_ms`` milliseconds;
* ◀ and ▶, which step one frame back or forward (they run Python, so they need a live kernel);
* a slider over the frames;
* the frame number, whose spinner arrows also step back and forward, with no kernel.

Both widgets draw the picture inline, in the page's own text colour on the page's background, so
they read well in light and dark themes alike (:func:`~paged_kv.pictures.pool.render_allocator`); their
status lines carry their own colours. The blocks' colours sit on that background too: each of the
eight (:data:`~paged_kv.pictures.plots.PALETTE`, sequences A to H) keeps 3:1 against a white page
and against JupyterLab's and VS Code's dark ones.

**A still for a notebook opened before it runs.** An untrusted notebook (a lesson opened fresh,
before its cells run) and a viewer with no widget JavaScript cannot draw a widget view: they show
the next output format they can. So each widget's display output also carries a ``text/html``
still, the picture in its image form (which survives an untrusted notebook's sanitiser) with a
caption saying what the live widget does. A live JupyterLab, VS Code and an HTML export holding
the widget state prefer the widget view itself. The player's still is its fullest frame; the
playground's, the allocator it shows when it is displayed.

``Play``, the slider, the frame number and the ``Stack`` are tied together with
``widgets.jslink``, not ``widgets.link``: a jslink lives in the browser. The widget state saved in
the notebook holds every frame and every link, so the player still animates in a notebook
exported to static HTML, or opened when no kernel runs. A kernel-side link or an ``observe``
callback would need a running kernel for each step.

:class:`AllocatorPlayground` drives a live allocator. You add a sequence with a chosen prompt
length (the ids run A, B, ..., Z, AA, AB, ...), run one decode step that appends a token to every
running sequence, finish a chosen sequence and reset. Under the controls, a status line shows the
usage. When an action cannot get its blocks, the status line shows the ``OutOfBlocksError``
message in red and nothing changes. Below that is the picture: its caption says what the last
action did, and the blocks it touched are highlighted; after a refused action it says what was
refused and why ("seq C: 9-token prompt refused: it needs 3 free blocks, 1 is free; nothing
changed"), with nothing highlighted.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from paged_kv.core.trace import allocate_caption, free_caption, token_caption
from paged_kv.errors import OutOfBlocksError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.pictures.pool import plural, render_allocator
from paged_kv.validate import check_count

if TYPE_CHECKING:
    from paged_kv.core.trace import TraceFrame

__all__ = ["AllocationPlayer", "AllocatorPlayground", "refusal_caption", "sequence_name"]

# A warning carries its own background, so its red contrasts (8:1) on a light or a dark page.
_WARNING_STYLE = (
    "color:#8A0010;background-color:#FDECEE;border-left:3px solid #B00020;padding:1px 6px;font-weight:bold"
)


def sequence_name(index: int) -> str:
    """The playground's id of the ``index``-th sequence: A, B, ..., Z, AA, AB, ... (like spreadsheet columns).

    >>> [sequence_name(i) for i in (0, 1, 25, 26, 27, 701, 702)]
    ['A', 'B', 'Z', 'AA', 'AB', 'ZZ', 'AAA']
    """
    number = check_count("index", index) + 1
    name = ""
    while number:
        number, letter = divmod(number - 1, 26)
        name = chr(ord("A") + letter) + name
    return name


# ---------------------------------------------------------------------------------- the player


class AllocationPlayer(widgets.VBox):
    """Replay a trace of allocator snapshots: Play, step back and forward, and a slider.

    Args:
        frames: the trace, usually ``cache.trace`` of an allocator made with ``record=True``.
        interval_ms: how long ``Play`` shows each frame.
        width: the width of the picture in pixels.

    Attributes:
        frames: the frames, as a tuple.
        stack: a ``Stack`` with one ``HTML`` picture per frame.
        play, slider, frame_number: ``Play``, an ``IntSlider`` and a ``BoundedIntText``, all over
            ``0 .. len(frames) - 1``.
        back_button, forward_button: ◀ and ▶.
        links: the three jslinks, Play-slider, slider-frame number and slider-stack.

    Raises:
        ValueError: ``frames`` is empty, or ``interval_ms`` or ``width`` is not a positive integer.
    """

    def __init__(self, frames: Sequence[TraceFrame], *, interval_ms: int = 700, width: int = 760) -> None:
        self.frames: tuple[TraceFrame, ...] = tuple(frames)
        if not self.frames:
            raise ValueError(
                "frames must hold at least one TraceFrame, got none; record a trace with "
                "PagedKVCacheAllocator(..., record=True) and pass its .trace"
            )
        interval_ms = check_count("interval_ms", interval_ms, minimum=1)
        width = self._width = check_count("width", width, minimum=1)
        last = len(self.frames) - 1

        self.stack = widgets.Stack(
            [widgets.HTML(self._render(i, width)) for i in range(len(self.frames))], selected_index=0
        )
        self.play = widgets.Play(value=0, min=0, max=last, step=1, interval=interval_ms)
        self.back_button = _small_button("◀", "previous frame")
        self.forward_button = _small_button("▶", "next frame")
        self.slider = widgets.IntSlider(value=0, min=0, max=last, readout=False)
        self.frame_number = widgets.BoundedIntText(
            value=0,
            min=0,
            max=last,
            description="frame",
            style={"description_width": "3.5em"},
            layout=widgets.Layout(width="10em"),
        )
        self.links = (
            widgets.jslink((self.play, "value"), (self.slider, "value")),
            widgets.jslink((self.slider, "value"), (self.frame_number, "value")),
            widgets.jslink((self.slider, "value"), (self.stack, "selected_index")),
        )
        self.back_button.on_click(lambda _button: self.step(-1))
        self.forward_button.on_click(lambda _button: self.step(+1))

        controls = widgets.HBox(
            [self.play, self.back_button, self.forward_button, self.slider, self.frame_number]
        )
        super().__init__([self.stack, controls])

    @classmethod
    def from_allocator(
        cls, cache: PagedKVCacheAllocator, *, interval_ms: int = 700, width: int = 760
    ) -> AllocationPlayer:
        """The player of everything ``cache`` recorded (it must be made with ``record=True``)."""
        return cls(cache.trace, interval_ms=interval_ms, width=width)

    def __repr__(self) -> str:
        return f"AllocationPlayer(frames={len(self.frames)})"

    # The state, read from the kernel side: the browser moves the stack through the jslinks.

    @property
    def frame(self) -> int:
        """The index of the frame the slider is on."""
        return self.slider.value

    @property
    def caption(self) -> str:
        """The caption shown under the current frame."""
        return self.frame_caption(self.frame)

    def frame_caption(self, index: int) -> str:
        """The caption shown under frame ``index``: ``"index/last · the frame's caption"``."""
        return f"{index}/{len(self.frames) - 1} · {self.frames[index].caption}"

    def frame_html(self, index: int) -> str:
        """The HTML picture of frame ``index``, as the stack holds it."""
        return self.stack.children[index].value

    def step(self, delta: int) -> int:
        """Pause and move the slider ``delta`` frames, clamped to the trace; returns the new frame."""
        self.play.playing = False
        self.slider.value = min(max(self.slider.value + delta, 0), len(self.frames) - 1)
        return self.slider.value

    def _render(self, index: int, width: int) -> str:
        frame = self.frames[index]
        return render_allocator(
            frame.snapshot,
            caption=self.frame_caption(index),
            highlight=frame.highlight,
            width=width,
            inline=True,
        )

    @property
    def still_frame(self) -> int:
        """The frame of the still: the one with the fewest free blocks (the earliest of equals)."""
        return min(range(len(self.frames)), key=lambda i: len(self.frames[i].snapshot.free_block_ids))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The widget view and a ``text/html`` still of :attr:`still_frame` for views that cannot draw it."""
        index = self.still_frame
        frame = self.frames[index]
        caption = f"{self.frame_caption(index)} · a still: run the cell to play all {len(self.frames)} frames"
        still = render_allocator(
            frame.snapshot, caption=caption, highlight=frame.highlight, width=self._width
        )
        return {**super()._repr_mimebundle_(**kwargs), "text/html": still}


def _small_button(label: str, tooltip: str) -> widgets.Button:
    return widgets.Button(description=label, tooltip=tooltip, layout=widgets.Layout(width="3em"))


# ------------------------------------------------------------------------------ the playground


class AllocatorPlayground(widgets.VBox):
    """A live allocator with buttons: add a sequence, run a decode step, finish one, reset.

    The bookkeeping is a real :class:`~paged_kv.kv.cache.PagedKVCacheAllocator` with one head of
    dimension one, so the K/V tensors stay tiny. The public methods (:meth:`add_sequence`,
    :meth:`decode_step`, :meth:`finish`, :meth:`reset`) are what the buttons call. None of them
    raises: an ``OutOfBlocksError`` or a ``ValueError`` is shown in :attr:`status` and leaves
    the allocator as it was.

    Attributes:
        cache: the allocator (a new one after :meth:`reset`).
        prompt: the ``IntSlider`` of the next sequence's prompt length, ``1 .. max_prompt``.
        add_button, decode_button, finish_button, reset_button: the buttons.
        sequence: the ``Dropdown`` of running sequences that ``finish`` frees.
        picture: the ``HTML`` picture of the allocator, captioned with the last action.
        status: the ``HTML`` usage line, and the message of an action that failed.
    """

    def __init__(
        self, num_blocks: int = 32, block_size: int = 4, *, max_prompt: int = 24, width: int = 760
    ) -> None:
        self.cache = _new_cache(num_blocks, block_size)
        max_prompt = check_count("max_prompt", max_prompt, minimum=1)
        self.width = check_count("width", width, minimum=1)
        self._next_index = 0
        self._caption = (
            f"{plural(self.cache.num_blocks, 'free block')} of {plural(self.cache.block_size, 'token')}"
        )
        self._highlight: tuple[int, ...] = ()
        self._message = ""

        self.prompt = widgets.IntSlider(
            value=min(block_size + 1, max_prompt), min=1, max=max_prompt, description="prompt"
        )
        self.add_button = widgets.Button(description="add sequence", tooltip="allocate the prompt's blocks")
        self.decode_button = widgets.Button(description="decode step", tooltip="one token for every sequence")
        self.sequence = widgets.Dropdown(options=[], description="sequence")
        self.finish_button = widgets.Button(description="finish", tooltip="free the chosen sequence")
        self.reset_button = widgets.Button(description="reset", tooltip="a new, empty allocator")
        self.status = widgets.HTML()
        self.picture = widgets.HTML()

        self.add_button.on_click(lambda _button: self.add_sequence())
        self.decode_button.on_click(lambda _button: self.decode_step())
        self.finish_button.on_click(lambda _button: self.finish())
        self.reset_button.on_click(lambda _button: self.reset())

        rows = [
            widgets.HBox([self.prompt, self.add_button]),
            widgets.HBox([self.decode_button, self.sequence, self.finish_button, self.reset_button]),
        ]
        super().__init__([*rows, self.status, self.picture])
        self._refresh()

    def __repr__(self) -> str:
        return (
            f"AllocatorPlayground(num_blocks={self.cache.num_blocks}, block_size={self.cache.block_size}, "
            f"sequences={len(self.cache.seq_ids)}, free={self.cache.num_free_blocks})"
        )

    # ----------------------------------------------------------------------------------- actions

    def add_sequence(self) -> None:
        """Allocate a new sequence with ``prompt.value`` tokens."""
        self._act(self._add_sequence, f"seq {self._next_name()}: {self.prompt.value}-token prompt")

    def decode_step(self) -> None:
        """Append one token to every running sequence, or to none when the blocks do not suffice."""
        running = len(self.cache.seq_ids)
        self._act(
            self._decode_step, f"decode step for {plural(running, 'sequence')}" if running else "decode step"
        )

    def finish(self) -> None:
        """Free the sequence chosen in :attr:`sequence`."""
        chosen = self.sequence.value
        self._act(self._finish, "finish" if chosen is None else f"finish seq {chosen}")

    def reset(self) -> None:
        """Start again from an empty allocator of the same size."""
        self._act(self._reset, "reset")

    def _act(self, action: Callable[[], tuple[str, Iterable[int]]], what: str) -> None:
        """Run an action and show what it did; when it fails, show why, and that nothing changed.

        ``what`` names the action in the caption of a refusal.
        """
        try:
            self._caption, highlight = action()
        except (OutOfBlocksError, ValueError, KeyError) as error:
            self._message = str(error)
            self._caption, self._highlight = refusal_caption(what, error), ()
        else:
            self._highlight = tuple(highlight)
            self._message = ""
        self._refresh()

    def _next_name(self) -> str:
        """The id the next added sequence gets: the next name not already held by the allocator."""
        while sequence_name(self._next_index) in self.cache:  # an id taken through .cache directly
            self._next_index += 1
        return sequence_name(self._next_index)

    def _add_sequence(self) -> tuple[str, Iterable[int]]:
        seq_id, num_tokens = self._next_name(), self.prompt.value
        table = self.cache.allocate_for_sequence(seq_id, num_tokens)
        self._next_index += 1
        return allocate_caption(seq_id, num_tokens, table.block_ids), table.block_ids

    def _decode_step(self) -> tuple[str, Iterable[int]]:
        seq_ids = self.cache.seq_ids
        if not seq_ids:
            raise ValueError("no sequence is running: add a sequence first")
        needed = sum(self.cache.needs_new_block(seq_id) for seq_id in seq_ids)
        if needed > self.cache.num_free_blocks:  # all or nothing: check before the first append
            what = f"a decode step for {plural(len(seq_ids), 'sequence')}"
            raise OutOfBlocksError(needed, self.cache.num_free_blocks, what)
        new_blocks = {seq_id: self.cache.append_tokens(seq_id) for seq_id in seq_ids}
        grown = [
            token_caption(seq_id, self.cache.sequence_length(seq_id), ids[0], new_block=True)
            for seq_id, ids in new_blocks.items()
            if ids
        ]
        caption = f"decode step: one token for each of {plural(len(seq_ids), 'sequence')}; "
        caption += "; ".join(grown) if grown else "every token fits in its last block"
        return caption, [self.cache.get_block_mapping(seq_id)[-1] for seq_id in seq_ids]

    def _finish(self) -> tuple[str, Iterable[int]]:
        seq_id = self.sequence.value
        if seq_id is None:
            raise ValueError("no sequence to finish: add a sequence first")
        block_ids = self.cache.get_block_mapping(seq_id)
        freed = self.cache.free_sequence(seq_id)
        return free_caption(seq_id, block_ids, freed), block_ids

    def _reset(self) -> tuple[str, Iterable[int]]:
        self.cache = _new_cache(self.cache.num_blocks, self.cache.block_size)
        self._next_index = 0
        return f"reset: all {plural(self.cache.num_blocks, 'block')} free", ()

    # ---------------------------------------------------------------------------------- display

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The widget view, plus a ``text/html`` still of the allocator for views that cannot draw it."""
        caption = f"{self._caption} · a still: run the cell to use the buttons"
        still = render_allocator(
            self.cache.snapshot(), caption=caption, highlight=self._highlight, width=self.width
        )
        return {**super()._repr_mimebundle_(**kwargs), "text/html": still}

    def _refresh(self) -> None:
        self.picture.value = render_allocator(
            self.cache.snapshot(),
            caption=self._caption,
            highlight=self._highlight,
            width=self.width,
            inline=True,
        )
        self.status.value = self._status_html()
        self._refresh_sequences()

    def _status_html(self) -> str:
        usage = self.cache.usage()
        line = (
            f"{usage.used_blocks} of {plural(self.cache.num_blocks, 'block')} used, "
            f"{usage.free_blocks} free · "
            f"{plural(usage.allocated_tokens, 'token')} in {plural(usage.reserved_tokens, 'slot')} "
            f"({usage.block_utilization:.0%} full, {usage.internal_fragmentation_tokens} empty)"
        )
        parts = [f"<div>{html.escape(line)}</div>"]
        if self._message:
            parts.append(f'<div style="{_WARNING_STYLE}">⚠ {html.escape(self._message)}</div>')
        return "".join(parts)

    def _refresh_sequences(self) -> None:
        seq_ids: tuple[Hashable, ...] = self.cache.seq_ids
        chosen = self.sequence.value
        self.sequence.options = list(seq_ids)
        self.sequence.value = chosen if chosen in seq_ids else (seq_ids[0] if seq_ids else None)
        self.decode_button.disabled = self.finish_button.disabled = not seq_ids


def _new_cache(num_blocks: int, block_size: int) -> PagedKVCacheAllocator:
    return PagedKVCacheAllocator(num_blocks, block_size, num_heads=1, head_dim=1)


def refusal_caption(what: str, error: Exception) -> str:
    """The caption of a refused action: what was refused, why, and that nothing changed.

    >>> refusal_caption("seq C: 9-token prompt", OutOfBlocksError(3, 1))
    'seq C: 9-token prompt refused: it needs 3 free blocks, 1 is free; nothing changed'
    >>> refusal_caption("decode step", ValueError("no sequence is running: add a sequence first"))
    'decode step refused: no sequence is running: add a sequence first; nothing changed'
    """
    if isinstance(error, OutOfBlocksError):
        verb = "is" if error.free == 1 else "are"
        why = f"it needs {plural(error.needed, 'free block')}, {error.free} {verb} free"
    else:
        why = str(error)
    return f"{what} refused: {why}; nothing changed"

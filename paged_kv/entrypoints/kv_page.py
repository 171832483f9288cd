"""The KV cache, live: a page the server serves at ``/kv`` (lesson 16).

While the server streams completions, ``/kv`` shows what the engine's block pool holds, step by
step: the physical pool (each block coloured by the request that holds it, a cached prefix shared
by several requests framed in dashes), each running request's block table, the free list in
eviction order and a usage gauge -- the course's pictures, drawn server-side by
:func:`~paged_kv.pictures.pool.render_allocator` (``inline=True``, so the SVG follows the page's
text colour in a light or a dark theme) -- and above them the numbers vLLM's ``/metrics`` reports:
``kv_cache_usage_perc`` (shown as a percentage), the requests running and waiting, the step, the
prefix cache's hit rate (hits / queries, in tokens), and each running request's tokens and blocks.
The block each request wrote its newest K/V to is outlined (:func:`newest_blocks`), so the outlines
walk along the tables as the requests decode.

Everything comes from :attr:`AsyncLLM.kv_view <paged_kv.serving.async_llm.AsyncLLM.kv_view>`, a
:class:`~paged_kv.serving.async_llm.KVCacheView` the engine loop replaces after every step and every
abort. :func:`kv_routes` serves it four ways:

* ``GET /kv``: the page, self-contained (inline CSS, JavaScript and SVG: no CDN, no font, works
  offline), with the current frame already in it, so it shows something without JavaScript too;
* ``GET /kv/events``: server-sent events (``text/event-stream``). The server polls ``kv_view``
  every ``interval_s`` (0.1 s) and sends one event when it changed, the first at once; the page
  swaps the event's frame in. A stream ends when its client disconnects, or after ``stream_s``
  seconds, when the browser's ``EventSource`` reconnects by itself (an open stream would otherwise
  hold a server's graceful shutdown for ever);
* ``GET /kv/frame``: the frame alone, an HTML fragment (what a page without ``EventSource`` polls);
* ``GET /kv/state``: the numbers as JSON (:func:`kv_state`), for tests and for the lesson.

With a memory that has no block pool (``Engine(mode="contiguous")``: ``snapshot`` is ``None``) the
page says so in a sentence and shows the numbers alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import time
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.pictures.pool import plural, render_allocator, seq_colour

if TYPE_CHECKING:
    from paged_kv.serving.async_llm import AsyncLLM, KVCacheView

__all__ = ["PAGE_TITLE", "kv_frame", "kv_page", "kv_routes", "kv_state", "newest_blocks"]

PAGE_TITLE = "paged_kv — the KV cache, live"
PICTURE_WIDTH = 900
LEGEND = (
    "A coloured block is held by a request (its label on the band; a dashed frame: several requests "
    "share it, a cached prefix). An empty block is free. The free list is the eviction order, least "
    "recently freed first, so a freed block keeps its cached prefix until it is reused."
)
NO_POOL = (
    "This engine keeps each request's K/V in one contiguous reservation (mode='contiguous'): there is "
    "no block pool to draw. The numbers above still follow every step."
)


# ------------------------------------------------------------------------------ the numbers


def _text(text: str) -> str:
    """``text`` escaped for an element's content (quotes need no escape there)."""
    return html.escape(text, quote=False)


def kv_state(view: KVCacheView) -> dict[str, Any]:
    """The view's numbers as JSON-ready data (``GET /kv/state``, and each event's ``state``).

    Keys, the view's field names but for the usage, which has vLLM's:

    * ``step``: the engine steps run so far;
    * ``kv_cache_usage_perc``: the pool's usage, a fraction in [0, 1], as vLLM's gauge
      ``vllm:kv_cache_usage_perc`` (the page shows it as a percentage);
    * ``num_running``, ``num_waiting``: the requests running and waiting (vLLM's gauges
      ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``);
    * ``prefix_cache_queries``, ``prefix_cache_hits`` (tokens, counted since the server started) and
      ``prefix_cache_hit_rate``, hits / queries (``None`` before the first query);
    * ``paged``: whether there is a block pool; then ``num_blocks``, ``block_size``,
      ``num_free_blocks`` and ``free_block_ids`` (the free list, head first: the eviction order),
      else these four are ``None``;
    * ``requests``: one entry per running request or block table, tables first in their order:
      ``request_id`` (as text), ``num_tokens`` (the request's tokens, ``None`` if it is not
      running), ``num_cached_tokens`` (the tokens its table's K/V holds) and ``block_ids`` (its
      block table; empty without a pool).

    Invariant: with a pool, ``num_free_blocks + len(set of every block_ids)`` is ``num_blocks``
    (a shared block counts once); with no request left, every block is free.
    """
    snapshot = view.snapshot
    tables = {} if snapshot is None else snapshot.tables
    ids: list[Hashable] = [*tables, *(r for r in view.num_tokens if r not in tables)]
    requests = [
        {
            "request_id": str(request_id),
            "num_tokens": view.num_tokens.get(request_id),
            "num_cached_tokens": tables[request_id].num_tokens if request_id in tables else 0,
            "block_ids": list(tables[request_id].block_ids) if request_id in tables else [],
        }
        for request_id in ids
    ]
    queries, hits = view.prefix_cache_queries, view.prefix_cache_hits
    return {
        "step": view.step,
        "kv_cache_usage_perc": view.kv_cache_usage,
        "num_running": view.num_running,
        "num_waiting": view.num_waiting,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "paged": snapshot is not None,
        "num_blocks": None if snapshot is None else snapshot.num_blocks,
        "block_size": None if snapshot is None else snapshot.block_size,
        "num_free_blocks": None if snapshot is None else len(snapshot.free_block_ids),
        "free_block_ids": None if snapshot is None else list(snapshot.free_block_ids),
        "requests": requests,
    }


# ------------------------------------------------------------------------------ the frame


def kv_frame(view: KVCacheView, *, width: int = PICTURE_WIDTH) -> str:
    """The frame: an HTML fragment of the numbers, the requests and the pool picture.

    The picture is :func:`~paged_kv.pictures.pool.render_allocator`'s inline form, or the sentence
    :data:`NO_POOL` when the view has no snapshot. Every number sits in an element with an id
    (``kv-step``, ``kv-usage``, ``kv-running``, ``kv-waiting``, ``kv-hit-rate``) and the frame's
    root carries ``data-step``; the same view always gives the same fragment.
    """
    state = kv_state(view)
    usage = state["kv_cache_usage_perc"]
    rate = state["prefix_cache_hit_rate"]
    hits = f"{state['prefix_cache_hits']} / {plural(state['prefix_cache_queries'], 'token')}"
    stats = "".join(
        _stat(key, label, value, note)
        for key, label, value, note in (
            ("usage", "KV cache usage", f"{100 * usage:.1f}%", "kv_cache_usage_perc"),
            ("running", "running", str(state["num_running"]), "num_requests_running"),
            ("waiting", "waiting", str(state["num_waiting"]), "num_requests_waiting"),
            ("step", "step", str(state["step"]), "engine steps run"),
            ("hit-rate", "prefix cache hit rate", "—" if rate is None else f"{100 * rate:.0f}%", hits),
        )
    )
    gauge = (
        f'<div class="kv-gauge" role="img" aria-label="KV cache usage {100 * usage:.1f}%">'
        f'<div style="width:{min(max(usage, 0.0), 1.0) * 100:.2f}%"></div></div>'
    )
    if view.snapshot is None:
        picture = f'<p class="kv-nopool">{_text(NO_POOL)}</p>'
    else:
        free = state["num_free_blocks"]
        caption = (
            f"step {view.step} · {plural(free, 'free block')} of {state['num_blocks']} · outlined: "
            "the block each request wrote its newest K/V to"
        )
        picture = render_allocator(
            view.snapshot, caption=caption, highlight=newest_blocks(view.snapshot), inline=True, width=width
        )
    return (
        f'<div class="kv-frame" data-step="{view.step}">'
        f'<div class="kv-stats">{stats}</div>{gauge}{_requests(state)}'
        f'<div class="kv-picture">{picture}</div></div>'
    )


def newest_blocks(snapshot: AllocatorSnapshot) -> list[int]:
    """The block each table's newest token went into: the block a decode step wrote, outlined.

    That is logical block ``(num_tokens - 1) // block_size`` of each table holding a token (a
    shared block once; a pool's null block never: no token goes there).

    >>> from paged_kv.core.block import BlockTable
    >>> tables = {"A": BlockTable([3, 5], 6), "B": BlockTable([3, 7, 2], 9), "C": BlockTable([], 0)}
    >>> newest_blocks(AllocatorSnapshot(8, 4, (0, 1, 4, 6), (0, 0, 1, 2, 0, 1, 0, 1), tables))
    [5, 2]
    """
    newest: list[int] = []
    for table in snapshot.tables.values():
        index = (table.num_tokens - 1) // snapshot.block_size
        if table.num_tokens > 0 and index < len(table.block_ids):
            block = table.block_ids[index]
            if block != snapshot.null_block and block not in newest and block < snapshot.num_blocks:
                newest.append(block)
    return newest


def _stat(key: str, label: str, value: str, note: str) -> str:
    return (
        f'<div class="kv-stat"><div class="kv-label">{_text(label)}</div>'
        f'<div class="kv-value" id="kv-{key}">{_text(value)}</div>'
        f'<div class="kv-note">{_text(note)}</div></div>'
    )


def _requests(state: dict[str, Any]) -> str:
    """The table of requests: a colour swatch and the id, its tokens (all of them, and those whose
    K/V its blocks hold: the newest token's K/V is written by the next step), its block table."""
    if not state["requests"]:
        return '<p class="kv-idle">No request is running: every block is free.</p>'
    rows = "".join(
        f'<tr><td><span class="kv-swatch" style="background:{seq_colour(r["request_id"])}"></span>'
        f"{_text(r['request_id'])}</td>"
        f'<td class="kv-num">{"—" if r["num_tokens"] is None else r["num_tokens"]}</td>'
        f'<td class="kv-num">{r["num_cached_tokens"]}</td>'
        f'<td class="kv-num">{len(r["block_ids"])}</td>'
        f'<td class="kv-blocks">{_text(" ".join(map(str, r["block_ids"])) or "—")}</td></tr>'
        for r in state["requests"]
    )
    return (
        '<table class="kv-requests"><thead><tr><th>request</th><th>tokens</th>'
        '<th title="tokens whose K/V the blocks hold: the newest one is written by the next step">'
        "K/V in blocks</th><th>blocks</th><th>block table</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


# ------------------------------------------------------------------------------ the page

_CSS = """
:root { color-scheme: light dark; --ink: #1f1f1f; --paper: #ffffff; --muted: #5c5c5c;
        --rule: #d0d0d0; --live: #0e6e3e; }
@media (prefers-color-scheme: dark) {
  :root { --ink: #e8e8e8; --paper: #111111; --muted: #b0b0b0; --rule: #444444; --live: #3fbf7f; }
}
body { margin: 0; background: var(--paper); color: var(--ink);
       font: 14px/1.45 "DejaVu Sans", Verdana, Helvetica, Arial, sans-serif; }
main { max-width: 940px; margin: 0 auto; padding: 14px 18px 24px; }
header { display: flex; align-items: baseline; gap: 14px; flex-wrap: wrap; }
h1 { font-size: 20px; margin: 0; }
.kv-sub { color: var(--muted); }
#kv-status { margin-left: auto; font-size: 13px; color: var(--muted); }
#kv-status.live { color: var(--live); }
.kv-stats { display: flex; gap: 10px; flex-wrap: wrap; margin: 12px 0 6px; }
.kv-stat { border: 1px solid var(--rule); border-radius: 6px; padding: 6px 12px; min-width: 96px; }
.kv-label, .kv-note { font-size: 12px; color: var(--muted); }
.kv-value { font-size: 22px; font-weight: bold; font-variant-numeric: tabular-nums; }
.kv-gauge { height: 8px; border: 1px solid var(--rule); border-radius: 4px; overflow: hidden; }
.kv-gauge > div { height: 100%; background: #888888; }
.kv-requests { border-collapse: collapse; margin: 10px 0 4px; font-variant-numeric: tabular-nums; }
.kv-requests th { text-align: left; font-size: 12px; color: var(--muted); font-weight: normal; }
.kv-requests th, .kv-requests td { padding: 2px 14px 2px 0; }
.kv-num { text-align: right; }
.kv-blocks { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
.kv-swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; border-radius: 2px; }
.kv-idle, .kv-nopool { margin: 10px 0; }
.kv-picture { margin-top: 8px; }
.kv-legend { color: var(--muted); font-size: 13px; max-width: 900px; }
"""

_SCRIPT = """
(() => {
  const frame = document.getElementById('kv-frame');
  const status = document.getElementById('kv-status');
  const base = location.pathname.replace(/\\/+$/, '');
  const say = (text, live) => { status.textContent = text; status.className = live ? 'live' : ''; };
  const show = html => { frame.innerHTML = html; };
  if (window.EventSource) {
    const source = new EventSource(base + '/events');
    source.onopen = () => say('live: updates on every step', true);
    source.onmessage = event => {
      show(JSON.parse(event.data).html);
      say('live: updates on every step', true);
    };
    source.onerror = () => say('reconnecting…', false);
  } else {
    const poll = () => fetch(base + '/frame').then(reply => reply.text()).then(show)
      .then(() => say('polling every 0.5 s', true), () => say('no answer from the server', false));
    poll();
    setInterval(poll, 500);
  }
})();
"""


# Four blocks, three held and one free: the page's icon, inline (no request for /favicon.ico).
_ICON = "data:image/svg+xml," + quote(
    "<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 16 16'>"
    "<rect x='1' y='1' width='6' height='6' fill='#0F70D6'/>"
    "<rect x='9' y='1' width='6' height='6' fill='#D47A00'/>"
    "<rect x='1' y='9' width='6' height='6' fill='#13894E'/>"
    "<rect x='9.5' y='9.5' width='5' height='5' fill='none' stroke='#888888'/></svg>"
)


def kv_page(view: KVCacheView, *, width: int = PICTURE_WIDTH) -> str:
    """The whole page (``GET /kv``): inline CSS and script, the current frame already drawn."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<title>{_text(PAGE_TITLE)}</title><link rel="icon" href="{_ICON}">'
        f"<style>{_CSS}</style></head><body><main>"
        '<header><h1>The KV cache, live</h1><span class="kv-sub">paged_kv · lesson 16</span>'
        '<span id="kv-status">connecting…</span></header>'
        f'<div id="kv-frame" aria-live="off">{kv_frame(view, width=width)}</div>'
        f'<p class="kv-legend">{_text(LEGEND)}</p>'
        "<noscript><p>Without JavaScript this page does not update: reload it.</p></noscript>"
        f"<script>{_SCRIPT}</script></main></body></html>"
    )


# ------------------------------------------------------------------------------ the routes


@dataclass
class _Rendered:
    """A view with its state, frame and event id: drawn once, whichever client asks first."""

    view: KVCacheView
    state: dict[str, Any]
    frame: str
    event_id: str


def kv_routes(
    async_llm: AsyncLLM,
    *,
    interval_s: float = 0.1,
    stream_s: float = 15.0,
    width: int = PICTURE_WIDTH,
) -> APIRouter:
    """The routes ``/kv``, ``/kv/events``, ``/kv/frame`` and ``/kv/state`` over ``async_llm.kv_view``.

    Args:
        async_llm: anything with a ``kv_view`` attribute (an :class:`~paged_kv.serving.async_llm.AsyncLLM`);
            it is read, never written, and only on the event loop.
        interval_s: how often an event stream looks at ``kv_view`` (seconds).
        stream_s: how long one event stream lasts before the browser reconnects (seconds).
        width: the pool picture's width in pixels.

    Invariants: each event is one ``data:`` line of JSON, ``{"state": kv_state(view), "html":
    kv_frame(view)}``, with an ``id:`` that depends on the state alone; a stream never sends two
    events with the same id in a row, nor (after a reconnect with ``Last-Event-ID``) the event its
    client last had. The latest view is drawn once however many clients watch it.
    """
    if not interval_s > 0 or not stream_s > 0:
        raise ValueError(f"interval_s and stream_s must be positive, got {interval_s!r} and {stream_s!r}")
    router = APIRouter()
    latest: list[_Rendered] = []  # the last view drawn: at most one entry

    def rendered() -> _Rendered:
        view = async_llm.kv_view
        if not latest or latest[0].view is not view:
            state = kv_state(view)
            text = json.dumps(state, sort_keys=True).encode()
            digest = hashlib.sha1(text, usedforsecurity=False).hexdigest()[:12]
            latest[:] = [_Rendered(view, state, kv_frame(view, width=width), f"{view.step}-{digest}")]
        return latest[0]

    @router.get("/kv", response_class=HTMLResponse, summary="The KV cache, live (a page)")
    async def page() -> HTMLResponse:
        return HTMLResponse(kv_page(async_llm.kv_view, width=width))

    @router.get("/kv/state", summary="The KV cache's numbers (JSON)")
    async def state() -> JSONResponse:
        return JSONResponse(rendered().state)

    @router.get("/kv/frame", response_class=HTMLResponse, summary="The KV cache's frame (an HTML fragment)")
    async def frame() -> HTMLResponse:
        return HTMLResponse(rendered().frame, headers={"Cache-Control": "no-store"})

    @router.get("/kv/events", summary="The KV cache's frames as server-sent events")
    async def events(request: Request) -> StreamingResponse:
        last_id = request.headers.get("last-event-id")

        async def stream() -> AsyncIterator[str]:
            nonlocal last_id
            yield f"retry: {max(100, round(interval_s * 1000))}\n\n"
            deadline = time.monotonic() + stream_s
            while time.monotonic() < deadline and not await request.is_disconnected():
                now = rendered()
                if now.event_id != last_id:
                    last_id = now.event_id
                    data = json.dumps({"state": now.state, "html": now.frame})
                    yield f"id: {now.event_id}\ndata: {data}\n\n"
                await asyncio.sleep(interval_s)

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    return router

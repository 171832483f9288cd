"""Shared helpers of the bench scripts: the timer (the course's own, :mod:`paged_kv.timing`), the result
row, the tables and the machine's description.

Every benchmark measures the package against a baseline *in the same run* and reports the ratio, so
a slow or busy machine shifts both sides alike. Nothing here asserts a time.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from paged_kv.timing import Timings, torch_threads
from paged_kv.timing import median_time as median_time  # the benches' timer is the course's


@dataclass(frozen=True)
class Row:
    """One line of a benchmark table.

    ``measured`` and ``baseline`` are in ``unit``; ``ratio`` is what ``target`` speaks of (a
    speed-up ``baseline / measured`` or a growth factor, as the name says); ``met`` is ``None``
    for a row with no target (shown for information). ``spread``, where the ratio is the median of
    rounds timed in turn, is the smallest and the largest round's ratio (shown after the ratio).
    """

    name: str
    measured: float
    baseline: float
    ratio: float
    target: str
    met: bool | None
    unit: str = "µs"
    spread: tuple[float, float] | None = None


def compare_thread_times(
    contestants: dict[str, Callable[[], object]], *, repeats: int, warmup: int, threads: int | None = None
) -> Timings:
    """:func:`paged_kv.timing.compare_times` in the CPU time of this thread (``time.thread_time``):
    ``warmup`` untimed calls of each contestant, then ``repeats`` rounds of one call each, in turn.

    For contestants that compute on this thread only (torch with one thread runs its operations on
    the caller's): the other processes of a busy machine then move the samples far less than they
    move wall time. A contestant that works in another thread (transformers' continuous batching
    does) must be timed with the wall clock instead.
    """
    samples: dict[str, list[float]] = {name: [] for name in contestants}
    with torch_threads(threads):
        for fn in contestants.values():
            for _ in range(warmup):
                fn()
        for _ in range(repeats):
            for name, fn in contestants.items():
                start = time.thread_time()
                fn()
                samples[name].append(time.thread_time() - start)
    return Timings({name: tuple(times) for name, times in samples.items()})


def spread_of(ratios: Iterable[float]) -> tuple[float, tuple[float, float]]:
    """The median of per-round ratios and their ``(smallest, largest)``: a row's ``ratio`` and ``spread``."""
    ratios = list(ratios)
    return statistics.median(ratios), (min(ratios), max(ratios))


def interpret_triton_without_a_gpu() -> None:
    """Set ``TRITON_INTERPRET=1`` where no CUDA device is visible and the variable is unset, as
    tests/conftest.py does: Triton fixes its mode, compiler or interpreter, when it is first
    imported, so this must run before anything imports triton (transformers does)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


FLAT_LIMIT = 1.5
"""An O(1) operation may cost at most this many times more on the large pool than on the small one."""


def flatness_rows(
    what: str,
    times: dict[str, dict[int, float]],
    small: int,
    large: int,
    labels: dict[str, str],
    package: str,
) -> list[Row]:
    """One row per key of ``times`` (seconds per pair, by pool size): its cost on the ``large`` pool
    over its cost on the ``small`` one, in ns per pair. Only the ``package`` key has the target
    (at most :data:`FLAT_LIMIT`); the others are shown for contrast."""
    rows = []
    for key, label in labels.items():
        growth = times[key][large] / times[key][small]
        is_package = key == package
        rows.append(
            Row(
                f"{what} cost {large:,} / {small:,} blocks: {label}",
                times[key][large] * 1e9,
                times[key][small] * 1e9,
                growth,
                f"<= {FLAT_LIMIT}x (flat)" if is_package else "—",
                growth <= FLAT_LIMIT if is_package else None,
                unit="ns/pair",
            )
        )
    return rows


def _met(met: bool | None) -> str:
    return "—" if met is None else ("yes" if met else "**no**")


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


HEADER = ("benchmark", "measured", "baseline", "unit", "ratio", "target", "met")


def _cells(row: Row) -> tuple[str, ...]:
    return (
        row.name,
        _number(row.measured),
        _number(row.baseline),
        row.unit,
        f"{row.ratio:.2f}x" + ("" if row.spread is None else f" ({row.spread[0]:.2f}-{row.spread[1]:.2f})"),
        row.target,
        _met(row.met).replace("**", ""),
    )


def text_table(rows: list[Row]) -> str:
    """The rows as an aligned plain-text table, for the terminal."""
    lines = [HEADER, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = []
    for index, line in enumerate(lines):
        pairs = enumerate(zip(line, widths, strict=True))
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in pairs]
        out.append("  ".join(cells))
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def markdown_table(rows: list[Row]) -> str:
    """The rows as a Markdown table; a missed target is shown in bold."""
    lines = ["| " + " | ".join(HEADER) + " |", "|---|" + "---:|" * 4 + "---|---|"]
    for row in rows:
        cells = list(_cells(row))
        cells[-1] = _met(row.met)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo where there is one, else what ``platform`` says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def machine_description() -> dict[str, str]:
    """Platform, CPU model, cores, Python and torch versions, and the CUDA device when there is one."""
    import torch

    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    description = {
        "platform": platform.platform(),
        "CPU": cpu_model(),
        "cores": f"{usable} usable of {cores}" if usable != cores else str(cores),
        "Python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "CUDA device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
    return description

"""The course's one timer, shared by lessons 03 and 05 and the benches, built to survive a busy laptop.

A single timing on a shared machine says little: another program takes a core for a few
milliseconds, a thread pool wakes up late, the first call pays for memory the later ones reuse.
So every measurement here follows the same rules:

* **warm-up**: ``warmup`` untimed calls come first;
* **repeats and medians**: ``repeats`` samples, each timing ``number`` calls in a row (so very short
  calls rise above the timer's resolution), and the median of the samples, which one slow sample
  cannot move;
* **threads**: ``threads`` fixes torch's intra-op threads for the measurement and restores them
  afterwards (one thread avoids a busy pool stalling at random);
* **interleaving**: :func:`compare_times` times its contestants round by round (A, B, C, A, B, C,
  ...), so a burst of load slows all of them alike, and :meth:`Timings.ratio` is the median of the
  per-round ratios;
* **the GPU**: with a CUDA ``device`` each sample waits for the GPU before it stops the clock.

Nothing here asserts a time: a ratio is for people to read, and :func:`how_fast` phrases it by its
direction ("3.2 times faster than", "1.9 times slower than"), never as "0.3 times faster".
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SAME_SPEED = 1.05
"""Ratios within this factor of 1 (either way) read as "about as fast as"."""


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads, then restore the previous number.

    ``None`` leaves the number as it is. Raises ``ValueError`` unless ``threads`` is ``None`` or a
    positive int.
    """
    if threads is None:
        yield
        return
    _check_int("threads", threads, 1)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@dataclass(frozen=True)
class Timings:
    """Samples of several contestants, timed round by round.

    ``samples[name][i]`` is the seconds one call of ``name`` took in round ``i`` (a sample of
    ``number`` calls, divided); every contestant has the same number of rounds.
    """

    samples: Mapping[str, tuple[float, ...]]

    def median(self, name: str) -> float:
        """The median seconds per call of ``name``. Raises ``KeyError`` for an unknown name."""
        return statistics.median(self._samples_of(name))

    def ratio(self, name: str, baseline: str) -> float:
        """The median over rounds of ``name``'s time over ``baseline``'s time in the same round.

        Above 1, ``name`` is slower than ``baseline``. Because both were measured in the same
        round, a load burst that slowed one slowed the other too, so this is steadier than the
        ratio of two medians. Raises ``KeyError`` for an unknown name.
        """
        pairs = zip(self._samples_of(name), self._samples_of(baseline), strict=True)
        return statistics.median(a / b for a, b in pairs)

    def _samples_of(self, name: str) -> tuple[float, ...]:
        if name not in self.samples:
            raise KeyError(f"no contestant named {name!r}; timed: {', '.join(map(repr, self.samples))}")
        return self.samples[name]


def compare_times(
    contestants: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 15,
    warmup: int = 2,
    number: int = 1,
    threads: int | None = None,
    device: torch.device | str | None = None,
) -> Timings:
    """Time every contestant ``repeats`` times, interleaved round by round, after ``warmup`` calls each.

    Args:
        contestants: a name for each zero-argument callable to time (at least one).
        repeats: rounds; each round takes one sample of every contestant, in the given order.
        warmup: untimed calls of each contestant before the first round.
        number: calls per sample; the sample is their total time divided by ``number``.
        threads: torch threads during the measurement (see :func:`torch_threads`); ``None`` keeps them.
        device: with a CUDA device, each sample synchronizes it before the clock stops.

    Returns:
        :class:`Timings` with ``repeats`` samples per contestant, in seconds per call.

    Raises:
        ValueError: no contestants, one is not callable, or a count is not an int in range (the
            message names the argument).
    """
    if not contestants:
        raise ValueError("contestants must name at least one callable")
    for name, fn in contestants.items():
        if not callable(fn):
            raise ValueError(f"contestants[{name!r}] must be callable, got {type(fn).__name__}")
    _check_int("repeats", repeats, 1)
    _check_int("warmup", warmup, 0)
    _check_int("number", number, 1)
    cuda = device is not None and torch.device(device).type == "cuda"
    samples: dict[str, list[float]] = {name: [] for name in contestants}
    with torch_threads(threads):
        for fn in contestants.values():
            for _ in range(warmup):
                fn()
            if cuda:
                torch.cuda.synchronize(device)
        for _ in range(repeats):
            for name, fn in contestants.items():
                start = time.perf_counter()
                for _ in range(number):
                    fn()
                if cuda:
                    torch.cuda.synchronize(device)
                samples[name].append((time.perf_counter() - start) / number)
    return Timings({name: tuple(times) for name, times in samples.items()})


def median_time(
    fn: Callable[[], object],
    repeats: int = 15,
    warmup: int = 2,
    number: int = 1,
    *,
    threads: int | None = None,
    device: torch.device | str | None = None,
) -> float:
    """The median over ``repeats`` samples of the seconds one call of ``fn`` takes.

    The arguments mean what they mean for :func:`compare_times`, which this is for one contestant.
    """
    timings = compare_times(
        {"fn": fn}, repeats=repeats, warmup=warmup, number=number, threads=threads, device=device
    )
    return timings.median("fn")


def how_fast(ratio: float) -> str:
    """A time ratio in words, by its direction: ``ratio`` is seconds over the baseline's seconds.

    ``0.25`` gives ``"4.0 times faster than"``, ``1.9`` gives ``"1.9 times slower than"``, and anything
    within :data:`SAME_SPEED` of 1 gives ``"about as fast as"``; factors of 10 and more are whole
    numbers.
    The phrase is meant to be followed by the baseline's name.

    Raises:
        ValueError: ``ratio`` is not a positive, finite number.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not (0 < ratio < math.inf):
        raise ValueError(f"ratio must be a positive, finite number got {ratio!r}")
    if 1 / SAME_SPEED < ratio < SAME_SPEED:
        return "about as fast as"
    factor, word = (1 / ratio, "faster") if ratio < 1 else (ratio, "slower")
    return f"{factor:.{0 if factor >= 10 else 1}f} times {word} than"


def _check_int(name: str, value: object, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name} must be an int of at least {lowest}, got {value!r}")

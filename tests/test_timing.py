"""The course's timer: warm-up, interleaved rounds, medians, threads restored, ratios phrased by direction.

No test asserts a wall-clock time: the clock is replaced by a fake one that each timed call moves
by a known amount.
"""

from __future__ import annotations

import pytest
import torch

from paged_kv import timing
from paged_kv.timing import Timings, compare_times, how_fast, median_time, torch_threads

pytestmark = pytest.mark.lesson05


class FakeClock:
    """``perf_counter`` replaced: time moves only when a contestant runs, by what it is told to cost."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def perf_counter(self) -> float:
        return self.now

    def contestant(self, name: str, costs: list[float]):
        """A callable that logs its name and advances the clock by the next cost (the last one repeats)."""
        queue = list(costs)

        def run() -> None:
            self.calls.append(name)
            self.now += queue.pop(0) if len(queue) > 1 else queue[0]

        return run


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", fake.perf_counter)
    return fake


def test_contestants_are_warmed_up_then_timed_round_by_round(clock):
    a, b = clock.contestant("a", [1.0]), clock.contestant("b", [2.0])
    timings = compare_times({"a": a, "b": b}, repeats=3, warmup=2)
    assert clock.calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert timings.samples == {"a": (1.0, 1.0, 1.0), "b": (2.0, 2.0, 2.0)}


def test_the_median_ignores_one_slow_sample_and_a_sample_divides_by_number(clock):
    # warm-up 1 call, then 3 samples of 2 calls: (1 + 1) / 2, (9 + 1) / 2, (1 + 1) / 2
    slow_once = clock.contestant("a", [5.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0])
    timings = compare_times({"a": slow_once}, repeats=3, warmup=1, number=2)
    assert timings.samples["a"] == (1.0, 5.0, 1.0)
    assert timings.median("a") == 1.0


def test_the_ratio_is_the_median_of_same_round_ratios_not_the_ratio_of_medians():
    # per-round ratios 2, 2.25 and 1.33: their median is 2; the medians' ratio, 4 / 3, pairs round 3's
    # paged time with round 2's baseline
    timings = Timings({"paged": (2.0, 9.0, 4.0), "sdpa": (1.0, 4.0, 3.0)})
    assert timings.ratio("paged", "sdpa") == 2.0
    assert timings.median("paged") / timings.median("sdpa") == 4.0 / 3.0
    with pytest.raises(KeyError, match="no contestant named 'flex'; timed: 'paged', 'sdpa'"):
        timings.ratio("flex", "sdpa")


def test_median_time_is_compare_times_for_one_callable(clock):
    costs = clock.contestant("fn", [1.0, 3.0, 2.0, 7.0])
    assert median_time(costs, repeats=3, warmup=1) == 3.0  # samples 3, 2, 7


@pytest.fixture
def three_threads():
    """Torch at three intra-op threads, a number nothing else sets (tests/conftest.py sets one), so
    that fixing threads to 1 and restoring them both show."""
    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(saved)


def test_threads_are_fixed_while_timing_and_restored_after_even_on_an_error(three_threads):
    seen = []
    compare_times({"f": lambda: seen.append(torch.get_num_threads())}, repeats=1, warmup=0, threads=1)
    assert seen == [1] and torch.get_num_threads() == three_threads

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        compare_times({"boom": boom}, threads=1)
    assert torch.get_num_threads() == three_threads
    with torch_threads(None):
        assert torch.get_num_threads() == three_threads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_is_synchronised_before_the_clock_stops(monkeypatch):
    synced = []
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: synced.append(device))
    compare_times({"f": lambda: None}, repeats=2, warmup=1, device="cuda")
    assert len(synced) == 3  # after the warm-up, and after each sample


def test_no_synchronisation_on_the_cpu(monkeypatch):
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronised"))
    compare_times({"f": lambda: None}, repeats=2, warmup=1, device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"contestants": {}}, "contestants must name at least one callable"),
        ({"contestants": {"x": 3}}, r"contestants\['x'\] must be callable, got int"),
        ({"repeats": 0}, "repeats must be an int of at least 1, got 0"),
        ({"warmup": -1}, "warmup must be an int of at least 0, got -1"),
        ({"number": 1.5}, "number must be an int of at least 1, got 1.5"),
        ({"threads": 0}, "threads must be an int of at least 1, got 0"),
        ({"repeats": True}, "repeats must be an int of at least 1, got True"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(kwargs, message):
    arguments = {"contestants": {"f": lambda: None}, **kwargs}
    with pytest.raises(ValueError, match=message):
        compare_times(**arguments)


@pytest.mark.parametrize(
    ("ratio", "phrase"),
    [
        (0.25, "4.0 times faster than"),
        (1 / 3.21, "3.2 times faster than"),
        (1.9, "1.9 times slower than"),
        (17.14, "17 times slower than"),
        (1 / 36.4, "36 times faster than"),
        (1.0, "about as fast as"),
        (1.04, "about as fast as"),
        (1 / 1.04, "about as fast as"),
        (1.2, "1.2 times slower than"),
    ],
)
def test_how_fast_phrases_a_ratio_by_its_direction(ratio, phrase):
    assert how_fast(ratio) == phrase


@pytest.mark.parametrize("ratio", [0, -1.5, float("inf"), float("nan"), "2", None, True])
def test_how_fast_rejects_what_is_not_a_positive_finite_ratio(ratio):
    with pytest.raises(ValueError, match="ratio must be a positive, finite number"):
        how_fast(ratio)

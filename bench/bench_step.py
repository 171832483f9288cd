"""The host's cost of one engine step with no model, against a nano-vllm-style engine (issue 21).

A step of the package's engine is ``output = scheduler.schedule(); result =
runner.execute_model(output); scheduler.update_from_output(output, result)``: the scheduler
decides every request's tokens and takes their blocks
(:class:`~paged_kv.serving.scheduler.Scheduler` over a
:class:`~paged_kv.core.kv_cache_manager.KVCacheManager`), the runner applies the
:class:`~paged_kv.serving.outputs.SchedulerOutput` to its persistent block table, prepares the
step's inputs once (:func:`~paged_kv.model.step.prepare_attention`: positions, ``query_start_loc``,
``seq_lens``, the block-table rows, the slot mapping) and runs the model, and the scheduler appends
the sampled tokens. Here the model is :class:`NullModel`, whose ``forward_step`` returns zero logits
at once, so what is timed is the host's work alone: the real
:class:`~paged_kv.serving.model_runner.ModelRunner`, its checks and sampling included, on a
one-layer, one-head :class:`~paged_kv.kv.storage.KVStorage` that nothing writes.

The baseline (:mod:`_nano_style`) is the same step in nano-vllm's style: a deque of running
sequences, ``can_append`` / ``may_append`` on a block list with ref counts and a free deque, then
``prepare_decode`` building the token ids, positions, context lengths, slot mapping and padded block
tables with Python lists and one tensor each, the same zero logits sampled, and ``postprocess``
appending the tokens.

Both serve ``num_seqs`` requests with seeded random prompts of 1 to ``max_prompt`` tokens (block
size 16), admitted and prefilled first (untimed), then decoding, none finishing while timed: each
sample times ``number`` steps of one contestant in the CPU time of the thread (:data:`CLOCK`), the
contestants interleaved round by round, and the ratio (package / baseline, target <= 1.0) is the
median of the rounds' ratios, their range beside it. The package runs twice: with
no token budget (the engine's default) and with ``max_num_batched_tokens`` = 16,384 (nano-vllm's
default, which its decode steps never consult). Each phase's share is shown as well: schedule,
execute (the runner, or nano-vllm's ``prepare_decode`` and sampling) and update
(``update_from_output``, or ``postprocess``).

    .venv/bin/python bench/bench_step.py [--profile]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _nano_style import NanoStyleRunner, NanoStyleScheduler, NanoStyleSequence
from _timing import Row, spread_of, text_table

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.kv.storage import KVStorage
from paged_kv.model.config import GPTConfig
from paged_kv.serving.model_runner import ModelRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler
from paged_kv.timing import torch_threads

TARGET = 1.0
"""The issue's target: the package's step costs the host at most what the nano-vllm-style one does."""

PHASES = ("schedule", "execute", "update")

CLOCK = time.thread_time
"""The clock of every sample: the CPU time of this thread, which the other processes of a busy
machine move far less than wall time (a step runs on this one thread: torch with one thread runs
its operations on the caller's). On the project's shared 2-core machine the rounds' ratios spread
over about 0.7-2.3x with ``time.perf_counter`` and 1.2-1.9x with this clock, in the same run."""

NANO_BUDGET = 16_384
"""nano-vllm's default ``max_num_batched_tokens``."""


class NullModel:
    """A model that computes nothing: ``forward_step`` returns zero logits over a one-token vocabulary,
    one row per request (what :class:`~paged_kv.serving.model_runner.ModelRunner` samples from).
    Its ``config`` is the one-layer, one-head storage's."""

    config = GPTConfig(vocab_size=1, num_layers=1, num_heads=1, head_dim=1)

    def forward_step(self, input_ids, positions, attend, logits_indices) -> torch.Tensor:
        return torch.zeros(len(logits_indices), 1)


def prompt_lengths(num_seqs: int, max_prompt: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, max_prompt) for _ in range(num_seqs)]


def pool_blocks(lengths: list[int], max_new_tokens: int, block_size: int) -> int:
    """Blocks for every sequence at its longest, and one each to spare: nobody is ever preempted."""
    return sum(blocks_for_tokens(n + max_new_tokens, block_size) for n in lengths) + len(lengths)


class PackageEngine:
    """The package's step loop with :class:`NullModel`: the scheduler, memory and runner the engine
    builds."""

    def __init__(self, lengths: list[int], max_new_tokens: int, block_size: int, budget: int | None) -> None:
        num_blocks = pool_blocks(lengths, max_new_tokens, block_size) + 1  # and the pool's null block
        memory = KVCacheManager(num_blocks, block_size)
        self.scheduler = Scheduler(memory, max_num_batched_tokens=budget)
        storage = KVStorage(1, num_blocks, block_size, 1, 1)
        width = blocks_for_tokens(max(lengths) + max_new_tokens, block_size)
        self.runner = ModelRunner(NullModel(), storage, max_num_reqs=len(lengths), max_blocks_per_req=width)
        rng = random.Random(1)
        for i, n in enumerate(lengths):
            prompt = tuple(rng.randrange(256) for _ in range(n))
            self.scheduler.add_request(EngineCoreRequest(i, n, max_new_tokens, prompt))

    def step(self, clock: list[float]) -> None:
        """One step; the seconds of its three phases are added to ``clock``."""
        t0 = CLOCK()
        output = self.scheduler.schedule()
        t1 = CLOCK()
        result = self.runner.execute_model(output)
        t2 = CLOCK()
        self.scheduler.update_from_output(output, result)
        t3 = CLOCK()
        clock[0] += t1 - t0
        clock[1] += t2 - t1
        clock[2] += t3 - t2

    def decoding(self) -> bool:
        """Whether every request runs and decodes (nothing waits, nothing left to prefill)."""
        s = self.scheduler
        return not s.waiting and all(r.num_computed_tokens == r.num_tokens - 1 for r in s.running)

    def tables(self) -> dict[int, list[int]]:
        memory = self.scheduler.memory
        return {r: list(memory.get_block_ids(r)[0]) for r in memory.request_ids}


class NanoEngine:
    """The nano-vllm-style step loop (:mod:`_nano_style`) on the same requests."""

    def __init__(self, lengths: list[int], max_new_tokens: int, block_size: int) -> None:
        num_blocks = pool_blocks(lengths, max_new_tokens, block_size)
        self.scheduler = NanoStyleScheduler(num_blocks, block_size, max_num_seqs=max(512, len(lengths)))
        self.runner = NanoStyleRunner(block_size)
        rng = random.Random(1)
        for i, n in enumerate(lengths):
            prompt = [rng.randrange(256) for _ in range(n)]
            self.scheduler.add(NanoStyleSequence(n, prompt, max_new_tokens, seq_id=i))

    def step(self, clock: list[float]) -> None:
        t0 = CLOCK()
        seqs, is_prefill = self.scheduler.schedule()
        t1 = CLOCK()
        tokens = self.runner.run(seqs, is_prefill)
        t2 = CLOCK()
        self.scheduler.postprocess(seqs, tokens)
        t3 = CLOCK()
        clock[0] += t1 - t0
        clock[1] += t2 - t1
        clock[2] += t3 - t2

    def decoding(self) -> bool:
        return not self.scheduler.waiting

    def tables(self) -> dict[int, list[int]]:
        return {seq.seq_id: list(seq.block_table) for seq in self.scheduler.running}


def start_decoding(engine: PackageEngine | NanoEngine, max_steps: int = 10_000) -> int:
    """Run ``engine`` until every request decodes (untimed); return the steps it took."""
    clock = [0.0, 0.0, 0.0]
    for step in range(max_steps):
        if engine.decoding():
            return step
        engine.step(clock)
    raise RuntimeError(f"the requests were not all decoding after {max_steps} steps")


def time_steps(
    contestants: dict[str, Callable[[list[float]], None]], *, repeats: int, number: int, warmup: int
) -> dict[str, list[list[float]]]:
    """Per contestant, per round, the seconds per step of each phase, :data:`PHASES` order: each round
    times ``number`` steps of every contestant in turn, after ``warmup`` untimed steps each."""
    for step in contestants.values():
        for _ in range(warmup):
            step([0.0, 0.0, 0.0])
    samples: dict[str, list[list[float]]] = {name: [] for name in contestants}
    for _ in range(repeats):
        for name, step in contestants.items():
            clock = [0.0, 0.0, 0.0]
            for _ in range(number):
                step(clock)
            samples[name].append([t / number for t in clock])
    return samples


def round_ratios(ours: list[float], theirs: list[float]) -> tuple[float, tuple[float, float]]:
    """The median of the rounds' ratios and their range (:func:`_timing.spread_of`)."""
    return spread_of(a / b for a, b in zip(ours, theirs, strict=True))


def run(
    num_seqs: int = 256,
    max_prompt: int = 512,
    block_size: int = 16,
    repeats: int = 15,
    number: int = 8,
    warmup: int = 4,
    threads: int = 1,
) -> list[Row]:
    """The rows: the whole step and each phase, the package (no budget, and nano-vllm's budget) over
    the nano-vllm-style baseline, in µs per step at ``num_seqs`` running sequences."""
    lengths = prompt_lengths(num_seqs, max_prompt)
    max_new_tokens = warmup + repeats * number + 8  # nobody finishes while timed
    engines = {
        "package": PackageEngine(lengths, max_new_tokens, block_size, None),
        "package, budget": PackageEngine(lengths, max_new_tokens, block_size, NANO_BUDGET),
        "nano": NanoEngine(lengths, max_new_tokens, block_size),
    }
    with torch_threads(threads):
        for engine in engines.values():
            start_decoding(engine)
        samples = time_steps({name: e.step for name, e in engines.items()},
                             repeats=repeats, number=number, warmup=warmup)  # fmt: skip
    totals = {name: [sum(phases) for phases in rounds] for name, rounds in samples.items()}
    what = (
        f"one decode step's host work at {num_seqs} running sequences (prompts 1-{max_prompt}, block "
        f"{block_size}), no model, CPU, {threads} thread{'s' if threads != 1 else ''}, thread CPU time, "
        f"median of {repeats} rounds of {number} steps"
    )
    names = {
        "package": "the package (no budget)",
        "package, budget": f"the package (max_num_batched_tokens={NANO_BUDGET:,})",
    }
    rows = []
    for key, label in names.items():
        ratio, spread = round_ratios(totals[key], totals["nano"])
        rows.append(Row(
            f"{what}: schedule + execute_model + update_from_output, {label} vs nano-vllm-style "
            f"schedule + prepare_decode + postprocess (time ratio, the rounds' range in brackets)",
            statistics.median(totals[key]) * 1e6, statistics.median(totals["nano"]) * 1e6, ratio,
            f"<= {TARGET:.1f}x", ratio <= TARGET, spread=spread,
        ))  # fmt: skip
    baselines = {"schedule": "schedule", "execute": "prepare_decode + sampling", "update": "postprocess"}
    ours = {"schedule": "Scheduler.schedule", "execute": "ModelRunner.execute_model",
            "update": "Scheduler.update_from_output"}  # fmt: skip
    for index, phase in enumerate(PHASES):
        mine = [rounds[index] for rounds in samples["package"]]
        theirs = [rounds[index] for rounds in samples["nano"]]
        ratio, spread = round_ratios(mine, theirs)
        rows.append(Row(
            f"{what}, phase {phase}: {ours[phase]} (no budget) vs nano-vllm-style {baselines[phase]}",
            statistics.median(mine) * 1e6, statistics.median(theirs) * 1e6, ratio, "—", None,
            spread=spread,
        ))  # fmt: skip
    return rows


def profile(num_seqs: int = 256, max_prompt: int = 512, block_size: int = 16, steps: int = 200,
            budget: int | None = None) -> None:  # fmt: skip
    """Print cProfile's top functions over ``steps`` decode steps of the package (``--profile``)."""
    import cProfile
    import pstats

    lengths = prompt_lengths(num_seqs, max_prompt)
    engine = PackageEngine(lengths, steps + 8, block_size, budget)
    with torch_threads(1):
        start_decoding(engine)
        clock = [0.0, 0.0, 0.0]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            engine.step(clock)
        profiler.disable()
    print(f"{steps} steps at {num_seqs} sequences, budget {budget}: per step "
          + ", ".join(f"{p} {t / steps * 1e6:,.0f} µs" for p, t in zip(PHASES, clock, strict=True))
          + " (under the profiler)")  # fmt: skip
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"num_seqs": 8, "max_prompt": 40, "block_size": 4, "repeats": 2, "number": 2, "warmup": 1}


if __name__ == "__main__":
    if "--profile" in sys.argv:
        profile()
        profile(budget=NANO_BUDGET)
    else:
        print(text_table(run()))

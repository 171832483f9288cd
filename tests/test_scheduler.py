"""The one scheduler (lessons 07, 09, 11): its steps, its memories, and the simulator and engine on it."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_kv.core.block import blocks_for_tokens
from paged_kv.model.config import GPTConfig
from paged_kv.model.kv_cache import ContiguousKVCache, PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.memory import ContiguousMemory, PagedMemory, admits
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.protocols import BlockCache, PagedCache, PrefixCachingCache, SwappingCache
from paged_kv.serving.request import SchedulerRequest
from paged_kv.serving.scheduler import RunnerOutput, Scheduler, SchedulerOutput, run_steps
from paged_kv.simulation.workload import BlockBookkeeping, ContiguousPolicy, PagedPolicy, Request, simulate

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=3)


def paged(num_blocks: int, block_size: int, **kwargs) -> PagedMemory:
    return PagedMemory(BlockBookkeeping(num_blocks, block_size), num_blocks, block_size, **kwargs)


def serve(scheduler: Scheduler, requests: list[tuple[int, SchedulerRequest]]):
    """Every step's output and result, with a counting runner."""
    return list(run_steps(scheduler, CountingRunner(scheduler.memory), requests))


# ------------------------------------------------------------------------------------ one step


def test_a_step_is_a_frozen_decision_then_an_update():
    memory = paged(8, 4)
    scheduler = Scheduler(memory)
    scheduler.add_request(SchedulerRequest("a", 5, 3))
    output = scheduler.schedule()
    assert isinstance(output, SchedulerOutput) and output.step == 0
    assert [p.request.request_id for p in output.prefills] == ["a"] and output.decodes == ()
    assert output.num_scheduled_tokens == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        output.step = 1  # type: ignore[misc]
    result = scheduler.update(output, RunnerOutput({"a": 7}))
    assert (result.num_running, result.held_tokens, result.reserved_tokens, result.finished) == (1, 5, 8, ())
    second = scheduler.schedule()
    assert [(d.request_id, d.token) for d in second.decodes] == [("a", 7)]  # the sampled token is fed back
    assert second.num_scheduled_tokens == 1


def test_a_request_with_o_output_tokens_runs_o_steps():
    for outputs in (1, 2, 5):
        steps = serve(Scheduler(paged(8, 4)), [(0, SchedulerRequest("a", 3, outputs))])
        assert len(steps) == outputs
        (request_id, tokens), *_ = steps[-1][1].finished
        assert request_id == "a" and len(tokens) == outputs


def test_a_stop_token_finishes_a_request_early_and_is_kept():
    # the counting runner samples token 0: a request stopping at 0 ends with its first token
    stopping, running_on = (
        SchedulerRequest("a", 3, 5, stop_token_ids=frozenset({0})),
        SchedulerRequest("b", 3, 5),
    )
    steps = serve(Scheduler(paged(8, 4)), [(0, stopping), (0, running_on)])
    finished = {request_id: tokens for _, result in steps for request_id, tokens in result.finished}
    assert finished == {"a": (0,), "b": (0,) * 5}
    assert steps[0][1].finished == (("a", (0,)),) and len(steps) == 5


def test_admission_is_the_engine_rule_first_come_first_served():
    # 6 blocks of 2: a (3 tokens, 2 blocks) needs 2 + 1 free, b (5 tokens, 3 blocks) 3 + 2 of 4: waits,
    # and c (1 token) must not jump ahead of it.
    scheduler = Scheduler(paged(6, 2))
    for request in (SchedulerRequest("a", 3, 4), SchedulerRequest("b", 5, 2), SchedulerRequest("c", 1, 1)):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [p.request.request_id for p in output.prefills] == ["a"]
    assert admits(4, 3, 1) is False and [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_max_num_seqs_caps_the_running_sequences():
    scheduler = Scheduler(paged(64, 4), max_num_seqs=2)
    steps = serve(scheduler, [(0, SchedulerRequest(i, 2, 3)) for i in range(5)])
    assert max(result.num_running for _, result in steps) == 2
    assert sum(len(result.finished) for _, result in steps) == 5


def test_preemption_takes_the_newest_and_requeues_it_at_the_front():
    # 4 blocks of 2, a and b 2 + 4 tokens: at step 3 both need a 3rd block and none is free.
    scheduler = Scheduler(paged(4, 2))
    steps = serve(scheduler, [(0, SchedulerRequest("a", 2, 4)), (0, SchedulerRequest("b", 2, 4))])
    preempted = [
        (output.step, p.request_id, p.way, p.num_tokens) for output, _ in steps for p in output.preemptions
    ]
    assert preempted == [(3, "b", "recompute", 4)]
    assert [d.request_id for d in steps[3][0].decodes] == ["a"]
    assert [p.request.request_id for p in steps[4][0].prefills] == ["b"]  # admitted again, first


def test_contiguous_memory_reserves_at_admission_and_never_preempts():
    memory = ContiguousMemory(10, lambda r: r.num_prompt_tokens + r.max_new_tokens)
    scheduler = Scheduler(memory)
    steps = serve(scheduler, [(0, SchedulerRequest("a", 2, 4)), (0, SchedulerRequest("b", 2, 4))])
    assert [result.reserved_tokens for _, result in steps] == [6, 6, 6, 6, 6, 6, 6, 6]
    assert all(not output.preemptions for output, _ in steps)
    assert memory.reservations == {}


# -------------------------------------------------------------------------------- invariants


@st.composite
def workloads(draw):
    n = draw(st.integers(0, 8))
    return [
        (draw(st.integers(0, 6)), SchedulerRequest(i, draw(st.integers(1, 12)), draw(st.integers(1, 10))))
        for i in range(n)
    ]


@given(workloads(), st.sampled_from([1, 2, 4]), st.integers(0, 12), st.sampled_from([None, 1, 3]))
def test_every_request_is_in_one_place_and_the_memory_ends_empty(arrivals, block_size, extra, max_num_seqs):
    largest = max((r.num_prompt_tokens + r.max_new_tokens for _, r in arrivals), default=1)
    num_blocks = largest // block_size + 2 + extra
    cache = BlockBookkeeping(num_blocks, block_size)
    scheduler = Scheduler(PagedMemory(cache, num_blocks, block_size), max_num_seqs=max_num_seqs)
    finished: dict = {}
    for output, result in run_steps(scheduler, CountingRunner(scheduler.memory), arrivals):
        places = [s.request.request_id for s in scheduler.running] + [r.request_id for r in scheduler.waiting]
        assert len(places) == len(set(places)) and not set(places) & set(finished)
        assert result.held_tokens <= result.reserved_tokens <= num_blocks * block_size
        assert output.num_scheduled_tokens == sum(p.num_new_tokens for p in output.prefills) + len(
            output.decodes
        )
        finished.update(result.finished)
    assert {i: len(t) for i, t in finished.items()} == {r.request_id: r.max_new_tokens for _, r in arrivals}
    assert cache.num_free_blocks == num_blocks


# ------------------------------------------------------------------- the simulator is the engine


def engine_requests(requests: list[Request], seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [
        EngineRequest(
            r.request_id,
            [rng.randrange(CONFIG.vocab_size) for _ in range(r.prompt_tokens)],
            r.output_tokens,
            r.arrival_step,
        )
        for r in requests
    ]


@st.composite
def small_workloads(draw):
    n = draw(st.integers(1, 6))
    return [
        Request(i, draw(st.integers(0, 4)), draw(st.integers(1, 12)), draw(st.integers(1, 10)))
        for i in range(n)
    ]


@settings(max_examples=25, deadline=None)
@given(small_workloads(), st.sampled_from([2, 4]), st.integers(0, 6), st.integers(0, 100))
def test_the_simulator_counts_the_steps_and_tokens_the_engine_counts(
    model, requests, block_size, extra, seed
):
    num_blocks = 24 // block_size + extra  # the longest request holds 21 tokens at most
    simulated = simulate(requests, PagedPolicy(block_size), num_blocks * block_size)
    served = Engine(model, num_blocks=num_blocks, block_size=block_size).run(engine_requests(requests, seed))
    assert simulated.steps == served.steps
    assert simulated.running == served.running and simulated.waiting == served.waiting
    assert simulated.held_tokens == served.held_tokens
    assert simulated.reserved_tokens == served.reserved_tokens
    assert simulated.utilization == served.utilization
    assert simulated.preemptions == served.preemptions
    assert {i: len(t) for i, t in served.tokens.items()} == {r.request_id: r.output_tokens for r in requests}


@settings(max_examples=15, deadline=None)
@given(small_workloads(), st.integers(0, 3), st.integers(0, 100))
def test_the_contiguous_simulator_counts_what_the_contiguous_engine_counts(model, requests, extra, seed):
    max_model_len = 22
    budget = (1 + extra) * max_model_len + 2 * extra
    simulated = simulate(requests, ContiguousPolicy("max", max_model_len), budget)
    served = Engine(
        model, num_blocks=budget, block_size=1, mode="contiguous", max_model_len=max_model_len
    ).run(engine_requests(requests, seed))
    assert (simulated.steps, simulated.running, simulated.waiting) == (
        served.steps,
        served.running,
        served.waiting,
    )
    assert simulated.held_tokens == served.held_tokens and simulated.reserved_tokens == served.reserved_tokens
    assert simulated.preemptions == served.preemptions == 0
    # Every request runs one step per output token: the prefill samples the first.
    assert sum(simulated.running) == sum(r.output_tokens for r in requests)


# ------------------------------------------------------------------------------ the protocols


def test_the_caches_satisfy_the_protocols():
    paged_cache = PagedKVCache(CONFIG, 8, 4)
    assert isinstance(paged_cache, PagedCache) and isinstance(paged_cache, SwappingCache)
    assert isinstance(paged_cache, PrefixCachingCache)
    assert not isinstance(ContiguousKVCache(CONFIG), BlockCache)  # it has no blocks to count
    bookkeeping = BlockBookkeeping(8, 4)
    assert isinstance(bookkeeping, BlockCache) and not isinstance(bookkeeping, PagedCache)


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Scheduler(paged(4, 2), preemption="evict"), "preemption must be one of"),
        (lambda: Scheduler(paged(4, 2), preemption="swap"), "preemption='swap' needs a cache with swap_out"),
        (lambda: Scheduler(paged(4, 2), max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerRequest([1], 2, 2), "request_id"),
        (lambda: SchedulerRequest("a", 0, 2), "num_prompt_tokens"),
        (lambda: SchedulerRequest("a", 2, 0), "max_new_tokens"),
        (lambda: SchedulerRequest("a", 2, 2, (1,)), "prompt_token_ids"),
        (lambda: paged(0, 2), "num_blocks"),
        (lambda: paged(4, 2, watermark=1.0), "watermark"),
        (lambda: ContiguousMemory(0, len), "budget_tokens"),
        (lambda: ContiguousMemory(8, 3), "reserve"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_refused_request_leaves_the_queue_unchanged():
    scheduler = Scheduler(paged(4, 2))
    scheduler.add_request(SchedulerRequest("a", 2, 2))
    for bad, match in (
        (SchedulerRequest("a", 2, 2), "was added before"),
        (SchedulerRequest("big", 7, 2), "cannot serve request 'big' even alone"),
        (("b", 2, 2), "must be a SchedulerRequest"),
    ):
        with pytest.raises(ValueError, match=match):
            scheduler.add_request(bad)  # type: ignore[arg-type]
    assert [r.request_id for r in scheduler.waiting] == ["a"]


def test_an_update_that_does_not_match_the_step_changes_nothing():
    scheduler = Scheduler(paged(8, 2))
    scheduler.add_request(SchedulerRequest("a", 2, 3))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for"):
        scheduler.update(output, RunnerOutput({}))
    with pytest.raises(ValueError, match="SchedulerOutput of step 0"):
        scheduler.update(SchedulerOutput(5), RunnerOutput({}))
    assert [len(s.generated) for s in scheduler.running] == [0]
    assert scheduler.update(output, RunnerOutput({"a": 1})).num_running == 1


# -------------------------------------------------------------------------- stateful, step by step


class SchedulerMachine(RuleBasedStateMachine):
    """Requests added between steps, in any order, on a small pool, preempting by recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size, self.num_blocks = 2, 8
        self.cache = BlockBookkeeping(self.num_blocks, self.block_size)
        self.scheduler = Scheduler(PagedMemory(self.cache, self.num_blocks, self.block_size))
        self.runner = CountingRunner(self.scheduler.memory)
        self.added: dict = {}
        self.finished: dict = {}

    @rule(prompt=st.integers(1, 6), outputs=st.integers(1, 6))
    def add(self, prompt: int, outputs: int) -> None:
        request = SchedulerRequest(len(self.added), prompt, outputs)
        self.scheduler.add_request(request)
        self.added[request.request_id] = request

    @rule()
    def step(self) -> None:
        running_before = {s.request.request_id for s in self.scheduler.running}
        output = self.scheduler.schedule()
        # Only sequences running before the step decode; newcomers prefill; victims are the newest.
        assert {d.request_id for d in output.decodes} <= running_before | {
            s.request_id for s in output.swapped_in
        }
        assert not {p.request.request_id for p in output.prefills} & running_before
        result = self.scheduler.update(output, self.runner.execute(output))
        assert result.held_tokens <= result.reserved_tokens
        for request_id, tokens in result.finished:
            assert len(tokens) == self.added[request_id].max_new_tokens
            self.finished[request_id] = tokens

    @invariant()
    def every_request_is_in_one_place(self) -> None:
        running = [s.request.request_id for s in self.scheduler.running]
        waiting = [r.request_id for r in self.scheduler.waiting]
        places = running + waiting + list(self.finished)
        assert sorted(places) == sorted(self.added)

    @invariant()
    def the_memory_holds_the_running_sequences(self) -> None:
        used = sum(blocks_for_tokens(s.held, self.block_size) for s in self.scheduler.running)
        assert self.cache.num_free_blocks == self.num_blocks - used


TestSchedulerMachine = SchedulerMachine.TestCase

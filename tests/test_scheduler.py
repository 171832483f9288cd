"""The one scheduler (lessons 07, 09-11): vLLM v1's step, its memories, and the simulator and engine on it."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.contiguous_memory import ContiguousMemory
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput, run_steps
from paged_kv.simulation.workload import ContiguousPolicy, PagedPolicy, Request, simulate
from tests.helpers import max_examples

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=3)


def paged(num_blocks: int, block_size: int, *, caching: bool = False, **kwargs) -> KVCacheManager:
    """``num_blocks`` blocks for the requests, in a pool of one more: its null block."""
    return KVCacheManager(num_blocks + 1, block_size, enable_caching=caching, **kwargs)


def serve(scheduler: Scheduler, requests: list[tuple[int, EngineCoreRequest]]):
    """Every step's output and result, with a counting runner."""
    return list(run_steps(scheduler, CountingRunner(), requests))


def scheduled(steps) -> list[dict]:
    return [dict(output.num_scheduled_tokens) for output, _ in steps]


# ------------------------------------------------------------------------------------ one step


def test_a_step_is_a_frozen_decision_then_an_update():
    memory = paged(8, 4)
    scheduler = Scheduler(memory)
    scheduler.add_request(EngineCoreRequest("a", 5, 3))
    output = scheduler.schedule()
    assert isinstance(output, SchedulerOutput) and output.step == 0
    assert output.num_scheduled_tokens == {"a": 5} and output.total_num_scheduled_tokens == 5
    (new,) = output.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, len(new.block_ids[0])) == ("a", 0, 2)
    assert memory.get_block_ids("a") == new.block_ids  # taken when scheduled, before it runs
    with pytest.raises(dataclasses.FrozenInstanceError):
        output.step = 1  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="update_from_output first"):
        scheduler.schedule()
    result = scheduler.update_from_output(output, ModelRunnerOutput({"a": 7}))
    assert (result.num_running, result.held_tokens, result.reserved_tokens, result.finished) == (1, 5, 8, ())
    assert result.new_tokens == {"a": 7} and result.first_tokens == ("a",)
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1} and second.scheduled_new_reqs == ()
    assert second.scheduled_cached_reqs.req_ids == ("a",)
    assert second.scheduled_cached_reqs.num_computed_tokens == (5,)
    assert second.scheduled_cached_reqs.new_block_ids == (((),),)  # the 6th token fits in block 2


def test_a_decode_takes_its_block_at_the_boundary_when_it_is_scheduled():
    memory = paged(8, 4)
    scheduler = Scheduler(memory)
    scheduler.add_request(EngineCoreRequest("a", 4, 3))
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({"a": 1}))
    free = memory.num_free_blocks
    output = scheduler.schedule()  # token 5 starts block 2
    ((gained,),) = output.scheduled_cached_reqs.new_block_ids  # one request, one group
    assert len(gained) == 1 and memory.num_free_blocks == free - 1
    assert memory.get_block_ids("a")[0][-1] == gained[0]


def test_a_request_with_o_output_tokens_runs_o_steps():
    for outputs in (1, 2, 5):
        steps = serve(Scheduler(paged(8, 4)), [(0, EngineCoreRequest("a", 3, outputs))])
        assert len(steps) == outputs
        (request_id, tokens), *_ = steps[-1][1].finished
        assert request_id == "a" and len(tokens) == outputs


def test_a_stop_token_finishes_a_request_early_and_is_kept():
    # the counting runner samples token 0: a request stopping at 0 ends with its first token
    stopping, running_on = (
        EngineCoreRequest("a", 3, 5, stop_token_ids=frozenset({0})),
        EngineCoreRequest("b", 3, 5),
    )
    steps = serve(Scheduler(paged(8, 4)), [(0, stopping), (0, running_on)])
    finished = {request_id: tokens for _, result in steps for request_id, tokens in result.finished}
    assert finished == {"a": (0,), "b": (0,) * 5}
    assert steps[0][1].finished == (("a", (0,)),) and len(steps) == 5
    assert steps[1][0].finished_req_ids == {"a"}  # the runner hears of it at the next step


def test_admission_needs_the_whole_prompt_and_no_headroom():
    # 6 blocks of 2: a (3 tokens) takes 2; b (5 tokens, 3 blocks) fits in the 4 left with no block
    # of headroom kept for a (vLLM keeps none); c (3 tokens, 2 blocks) finds 1 and waits.
    scheduler = Scheduler(paged(6, 2))
    for request in (EngineCoreRequest("a", 3, 4), EngineCoreRequest("b", 5, 2), EngineCoreRequest("c", 3, 1)):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 3, "b": 5}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_admission_is_first_come_first_served():
    # b (5 tokens) does not fit in the 4 blocks of 2 a leaves free; c (1 token) must not jump it.
    scheduler = Scheduler(paged(6, 2))
    for request in (EngineCoreRequest("a", 4, 2), EngineCoreRequest("b", 9, 2), EngineCoreRequest("c", 1, 1)):
        scheduler.add_request(request)
    assert scheduler.schedule().num_scheduled_tokens == {"a": 4}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_a_chunk_takes_its_own_blocks_but_the_whole_prompt_must_fit():
    # A budget of 4 tokens: a's 10-token prompt runs in chunks of 4, 4 and 2, taking 2, 2 and 1
    # block of 2 as they are scheduled. b (7 tokens) must wait: its whole prompt (4 blocks) does
    # not fit in the 10 - 5 = 5... it does, but the budget is spent; then with reserve_full_prompt
    # off a first chunk alone may be admitted into blocks the rest of the prompt could not have.
    memory = paged(7, 2)
    scheduler = Scheduler(memory, max_num_batched_tokens=4)
    scheduler.add_request(EngineCoreRequest("a", 10, 2))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4} and memory.num_free_blocks == 5
    scheduler.update_from_output(output, ModelRunnerOutput({}))
    scheduler.add_request(EngineCoreRequest("b", 6, 1))
    output = scheduler.schedule()  # a's second chunk spends the budget
    assert output.num_scheduled_tokens == {"a": 4} and memory.num_free_blocks == 3
    scheduler.update_from_output(output, ModelRunnerOutput({}))
    output = scheduler.schedule()  # a's last 2 tokens; b's 6 tokens need 3 blocks, 2 are free
    assert output.num_scheduled_tokens == {"a": 2}

    lenient = Scheduler(paged(7, 2), max_num_batched_tokens=4, reserve_full_prompt=False)
    lenient.add_request(EngineCoreRequest("a", 10, 2))
    lenient.update_from_output(lenient.schedule(), ModelRunnerOutput({}))
    lenient.update_from_output(lenient.schedule(), ModelRunnerOutput({}))
    lenient.add_request(EngineCoreRequest("b", 6, 1))
    assert lenient.schedule().num_scheduled_tokens == {"a": 2, "b": 2}  # b's first chunk squeezes in


def test_the_watermark_applies_only_while_another_request_runs():
    # 4 blocks of 2, a watermark of 1 block: alone, a 7-token prompt (4 blocks) is admitted.
    scheduler = Scheduler(paged(4, 2, watermark=0.25))
    scheduler.add_request(EngineCoreRequest("a", 7, 1))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 7}
    beside = Scheduler(paged(6, 2, watermark=0.2))  # keeps ceil(0.2 * 6) = 2 blocks
    for request in (EngineCoreRequest("a", 2, 3), EngineCoreRequest("b", 7, 1)):
        beside.add_request(request)
    assert beside.schedule().num_scheduled_tokens == {"a": 2}  # b's 4 blocks + 2 > the 5 free


def test_max_num_seqs_caps_the_running_sequences():
    scheduler = Scheduler(paged(64, 4), max_num_seqs=2)
    steps = serve(scheduler, [(0, EngineCoreRequest(i, 2, 3)) for i in range(5)])
    assert max(result.num_running for _, result in steps) == 2
    assert sum(len(result.finished) for _, result in steps) == 5


def test_preemption_takes_the_newest_and_requeues_it_at_the_front():
    # 4 blocks of 2, a and b 2 + 4 tokens: at step 3 a's 5th token needs a 3rd block, none is free.
    scheduler = Scheduler(paged(4, 2))
    steps = serve(scheduler, [(0, EngineCoreRequest("a", 2, 4)), (0, EngineCoreRequest("b", 2, 4))])
    preempted = [
        (output.step, p.request_id, p.way, p.num_tokens) for output, _ in steps for p in output.preemptions
    ]
    assert preempted == [(3, "b", "recompute", 4)]
    assert steps[3][0].num_scheduled_tokens == {"a": 1}  # nobody is admitted in a step that preempts
    resumed = steps[4][0]  # a finished at step 3: b comes back first, from the front of the queue
    assert resumed.num_scheduled_tokens == {"b": 5}  # prompt and its 3 tokens, prefilled again
    assert resumed.scheduled_new_reqs[0].num_computed_tokens == 0


def test_a_request_that_cannot_fit_preempts_itself_when_it_is_the_newest():
    scheduler = Scheduler(paged(3, 2))
    for request in (EngineCoreRequest("a", 2, 3), EngineCoreRequest("b", 4, 3)):
        scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({"a": 1, "b": 1}))
    output = scheduler.schedule()  # a's 3rd token fits in block 2? no: a holds 1 block, full
    assert [p.request_id for p in output.preemptions] == ["b"]
    assert output.num_scheduled_tokens == {"a": 1}


def test_swap_preemption_moves_the_blocks_and_brings_them_back():
    memory = paged(4, 2)
    scheduler = Scheduler(memory, preemption="swap")
    steps = serve(scheduler, [(0, EngineCoreRequest("a", 2, 4)), (0, EngineCoreRequest("b", 2, 4))])
    out = next(output for output, _ in steps if output.blocks_to_swap_out)
    assert list(out.blocks_to_swap_out) == ["b"] and len(out.blocks_to_swap_out["b"][0]) == 2
    back = next(output for output, _ in steps if output.blocks_to_swap_in)
    (new,) = [r for r in back.scheduled_new_reqs if r.req_id == "b"]
    assert new.block_ids == back.blocks_to_swap_in["b"] and new.num_computed_tokens == 4
    assert back.num_scheduled_tokens["b"] == 1  # it decodes as soon as it is back
    finished = {r: t for _, result in steps for r, t in result.finished}
    assert finished == {"a": (0,) * 4, "b": (0,) * 4} and memory.num_free_blocks == 4


def test_contiguous_memory_reserves_at_admission_and_never_preempts():
    memory = ContiguousMemory(12, lambda r: r.num_prompt_tokens + r.max_tokens, seat_tokens=6, block_size=2)
    scheduler = Scheduler(memory)
    steps = serve(scheduler, [(0, EngineCoreRequest("a", 2, 4)), (0, EngineCoreRequest("b", 2, 4))])
    assert [result.reserved_tokens for _, result in steps] == [12, 12, 12, 12]
    assert all(not output.preemptions for output, _ in steps)
    assert [r.block_ids for r in steps[0][0].scheduled_new_reqs] == [((0, 1, 2),), ((3, 4, 5),)]
    assert memory.reservations == {}


def test_prefix_hits_are_computed_tokens_of_a_new_request():
    memory = paged(8, 2, caching=True)
    scheduler = Scheduler(memory)
    prompt = (1, 2, 3, 4, 5)
    scheduler.add_request(EngineCoreRequest("a", 5, 1, prompt))
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({"a": 9}))
    scheduler.add_request(EngineCoreRequest("b", 5, 1, prompt))
    output = scheduler.schedule()
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 4 and output.num_scheduled_tokens == {"b": 1}
    assert new.block_ids[0][:2] == memory.get_block_ids("b")[0][:2]


# -------------------------------------------------------------------------------- invariants


@st.composite
def workloads(draw):
    n = draw(st.integers(0, 8))
    return [
        (draw(st.integers(0, 6)), EngineCoreRequest(i, draw(st.integers(1, 12)), draw(st.integers(1, 10))))
        for i in range(n)
    ]


@settings(max_examples=max_examples(60), deadline=None)
@given(
    workloads(),
    st.sampled_from([1, 2, 4]),
    st.integers(0, 12),
    st.sampled_from([None, 1, 3]),
    st.sampled_from([None, 1, 5, 16]),
    st.sampled_from(["recompute", "swap"]),
)
def test_every_request_is_in_one_place_and_the_memory_ends_empty(
    arrivals, block_size, extra, max_num_seqs, budget, preemption
):
    largest = max((r.num_prompt_tokens + r.max_tokens for _, r in arrivals), default=1)
    num_blocks = largest // block_size + 1 + extra
    memory = paged(num_blocks, block_size)
    scheduler = Scheduler(
        memory, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, preemption=preemption
    )
    finished: dict = {}
    for output, result in run_steps(scheduler, CountingRunner(), arrivals):
        places = (
            [r.request_id for r in scheduler.running]
            + [r.request_id for r in scheduler.waiting]
            + [r.request_id for r in scheduler.swapped]
        )
        assert len(places) == len(set(places)) and not set(places) & set(finished)
        assert result.held_tokens <= result.reserved_tokens <= num_blocks * block_size
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        if budget is not None:
            assert output.total_num_scheduled_tokens <= budget
        for request in scheduler.running:  # the memory holds exactly the computed tokens
            assert memory.num_tokens(request.request_id) == request.num_computed_tokens
        finished.update(result.finished)
    assert {i: len(t) for i, t in finished.items()} == {r.request_id: r.max_tokens for _, r in arrivals}
    assert memory.num_free_blocks == num_blocks and not scheduler.requests


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


@settings(max_examples=max_examples(25), deadline=None)
@given(small_workloads(), st.sampled_from([2, 4]), st.integers(0, 6), st.integers(0, 100))
def test_the_simulator_counts_the_steps_and_tokens_the_engine_counts(
    model, requests, block_size, extra, seed
):
    num_blocks = 24 // block_size + extra  # the longest request holds 21 tokens at most
    simulated = simulate(requests, PagedPolicy(block_size), num_blocks * block_size)
    # The simulator's pool is the budget's blocks and its null block: the engine's num_blocks counts both.
    served = Engine(model, num_blocks=num_blocks + 1, block_size=block_size).run(
        engine_requests(requests, seed)
    )
    assert simulated.steps == served.steps
    assert simulated.running == served.running and simulated.waiting == served.waiting
    assert simulated.held_tokens == served.held_tokens
    assert simulated.reserved_tokens == served.reserved_tokens
    assert simulated.utilization == served.utilization
    assert simulated.preemptions == served.preemptions
    assert {i: len(t) for i, t in served.tokens.items()} == {r.request_id: r.output_tokens for r in requests}


@settings(max_examples=max_examples(15), deadline=None)
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


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Scheduler(paged(4, 2), preemption="evict"), "preemption must be one of"),
        (lambda: Scheduler(paged(4, 2), max_num_seqs=0), "max_num_seqs"),
        (lambda: Scheduler(paged(4, 2), max_num_batched_tokens=0), "max_num_batched_tokens"),
        (lambda: EngineCoreRequest([1], 2, 2), "request_id"),
        (lambda: EngineCoreRequest("a", 0, 2), "num_prompt_tokens"),
        (lambda: EngineCoreRequest("a", 2, 0), "max_tokens"),
        (lambda: EngineCoreRequest("a", 2, 2, (1,)), "prompt_token_ids"),
        (lambda: KVCacheManager(1, 2), "num_blocks"),  # the null block and one more, at least
        (lambda: paged(4, 2, watermark=1.0), "watermark"),
        (lambda: ContiguousMemory(0, len, seat_tokens=1), "budget_tokens"),
        (lambda: ContiguousMemory(8, 3, seat_tokens=1), "reserve"),
        (lambda: ContiguousMemory(8, len, seat_tokens=0), "seat_tokens"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_live_id_is_refused_and_a_finished_one_comes_again():
    scheduler = Scheduler(paged(4, 2))
    scheduler.add_request(EngineCoreRequest("a", 2, 1))
    with pytest.raises(ValueError, match="request_id 'a' is live"):
        scheduler.add_request(EngineCoreRequest("a", 2, 2))
    assert [r.request_id for r in scheduler.waiting] == ["a"] and list(scheduler.requests) == ["a"]
    scheduler.update_from_output(output := scheduler.schedule(), CountingRunner().execute_model(output))
    assert not scheduler.requests and not scheduler.has_unfinished_requests  # finished: forgotten
    scheduler.add_request(EngineCoreRequest("a", 2, 1))  # its id is free again
    assert list(scheduler.requests) == ["a"]


def test_an_update_that_does_not_match_the_step_changes_nothing():
    scheduler = Scheduler(paged(8, 2))
    scheduler.add_request(EngineCoreRequest("a", 2, 3))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for"):
        scheduler.update_from_output(output, ModelRunnerOutput({}))
    with pytest.raises(ValueError, match="SchedulerOutput of step 0"):
        scheduler.update_from_output(SchedulerOutput(5), ModelRunnerOutput({}))
    assert [len(r.output_token_ids) for r in scheduler.running] == [0]
    assert scheduler.update_from_output(output, ModelRunnerOutput({"a": 1})).num_running == 1


# -------------------------------------------------------------------------- stateful, step by step


class SchedulerMachine(RuleBasedStateMachine):
    """Requests added between steps, in any order, on a small pool, under a small budget."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size, self.num_blocks = 2, 8
        self.memory = paged(self.num_blocks, self.block_size)
        self.scheduler = Scheduler(self.memory, max_num_batched_tokens=5)
        self.runner = CountingRunner()
        self.added: dict = {}
        self.finished: dict = {}

    @rule(prompt=st.integers(1, 6), outputs=st.integers(1, 6))
    def add(self, prompt: int, outputs: int) -> None:
        request = EngineCoreRequest(len(self.added), prompt, outputs)
        self.scheduler.add_request(request)
        self.added[request.request_id] = request

    @rule()
    def step(self) -> None:
        running_before = [r.request_id for r in self.scheduler.running]
        output = self.scheduler.schedule()
        # The running requests come first, in list order; victims are the newest of them.
        order = list(output.num_scheduled_tokens)
        kept = [r for r in running_before if r in output.num_scheduled_tokens]
        assert order[: len(kept)] == kept
        victims = [p.request_id for p in output.preemptions]
        assert victims == running_before[len(running_before) - len(victims) :][::-1]
        assert output.total_num_scheduled_tokens <= 5
        result = self.scheduler.update_from_output(output, self.runner.execute_model(output))
        assert result.held_tokens <= result.reserved_tokens
        for request_id, tokens in result.finished:
            assert len(tokens) == self.added[request_id].max_tokens
            self.finished[request_id] = tokens

    @invariant()
    def every_request_is_in_one_place(self) -> None:
        running = [r.request_id for r in self.scheduler.running]
        waiting = [r.request_id for r in self.scheduler.waiting]
        places = running + waiting + list(self.finished)
        assert sorted(places) == sorted(self.added)

    @invariant()
    def the_memory_holds_the_running_requests_computed_tokens(self) -> None:
        used = sum(blocks_for_tokens(r.num_computed_tokens, self.block_size) for r in self.scheduler.running)
        assert self.memory.num_free_blocks == self.num_blocks - used


TestSchedulerMachine = SchedulerMachine.TestCase

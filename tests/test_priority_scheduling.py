"""Priority scheduling (lesson 11): vLLM's ``--scheduling-policy priority`` in the one scheduler.

Waiting requests go by ``(priority, arrival_time)``, lower first; when the running requests' slots
do not fit, the victim is the running request with the largest ``(priority, arrival_time)``,
wherever it stands in the running list, even one scheduled earlier in the same step; a request
that preempts itself lets the ones after it try. The policy changes who waits, never the tokens.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.reference.lesson11 import priority_victims
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.serving.scheduler import ModelRunnerOutput, Scheduler, run_steps
from tests.helpers import max_examples

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)


def priority_scheduler(num_blocks: int, block_size: int, **kwargs) -> Scheduler:
    """A priority scheduler over ``num_blocks`` blocks (and the pool's null block)."""
    return Scheduler(KVCacheManager(num_blocks + 1, block_size), policy="priority", **kwargs)


def request(request_id: str, prompt: int, max_tokens: int, priority: int, arrival: float | None = None):
    return EngineCoreRequest(request_id, prompt, max_tokens, priority=priority, arrival_time=arrival)


def run_all(scheduler: Scheduler, requests: list[EngineCoreRequest]):
    return list(run_steps(scheduler, CountingRunner(), [(0, r) for r in requests]))


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = priority_scheduler(64, 4, max_num_seqs=1)
    arrivals = [request("late-1", 2, 1, 1, 0.0), request("c", 2, 1, 2, 0.0), request("a", 2, 1, 0, 3.0)]
    arrivals.append(request("early-1", 2, 1, 1, -1.0))
    admitted = [new.req_id for out, _ in run_all(scheduler, arrivals) for new in out.scheduled_new_reqs]
    assert admitted == ["a", "early-1", "late-1", "c"]


def test_the_fcfs_scheduler_ignores_nothing_but_keeps_arrival_order():
    scheduler = Scheduler(KVCacheManager(65, 4), max_num_seqs=1)
    arrivals = [EngineCoreRequest(i, 2, 1) for i in "xyz"]
    admitted = [new.req_id for out, _ in run_all(scheduler, arrivals) for new in out.scheduled_new_reqs]
    assert admitted == ["x", "y", "z"]


def step_to_preemption(scheduler: Scheduler, arrivals: dict[int, list[EngineCoreRequest]], step: int):
    """Run ``step`` steps, adding ``arrivals[i]`` before step ``i``; schedule the next and return it."""
    runner = CountingRunner()
    for i in range(step + 1):
        for r in arrivals.get(i, ()):
            scheduler.add_request(r)
        output = scheduler.schedule()
        if i == step:
            return output
        scheduler.update_from_output(output, runner.execute_model(output))


def test_the_victim_is_the_lowest_ranked_running_request_even_one_scheduled_before():
    # 6 blocks of 2. b (priority 5) runs first, a (0) and c (1) join; at step 3 b's decode takes
    # the last free block, a's finds none: the victim is b, first in the running list and
    # scheduled earlier in this very step (FCFS would take c, the newest).
    arrivals = {0: [request("b", 2, 6, 5)], 1: [request("a", 3, 6, 0)], 2: [request("c", 1, 6, 1)]}
    scheduler = priority_scheduler(6, 2)
    output = step_to_preemption(scheduler, arrivals, 3)
    assert [p.request_id for p in output.preemptions] == ["b"]
    assert dict(output.num_scheduled_tokens) == {"a": 1, "c": 1}  # b's token and block went back
    assert "b" not in output.scheduled_cached_reqs.req_ids
    assert scheduler.requests["b"].num_computed_tokens == 0  # recompute: it prefills again
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    assert scheduler.memory.num_free_blocks == 6 - 3 - 1  # a holds 3, c 1: b's 3 are back
    fcfs = Scheduler(KVCacheManager(7, 2))
    plain = {
        i: [EngineCoreRequest(r.request_id, r.num_prompt_tokens, 6) for r in rs] for i, rs in arrivals.items()
    }
    assert [p.request_id for p in step_to_preemption(fcfs, plain, 3).preemptions] == ["c"]


def test_a_request_that_preempts_itself_lets_the_higher_ranked_ones_after_it_try():
    # 3 blocks of 2; a (priority 9) admitted first, then b (0): at token 3 a needs a block and
    # none is free; a is the lowest ranked, preempts itself, and b, after it, takes a's block.
    scheduler = priority_scheduler(3, 2)
    for r in (request("a", 2, 3, 9), request("b", 4, 3, 0)):
        scheduler.add_request(r)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput({"a": 1, "b": 1}))
    output = scheduler.schedule()
    assert [p.request_id for p in output.preemptions] == ["a"]
    assert dict(output.num_scheduled_tokens) == {"b": 1}
    fcfs = Scheduler(KVCacheManager(4, 2))
    for r in (EngineCoreRequest("a", 2, 3), EngineCoreRequest("b", 4, 3)):
        fcfs.add_request(r)
    fcfs.update_from_output(fcfs.schedule(), ModelRunnerOutput({"a": 1, "b": 1}))
    assert [p.request_id for p in fcfs.schedule().preemptions] == ["b"]  # FCFS: the newest goes


def test_a_preempted_request_waits_in_its_rank_not_at_the_front():
    arrivals = {0: [request("b", 2, 6, 5)], 1: [request("a", 3, 6, 0)], 2: [request("c", 1, 6, 1)]}
    arrivals[3] = [request("d", 2, 4, 3), request("e", 2, 4, 7)]  # ranked above b, and below
    scheduler = priority_scheduler(6, 2)
    output = step_to_preemption(scheduler, arrivals, 3)
    assert [p.request_id for p in output.preemptions] == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["d", "b", "e"]


@st.composite
def workloads(draw):
    """Up to 6 requests of at most 13 tokens each: every one fits 7 blocks of 2 alone."""
    n = draw(st.integers(2, 6))
    return [
        request(f"r{i}", draw(st.integers(1, 7)), draw(st.integers(1, 6)), draw(st.integers(-2, 2)),
                float(draw(st.integers(0, 3))))
        for i in range(n)
    ]  # fmt: skip


@settings(max_examples=max_examples(40), deadline=None)
@given(requests=workloads(), num_blocks=st.integers(7, 12), budget=st.sampled_from([None, 3, 8]))
def test_every_victim_ranks_below_every_request_left_running(requests, num_blocks, budget):
    scheduler = priority_scheduler(num_blocks, 2, max_num_batched_tokens=budget)
    key = {r.request_id: (r.priority, r.arrival_time) for r in requests}
    finished = set()
    for output, result in run_all(scheduler, requests):
        victims = [p.request_id for p in output.preemptions]
        if victims:
            assert not output.scheduled_new_reqs  # admission never preempts, and waits a step
            stayed = output.scheduled_cached_reqs.req_ids
            assert all(key[v] >= key[s] for v in victims for s in stayed)
        finished.update(request_id for request_id, _ in result.finished)
    assert finished == set(key)


# ------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=5)


def test_the_engine_gives_the_same_tokens_whatever_the_priorities(model):
    requests = [
        EngineRequest(i, [(7 * i + j) % 50 for j in range(3 + i % 4)], 6 + i % 3, arrival_step=i % 2,
                      priority=(5 - i) % 3)
        for i in range(6)
    ]  # fmt: skip
    fcfs = Engine(model, num_blocks=7, block_size=2)
    plain = fcfs.run([EngineRequest(r.request_id, r.prompt, r.max_tokens, r.arrival_step) for r in requests])
    engine = Engine(model, num_blocks=7, block_size=2, scheduling_policy="priority")
    ranked = engine.run(requests)
    assert engine.scheduling_policy == "priority"
    assert ranked.tokens == plain.tokens
    assert ranked.num_preemptions > 0 and plain.num_preemptions > 0
    by_priority = {p: [r.request_id for r in requests if r.priority == p] for p in (0, 2)}

    def last_of(result, p):
        return max(result.finished_step[i] for i in by_priority[p])

    def first_of(result, p):
        return min(result.finished_step[i] for i in by_priority[p])

    assert last_of(ranked, 0) < first_of(ranked, 2)  # who waits is the policy's
    assert first_of(plain, 2) < last_of(plain, 0)


def test_a_bad_policy_is_named(model):
    with pytest.raises(ValueError, match="policy must be one of"):
        Scheduler(KVCacheManager(5, 2), policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        Engine(model, num_blocks=16, block_size=4, scheduling_policy="lifo")


def test_an_fcfs_engine_refuses_a_priority_and_a_priority_engine_an_odd_one(model):
    engine = Engine(model, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        engine.run([EngineRequest("a", [1, 2], 2, priority=1)])
    llm = Engine(model, num_blocks=16, block_size=4, scheduling_policy="priority").new_llm_engine()
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.add_request("a", [1, 2], SamplingParams(max_tokens=2), priority=1.5)
    assert not llm.has_unfinished_requests()


@settings(max_examples=max_examples(40), deadline=None)
@given(st.integers(0, 10_000), st.integers(5, 14), st.sampled_from([2, 4]))
def test_the_scheduler_preempts_exactly_the_victims_priority_victims_names(seed, num_blocks, block_size):
    # As test_preemption's check of FCFS: without a budget every running request decodes at each
    # step, so the step's preemptions are priority_victims's answer on the state before the step.
    rng = random.Random(seed)
    largest = num_blocks * block_size
    scheduler = priority_scheduler(num_blocks, block_size)
    memory = scheduler.memory
    for i in range(rng.randint(2, 6)):
        prompt = rng.randint(1, largest // 2)
        scheduler.add_request(
            request(
                f"r{i}", prompt, rng.randint(1, largest - prompt + 1), rng.randint(0, 2), i + rng.random()
            )
        )
    runner = CountingRunner()
    while scheduler.has_unfinished_requests:
        running = [
            (
                r.request_id,
                len(memory.get_block_ids(r.request_id)[0]),
                r.num_computed_tokens % block_size == 0,
                r.request.priority,
                r.request.arrival_time,
            )
            for r in scheduler.running
        ]
        expected = priority_victims(running, memory.num_free_blocks)
        output = scheduler.schedule()
        assert [p.request_id for p in output.preemptions] == expected
        scheduler.update_from_output(output, runner.execute_model(output))

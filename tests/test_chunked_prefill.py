"""Chunked prefill under a token budget (lesson 09): vLLM v1's scheduling, in the one scheduler.

The scheduler's schedules are checked step by step on concrete workloads and as properties of
random ones (a counting runner, no model); the engine's tokens with a budget are compared with the
engine's tokens without one, on the tiny GPT here and on a Hugging Face Llama in
``tests/test_hf_models.py``.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_manager import KVCacheManager
from paged_kv.model.config import GPTConfig
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest, min_num_blocks
from paged_kv.serving.model_runner import CountingRunner
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import ModelRunnerOutput, Scheduler, run_steps
from tests.helpers import built

pytestmark = pytest.mark.lesson09

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)


@pytest.fixture(scope="module")
def cpu_model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=3)


@pytest.fixture
def model(cpu_model: TinyGPT, device: torch.device) -> TinyGPT:
    return cpu_model.to(device)


def paged(num_blocks: int, block_size: int, *, caching: bool = False) -> KVCacheManager:
    """``num_blocks`` blocks for the requests, in a pool of one more: its null block."""
    return KVCacheManager(num_blocks + 1, block_size, enable_caching=caching)


def schedules(scheduler: Scheduler, arrivals) -> list[tuple]:
    """Each step's ``(request, tokens)`` pairs, with a counting runner."""
    return [
        tuple(out.num_scheduled_tokens.items()) for out, _ in run_steps(scheduler, CountingRunner(), arrivals)
    ]


def workload(seed: int, n: int = 8, longest: int = 30, shared: int = 0) -> list[EngineRequest]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [
        EngineRequest(
            i,
            prefix[: rng.randint(0, shared)] + [rng.randrange(256) for _ in range(rng.randint(1, longest))],
            rng.randint(1, 10),
            rng.randint(0, 4),
        )
        for i in range(n)
    ]


# ---------------------------------------------------------------------------- concrete schedules


def test_a_budget_splits_a_prompt_into_chunks_and_decodes_come_first():
    scheduler = Scheduler(paged(16, 4), max_num_batched_tokens=4)
    got = schedules(scheduler, [(0, EngineCoreRequest("a", 6, 3)), (0, EngineCoreRequest("b", 3, 2))])
    assert got == [
        (("a", 4),),  # a's first chunk spends the budget: b waits
        (("a", 2), ("b", 2)),  # a's last chunk samples its first token; b is admitted with what is left
        (("a", 1), ("b", 1)),  # a decodes first, then b's last chunk
        (("a", 1), ("b", 1)),  # both decode; both finish
    ]


def test_only_the_last_chunk_samples_and_the_computed_count_catches_up():
    memory = paged(16, 4)
    scheduler = Scheduler(memory, max_num_batched_tokens=3)
    scheduler.add_request(EngineCoreRequest("a", 7, 2))
    seen = []
    for _ in range(3):
        output = scheduler.schedule()
        (n,) = output.num_scheduled_tokens.values()
        (request,) = scheduler.running
        seen.append((request.num_computed_tokens - n, n, len(memory.get_block_ids("a")[0])))
        samples = request.num_computed_tokens == request.num_tokens
        result = scheduler.update_from_output(output, ModelRunnerOutput({"a": 9} if samples else {}))
        assert (result.first_tokens == ("a",)) is samples
    # each chunk takes the blocks of its own tokens when it is scheduled: 1, then 2, then 2
    assert seen == [(0, 3, 1), (3, 3, 2), (6, 1, 2)]
    assert scheduler.running[0].output_token_ids == [9]
    assert scheduler.schedule().num_scheduled_tokens == {"a": 1}


def test_a_partial_chunk_needs_no_token_and_a_sampling_one_does():
    scheduler = Scheduler(paged(16, 4), max_num_batched_tokens=2)
    scheduler.add_request(EngineCoreRequest("a", 3, 2))
    first = scheduler.schedule()
    scheduler.update_from_output(first, ModelRunnerOutput({}))  # nothing sampled: the chunk ends mid-prompt
    last = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update_from_output(last, ModelRunnerOutput({}))
    assert scheduler.update_from_output(last, ModelRunnerOutput({"a": 1})).held_tokens == 3


def test_without_a_budget_a_step_prefills_whole_prompts():
    got = schedules(
        Scheduler(paged(16, 4)), [(0, EngineCoreRequest("a", 6, 2)), (0, EngineCoreRequest("b", 3, 1))]
    )
    assert got == [(("a", 6), ("b", 3)), (("a", 1),)]


def test_with_prefix_caching_the_first_chunk_starts_after_the_cached_blocks():
    scheduler = Scheduler(paged(16, 2, caching=True), max_num_batched_tokens=3)
    prompt = tuple(range(7))
    steps = list(
        run_steps(
            scheduler,
            CountingRunner(),
            [(0, EngineCoreRequest("a", 7, 1, prompt)), (5, EngineCoreRequest("b", 7, 1, prompt))],
        )
    )
    b = [
        (new.num_computed_tokens, out.num_scheduled_tokens["b"])
        for out, _ in steps
        for new in out.scheduled_new_reqs
        if new.req_id == "b"
    ]
    assert b == [(6, 1)]  # three blocks hit: only the last prompt token runs


def test_a_budget_must_be_a_positive_integer(cpu_model):
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            Scheduler(paged(4, 2), max_num_batched_tokens=bad)
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            Engine(cpu_model, num_blocks=8, max_num_batched_tokens=bad)


def test_a_budget_runs_the_contiguous_mode_too(cpu_model):
    # The contiguous mode reserves differently but runs the same step: one forward, chunks and all.
    requests = workload(3, n=4, longest=12)
    kwargs = {"num_blocks": 24, "block_size": 4, "mode": "contiguous", "max_model_len": 32}
    whole = Engine(cpu_model, **kwargs).run(requests)
    chunked = Engine(cpu_model, **kwargs, max_num_batched_tokens=5).run(requests)
    assert chunked.tokens == whole.tokens and max(chunked.tokens_per_step) <= 5


# ------------------------------------------------------------------------ the engine's tokens


@functools.cache
def tokens_without_a_budget(model: TinyGPT, device: torch.device) -> dict:
    """The tokens of ``workload(0, shared=12)`` on a pool that never preempts, with no token budget:
    the same for every budget the test below tries, so run once per model and device."""
    return Engine(model, num_blocks=128, block_size=4).run(workload(0, shared=12)).tokens


@pytest.mark.parametrize("budget", [1, 4, 7, 64])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_tokens_do_not_depend_on_the_budget(model, budget, prefix_caching, device):
    requests = workload(0, shared=12)
    alone = tokens_without_a_budget(model, device)
    for num_blocks in (128, min_num_blocks(requests, 4)):
        result = Engine(
            model,
            num_blocks=num_blocks,
            block_size=4,
            max_num_batched_tokens=budget,
            enable_prefix_caching=prefix_caching,
        ).run(requests)
        assert result.tokens == alone
        assert max(result.tokens_per_step) <= budget
        assert len(result.scheduled_tokens) == result.steps


def test_chunking_bounds_the_largest_step_and_spreads_a_long_prefill_over_steps(model):
    long, short = [7] * 48, [5] * 2
    requests = [EngineRequest("long", long, 2), EngineRequest("short", short, 2, arrival_step=1)]
    whole = Engine(model, num_blocks=32, block_size=4).run(requests)
    chunked = Engine(model, num_blocks=32, block_size=4, max_num_batched_tokens=16).run(requests)
    assert chunked.tokens == whole.tokens
    assert max(whole.tokens_per_step) == 48 and max(chunked.tokens_per_step) == 16
    assert chunked.scheduled_tokens[:4] == [
        (("long", 16),),
        (("long", 16),),
        (("long", 16),),
        (("long", 1), ("short", 2)),
    ]
    assert chunked.time_to_first_token == {"long": 3, "short": 3}
    assert whole.time_to_first_token == {"long": 1, "short": 1}
    assert chunked.first_token_step == {"long": 2, "short": 3}


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    budget=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4, 5]),
    spare=st.integers(0, 6),
    prefix_caching=st.booleans(),
    preemption=st.sampled_from(["recompute", "swap"]),
)
def test_random_workloads_give_the_same_tokens_under_any_budget(
    cpu_model, seed, budget, block_size, spare, prefix_caching, preemption
):
    if preemption == "swap":
        prefix_caching = False  # swap with prefix caching: covered by the engine's own tests
    requests = workload(seed, n=6, longest=20, shared=10)
    num_blocks = min_num_blocks(requests, block_size) + spare
    alone = Engine(cpu_model, num_blocks=num_blocks, block_size=block_size, preemption=preemption).run(
        requests
    )
    result = Engine(
        cpu_model,
        num_blocks=num_blocks,
        block_size=block_size,
        preemption=preemption,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=budget,
    ).run(requests)
    assert result.tokens == alone.tokens
    assert all(n <= budget for n in result.tokens_per_step)
    assert set(result.time_to_first_token) == {r.request_id for r in requests}
    assert all(t >= 1 for t in result.time_to_first_token.values())


# ------------------------------------------------------------------- recompute, the v1 way


def preempting_workload() -> list[EngineRequest]:
    rng = random.Random(1)
    return [
        EngineRequest(i, [rng.randrange(256) for _ in range(rng.randint(1, 12))], rng.randint(5, 20))
        for i in range(8)
    ]


def test_a_recomputed_request_resumes_by_prefilling_its_prompt_and_generated_tokens(model):
    requests = preempting_workload()
    budget = 3
    engine = Engine(
        model, num_blocks=min_num_blocks(requests, 4), block_size=4, max_num_batched_tokens=budget
    )
    outputs = []

    def watch(llm):
        scheduler, runner = llm.engine_core.scheduler, llm.engine_core.model_runner
        execute = runner.execute_model

        def execute_model(output):
            outputs.append(
                (
                    output,
                    {
                        r.request_id: (r.num_computed_tokens, r.num_tokens, len(r.output_token_ids))
                        for r in scheduler.running
                    },
                )
            )
            return execute(output)

        runner.execute_model = execute_model

    built(engine, watch)
    result = engine.run(requests)
    resumed = 0
    for output, state in outputs:
        assert output.total_num_scheduled_tokens <= budget
        for new in output.scheduled_new_reqs:
            _, num_tokens, generated = state[new.req_id]
            if generated:  # a resume: its prompt and the tokens it had generated, from 0
                resumed += 1
                assert new.num_computed_tokens == 0 and len(new.token_ids) == num_tokens
    assert resumed, "the workload must preempt a request that has generated tokens"
    assert result.tokens == Engine(model, num_blocks=128, block_size=4).run(requests).tokens


def test_recompute_resumes_by_prefill_with_or_without_a_budget(model):
    requests = preempting_workload()
    num_blocks = min_num_blocks(requests, 4)
    roomy = Engine(model, num_blocks=128, block_size=4).run(requests)
    prompts = sum(len(r.prompt) for r in requests)
    for budget in (None, 64):
        result = Engine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget).run(
            requests
        )
        assert result.preemptions_by_reason["recompute"] > 0
        assert result.tokens == roomy.tokens
        # A resume prefills the K/V of the tokens it held again, and each victim's last sampled token.
        assert prompts + result.recomputed_tokens <= result.prefill_tokens_computed
        assert result.prefill_tokens_computed <= prompts + result.recomputed_tokens + result.preemptions


def test_with_prefix_caching_a_resumed_request_hits_its_own_prompt_blocks(model):
    requests = preempting_workload()
    num_blocks = min_num_blocks(requests, 4)
    result = Engine(
        model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True
    ).run(requests)
    assert result.preemptions and result.prefix_cache_hits > 0
    assert result.tokens == Engine(model, num_blocks=128, block_size=4).run(requests).tokens


# ------------------------------------------------------------------------ properties, stateful


class ChunkedSchedulerMachine(RuleBasedStateMachine):
    """Requests added between steps on a small pool, under a token budget, preempting by recompute."""

    @initialize(budget=st.integers(1, 9), prefix_caching=st.booleans())
    def start(self, budget: int, prefix_caching: bool) -> None:
        self.block_size, self.num_blocks, self.budget = 2, 10, budget
        self.memory = paged(self.num_blocks, self.block_size, caching=prefix_caching)
        self.scheduler = Scheduler(self.memory, max_num_batched_tokens=budget)
        self.runner = CountingRunner()
        self.added: dict = {}
        self.finished: dict = {}

    @rule(prompt=st.integers(1, 7), outputs=st.integers(1, 6), shared=st.booleans())
    def add(self, prompt: int, outputs: int, shared: bool) -> None:
        ids = tuple(range(prompt)) if shared else tuple(1000 + len(self.added) + i for i in range(prompt))
        request = EngineCoreRequest(len(self.added), prompt, outputs, ids)
        self.scheduler.add_request(request)
        self.added[request.request_id] = request

    @rule()
    def step(self) -> None:
        before = {r.request_id: r.num_computed_tokens for r in self.scheduler.running}
        output = self.scheduler.schedule()
        assert output.total_num_scheduled_tokens <= self.budget
        assert all(n >= 1 for n in output.num_scheduled_tokens.values())
        for request in self.scheduler.running:  # a continued chunk starts where the last ended
            if request.request_id in before:
                n = output.num_scheduled_tokens.get(request.request_id, 0)
                assert request.num_computed_tokens == before[request.request_id] + n
            assert request.num_computed_tokens <= request.num_tokens
        # every running request runs: a decode or a chunk
        assert set(output.num_scheduled_tokens) == {r.request_id for r in self.scheduler.running}
        result = self.scheduler.update_from_output(output, self.runner.execute_model(output))
        for request_id, tokens in result.finished:
            assert len(tokens) == self.added[request_id].max_tokens
            self.finished[request_id] = tokens

    @invariant()
    def counts_never_pass_the_tokens_and_one_at_most_is_partly_prefilled(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        running = self.scheduler.running
        assert len(running) <= self.budget
        partial = [
            i
            for i, r in enumerate(running)
            if r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids
        ]
        assert partial in ([], [len(running) - 1])

    @invariant()
    def every_request_is_in_one_place_and_the_memory_holds_the_running(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        places = [r.request_id for r in self.scheduler.running]
        places += [r.request_id for r in self.scheduler.waiting] + list(self.finished)
        assert sorted(places) == sorted(self.added)
        if not self.memory.enable_caching:  # shared blocks count once
            used = sum(
                blocks_for_tokens(r.num_computed_tokens, self.block_size) for r in self.scheduler.running
            )
            assert self.memory.num_free_blocks == self.num_blocks - used


TestChunkedSchedulerMachine = ChunkedSchedulerMachine.TestCase
TestChunkedSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(1, 12),
    requests=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=8
    ),
)
def test_a_budget_changes_when_tokens_come_not_how_many(budget, requests):
    """With a counting runner on a pool too large to preempt: the same requests finish with the
    same numbers of tokens, every step runs at most the budget, and the steps run exactly the
    same tokens in all."""
    arrivals = [(t, EngineCoreRequest(i, p, o)) for i, (t, p, o) in enumerate(requests)]

    def run(max_num_batched_tokens):
        scheduler = Scheduler(paged(64, 2), max_num_batched_tokens=max_num_batched_tokens)
        steps = list(run_steps(scheduler, CountingRunner(), arrivals))
        done = {k: len(v) for _, step in steps for k, v in step.finished}
        return done, steps

    whole, whole_steps = run(None)
    chunked, chunked_steps = run(budget)
    assert chunked == whole
    assert all(out.total_num_scheduled_tokens <= budget for out, _ in chunked_steps)
    assert sum(step.num_prefill_tokens for _, step in chunked_steps) == sum(p for _, p, _ in requests)
    assert sum(out.total_num_scheduled_tokens for out, _ in chunked_steps) == sum(
        out.total_num_scheduled_tokens for out, _ in whole_steps
    )


# ------------------------------------------------------------------------ the cache's side


def test_a_chunk_must_start_where_the_last_one_ended(device):
    cache = PagedKVCache(CONFIG, 8, 4, device)
    cache.add_sequence("a", 10)
    with pytest.raises(ValueError, match="cached tokens"):
        cache.begin_prefill(["a"], [2], [3])
    with pytest.raises(ValueError, match="at most its 10 tokens"):
        cache.begin_prefill(["a"], [0], [11])
    with pytest.raises(ValueError, match="got end 0"):
        cache.begin_prefill(["a"], [0], [0])
    cache.begin_prefill(["a"], [0], [4])
    with pytest.raises(ValueError, match="must be its 4"):
        cache.begin_prefill(["a"], [0], [4])  # already written
    cache.begin_prefill(["a"], [4], [6])  # the rest
    cache.free("a")


@torch.no_grad()
def test_chunks_write_the_same_kv_and_predict_the_same_tokens_as_one_prefill(model, device):
    prompt = torch.tensor(random.Random(2).choices(range(256), k=23), device=device)
    whole = PagedKVCache(CONFIG, 16, 4, device)
    whole.add_sequence("a", 23)
    expected = model.prefill_batch([prompt], ["a"], whole)
    for cuts in ([1, 22], [4, 8, 11], [7, 7, 9], [5] * 4 + [3]):
        chunked = PagedKVCache(CONFIG, 16, 4, device)
        chunked.add_sequence("a", 23)
        start = 0
        for size in cuts:
            logits = model.prefill_batch([prompt[: start + size]], ["a"], chunked, [start])
            start += size
        torch.testing.assert_close(logits, expected)
        for layer in range(CONFIG.num_layers):
            for got, want in zip(chunked.read_kv(layer, "a"), whole.read_kv(layer, "a"), strict=True):
                torch.testing.assert_close(got, want)


def test_a_prompt_freed_between_chunks_leaves_no_unwritten_block_in_the_prefix_cache(device):
    tokens = list(range(12))
    cache = PagedKVCache(CONFIG, 8, 4, device, enable_prefix_caching=True)
    cache.add_sequence("a", 12, tokens)
    cache.begin_prefill(["a"], [0], [5])  # block 0 written, block 1 partly, block 2 not
    cache.free("a")
    cache.add_sequence("b", 12, tokens)
    assert cache.num_cached_tokens("b") == 4  # only the block the chunk wrote whole
    cache.free("b")
    cache.add_sequence("c", 12, tokens)
    cache.begin_prefill(["c"], [4], None)  # prefill the rest: now every block is written
    cache.free("c")
    cache.add_sequence("d", 12, tokens)
    assert cache.num_cached_tokens("d") == 8  # two of three: the last prompt token is computed


# ------------------------------------------------------------------------------- the bench


def test_the_bench_reports_the_largest_step_and_time_to_first_token():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import bench_chunked

    assert bench_chunked.percentile([5, 1, 3, 2, 4], 0.5) == 3
    assert bench_chunked.percentile(list(range(1, 101)), 0.99) == 99
    assert bench_chunked.percentile([7], 0.99) == 7
    requests = bench_chunked.long_prompt_requests(16, 64)
    assert [r.arrival_step for r in requests] == list(range(16))
    assert [len(r.prompt) >= 32 for r in requests] == [i % 8 == 0 for i in range(16)]
    rows = bench_chunked.run(**bench_chunked.QUICK)  # raises if a budget changed a token
    largest = rows[0]
    assert largest.unit == "tokens" and largest.measured <= bench_chunked.QUICK["budget"] < largest.baseline


def test_a_budget_sweep_runs_each_engine_under_the_budget(cpu_model):
    from paged_kv.serving.engine import sweep_budgets

    requests = preempting_workload()
    smallest = min_num_blocks(requests, 4)
    rows = sweep_budgets(cpu_model, requests, [smallest, 2 * smallest], 4, max_num_batched_tokens=64)
    for row in rows:
        engine = Engine(cpu_model, num_blocks=row["num_blocks"], block_size=4, max_num_batched_tokens=64)
        result = engine.run(requests)
        assert (row["steps"], row["preemptions"]) == (result.steps, result.preemptions)
    whole = sweep_budgets(cpu_model, requests, [smallest], 4)
    assert whole[0]["steps"] == Engine(cpu_model, num_blocks=smallest, block_size=4).run(requests).steps

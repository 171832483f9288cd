"""The concurrent workload simulator: paged blocks against contiguous reservation (lesson 07)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv.serving.request import EngineCoreRequest
from paged_kv.simulation.shares import MemoryShares, SlotUse
from paged_kv.simulation.workload import (
    ALPACA,
    CONTIGUOUS_KINDS,
    SHAREGPT,
    WORKLOADS,
    BlockBookkeeping,
    ContiguousPolicy,
    LengthDistribution,
    PagedPolicy,
    Request,
    SimulationResult,
    compare_policies,
    format_table,
    next_power_of_two,
    reserved_tokens,
    sample_requests,
    sequences_that_fit,
    simulate,
)

pytestmark = pytest.mark.lesson07

# ------------------------------------------------------------------------------------ the requests


def test_the_presets():
    assert WORKLOADS == {"sharegpt": SHAREGPT, "alpaca": ALPACA}
    assert (SHAREGPT.mean_prompt, SHAREGPT.mean_output, SHAREGPT.max_model_len) == (161, 338, 2048)
    assert (ALPACA.mean_prompt, ALPACA.mean_output, ALPACA.max_model_len) == (19, 58, 512)


@pytest.mark.parametrize("dist", [SHAREGPT, ALPACA], ids=lambda d: d.name)
def test_sample_means_match_the_targets(dist):
    requests = sample_requests(dist, 5000, seed=1)
    prompts = [r.prompt_tokens for r in requests]
    outputs = [r.output_tokens for r in requests]
    assert statistics.mean(prompts) == pytest.approx(dist.mean_prompt, rel=0.05)
    assert statistics.mean(outputs) == pytest.approx(dist.mean_output, rel=0.05)
    assert min(prompts) >= 1 and min(outputs) >= 1
    assert max(prompts) <= dist.max_prompt and max(outputs) <= dist.max_output
    # A long tail: the longest prompts are many times the mean, as in the real data sets.
    assert max(prompts) > 4 * dist.mean_prompt


def test_sampling_is_deterministic_for_a_seed():
    first = sample_requests("sharegpt", 50, seed=7, arrival_rate=0.5)
    assert first == sample_requests("sharegpt", 50, seed=7, arrival_rate=0.5)
    assert first != sample_requests("sharegpt", 50, seed=8, arrival_rate=0.5)
    assert [r.request_id for r in first] == list(range(50))


def test_the_arrival_rate_changes_arrivals_not_lengths():
    burst = sample_requests("alpaca", 2000, seed=3)
    spread = sample_requests("alpaca", 2000, seed=3, arrival_rate=4.0)
    assert {r.arrival_step for r in burst} == {0}
    assert [(r.prompt_tokens, r.output_tokens) for r in burst] == [
        (r.prompt_tokens, r.output_tokens) for r in spread
    ]
    steps = [r.arrival_step for r in spread]
    assert steps == sorted(steps)
    assert steps[-1] == pytest.approx(2000 / 4.0, rel=0.1)  # Poisson: about rate requests per step


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 17, 1024, 1025)] == [1, 2, 4, 4, 8, 32, 1024, 2048]


def test_contiguous_reservations():
    request = Request("r", 0, prompt_tokens=100, output_tokens=200)  # 300 tokens in the end
    assert ContiguousPolicy("max", 2048).reservation(request) == 2048
    assert ContiguousPolicy("pow2", 2048).reservation(request) == 356  # 100 + 256 for the output
    assert ContiguousPolicy("pow2", 320).reservation(request) == 320  # capped at the model's length
    assert ContiguousPolicy("oracle").reservation(request) == 300
    assert PagedPolicy(16).peak_tokens(request) == 304  # 19 blocks of 16


def test_reserved_tokens_sizes_the_slot_for_the_final_length():
    assert [reserved_tokens(kind, 100, 200, 2048) for kind in ("max", "pow2", "oracle")] == [2048, 356, 300]
    # The vLLM paper's Orca (Pow2): the prompt exactly, the output rounded up to a power of two.
    assert reserved_tokens("pow2", 7, 25, 2048) == 7 + 32  # the paper's example: 32 for 25 outputs
    assert reserved_tokens("pow2", 200, 64, 2048) == 264  # an output of a power of two is its own room
    assert reserved_tokens("pow2", 300, 1, 2048) == 301  # the prompt is never rounded: not 512
    assert reserved_tokens("pow2", 150, 200, 400) == 400  # 150 + 256 capped at the model's length
    assert reserved_tokens("pow2", 100, 200, 400) == 356  # under the cap: untouched
    assert reserved_tokens("pow2", 100, 200) == 356  # no cap without a model length
    assert reserved_tokens("pow2", 7, 0) == 7  # no output, no room for it
    assert [reserved_tokens(kind, 1024, 1024, 2048) for kind in CONTIGUOUS_KINDS] == [
        2048
    ] * 3  # exactly fits
    assert reserved_tokens("oracle", 7, 0) == 7  # a prompt alone


def _output_room_by_doubling(output_tokens: int) -> int:
    room = 1 if output_tokens else 0
    while room < output_tokens:
        room *= 2
    return room


@given(st.integers(1, 3000), st.integers(0, 3000), st.integers(1, 6000))
def test_pow2_rounds_only_the_output_and_never_past_the_model(prompt, output, max_model_len):
    if prompt + output > max_model_len:
        with pytest.raises(ValueError, match="max_model_len"):
            reserved_tokens("pow2", prompt, output, max_model_len)
        return
    reserved = reserved_tokens("pow2", prompt, output, max_model_len)
    assert reserved == min(prompt + _output_room_by_doubling(output), max_model_len)
    assert prompt + output <= reserved <= max_model_len
    assert reserved - prompt < 2 * output or output == reserved - prompt == 0  # under twice the output
    assert (
        reserved_tokens("oracle", prompt, output)
        <= reserved
        <= reserved_tokens("max", prompt, output, max_model_len)
    )


@pytest.mark.parametrize("workload", ["sharegpt", "alpaca"])
def test_contiguous_policies_reserve_what_reserved_tokens_says(workload):
    max_model_len = WORKLOADS[workload].max_model_len
    for kind in CONTIGUOUS_KINDS:
        policy = ContiguousPolicy(kind, max_model_len)
        for r in sample_requests(workload, 200, seed=2):
            assert policy.reservation(r) == reserved_tokens(
                kind, r.prompt_tokens, r.output_tokens, max_model_len
            )


# ---------------------------------------------------------------------- hand-computed scenarios

# Three requests, all at step 0: A = 4 + 2, B = 3 + 5, C = 2 + 1 tokens (prompt + output), so final
# lengths 6, 8 and 3. A sequence's prefill, on its admission step, samples its first output token;
# each step after, it decodes one more. At the end of a step it holds prompt + generated - 1 tokens
# (its last token is the next step's input), and it finishes in the step its last token is sampled:
# a request with o output tokens runs o steps.
A, B, C = Request("A", 0, 4, 2), Request("B", 0, 3, 5), Request("C", 0, 2, 1)
HAND = [A, B, C]


def test_contiguous_max_runs_one_at_a_time():
    # max_model_len 10 and a budget of 17: one 10-token slot at a time. A runs steps 0-1 (prefill,
    # one decode), B steps 2-6, C step 7: 8 steps with one sequence each.
    result = simulate(HAND, ContiguousPolicy("max", 10), budget_tokens=17)
    assert result.steps == 8
    assert result.running == [1] * 8
    assert result.finished == [0, 1, 1, 1, 1, 1, 2, 3]
    assert result.reserved_tokens == [10] * 8
    assert result.held_tokens == [4, 5, 3, 4, 5, 6, 7, 2]
    assert (result.peak_running, result.mean_running, result.preemptions) == (1, 1.0, 0)


def test_contiguous_pow2_runs_two():
    # Slots of 4 + 2 = 6, 3 + 8 = 11 capped at 10, and 2 + 1 = 3. Step 0: A + B reserve 16; C (19 > 17)
    # waits, first come first served. A finishes at the end of step 1; C is admitted at step 2
    # (10 + 3 = 13) and finishes then; B at 4.
    result = simulate(HAND, ContiguousPolicy("pow2", 10), budget_tokens=17)
    assert result.running == [2, 2, 2, 1, 1]
    assert result.waiting == [1, 1, 0, 0, 0]
    assert result.finished == [0, 1, 2, 2, 3]
    assert result.held_tokens == [7, 9, 7, 6, 7]
    assert result.reserved_tokens == [16, 16, 13, 10, 10]
    assert result.peak_reserved_tokens == 16
    assert result.throughput == pytest.approx(8 / 5)  # 2 + 5 + 1 output tokens in 5 steps
    # Step 0: A holds 4 of its 6 in 6 slots, B 3 of 8 in 10: 7 tokens, 2 + 5 to come, B's last 2
    # slots never used, 1 free. Step 1: 5 + 4 tokens, 1 + 4 to come. C waits at both steps.
    assert result.slot_use[:2] == [SlotUse(7, 7, 2, 1), SlotUse(9, 5, 2, 1)]
    assert result.memory_shares == MemoryShares(16, 12, 4, 2, steps=2, capacity=17)
    assert result.blocked_by_holes == 0


def test_contiguous_oracle_runs_all_three():
    # Slots of 6, 8 and 3 = 17: all three at step 0. C finishes at 0, A at 1, B at 4.
    result = simulate(HAND, ContiguousPolicy("oracle"), budget_tokens=17)
    assert result.running == [3, 2, 1, 1, 1]
    assert result.held_tokens == [9, 9, 5, 6, 7]
    assert result.reserved_tokens == [17, 14, 8, 8, 8]
    expected = [9 / 17, 9 / 14, 5 / 8, 6 / 8, 7 / 8]
    assert result.utilization == pytest.approx(expected)
    assert result.mean_utilization == pytest.approx(sum(expected) / 5)
    assert result.utilization[-1] == 7 / 8  # the last token is sampled, never stored


def test_paged_admits_whole_prompts_into_a_full_pool():
    # Blocks of 4 and a budget of 17: 4 blocks. vLLM's rule: a prompt's blocks must be free, and
    # no block is kept back for the running ones' growth. Step 0: A, B and C (1 block each) are
    # admitted and C finishes. Step 1: A's 5th token takes a block and A finishes. Steps 2-4: B.
    result = simulate(HAND, PagedPolicy(block_size=4), budget_tokens=17)
    assert result.running == [3, 2, 1, 1, 1]
    assert result.waiting == [0, 0, 0, 0, 0]
    assert result.held_tokens == [9, 9, 5, 6, 7]
    assert result.reserved_tokens == [12, 12, 8, 8, 8]
    assert result.finished == [1, 2, 2, 2, 3]
    assert result.preemptions == 0


def test_block_bookkeeping_is_the_engines_memory_with_no_tensor():
    memory = BlockBookkeeping(5, 2, enable_caching=True, record=True)  # 4 blocks and the null block
    a, b = EngineCoreRequest("a", 4, 2, (1, 2, 3, 4)), EngineCoreRequest("b", 3, 2, (1, 2, 9))
    assert len(memory.allocate_slots(a, 4, a.prompt_token_ids)[0]) == 2
    computed = memory.get_computed_blocks(b, b.prompt_token_ids)
    assert computed.num_tokens == 2  # b's first block is a's
    assert memory.allocate_slots(b, 1, b.prompt_token_ids, new_computed_blocks=computed) == (
        (*computed.block_ids[0], memory.get_block_ids("b")[0][-1]),
    )
    assert memory.num_free_blocks == 1
    memory.free("a")
    memory.free("b")
    assert memory.num_free_blocks == 4
    assert [f.event for f in memory.trace] == ["start", "allocate", "allocate", "free", "free"]


class CountingBookkeeping(BlockBookkeeping):
    """The simulator's memory, counting the calls its scheduler makes."""

    calls: dict[str, int]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"allocate_slots": 0, "refused": 0, "free": 0}
        CountingBookkeeping.last = self

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        blocks = super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        self.calls["allocate_slots" if blocks is not None else "refused"] += 1
        return blocks

    def free(self, request_id):
        if request_id in self:
            self.calls["free"] += 1
        return super().free(request_id)


def test_running_out_of_blocks_preempts_the_newest_by_recompute(monkeypatch):
    # Blocks of 2 and a budget of 8: 4 blocks. A and B are 2 + 4 tokens each (3 blocks at the end).
    # Step 0: both admitted (a prompt's block each), prefilled, 1 block each. Step 1:
    # both take a 2nd block: 0 free. Step 2: both fill it. Step 3: both need a 3rd block, none is
    # free: B, the newest, is preempted, its 2 blocks freed, and A takes one and finishes. B resumes
    # at step 4: it prefills its prompt and its 3 generated tokens (5 tokens, 3 blocks), samples its
    # last token and finishes.
    monkeypatch.setattr("paged_kv.simulation.workload.BlockBookkeeping", CountingBookkeeping)
    a, b = Request("a", 0, 2, 4), Request("b", 0, 2, 4)
    result = simulate([a, b], PagedPolicy(block_size=2), budget_tokens=8)
    assert result.preemptions == 1
    assert result.all_finished
    assert result.running == [2, 2, 2, 1, 1]
    assert result.waiting == [0, 0, 0, 1, 0]
    assert result.held_tokens == [4, 6, 8, 5, 5]
    assert result.reserved_tokens == [4, 8, 8, 6, 6]
    # The engine's memory did the bookkeeping: one allocation per scheduled request and step (2 + 2
    # + 2 + 1 + 1), one refused (A's at step 3, before B made room), and B was freed twice.
    assert CountingBookkeeping.last.calls == {"allocate_slots": 8, "refused": 1, "free": 3}
    assert CountingBookkeeping.last.num_free_blocks == 4  # the null block aside


def test_the_contiguous_oracle_never_preempts_the_same_workload():
    a, b = Request("a", 0, 2, 4), Request("b", 0, 2, 4)
    result = simulate([a, b], ContiguousPolicy("oracle"), budget_tokens=8)
    assert (result.steps, result.preemptions, result.peak_running) == (8, 0, 1)


def test_peak_concurrency_over_time_is_not_monotone_in_the_reservation():
    # A scheduling anomaly: final lengths 13, 7, 3, 6 in a budget of 20. The oracle runs A + B at
    # once (20), then A with C, then A with D: never 3. pow2 (slots 5 + 8, 2 + 8, 2 + 1, 4 + 2) runs
    # A alone, and when A finishes B + C + D take 19: a peak of 3. The oracle still finishes first.
    requests = [Request(i, 0, p, o) for i, (p, o) in enumerate([(5, 8), (2, 5), (2, 1), (4, 2)])]
    oracle = simulate(requests, ContiguousPolicy("oracle", 16), 20)
    pow2 = simulate(requests, ContiguousPolicy("pow2", 16), 20)
    assert [ContiguousPolicy("pow2", 16).reservation(r) for r in requests] == [13, 10, 3, 6]
    assert (oracle.peak_running, pow2.peak_running) == (2, 3)
    assert (oracle.running[0], pow2.running[0]) == (2, 1)
    assert (oracle.steps, pow2.steps) == (8, 13)


# ---------------------------------------------------------------------------------- invariants

MAX_LEN = 80  # every request below is at most 40 + 40 tokens


@st.composite
def workloads(draw):
    lengths = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), max_size=10))
    arrivals = draw(st.lists(st.integers(0, 15), min_size=len(lengths), max_size=len(lengths)))
    requests = [Request(i, t, p, o) for i, ((p, o), t) in enumerate(zip(lengths, arrivals, strict=True))]
    return requests, draw(st.integers(MAX_LEN, 400))


def all_policies(block_size: int = 16):
    return [PagedPolicy(block_size)] + [ContiguousPolicy(kind, MAX_LEN) for kind in ("max", "pow2", "oracle")]


def check_invariants(result: SimulationResult, requests: list[Request]) -> None:
    assert result.all_finished
    assert result.finished[-1:] == ([len(requests)] if requests else [])
    assert all(x <= y for x, y in zip(result.finished, result.finished[1:], strict=False))
    for held, reserved in zip(result.held_tokens, result.reserved_tokens, strict=True):
        assert 0 <= held <= reserved <= result.budget_tokens
    assert len(result.slot_use) == result.steps
    for use, held, reserved in zip(result.slot_use, result.held_tokens, result.reserved_tokens, strict=True):
        assert sum(use) == result.budget_tokens and min(use) >= 0
        assert use.token_states == held
        assert use.external_fragmentation == result.budget_tokens - reserved
    shares = result.memory_shares
    assert shares.steps == sum(1 for waiting in result.waiting if waiting)
    if shares.steps:
        assert sum(shares.percent().values()) == pytest.approx(100)
    done_before = [0, *result.finished][:-1]  # a sequence finishing at step t runs at step t
    for running, waiting, done in zip(result.running, result.waiting, done_before, strict=True):
        assert running + waiting + done <= len(requests)
    # Nobody finishes before its o steps (a prefill, o - 1 decodes): the longest request bounds the run.
    assert result.steps >= max((r.arrival_step + r.output_tokens for r in requests), default=0)


@given(workloads(), st.sampled_from([1, 2, 4, 16]))
def test_every_policy_keeps_the_invariants(workload, block_size):
    requests, budget = workload
    for policy in all_policies(block_size):
        result = simulate(requests, policy, budget)
        check_invariants(result, requests)
        if isinstance(policy, ContiguousPolicy):
            assert result.preemptions == 0  # the slot always holds the final length


@given(workloads(), st.sampled_from([1, 4, 16]))
def test_a_paged_sequence_wastes_less_than_a_block_and_never_waits_for_a_hole(workload, block_size):
    requests, budget = workload
    result = simulate(requests, PagedPolicy(block_size), budget)
    for use, running in zip(result.slot_use, result.running, strict=True):
        assert use.reservation + use.internal_fragmentation <= running * (block_size - 1)
    assert result.blocked_by_holes == 0


@given(workloads())
def test_compaction_never_waits_for_a_hole(workload):
    requests, budget = workload
    for kind in ("pow2", "oracle"):
        compacted = simulate(requests, ContiguousPolicy(kind, MAX_LEN, compact=True), budget)
        assert compacted.blocked_by_holes == 0
        check_invariants(compacted, requests)


@given(workloads())
def test_smaller_reservations_fit_more_sequences_at_once(workload):
    requests, budget = workload
    burst = [Request(r.request_id, 0, r.prompt_tokens, r.output_tokens) for r in requests]
    results = {}
    for kind in ("oracle", "pow2", "max"):
        policy = ContiguousPolicy(kind, MAX_LEN)
        results[kind] = simulate(burst, policy, budget)
        # With everyone waiting at step 0, first come first served admits the longest prefix that fits.
        assert results[kind].running[:1] == ([sequences_that_fit(burst, policy, budget)] if burst else [])
    assert results["oracle"].running[:1] >= results["pow2"].running[:1] >= results["max"].running[:1]
    assert results["oracle"].peak_running >= results["max"].peak_running
    assert results["pow2"].peak_running >= results["max"].peak_running


def test_a_simulation_is_deterministic():
    assert compare_policies("alpaca", 40, 2048, seed=5, arrival_rate=1.0) == compare_policies(
        "alpaca", 40, 2048, seed=5, arrival_rate=1.0
    )


# ------------------------------------------------------------------------------ the comparison


def test_paged_fits_more_sequences_than_contiguous_max_on_sharegpt():
    # 100 requests: more than any policy runs at once, so the budget decides.
    paged, maximum, pow2, oracle = compare_policies("sharegpt", num_requests=100, budget_tokens=32768, seed=0)
    assert [r.policy for r in (paged, maximum, pow2, oracle)] == [
        "vLLM (blocks of 16)",
        "Orca (Max)",
        "Orca (Pow2)",
        "Orca (Oracle)",
    ]
    assert maximum.peak_running == 32768 // 2048
    assert paged.mean_running > 2 * maximum.mean_running
    assert paged.peak_running > maximum.peak_running
    assert paged.mean_utilization > 0.9 > oracle.mean_utilization > pow2.mean_utilization
    assert paged.steps < maximum.steps
    requests = sample_requests("sharegpt", 100, seed=0)
    assert sequences_that_fit(requests, PagedPolicy(16), 32768) > sequences_that_fit(
        requests, ContiguousPolicy("max", 2048), 32768
    )


def test_format_table():
    results = compare_policies("alpaca", num_requests=30, budget_tokens=1024, seed=0)
    lines = format_table(results).splitlines()
    assert lines[0].split("  ")[0] == "policy"
    assert "mean util %" in lines[0] and "tokens/step" in lines[0] and "preemptions" in lines[0]
    assert set(lines[1]) == {"-", " "}
    assert [line[: len(r.policy) + 2] for line, r in zip(lines[2:], results, strict=True)] == [
        r.policy + "  " for r in results
    ]
    assert len({len(line) for line in lines}) == 1  # aligned
    assert lines[2].split()[-1] == str(results[0].preemptions)


def test_progress_bar_and_max_steps(capsys):
    requests = sample_requests("alpaca", 10, seed=0)
    full = simulate(requests, PagedPolicy(), 4096, progress=True)
    assert "10/10" in capsys.readouterr().err
    cut = simulate(requests, PagedPolicy(), 4096, max_steps=3)
    assert cut.steps == 3 and not cut.all_finished
    assert cut.running == full.running[:3]


def test_the_policies_are_named_as_in_the_paper():
    assert [ContiguousPolicy(kind, 2048).name for kind in CONTIGUOUS_KINDS] == [
        "Orca (Max)",
        "Orca (Pow2)",
        "Orca (Oracle)",
    ]
    assert ContiguousPolicy("oracle", compact=True).name == "Orca (Oracle), compacted"
    assert PagedPolicy(8).name == "vLLM (blocks of 8)"


def test_figure_2_measured_on_a_sharegpt_burst():
    # The paper's setting: about 15,700 KV slots (OPT-13B on an A100-40GB), ShareGPT, 2,048 at most.
    paged, maximum, pow2, oracle = compare_policies("sharegpt", num_requests=120, budget_tokens=15728, seed=0)
    shares = {r.policy: r.memory_shares.percent() for r in (paged, maximum, pow2, oracle)}
    tokens = [shares[r.policy]["token_states"] for r in (maximum, pow2, oracle, paged)]
    assert tokens == sorted(tokens) and tokens[-1] > 90  # Max < Pow2 < Oracle < vLLM
    assert shares["Orca (Max)"]["internal_fragmentation"] > 50  # most of 2,048 is never used
    assert shares["Orca (Oracle)"]["internal_fragmentation"] == 0  # it reserves the final length
    assert shares["Orca (Max)"]["external_fragmentation"] == pytest.approx(100 * (15728 - 7 * 2048) / 15728)
    assert maximum.blocked_by_holes == 0 < min(pow2.blocked_by_holes, oracle.blocked_by_holes)
    assert paged.blocked_by_holes == 0


def test_no_requests():
    result = simulate([], PagedPolicy(), 64)
    assert (result.steps, result.peak_running, result.peak_reserved_tokens) == (0, 0, 0)
    assert (result.mean_running, result.mean_utilization, result.throughput) == (0.0, 0.0, 0.0)
    assert result.all_finished


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: sample_requests("sharegpt", -1), "num_requests"),
        (lambda: sample_requests("sharegpt", 5, seed=-1), "seed"),
        (lambda: sample_requests("sharegpt", 5, arrival_rate=0), "arrival_rate"),
        (lambda: sample_requests("sharegpt", 5, arrival_rate=math.nan), "arrival_rate"),
        (lambda: sample_requests("sharegpt", 5, arrival_rate="1"), "arrival_rate"),
        (lambda: sample_requests("wikipedia", 5), "workload"),
        (lambda: compare_policies("wikipedia"), "workload"),
        (lambda: LengthDistribution("x", 0.5, 10, 100, 100), "mean_prompt"),
        (lambda: LengthDistribution("x", 10, 100, 100, 100), "mean_output"),
        (lambda: LengthDistribution("x", 10, 10, 1, 100), "max_prompt"),
        (lambda: LengthDistribution("x", 10, 10, 100, 100, sigma=0), "sigma"),
        (lambda: Request(0, 0, 0, 5), "prompt_tokens"),
        (lambda: Request(0, 0, 5, 0), "output_tokens"),
        (lambda: Request(0, -1, 5, 5), "arrival_step"),
        (lambda: Request([0], 0, 5, 5), "request_id"),
        (lambda: PagedPolicy(0), "block_size"),
        (lambda: ContiguousPolicy("exact"), "kind"),
        (lambda: ContiguousPolicy("max"), "max_model_len"),
        (lambda: ContiguousPolicy("oracle", compact="yes"), "compact"),
        (lambda: ContiguousPolicy("max", 10).reservation(Request(0, 0, 8, 8)), "max_model_len"),
        (lambda: next_power_of_two(0), "n"),
        (lambda: reserved_tokens("exact", 100, 200, 2048), "kind"),
        (lambda: reserved_tokens("oracle", 10, 10, 16), "max_model_len"),
        (lambda: reserved_tokens("max", 10, 10), "max_model_len"),
        (lambda: reserved_tokens("max", 10, 10, 0), "max_model_len"),
        (lambda: reserved_tokens("oracle", 0, 10), "prompt_tokens"),
        (lambda: reserved_tokens("oracle", 10, -1), "output_tokens"),
        (lambda: simulate([A], PagedPolicy(), 0), "budget_tokens"),
        (lambda: simulate([A], PagedPolicy(), 64, max_steps=-1), "max_steps"),
        (lambda: simulate([A], "paged", 64), "policy"),
        (lambda: simulate([A, A], PagedPolicy(), 64), "request_id"),
        (lambda: simulate([(4, 2)], PagedPolicy(), 64), "requests"),
        (lambda: simulate([A], PagedPolicy(16), 15), "budget_tokens"),  # not one whole block
        (lambda: simulate([Request(0, 0, 8, 5)], ContiguousPolicy("pow2"), 15), "budget_tokens"),  # 8 + 8
        (lambda: sequences_that_fit([A], PagedPolicy(), -1), "budget_tokens"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_a_recorded_paged_run_keeps_one_frame_per_event():
    requests = [Request("a", 0, 4, 2), Request("b", 1, 5, 1)]
    plain = simulate(requests, PagedPolicy(block_size=4), budget_tokens=16)
    recorded = simulate(requests, PagedPolicy(block_size=4), budget_tokens=16, record=True)
    assert plain.trace == []
    assert recorded.running == plain.running and recorded.held_tokens == plain.held_tokens
    events = [frame.event for frame in recorded.trace]
    # start, a's prompt, a's decode (its 5th token takes a block), b's prompt, two frees
    assert events.count("allocate") == 2 and events.count("free") == 2 and "new_block" in events
    assert events[0] == "start" and recorded.trace[-1].snapshot.tables == {}
    # Block 0 of the pool is its null block: a's prompt takes block 1.
    assert "seq a: 4-token prompt takes blocks [1]" in [frame.caption for frame in recorded.trace]
    assert all(frame.snapshot.null_block == 0 for frame in recorded.trace)
    assert simulate(requests, ContiguousPolicy("oracle"), budget_tokens=16, record=True).trace == []

"""The online engine (lesson 15): requests added and aborted while it steps, vLLM's sampling
parameters, the output processor's text, stop strings and finish reasons, ``n`` children, records.

The references: greedy tokens are exactly :func:`~paged_kv.model.generate`'s for the prompt alone
(``tests.helpers.alone``), whatever else runs, arrives or leaves; a seeded request's tokens are
those of the same request served alone; the memory holds blocks for the running requests only,
and a request that leaves (finished, stopped by a string, aborted) gives its blocks back at once.
A hypothesis state machine adds, steps and aborts at random and checks the same invariants.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable, Sequence

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.output_processor import OutputProcessor, RequestOutput, child_request_ids
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

from .helpers import alone, engine_args, max_examples

pytestmark = pytest.mark.lesson16

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64)
DELTA = RequestOutputKind.DELTA


@functools.cache
def _model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=1)


@pytest.fixture
def model(device: torch.device) -> TinyGPT:
    return _model().to(device)


def letters(ids: Sequence[int]) -> str:
    """A tokenizer's decode of one character per token: stop strings are easy to place."""
    return "".join(chr(ord("a") + t % 26) for t in ids)


def utf8(ids: Sequence[int]) -> str:
    """A byte-level tokenizer's decode: a token is a byte, an incomplete character shows as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def expected(model: TinyGPT, prompt: Sequence[int], max_tokens: int) -> list[int]:
    return alone(model, EngineRequest("x", list(prompt), max_tokens))


def online(model: TinyGPT, num_blocks: int = 48, block_size: int = 4, decode=letters, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(
        model, engine_args(num_blocks, block_size=block_size, **kwargs), decode=decode
    )


def run(llm: LLMEngine, max_steps: int = 500) -> dict[Hashable, list[RequestOutput]]:
    """Step until nothing is left; every output of each request, in order."""
    outputs: dict[Hashable, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return outputs
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def final_tokens(outputs: dict[Hashable, list[RequestOutput]]) -> dict[Hashable, list[int]]:
    return {r: outs[-1].outputs[0].token_ids for r, outs in outputs.items()}


def served_alone(
    model: TinyGPT, prompt: Sequence[int], params: SamplingParams, decode=letters, **kwargs
) -> RequestOutput:
    """The last output of ``prompt`` served alone by a fresh engine."""
    llm = online(model, decode=decode, **kwargs)
    llm.add_request("alone", prompt, params)
    return run(llm)["alone"][-1]


def state(llm: LLMEngine) -> tuple:
    """Everything a refused request must leave as it was."""
    scheduler = llm.engine_core.scheduler
    return (
        llm.output_processor.request_ids(),
        [r.request_id for r in scheduler.waiting],
        [r.request_id for r in scheduler.running],
        [r.request_id for r in scheduler.swapped],
        set(scheduler.requests),
        scheduler.memory.num_free_blocks,
        dict(llm._arrival),
    )


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]


# ------------------------------------------------------------------------------ greedy tokens


def test_a_batch_of_greedy_requests_gets_the_tokens_of_generate(model):
    llm = online(model)
    lengths = [6, 3, 9, 1]
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        llm.add_request(i, prompt, greedy(n))
    assert llm.get_num_unfinished_requests() == 4 and llm.has_unfinished_requests()
    outputs = run(llm)
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        last = outputs[i][-1]
        assert last.finished and last.prompt_token_ids == prompt
        (completion,) = last.outputs
        assert completion.token_ids == expected(model, prompt, n)
        assert completion.text == letters(completion.token_ids)
        assert (completion.finish_reason, completion.stop_reason) == ("length", None)
        assert [o.finished for o in outputs[i]] == [False] * (n - 1) + [True]  # one output per token
    assert llm.get_num_unfinished_requests() == 0 and not llm.has_unfinished_requests()
    assert llm.engine_core.scheduler.memory.num_free_blocks == 47
    assert llm.step() == []  # nothing to run: nothing happens


def test_the_offline_engine_runs_the_online_one_step_for_step(model):
    requests = [EngineRequest(f"r{i}", p, 6 + i, arrival_step=i) for i, p in enumerate(PROMPTS)]
    engine = Engine(model, num_blocks=10, block_size=2)
    result = engine.run(requests)
    llm = online(model, num_blocks=10, block_size=2, decode=None)
    scheduled, tokens = [], {}
    pending = list(requests)
    while pending or llm.has_unfinished_requests():
        while pending and pending[0].arrival_step <= llm.num_steps:
            r = pending.pop(0)
            llm.add_request(r.request_id, r.prompt, greedy(r.max_tokens))
        for out in llm.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        scheduled.append(tuple(llm.last_step[0].num_scheduled_tokens.items()))
    assert result.tokens == {r.request_id: tokens[r.request_id] for r in requests}
    assert result.tokens == {r.request_id: alone(model, r) for r in requests}
    assert result.scheduled_tokens == scheduled  # the very same steps
    assert result.preemptions > 0  # a small pool: the steps include preemptions


def test_requests_arriving_while_others_run_get_the_tokens_of_generate(model):
    llm = online(model, num_blocks=12, block_size=2)
    llm.add_request("first", PROMPTS[0], greedy(10))
    outputs: dict[Hashable, list[RequestOutput]] = {}
    for step in range(30):
        if step == 3:
            llm.add_request("second", PROMPTS[1], greedy(6))
        if step == 5:
            llm.add_request("third", PROMPTS[3], greedy(8))
        for out in llm.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not llm.has_unfinished_requests()
    assert final_tokens(outputs) == {
        "first": expected(model, PROMPTS[0], 10),
        "second": expected(model, PROMPTS[1], 6),
        "third": expected(model, PROMPTS[3], 8),
    }


# ------------------------------------------------------------------------------ aborts


def test_aborting_a_running_request_frees_its_blocks_at_once(model):
    llm = online(model, num_blocks=16, block_size=2)
    memory, runner = llm.engine_core.scheduler.memory, llm.engine_core.model_runner
    llm.add_request("a", PROMPTS[1], greedy(12))
    llm.add_request("b", PROMPTS[0], greedy(8))
    for _ in range(3):
        llm.step()
    held = len(memory.get_block_ids("a")[0])
    free, usage = memory.num_free_blocks, memory.usage
    assert held > 0 and "a" in runner.block_tables.rows
    (out,) = llm.abort_request("a")
    assert memory.num_free_blocks == free + held and memory.usage < usage  # before any step
    assert "a" not in memory
    assert [r.request_id for r in llm.engine_core.scheduler.running] == ["b"]
    assert out.request_id == "a" and out.finished
    (completion,) = out.outputs
    assert completion.finish_reason == "abort" and completion.stop_reason is None
    assert completion.token_ids == expected(model, PROMPTS[1], 12)[:3]  # what it had: three steps
    assert "a" in runner.block_tables.rows  # the runner hears of it at the next step
    llm.step()
    assert "a" not in runner.block_tables.rows and "a" not in llm.output_processor
    assert llm.abort_request("a") == []  # finished: skipped
    assert final_tokens(run(llm))["b"] == expected(model, PROMPTS[0], 8)
    assert memory.num_free_blocks == 15


def test_aborting_a_waiting_request_just_removes_it(model):
    llm = online(model, num_blocks=16, block_size=2, max_num_seqs=1)
    llm.add_request("a", PROMPTS[0], greedy(5))
    llm.add_request("b", PROMPTS[1], greedy(5))
    llm.step()
    assert [r.request_id for r in llm.engine_core.scheduler.waiting] == ["b"]
    free = llm.engine_core.scheduler.memory.num_free_blocks
    (out,) = llm.abort_request(["b", "nobody"])
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == [] and out.finished
    assert not llm.engine_core.scheduler.waiting and llm.engine_core.scheduler.memory.num_free_blocks == free
    assert llm.get_num_unfinished_requests() == 1
    assert final_tokens(run(llm)) == {"a": expected(model, PROMPTS[0], 5)}


def test_aborting_a_swapped_out_request_drops_its_host_copy_at_the_next_step(model):
    llm = online(model, num_blocks=6, block_size=2, preemption="swap")  # 5 blocks and the null block
    llm.add_request("a", [1, 2, 3], greedy(8))
    llm.add_request("b", [4, 5, 6], greedy(8))
    for _ in range(20):  # a small pool: the newest is swapped out within a few steps
        if llm.engine_core.scheduler.swapped:
            break
        llm.step()
    assert [r.request_id for r in llm.engine_core.scheduler.swapped] == [
        "b"
    ] and "b" in llm.engine_core.model_runner.swapped
    free = llm.engine_core.scheduler.memory.num_free_blocks
    (out,) = llm.abort_request("b")
    assert out.outputs[0].finish_reason == "abort"
    assert not llm.engine_core.scheduler.swapped and llm.engine_core.scheduler.memory.num_free_blocks == free
    assert "b" in llm.engine_core.model_runner.swapped  # until the runner is told
    llm.step()
    assert "b" not in llm.engine_core.model_runner.swapped
    assert final_tokens(run(llm)) == {"a": expected(model, [1, 2, 3], 8)}
    assert llm.engine_core.scheduler.memory.num_free_blocks == 5 and not llm.engine_core.model_runner.swapped


def test_an_id_is_refused_only_while_its_request_is_live(model):
    llm = online(model)
    llm.add_request("done", [1, 2, 3], greedy(1))
    run(llm)
    assert not llm.engine_core.scheduler.requests and not llm.output_processor.request_ids()
    llm.add_request("done", [4, 5], greedy(2))  # finished: its id may come again, as in vLLM
    assert final_tokens(run(llm)) == {"done": expected(model, [4, 5], 2)}


def test_unknown_and_finished_ids_are_ignored_and_a_parent_aborts_all_its_children(model):
    llm = online(model)
    assert llm.abort_request("ghost") == [] and llm.abort_request([]) == []
    llm.add_request("p", PROMPTS[0], SamplingParams(n=3, seed=1, max_tokens=10))
    llm.add_request("q", PROMPTS[1], greedy(2))
    run_steps = [llm.step() for _ in range(3)]
    assert all(run_steps) and "q" not in llm.output_processor  # q finished at step 2
    before = state(llm)
    assert llm.abort_request(["q", "0_p"]) == []  # a finished id, a child's core id: not a request
    assert state(llm) == before
    (out,) = llm.abort_request(("p",))
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert all(len(c.token_ids) == 3 for c in out.outputs)
    assert not llm.has_unfinished_requests() and llm.engine_core.scheduler.memory.num_free_blocks == 47


# ------------------------------------------------------------------------------ refused requests


@pytest.mark.parametrize(
    ("request_id", "prompt", "params", "message"),
    [
        ("new", [], None, "prompt_token_ids must be a non-empty list of token ids"),
        ("new", "abc", None, "prompt_token_ids must be a non-empty list of token ids"),
        ("new", [1, 256], None, r"prompt_token_ids must hold token ids in \[0, 256\)"),
        ("new", [1, -1], None, r"prompt_token_ids must hold token ids in \[0, 256\)"),
        ("new", [1, 2.5], None, r"prompt_token_ids must hold token ids in \[0, 256\)"),
        (
            "new",
            [1] * 65,
            None,
            r"^The decoder prompt \(length 65\) is longer than the maximum model length of 64\. Make sure "
            r"that `max_model_len` is no smaller than the number of text tokens\.$",
        ),
        (
            "new",
            [1] * 64,
            None,
            r"^The decoder prompt \(length 64\) plus the number of requested output tokens \(at least 1\) "
            r"is longer than the maximum model length of 64\. Make sure that `max_model_len` is no smaller "
            r"than the number of text tokens \(prompt \+ requested output tokens\)\.$",
        ),
        ("run", [1, 2], None, "request_id 'run' is in use"),
        ("wait", [1, 2], None, "request_id 'wait' is in use"),
        ("0_kids", [1, 2], None, "request_id '0_kids' is in use"),  # a child's core id
        ("kids", [3], greedy(1), "request_id 'kids' is in use"),
        (["x"], [1, 2], None, "request_id"),
        ("new", [1, 2], {"max_tokens": 3}, "sampling_params must be a SamplingParams"),
        ("new", [1] * 40, greedy(20), "cannot hold request 'new' alone"),
    ],
)
def test_a_refused_request_leaves_the_engine_as_it_was(request_id, prompt, params, message):
    llm = online(_model().to("cpu"), num_blocks=12, block_size=4, max_num_seqs=2)
    llm.add_request("done", [1, 2, 3], greedy(1))
    llm.step()
    llm.add_request("run", [1, 2, 3], greedy(5))
    llm.add_request("kids", [4, 5], SamplingParams(n=2, max_tokens=5))
    llm.add_request("wait", [6], greedy(5))
    llm.step()
    before = state(llm)
    with pytest.raises(ValueError, match=message):
        llm.add_request(request_id, prompt, params)
    assert state(llm) == before
    run(llm)
    assert llm.engine_core.scheduler.memory.num_free_blocks == 11


def test_stop_strings_need_a_decode_function():
    llm = online(_model().to("cpu"), num_blocks=12, block_size=4, decode=None)
    before = state(llm)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.add_request("a", [1, 2], SamplingParams(stop="x"))
    assert state(llm) == before
    llm.add_request("a", [1, 2], greedy(3))  # the id is still free; no text without a decode
    out = run(llm)["a"][-1]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 3


def test_max_tokens_is_capped_at_max_model_len_less_the_prompt(model):
    llm = online(model, num_blocks=40, block_size=4, max_model_len=20)
    prompt = list(range(1, 18))
    llm.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=100))
    (completion,) = run(llm)["long"][-1].outputs
    assert completion.token_ids == expected(model, prompt, 3)
    assert completion.finish_reason == "length"


# ------------------------------------------------------------------------------ stop conditions


def test_a_stop_string_cuts_the_text_and_frees_the_blocks_at_once(model):
    prompt = PROMPTS[1]
    tokens = expected(model, prompt, 16)
    text = letters(tokens)
    stop = text[5:7]
    at = text.find(stop)
    llm = online(model)
    llm.add_request("s", prompt, greedy(16, stop=["never", stop]))
    outputs = []
    while not outputs or not outputs[-1].finished:
        (out,) = llm.step()
        outputs.append(out)
    assert (
        llm.engine_core.scheduler.memory.num_free_blocks == 47 and not llm.has_unfinished_requests()
    )  # at once
    (completion,) = outputs[-1].outputs
    assert completion.text == text[:at] and stop not in completion.text
    assert completion.token_ids == tokens[: at + 2]  # up to the token that completed it
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert len(outputs) == at + 2  # the step that completed it was the last one
    assert (
        "s" in llm.engine_core.model_runner.block_tables.rows
    )  # the runner drops its row when it hears, next step
    llm.add_request("t", [1], greedy(1))
    run(llm)
    assert "s" not in llm.engine_core.model_runner.block_tables.rows


def test_a_stop_string_wins_over_the_length_on_the_same_token(model):
    prompt = PROMPTS[1]
    tokens = expected(model, prompt, 16)
    text = letters(tokens)
    at = text.find(text[5:7])
    out = served_alone(model, prompt, greedy(at + 2, stop=text[5:7]))
    assert out.outputs[0].token_ids == tokens[: at + 2]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", text[5:7])
    assert out.outputs[0].text == text[:at]


def test_a_stop_token_is_kept_in_the_tokens_and_left_out_of_the_text(model):
    prompt = PROMPTS[3]
    tokens = expected(model, prompt, 12)
    stop = tokens[4]
    first = tokens.index(stop)
    never = next(t for t in range(256) if t not in tokens)
    out = served_alone(model, prompt, greedy(12, stop_token_ids=[never, stop]))
    (completion,) = out.outputs
    assert completion.token_ids == tokens[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.text == letters(tokens[:first])  # vLLM leaves the stop token's text out


def test_the_models_end_of_sequence_token_ends_a_request_unless_ignore_eos(device):
    model = TinyGPT(CONFIG, seed=1).to(device)
    prompt = PROMPTS[3]
    tokens = expected(_model(), prompt, 10)
    eos = tokens[3]
    model.eos_token_ids = (eos,)  # as a Hugging Face model's generation_config names it
    first = tokens.index(eos)
    assert generate(model, [prompt], 10).tokens[0] == tokens[: first + 1]
    out = served_alone(model, prompt, greedy(10))
    (completion,) = out.outputs
    assert completion.token_ids == tokens[: first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert completion.text == letters(tokens[:first])
    both = served_alone(model, prompt, greedy(10, stop_token_ids=[eos]))
    assert both.outputs[0].stop_reason is None  # vLLM checks the end of sequence first
    ignoring = served_alone(model, prompt, greedy(10, ignore_eos=True))
    assert ignoring.outputs[0].token_ids == tokens and ignoring.outputs[0].finish_reason == "length"


def test_streamed_text_never_shows_part_of_a_stop_string(model):
    prompt = PROMPTS[1]
    tokens = expected(model, prompt, 20)
    text = letters(tokens)
    almost = text[8:10] + "!"  # starts where the text goes on, never completes
    stop = text[12:15]
    cut = min(text.find(stop), 20)
    llm = online(model)
    llm.add_request("d", prompt, greedy(20, stop=[almost, stop], output_kind=DELTA))
    llm.add_request("c", prompt, greedy(20, stop=[almost, stop]))
    sent, ids, seen = "", [], []
    for _ in range(40):
        for out in llm.step():
            (completion,) = out.outputs
            if out.request_id == "c":
                seen.append(completion.text)
                continue
            sent += completion.text
            ids += completion.token_ids
            assert text[:cut].startswith(sent)  # never text that is cut later
            if not out.finished:
                assert len(sent) <= max(0, len(ids) - 2)  # the longest stop string, less one, held back
    assert sent == seen[-1] == text[:cut] and ids == tokens[: cut + 3]
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))


# ------------------------------------------------------------------------------ output kinds


def test_delta_outputs_add_up_to_the_cumulative_ones_and_final_only_outputs_once(model):
    llm = online(model, decode=utf8)
    params = {kind: SamplingParams(seed=11, max_tokens=24, output_kind=kind) for kind in RequestOutputKind}
    for kind, p in params.items():
        llm.add_request(kind.name, PROMPTS[0], p)
    outputs = run(llm)
    cumulative = outputs["CUMULATIVE"]
    (final,) = outputs["FINAL_ONLY"]
    delta = outputs["DELTA"]
    last = cumulative[-1].outputs[0]
    assert final.finished and final.outputs[0] == last
    assert "".join(o.outputs[0].text for o in delta) == last.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == last.token_ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in delta)
    assert last.text == utf8(last.token_ids) and len(last.token_ids) == 24
    for out in cumulative[:-1]:  # a running text never ends with half a character
        assert not out.outputs[0].text.endswith("\ufffd")


# ------------------------------------------------------------------------------ random sampling


def test_a_seeded_request_gets_its_tokens_whatever_runs_beside_it(model):
    params = SamplingParams(seed=5, temperature=0.9, top_k=40, top_p=0.95, max_tokens=12)
    by_itself = served_alone(model, PROMPTS[1], params).outputs[0].token_ids
    llm = online(model)
    llm.add_request("g", PROMPTS[0], greedy(7))
    llm.add_request("r", PROMPTS[3], SamplingParams(max_tokens=9))
    llm.add_request("s", PROMPTS[1], params)
    llm.add_request("r2", PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.3))
    tokens = final_tokens(run(llm))
    assert tokens["s"] == by_itself
    assert (
        "s" in llm.engine_core.model_runner.sampling and "g" not in llm.engine_core.model_runner.sampling
    )  # until the runner hears
    llm.step()
    assert not llm.engine_core.model_runner.sampling
    assert tokens["g"] == expected(model, PROMPTS[0], 7)
    assert served_alone(model, PROMPTS[1], params).outputs[0].token_ids == by_itself
    other_seed = SamplingParams(seed=6, max_tokens=12)
    assert served_alone(model, PROMPTS[1], other_seed).outputs[0].token_ids != by_itself


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "prefix-caching"])
def test_a_seeded_request_gets_its_tokens_through_recompute_preemptions(model, caching):
    params = SamplingParams(seed=5, temperature=1.0, max_tokens=8)
    by_itself = served_alone(model, [8, 9, 10], params).outputs[0].token_ids
    llm = online(model, num_blocks=8, block_size=2, enable_prefix_caching=caching)
    llm.add_request("a", [1, 2, 3], greedy(8))
    llm.add_request("b", [4, 5, 6, 7], greedy(8))
    llm.add_request("s", [8, 9, 10], params)
    preempted, outputs, cached, resumed_hits = [], {}, set(), 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id] = out.outputs[0].token_ids
            cached.add(out.num_cached_tokens)
        preempted += [p.request_id for p in llm.last_step[0].preemptions]
        resumed_hits += llm.last_stats.prefix_cache_stats.preempted_hits
    assert preempted.count("s") >= 2 and llm.num_preemptions == len(preempted)
    assert outputs == {
        "a": expected(model, [1, 2, 3], 8),
        "b": expected(model, [4, 5, 6, 7], 8),
        "s": by_itself,
    }
    assert (resumed_hits > 0) == caching  # a resumed request found its own blocks again...
    assert cached == {0}  # ...but num_cached_tokens is its first admission's, as vLLM's


def test_n_children_are_vllms_and_child_i_is_the_request_with_seed_plus_i(model):
    llm = online(model)
    params = SamplingParams(n=3, seed=40, max_tokens=6, temperature=1.2)
    llm.add_request("p", PROMPTS[1], params)
    assert (
        [r.request_id for r in llm.engine_core.scheduler.waiting]
        == ["0_p", "1_p", "2_p"]
        == child_request_ids("p", 3)
    )
    assert llm.get_num_unfinished_requests() == 1
    outputs = run(llm)["p"]
    assert all(len(out.outputs) == 3 for out in outputs)  # cumulative: every child, every step
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    for i, completion in enumerate(final.outputs):
        child = SamplingParams(seed=40 + i, max_tokens=6, temperature=1.2)
        assert completion.token_ids == served_alone(model, PROMPTS[1], child).outputs[0].token_ids
        assert completion.text == letters(completion.token_ids) and completion.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1


def test_children_share_the_prompts_blocks_with_prefix_caching(model):
    prompt = list(range(1, 10))  # two full blocks of 4 and one token
    used = {}
    for caching in (True, False):
        llm = online(model, num_blocks=40, enable_prefix_caching=caching)
        llm.add_request("p", prompt, SamplingParams(n=4, seed=3, max_tokens=3, output_kind=DELTA))
        llm.step()
        used[caching] = 39 - llm.engine_core.scheduler.memory.num_free_blocks  # 39 blocks and the null block
        assert llm.last_stats.num_running_reqs == 4
        outputs = run(llm)["p"]
        assert sum(len(c.token_ids) for out in outputs for c in out.outputs) == 4 * 2  # deltas after step 1
        assert llm.engine_core.scheduler.memory.num_free_blocks == 39
        assert outputs[-1].num_cached_tokens == 0  # the first child's admission found nothing cached
        llm.add_request("again", prompt, greedy(1))
        assert run(llm)["again"][-1].num_cached_tokens == (8 if caching else 0)
    assert used == {True: 2 + 4, False: 4 * 3}  # the two full blocks once, each child its last one


# ------------------------------------------------------------------------------ records


def test_the_step_records_count_first_tokens_latencies_and_finished_requests(model):
    now = [0.0]
    args = engine_args(20, block_size=4, max_num_seqs=2)
    llm = LLMEngine.from_engine_args(model, args, decode=letters, clock=lambda: now[0])
    llm.add_request("a", [1, 2, 3], greedy(2))
    llm.add_request("b", [4, 5, 6, 7, 8], greedy(3))
    llm.add_request("c", [9], greedy(1), arrival_time=-1.0)
    now[0] = 2.0
    llm.step()
    stats, it = llm.last_stats, llm.last_iteration
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.num_generation_tokens == 2 and stats.num_prompt_tokens == 8
    assert stats.kv_cache_usage == pytest.approx(3 / 19)  # a: 1 block, b: 2, of 19 (the null block aside)
    assert it.time_to_first_tokens_iter == (2.0, 2.0) and it.inter_token_latencies_iter == ()
    assert it.num_generation_tokens == 2 and it.num_prompt_tokens == 8 and it.finished_requests == ()
    now[0] = 5.0
    llm.step()  # a finishes (2 tokens), freeing its seat; c waits still
    it = llm.last_iteration
    assert it.inter_token_latencies_iter == (3.0, 3.0) and it.time_to_first_tokens_iter == ()
    assert [(f.finish_reason, f.e2e_latency, f.num_generation_tokens) for f in it.finished_requests] == [
        ("length", 5.0, 2)
    ]
    assert llm.last_stats.num_running_reqs == 1 and llm.last_stats.num_prompt_tokens == 0
    now[0] = 6.0
    llm.step()  # c admitted: its time to first token counts from its own arrival
    it = llm.last_iteration
    assert it.time_to_first_tokens_iter == (7.0,)
    assert sorted((f.finish_reason, f.e2e_latency) for f in it.finished_requests) == [
        ("length", 6.0),
        ("length", 7.0),
    ]
    assert llm.last_stats.num_running_reqs == 0 and llm.last_stats.kv_cache_usage == 0.0
    assert not llm._arrival and not llm._last_token_at  # nothing kept of what left


# ------------------------------------------------------------------------------ the output processor alone

BYTES = [0x61, 0x62, 0x20, 0xC3, 0xA9, 0xE2, 0x82, 0xAC]  # a, b, space, and the bytes of é and €


def reference(tokens: list[int], stops: list[str], stop_token: bool) -> tuple[list[int], str, str, object]:
    """The completion vLLM makes of ``tokens`` coming one by one: its tokens, text, finish and stop
    reasons. The core ends it after the last token (a stop token when ``stop_token``)."""
    for k in range(1, len(tokens) + 1):
        last = k == len(tokens)
        text = utf8(tokens[: k - 1] if last and stop_token else tokens[:k])
        for stop in stops:
            if stop in text:
                return tokens[:k], text[: text.find(stop)], "stop", stop
    return tokens, text, "stop" if stop_token else "length", tokens[-1] if stop_token else None


@settings(max_examples=150)
@given(
    tokens=st.lists(st.sampled_from(BYTES), min_size=1, max_size=16),
    stops=st.lists(st.text(alphabet="ab é€", min_size=1, max_size=3), max_size=2),
    stop_token=st.booleans(),
)
def test_the_output_processor_streams_exactly_the_text_vllm_ends_with(tokens, stops, stop_token):
    processor = OutputProcessor(utf8)
    stop_ids = [tokens[-1]] if stop_token else []
    for kind in RequestOutputKind:
        params = SamplingParams(stop=stops, stop_token_ids=stop_ids, output_kind=kind)
        processor.add_request(kind, [1, 2], params)
    want_tokens, want_text, want_finish, want_reason = reference(tokens, stops, stop_token)
    outputs: dict[Hashable, list] = {kind: [] for kind in RequestOutputKind}
    for k, token in enumerate(tokens, start=1):
        live = [kind for kind in RequestOutputKind if kind in processor]
        if not live:
            break
        outs, stopped = processor.process_outputs(
            {kind: token for kind in live} | {"ghost": 3}, finished=live if k == len(tokens) else ()
        )
        # A stop string before the core's last token: the engine must finish the request in the core.
        ended_by_string = isinstance(want_reason, str) and k == len(want_tokens) < len(tokens)
        assert sorted(stopped, key=str) == (sorted(live, key=str) if ended_by_string else [])
        for out in outs:
            outputs[out.request_id].append(out)
    delta, cumulative = outputs[DELTA], outputs[RequestOutputKind.CUMULATIVE]
    (final,) = outputs[RequestOutputKind.FINAL_ONLY]  # once, at the end
    sent = ""
    for out in delta:
        (completion,) = out.outputs
        sent += completion.text
        assert want_text.startswith(sent)  # nothing sent is taken back
    assert sent == want_text
    assert [t for out in delta for t in out.outputs[0].token_ids] == want_tokens
    for out in cumulative:
        assert want_text.startswith(out.outputs[0].text)
        if not out.finished:  # a running text holds back an incomplete last character
            assert out.outputs[0].finish_reason is None
            assert stops or not out.outputs[0].text.endswith("\ufffd")
    for out in (delta[-1], cumulative[-1], final):
        assert out.finished
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (want_finish, want_reason)
    assert cumulative[-1].outputs[0].token_ids == final.outputs[0].token_ids == want_tokens
    assert cumulative[-1].outputs[0].text == final.outputs[0].text == want_text
    assert len(processor) == 0


def test_the_output_processor_gathers_children_and_their_finish_reasons():
    processor = OutputProcessor(letters)
    ids = processor.add_request("p", [5], SamplingParams(n=3, seed=0, max_tokens=4, output_kind=DELTA))
    assert ids == ["0_p", "1_p", "2_p"] and processor.children("p") == ids and processor.children("q") == []
    (out,), _ = processor.process_outputs({"0_p": 0, "1_p": 1, "2_p": 2}, finished=["1_p"])
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (0, "a", None),
        (1, "b", "length"),
        (2, "c", None),
    ]
    assert processor.last_finished == [("1_p", "length", 1)] and not out.finished
    assert processor.children("p") == ["0_p", "2_p"]
    (out,), _ = processor.process_outputs({"0_p": 3, "1_p": 9})  # a finished child's token is ignored
    assert [(c.index, c.text) for c in out.outputs] == [(0, "d")]
    (out,), _ = processor.process_outputs({}, aborted=["2_p", "0_p"])
    assert out.finished and [(c.index, c.finish_reason, c.token_ids) for c in out.outputs] == [
        (0, "abort", []),
        (2, "abort", []),
    ]
    assert "p" not in processor and processor.process_outputs({"0_p": 1}, aborted=["0_p"]) == ([], [])


# ------------------------------------------------------------------------------ the state machine

NUM_BLOCKS, BLOCK_SIZE = 8, 2
SYSTEM = [7, 7, 3, 1]  # a shared prefix of two blocks, so the prefix cache hits


class OnlineEngineMachine(RuleBasedStateMachine):
    """Requests come, steps run, clients abort, on a small pool with prefix caching (and preemption).

    Invariants: the memory holds blocks for exactly the running requests (usage 0 when none runs);
    no output carries more tokens than its request asked for. At the end every request has finished
    or was aborted, each greedy one that finished has its tokens of ``generate``, and every block
    is free."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model().to("cpu")
        args = engine_args(
            NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            attention_backend="GATHER",  # the quickest on a CPU at this size: the steps are what is tested
        )
        self.llm = LLMEngine.from_engine_args(self.model, args, decode=letters)
        self.requests: dict[Hashable, tuple[list[int], SamplingParams]] = {}
        self.tokens: dict[Hashable, dict[int, list[int]]] = {}  # request -> child index -> tokens
        self.final: dict[Hashable, RequestOutput] = {}
        self.ids = itertools.count()

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            prompt, params = self.requests[out.request_id]
            assert out.request_id not in self.final and out.prompt_token_ids == prompt
            children = self.tokens[out.request_id]
            for c in out.outputs:
                if params.output_kind is DELTA:
                    children.setdefault(c.index, []).extend(c.token_ids)
                else:
                    children[c.index] = list(c.token_ids)
                assert len(children[c.index]) <= params.max_tokens
            if out.finished:
                self.final[out.request_id] = out

    @rule(
        tail=st.lists(st.integers(0, 255), min_size=1, max_size=5),
        shared=st.booleans(),
        max_tokens=st.integers(1, 6),
        how=st.sampled_from(["greedy", "seeded", "n=2", "stop"]),
        kind=st.sampled_from(list(RequestOutputKind)),
    )
    def add_request(self, tail, shared, max_tokens, how, kind) -> None:
        prompt = (SYSTEM if shared else []) + tail
        params = {
            "greedy": greedy(max_tokens, output_kind=kind),
            "seeded": SamplingParams(seed=len(tail), max_tokens=max_tokens, output_kind=kind),
            "n=2": SamplingParams(n=2, max_tokens=max_tokens, output_kind=kind),
            "stop": greedy(max_tokens, stop=["e", "q"], output_kind=kind),
        }[how]
        request_id = f"r{next(self.ids)}"
        self.requests[request_id] = (prompt, params)
        self.tokens[request_id] = {}
        self.llm.add_request(request_id, prompt, params)

    @rule()
    def step(self) -> None:  # with nothing to run too: a step then does nothing
        self.record(self.llm.step())
        for preemption in self.llm.last_step[0].preemptions:
            event(f"preempted by {preemption.way}")
        if self.llm.last_stats.prefix_cache_stats.hits:
            event("a prefix-cache hit")

    @rule(data=st.data())
    def abort_request(self, data) -> None:
        live = [r for r in self.requests if r not in self.final]
        request_id = data.draw(st.sampled_from([*live, "ghost", *list(self.final)[:1]]))
        free = self.llm.engine_core.scheduler.memory.num_free_blocks
        where = {
            r.request_id: name
            for name in ("waiting", "running")
            for r in getattr(self.llm.engine_core.scheduler, name)
        }
        event(f"abort of a {where.get(request_id, 'missing')} request")
        event(f"abort of a {where.get(f'0_{request_id}', 'missing')} child")
        outputs = self.llm.abort_request(request_id)
        assert (len(outputs) == 1) == (request_id in live)
        self.record(outputs)
        assert self.llm.engine_core.scheduler.memory.num_free_blocks >= free
        for out in outputs:
            assert out.finished and {c.finish_reason for c in out.outputs} <= {"abort", "stop", "length"}

    @invariant()
    def the_memory_holds_the_running_requests_only(self) -> None:
        scheduler = self.llm.engine_core.scheduler
        running = {r.request_id for r in scheduler.running}
        assert set(scheduler.memory.request_ids) == running
        if not running:
            assert scheduler.memory.usage == 0.0

    @invariant()
    def the_scheduler_holds_the_unfinished_children_only(self) -> None:
        scheduler, processor = self.llm.engine_core.scheduler, self.llm.output_processor
        held = [
            r.request_id for queue in (scheduler.waiting, scheduler.running, scheduler.swapped) for r in queue
        ]
        children = [
            child for request_id in processor.request_ids() for child in processor.children(request_id)
        ]
        assert sorted(held) == sorted(children)
        assert sorted(processor.request_ids()) == sorted(r for r in self.requests if r not in self.final)
        # The runner keeps rows and generators for the requests still there, and for those that left
        # since the last step only: it hears of them (finished_req_ids) at the next one.
        leaving = scheduler._finished_ids
        assert (
            set(self.llm.engine_core.model_runner.block_tables.rows)
            <= {r.request_id for r in scheduler.running} | leaving
        )
        assert set(self.llm.engine_core.model_runner.sampling) <= set(held) | leaving

    def teardown(self) -> None:
        for _ in range(300):
            if not self.llm.has_unfinished_requests():
                break
            self.record(self.llm.step())
        assert not self.llm.has_unfinished_requests() and self.llm.get_num_unfinished_requests() == 0
        assert self.llm.engine_core.scheduler.memory.num_free_blocks == NUM_BLOCKS - 1
        assert set(self.final) == set(self.requests)  # every one finished or was aborted
        for request_id, (prompt, params) in self.requests.items():
            final = self.final[request_id]
            assert len(final.outputs if params.output_kind is not DELTA else self.tokens[request_id]) >= 1
            reasons = {c.finish_reason for c in final.outputs}
            assert reasons <= {"stop", "length", "abort"}
            if params.greedy and "abort" not in reasons:
                want = expected(self.model, prompt, params.max_tokens)
                got = self.tokens[request_id][0]
                if params.stop:
                    assert want[: len(got)] == got and not ({"e", "q"} & set(letters(got[:-1])))
                else:
                    assert got == want


OnlineEngineMachine.TestCase.settings = settings(max_examples=max_examples(10), stateful_step_count=25)
test_the_online_engine_under_random_requests_steps_and_aborts = OnlineEngineMachine.TestCase

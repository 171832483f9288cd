"""Log-probabilities and the logits processors (lesson 16), against references.

* The engine's ``logprobs`` and ``prompt_logprobs`` equal a log-softmax of Hugging Face's own logits
  for the same tokens (a tiny random-weight Llama built from a config), whole prompts, chunked
  prefills and preemptions alike, streamed (``DELTA``) or not.
* The processors (``logit_bias``, ``min_tokens``, the three penalties, ``bad_words``) equal a plain
  Python reference, one token id at a time, in vLLM's order; a request that asks for none of them
  gets the tokens it got before they existed; each row is processed alone, so a seeded request's
  tokens do not depend on its batch.
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.logprobs import Logprob
from paged_kv.serving.sampler import SamplingState, process_logits, sample, token_logprobs
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.lesson16

VOCAB = 96


@functools.cache
def llama(device: str = "cpu"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval().to(device)
    model.generation_config.eos_token_id = None
    return model


def text(ids) -> str:
    return "".join(chr(65 + t % 26) for t in ids)


def run(model, requests, *, decode=text, **settings) -> dict:
    """Each request ``(prompt, params)`` served on one ``LLMEngine``; the final output of each."""
    args = EngineArgs(block_size=4, num_gpu_blocks_override=settings.pop("num_blocks", 64), **settings)
    llm = LLMEngine.from_engine_args(model, args, decode=decode)
    for i, (prompt, params) in enumerate(requests):
        llm.add_request(i, prompt, params)
    finals, deltas = {}, {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            deltas.setdefault(out.request_id, []).append(out)
            if out.finished:
                finals[out.request_id] = out
    return {"final": finals, "deltas": deltas, "engine": llm}


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """The log-softmax of HF's logits at every position of ``tokens``, one forward, no cache."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        return model(ids).logits[0].float().log_softmax(dim=-1).cpu()


def prompts(n: int, seed: int, longest: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, longest))] for _ in range(n)]


def assert_position(position: dict, reference: torch.Tensor, token: int, k: int) -> None:
    """One position's dict against the reference log-softmax: the chosen token first, with its
    logprob and rank, then the top k by rank (the chosen one once), each with its text."""
    ids = list(position)
    top = reference.topk(k).indices.tolist()
    assert ids == [token] + [t for t in top if t != token]
    assert position[token].rank == int((reference >= reference[token]).sum())
    assert [position[t].rank for t in ids[1:]] == [top.index(t) + 1 for t in ids[1:]]
    for t in ids:
        assert math.isclose(position[t].logprob, float(reference[t]), abs_tol=1e-4)
        assert position[t].decoded_token == text([t])


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 7}, {"num_blocks": 14}],
    ids=["whole", "chunked", "preempted"],
)
def test_logprobs_equal_a_log_softmax_of_hfs_logits(settings):
    model = llama()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    batch = prompts(4, seed=1)
    result = run(model, [(p, params) for p in batch], **settings)
    if settings.get("num_blocks"):
        assert result["engine"].num_preemptions > 0
    for i, prompt in enumerate(batch):
        out = result["final"][i]
        (completion,) = out.outputs
        tokens = prompt + completion.token_ids
        reference = hf_logprobs(model, tokens)
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for j, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            assert_position(position, reference[len(prompt) - 1 + j], token, 3)
            assert position[token].rank == 1  # greedy: the likeliest
        total = sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True))
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-5)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert_position(out.prompt_logprobs[p], reference[p - 1], prompt[p], 2)


def test_logprobs_come_with_their_tokens_in_a_stream_and_the_prompts_once():
    model = llama()
    params = SamplingParams(
        temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA
    )
    whole = SamplingParams(temperature=0, max_tokens=6, logprobs=1, prompt_logprobs=0)
    prompt = prompts(1, seed=4)[0]
    streamed = run(model, [(prompt, params)])["deltas"][0]
    final = run(model, [(prompt, whole)])["final"][0]
    joined = [p for out in streamed for c in out.outputs for p in c.logprobs]
    assert joined == final.outputs[0].logprobs
    assert all(len(c.logprobs) == len(c.token_ids) for out in streamed for c in out.outputs)
    assert streamed[0].prompt_logprobs == final.prompt_logprobs
    assert all(out.prompt_logprobs is None for out in streamed[1:])
    assert all(len(p) == 1 for p in final.prompt_logprobs[1:])  # k = 0: the prompt token alone


def test_a_request_without_logprobs_gets_none_and_the_same_tokens():
    model = llama()
    prompt = prompts(1, seed=5)[0]
    plain = run(model, [(prompt, SamplingParams(temperature=0, max_tokens=6))])["final"][0]
    scored = run(model, [(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=2))])["final"][0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    assert plain.outputs[0].cumulative_logprob is None
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids


def test_the_whole_vocabulary_and_the_limit():
    model = llama()
    prompt = [3, 4, 5]
    out = run(model, [(prompt, SamplingParams(temperature=0, max_tokens=2, logprobs=-1))], max_logprobs=-1)
    position = out["final"][0].outputs[0].logprobs[0]
    assert len(position) == VOCAB
    assert math.isclose(sum(math.exp(p.logprob) for p in position.values()), 1.0, abs_tol=1e-4)
    llm = LLMEngine.from_engine_args(model, EngineArgs(block_size=4, num_gpu_blocks_override=16))
    with pytest.raises(ValueError, match="sample logprobs of 21, which is greater than max allowed: 20"):
        llm.add_request("a", prompt, SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="prompt logprobs of 96, which is greater than max allowed: 20"):
        llm.add_request("a", prompt, SamplingParams(prompt_logprobs=-1))
    assert not llm.has_unfinished_requests()


def test_token_logprobs_ranks_ties_and_k_zero():
    logprobs = torch.tensor([-1.0, -0.5, -0.5, -3.0])
    scored = token_logprobs(logprobs, 3, 2)
    assert scored.token_ids[0] == 3 and scored.rank == 4 and set(scored.token_ids[1:]) == {1, 2}
    assert token_logprobs(logprobs, 2, 0) == token_logprobs(logprobs, 2, 0)._replace(token_ids=(2,))
    assert token_logprobs(logprobs, 2, 0).rank == 2  # at least as likely: itself and token 1
    assert len(token_logprobs(logprobs, 0, -1).token_ids) == 5


# ------------------------------------------------------------------------------ the processors


def reference_process(logits: list[float], params: SamplingParams, prompt, outputs, stops) -> list[float]:
    """vLLM's order, one token id at a time, in float64."""
    out = list(logits)
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    if len(outputs) < params.min_tokens:
        for token in stops:
            out[token] = -math.inf
    seen = set(prompt) | set(outputs)
    for token in range(len(out)):
        if params.repetition_penalty != 1.0 and token in seen:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = outputs.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    for word in params.bad_words_token_ids or ():
        prefix = list(word[:-1])
        if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix) :] == prefix:
            out[word[-1]] = -math.inf
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    bias=st.dictionaries(st.integers(0, 11), st.floats(-150, 150), max_size=3),
    penalties=st.tuples(st.floats(-2, 2), st.floats(-2, 2), st.floats(0.2, 2.0)),
    min_tokens=st.integers(0, 4),
    words=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=3), max_size=3),
    outputs=st.lists(st.integers(0, 11), max_size=6),
)
def test_the_processors_equal_a_reference_in_vllms_order(seed, bias, penalties, min_tokens, words, outputs):
    presence, frequency, repetition = penalties
    params = SamplingParams(
        temperature=0,
        logit_bias=bias,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        min_tokens=min_tokens,
        max_tokens=None,
        bad_words_token_ids=tuple(map(tuple, words)),
    )
    logits = torch.randn(12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    prompt, stops = (1, 2, 2, 7), frozenset({0, 5})
    state = SamplingState(params, None, prompt, stops, list(outputs))
    got = process_logits(logits, state).tolist()
    want = reference_process(logits.tolist(), params, prompt, outputs, stops)
    for g, w in zip(got, want, strict=True):
        assert (g == w == -math.inf) or math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-9)


def test_each_processor_moves_the_greedy_token_as_it_should():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])

    def greedy(outputs=(), prompt=(), **kw) -> int:
        params = SamplingParams(temperature=0, max_tokens=None, **kw)
        state = SamplingState(params, None, tuple(prompt), frozenset({0}), list(outputs))
        return int(sample(logits, [state])[0][0])

    assert greedy() == 0
    assert greedy(logit_bias={3: 100}) == 3  # a big bias forces a token
    assert greedy(min_tokens=2, outputs=[1]) == 1  # the stop token 0 held back
    assert greedy(min_tokens=2, outputs=[1, 1]) == 0  # and let go once min_tokens are out
    assert greedy(frequency_penalty=2.0, outputs=[0]) == 1  # 3 - 2 < 2
    assert greedy(presence_penalty=1.5, outputs=[0, 0, 0]) == 1
    assert greedy(repetition_penalty=2.0, prompt=[0]) == 1  # 3 / 2 < 2
    assert greedy(bad_words_token_ids=((0,),)) == 1
    assert greedy(bad_words_token_ids=((2, 0),), outputs=[2]) == 1  # "2 0" banned after a 2
    assert greedy(bad_words_token_ids=((2, 0),), outputs=[1]) == 0


def test_processed_requests_keep_their_tokens_whatever_their_batch():
    model = llama()
    batch = prompts(5, seed=9)
    processed = SamplingParams(
        seed=3, max_tokens=10, presence_penalty=0.8, repetition_penalty=1.3, min_p=0.05, logit_bias={7: 2.0}
    )
    alone = run(model, [(batch[0], processed)])["final"][0].outputs[0].token_ids
    others = [(p, SamplingParams(seed=i, max_tokens=4, frequency_penalty=1)) for i, p in enumerate(batch[1:])]
    together = run(model, [(batch[0], processed), *others], num_blocks=20)
    assert together["final"][0].outputs[0].token_ids == alone
    plain = run(model, [(batch[0], SamplingParams(seed=3, max_tokens=10))])["final"][0].outputs[0].token_ids
    assert plain != alone  # the processing did change the draws


def test_a_stop_string_is_looked_for_only_after_min_tokens():
    model = llama()
    prompt = prompts(1, seed=2)[0]
    plain = run(model, [(prompt, SamplingParams(temperature=0, max_tokens=10))])["final"][0].outputs[0]
    stop = plain.text[1]  # a letter the greedy answer writes early on
    first = plain.text.index(stop)
    stopped = run(model, [(prompt, SamplingParams(temperature=0, max_tokens=10, stop=[stop]))])
    assert stopped["final"][0].outputs[0].text == plain.text[:first]
    held = SamplingParams(temperature=0, max_tokens=10, stop=[stop], min_tokens=first + 1)
    out = run(model, [(prompt, held)])["final"][0].outputs[0]
    later = plain.text.find(stop, first + 1)
    assert out.text == (plain.text if later == -1 else plain.text[:later])


def test_bad_words_need_a_tokenizer_and_the_vocabulary():
    model = llama()
    llm = LLMEngine.from_engine_args(model, EngineArgs(block_size=4, num_gpu_blocks_override=16))
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.add_request("a", [1, 2], SamplingParams(bad_words=["x"]))
    too_big = SamplingParams(bad_words=["x"]).update_from_tokenizer(lambda _: [500])
    with pytest.raises(ValueError, match="following tokens were specified as bad: \\[500\\]"):
        llm.add_request("a", [1, 2], too_big)
    with pytest.raises(ValueError, match="in logit_bias contain out-of-vocab token ids"):
        llm.add_request("a", [1, 2], SamplingParams(logit_bias={96: 1.0}))
    assert not llm.has_unfinished_requests()
    assert Logprob(-0.5).rank is None

"""Extra keys in the block hash (issue 32): a ``cache_salt`` isolates its requests, a LoRA name keys
every block, and a request that asks for ``prompt_logprobs`` reads no cached block.

The references: vLLM 0.33.0's ``generate_block_hash_extra_keys`` (``("lora", name)`` on every block,
then ``("cache_salt", salt)`` on the first); a dict keyed by ``(salt, lora, prefix)`` of what earlier
requests computed, which the memory's hits must equal; ``block_hash(parent, tokens)`` for a request
with no extra keys, as before the keys; and the tokens ``generate`` gives each prompt alone, which no
salt may change. The timing a salt removes is shown by its deterministic cause: the tokens the model
computes (a second request of one salt computes fewer, one of another salt all of them);
``bench/bench_cache_salt.py`` times it.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.core import prefix_cache
from paged_kv.core.block_pool import NULL_BLOCK
from paged_kv.core.kv_cache_groups import full_attention_group, kv_cache_groups
from paged_kv.core.kv_cache_manager import KVCacheManager, skip_reading_prefix_cache
from paged_kv.core.prefix_cache import (
    NO_EXTRA_KEYS,
    ROOT_HASH,
    block_hash,
    chain_hashes,
    full_blocks,
    generate_block_hash_extra_keys,
    request_extra_keys,
)
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import EngineRequest
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.sampling_params import SamplingParams

from .helpers import alone, engine_args

pytestmark = pytest.mark.lesson08

BLOCK = 4
PROMPT = tuple(range(30, 47))  # 17 tokens: 4 full blocks, all of which a later prompt can hit
GROUPS = {
    "full": full_attention_group(BLOCK),
    "sliding": kv_cache_groups([5], BLOCK),  # a window of 5: a hit needs its last block only
    "hybrid": kv_cache_groups([5, None], BLOCK),
}


def request(
    request_id: Hashable,
    tokens: Sequence[int] = PROMPT,
    salt: str | None = None,
    lora: str | None = None,
    params: SamplingParams | None = None,
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id,
        len(tokens),
        8,
        tuple(tokens),
        sampling_params=params,
        cache_salt=salt,
        lora_name=lora,
    )


def memory(groups: str = "full", num_blocks: int = 64) -> KVCacheManager:
    return KVCacheManager(num_blocks, kv_cache_groups=GROUPS[groups], enable_caching=True)


def admit(memory: KVCacheManager, req: EngineCoreRequest, tokens: Sequence[int] = PROMPT) -> int:
    """Look ``req`` up and give it slots for ``tokens``, as the scheduler admits it: its hit in tokens."""
    computed = memory.get_computed_blocks(req, tokens)
    assert memory.allocate_slots(req, len(tokens) - computed.num_tokens, tokens, new_computed_blocks=computed)
    return computed.num_tokens


def pool_state(memory: KVCacheManager) -> tuple:
    pool = memory.block_pool
    return (
        memory.request_ids,
        pool.free_block_ids,
        pool.prefix_cache.cached_blocks(),
        memory.prefix_cache_stats,
    )


# ------------------------------------------------------------------------------ the keys


def test_the_extra_keys_are_vllms_lora_on_every_block_then_the_salt_on_the_first():
    both = SimpleNamespace(cache_salt="tenant", lora_name="adapter")
    assert generate_block_hash_extra_keys(both, 0) == (("lora", "adapter"), ("cache_salt", "tenant"))
    assert generate_block_hash_extra_keys(both, BLOCK) == (("lora", "adapter"),)
    assert generate_block_hash_extra_keys(SimpleNamespace(cache_salt="tenant"), 0) == (
        ("cache_salt", "tenant"),
    )
    assert generate_block_hash_extra_keys(SimpleNamespace(cache_salt="tenant"), BLOCK) is None
    for nothing in (None, SimpleNamespace(), SimpleNamespace(cache_salt="", lora_name=None), request("r")):
        assert generate_block_hash_extra_keys(nothing, 0) is None  # an empty salt is none, as vLLM's `if`
        assert request_extra_keys(nothing, BLOCK) is NO_EXTRA_KEYS
    keys = request_extra_keys(both, BLOCK)
    assert [keys.for_block(i) for i in range(3)] == [
        (("lora", "adapter"), ("cache_salt", "tenant")),
        (("lora", "adapter"),),
        (("lora", "adapter"),),
    ]


@pytest.mark.parametrize("name", ["cache_salt", "lora_name"])
@pytest.mark.parametrize("value", [3, b"salt", ("a",)])
def test_a_key_that_is_not_a_string_is_refused_by_name_and_changes_nothing(name, value):
    with pytest.raises(ValueError, match=name):
        generate_block_hash_extra_keys(SimpleNamespace(**{name: value}), 0)
    mem = memory()
    admit(mem, request("warm"))
    before = pool_state(mem)
    bad = SimpleNamespace(request_id="bad", **{name: value})
    with pytest.raises(ValueError, match=name):
        mem.get_computed_blocks(bad, PROMPT)
    with pytest.raises(ValueError, match=name):
        mem.allocate_slots(bad, len(PROMPT), PROMPT)
    assert pool_state(mem) == before


def test_an_unsalted_request_hashes_exactly_as_before_the_keys():
    blocks = full_blocks(PROMPT, BLOCK)
    before = []  # the chain as the course always computed it, written out
    parent = ROOT_HASH
    for tokens in blocks:
        parent = hash((parent, tokens))
        before.append(parent)
    assert chain_hashes(blocks) == chain_hashes(blocks, NO_EXTRA_KEYS) == before
    assert block_hash(ROOT_HASH, blocks[0]) == block_hash(ROOT_HASH, blocks[0], None) == before[0]
    assert chain_hashes(blocks, request_extra_keys(request("r"), BLOCK)) == before
    mem = memory()
    admit(mem, request("r"))
    (table,) = mem.get_block_ids("r")
    cache = mem.block_pool.prefix_cache
    assert [cache.entry(b).block_hash for b in table[: len(blocks)]] == before
    assert all(cache.entry(b).extra_keys is None for b in table[: len(blocks)])


def test_a_salt_changes_every_hash_of_the_chain_and_a_lora_name_keys_every_block():
    blocks = full_blocks(PROMPT, BLOCK)
    plain = chain_hashes(blocks)
    salted = chain_hashes(blocks, request_extra_keys(request("s", salt="a"), BLOCK))
    other = chain_hashes(blocks, request_extra_keys(request("s", salt="b"), BLOCK))
    assert len({*plain, *salted, *other}) == 3 * len(blocks)  # the first block's salt reaches them all
    assert salted[1:] == [block_hash(h, t) for h, t in zip(salted, blocks[1:], strict=False)]  # first only
    lora = chain_hashes(blocks, request_extra_keys(request("l", lora="x"), BLOCK))
    assert lora[1:] == [block_hash(h, t, (("lora", "x"),)) for h, t in zip(lora, blocks[1:], strict=False)]
    mem = memory()
    admit(mem, request("l", salt="a", lora="x"))
    (table,) = mem.get_block_ids("l")
    entries = [mem.block_pool.prefix_cache.entry(b) for b in table[: len(blocks)]]
    assert [e.extra_keys for e in entries] == [(("lora", "x"), ("cache_salt", "a"))] + [(("lora", "x"),)] * 3


def test_a_salted_hash_is_the_same_in_every_process():
    """The lessons print hashes: a salt is a string, whose ``hash`` changes from run to run."""
    keys = (("lora", "x"), ("cache_salt", "tenant"))
    here = block_hash(ROOT_HASH, (1, 2, 3, 4), keys)
    path = Path(prefix_cache.__file__)
    script = (
        "import importlib.util, sys\n"  # the module alone: it imports the standard library only
        f"spec = importlib.util.spec_from_file_location('pc', {str(path)!r})\n"
        "pc = sys.modules['pc'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(pc)\n"
        f"print(pc.block_hash(0, (1, 2, 3, 4), {keys!r}))\n"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == here


# ----------------------------------------------------------------------------- the memory


@pytest.mark.parametrize("groups", list(GROUPS))
def test_one_salt_shares_as_before_and_another_salt_shares_nothing(groups):
    mem = memory(groups)
    full_hit = (len(PROMPT) - 1) // BLOCK * BLOCK
    assert admit(mem, request("a1", salt="a")) == 0
    assert admit(mem, request("a2", salt="a")) == full_hit
    assert admit(mem, request("b1", salt="b")) == 0
    assert admit(mem, request("none")) == 0
    assert admit(mem, request("none2")) == full_hit
    assert admit(mem, request("b2", salt="b")) == full_hit
    assert admit(mem, request("x", salt="a", lora="x")) == 0  # the LoRA name is a key too
    assert admit(mem, request("x2", salt="a", lora="x")) == full_hit
    for name in mem.request_ids:  # the hits are the first of their own keys' blocks
        first = {"a2": "a1", "none2": "none", "b2": "b1", "x2": "x"}.get(name)
        if first is not None:
            for mine, theirs in zip(mem.get_block_ids(name), mem.get_block_ids(first), strict=True):
                shared = {b for b in mine if b != NULL_BLOCK} & set(theirs)
                assert shared and shared <= set(theirs[: full_hit // BLOCK])


@pytest.mark.parametrize("groups", list(GROUPS))
def test_a_hash_collision_between_salts_never_shares_a_block(groups, monkeypatch):
    """With a hash that ignores the extra keys, only the comparison of the keys keeps salts apart:
    in a lookup (the first block's in a full-attention hit, the whole prefix's in a sliding
    window's), and when a block is cached (a chain never goes on through another salt's block)."""
    monkeypatch.setattr(
        prefix_cache,
        "block_hash",
        lambda parent_hash, token_ids, extra_keys=None: hash((parent_hash, token_ids)),
    )
    mem = memory(groups)
    short = PROMPT[:9]  # two full blocks
    assert admit(mem, request("a1", short, salt="a"), short) == 0
    assert admit(mem, request("b1", salt="b")) == 0  # its first blocks collide with a's: its chain ends
    assert admit(mem, request("b2", salt="b")) == 0
    assert admit(mem, request("plain")) == 0
    assert admit(mem, request("a2", salt="a")) == 8  # a's own two blocks, and none of b's after them
    assert admit(mem, request("a3", salt="a")) == (len(PROMPT) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("groups", list(GROUPS))
def test_a_block_filled_in_decode_takes_its_requests_keys(groups):
    mem = memory(groups)
    prompt, answer = PROMPT[:6], tuple(range(90, 101))
    tokens = list(prompt)
    for name, salt in (("a", "a"), ("b", "b")):
        req = request(name, prompt, salt=salt)
        admit(mem, req, prompt)
        for end in range(1, len(answer) + 1):  # the running request's path, one token a step
            tokens = [*prompt, *answer[:end]]
            assert mem.allocate_slots(req, 1, tokens) is not None
        mem.free(name)
    follow_up = [*tokens, 7]  # the previous turn and its answer: 4 full blocks, 3 of them decoded
    assert admit(mem, request("a-turn-2", follow_up, salt="a"), follow_up) == 16
    assert admit(mem, request("c-turn-2", follow_up, salt="c"), follow_up) == 0
    hashes = chain_hashes(full_blocks(follow_up, BLOCK), request_extra_keys(request("k", salt="a"), BLOCK))
    for table in mem.get_block_ids("a-turn-2"):  # a window's table holds the null block before it
        real = [(b, h) for b, h in zip(table, hashes, strict=False) if b != NULL_BLOCK]
        assert real and all(mem.block_pool.prefix_cache.entry(b).block_hash == h for b, h in real)


@pytest.mark.parametrize("groups", list(GROUPS))
def test_a_request_for_prompt_logprobs_gets_no_hit_but_caches_its_blocks(groups):
    mem = memory(groups)
    wants = SamplingParams(prompt_logprobs=1)
    assert skip_reading_prefix_cache(request("p", params=wants))
    assert not skip_reading_prefix_cache(request("q", params=SamplingParams(logprobs=1)))
    assert not skip_reading_prefix_cache(None)
    assert admit(mem, request("first", params=wants)) == 0
    stats = mem.prefix_cache_stats
    assert stats.requests == 0  # a lookup it skipped is not counted (vLLM's record_prefix_cache_stats)
    assert admit(mem, request("second")) == (len(PROMPT) - 1) // BLOCK * BLOCK  # its blocks, for others
    assert mem.get_computed_blocks(request("third", params=wants), PROMPT).num_tokens == 0
    assert admit(mem, request("third", params=wants)) == 0
    assert mem.prefix_cache_stats.requests == 1


# A few prompts with shared beginnings, so that equal prefixes under other keys are common.
STEMS = [tuple(range(10, 30)), tuple(range(10, 18)) + tuple(range(50, 62))]


@st.composite
def salted_requests(draw) -> list[tuple[str | None, str | None, tuple[int, ...], tuple[int, ...], bool]]:
    out = []
    for _ in range(draw(st.integers(3, 9))):
        stem = draw(st.sampled_from(STEMS))
        prompt = stem[: draw(st.integers(1, len(stem)))] + tuple(
            draw(st.lists(st.integers(0, 3), max_size=5))
        )
        answer = tuple(draw(st.lists(st.integers(0, 3), max_size=6)))
        salt = draw(st.sampled_from([None, "a", "b"]))
        lora = draw(st.sampled_from([None, "x"]))
        out.append((salt, lora, prompt, answer, draw(st.booleans())))
    return out


@pytest.mark.parametrize("groups", ["full", "hybrid"])
@settings(max_examples=25, deadline=None)
@given(requests=salted_requests())
def test_hits_are_what_earlier_requests_of_the_same_keys_computed(groups, requests):
    """Random requests of salts ``None``/``a``/``b`` and LoRA names ``None``/``x`` against a dict keyed
    by ``(salt, lora, prefix)``: each hit is the longest prefix its own keys computed before (the pool
    is large enough never to evict), every block it reuses was filled under its keys, every cached
    entry carries its keys, and an unsalted request's hashes are the plain chain."""
    num_groups = len(GROUPS[groups])
    total = sum(-(-(len(p) + len(a)) // BLOCK) for _, _, p, a, _ in requests)
    mem = memory(groups, num_blocks=num_groups * total + 2)
    cache = mem.block_pool.prefix_cache
    computed_before: set[tuple[str | None, str | None, tuple[int, ...]]] = set()
    filled_by: dict[
        int, tuple[str | None, str | None]
    ] = {}  # block -> the keys of the request that filled it
    for index, (salt, lora, prompt, answer, keep) in enumerate(requests):
        keys = (salt, lora)
        req = request(index, prompt, salt=salt, lora=lora)
        expected = 0
        while (
            expected < (len(prompt) - 1) // BLOCK
            and (*keys, prompt[: (expected + 1) * BLOCK]) in computed_before
        ):
            expected += 1
        computed = mem.get_computed_blocks(req, prompt)
        assert computed.num_tokens == expected * BLOCK
        hits = {b for group in computed.block_ids for b in group if b != NULL_BLOCK}
        assert all(filled_by[b] == keys for b in hits)
        gained = mem.allocate_slots(req, len(prompt) - expected * BLOCK, prompt, new_computed_blocks=computed)
        tokens = list(prompt)
        for token in answer:
            tokens.append(token)
            more = mem.allocate_slots(req, 1, tokens)
            gained = tuple((*g, *m) for g, m in zip(gained, more, strict=True))
        for block_id in {b for group in gained for b in group} - hits:
            filled_by[block_id] = keys
        computed_before.update((*keys, tuple(tokens[:end])) for end in range(BLOCK, len(tokens) + 1, BLOCK))
        extra = request_extra_keys(req, BLOCK)
        plain = chain_hashes(full_blocks(tokens, BLOCK))
        for table in mem.get_block_ids(index):
            for position, block_id in enumerate(table[: len(tokens) // BLOCK]):
                entry = cache.entry(block_id)
                if entry is not None:
                    assert entry.extra_keys == extra.for_block(position)
                    assert filled_by[block_id] == keys
                    if extra == NO_EXTRA_KEYS:
                        assert entry.block_hash == plain[position]
        if not keep:
            mem.free(index)


# ----------------------------------------------------------------------------- the engine


CONFIGS = {
    "full": GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64),
    "hybrid": GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=64, sliding_windows=(5, None)),
}


@functools.cache
def _model(kind: str) -> TinyGPT:
    return TinyGPT(CONFIGS[kind], seed=3)


def serve_one(
    llm: LLMEngine, request_id: str, params: SamplingParams, **keys
) -> tuple[list[int], int, object]:
    """Serve one request alone on ``llm`` to its end: its tokens, the tokens the model computed for it
    (every step's scheduled tokens: its prefill less the cached prefix, then one per decode step),
    and its last output."""
    llm.add_request(request_id, list(PROMPT), params, **keys)
    computed, last = 0, None
    while llm.has_unfinished_requests():
        for out in llm.step():
            last = out
        computed += llm.last_step[0].total_num_scheduled_tokens
    return last.outputs[0].token_ids, computed, last


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_engine_gives_the_same_tokens_with_any_salt_and_a_second_request_of_a_salt_computes_less(
    kind, device
):
    model = _model(kind).to(device)
    llm = LLMEngine.from_engine_args(model, engine_args(64, block_size=BLOCK, enable_prefix_caching=True))
    params = SamplingParams(temperature=0.0, max_tokens=5)
    expected = alone(model, EngineRequest("x", list(PROMPT), 5))
    hit = (len(PROMPT) - 1) // BLOCK * BLOCK
    everything = len(PROMPT) + 5 - 1  # the prompt, then a decode token for each output but the last
    served = {}
    for request_id, salt in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("plain", None), ("b2", "b")):
        served[request_id] = serve_one(llm, request_id, params, cache_salt=salt)
    assert all(tokens == expected for tokens, _, _ in served.values())
    computed = {request_id: tokens for request_id, (_, tokens, _) in served.items()}
    cached = {request_id: out.num_cached_tokens for request_id, (_, _, out) in served.items()}
    assert computed == {
        "a1": everything,
        "a2": everything - hit,
        "b1": everything,
        "plain": everything,
        "b2": everything - hit,
    }
    assert cached == {"a1": 0, "a2": hit, "b1": 0, "plain": 0, "b2": hit}
    scored = SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=1)
    tokens, work, out = serve_one(llm, "scored", scored)  # the unsalted prompt is cached: not read
    assert tokens == expected and work == everything and out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    assert llm.engine_core.memory.num_free_blocks == 64 - 1

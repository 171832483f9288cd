"""Prefix caching in the tiny GPT and its engine: a cached prefix is read, never recomputed or rewritten.

With ``enable_prefix_caching=True`` a request whose prompt starts with full blocks that an earlier
prompt computed reuses them, and its prefill computes only the rest. The text must not change: every
request gets the tokens of its prompt generated alone, with or without preemption.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import event, given, settings, target
from hypothesis import strategies as st

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.prefix_cache import chain_hashes, full_blocks
from paged_kv.model.config import GPTConfig
from paged_kv.model.kv_cache import PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.pictures.plots import plot_metrics
from paged_kv.serving.engine import Engine, EngineRequest, min_num_blocks
from paged_kv.serving.engine_result import EngineResult

from .helpers import alone, built, max_examples

pytestmark = pytest.mark.lesson09

CONFIG = GPTConfig(num_layers=2, num_heads=2, head_dim=8, max_len=128)
TOLERANCES = {"rtol": 1e-4, "atol": 1e-4}
SYSTEM = [100, 101, 102, 103, 104, 105, 106, 107, 108]  # 9 tokens: two full blocks of 4, and one more


@pytest.fixture(scope="module")
def model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=1)


def assert_alone(model: TinyGPT, result: EngineResult, requests: list[EngineRequest]) -> None:
    for request in requests:
        assert result.tokens[request.request_id] == alone(model, request), request.request_id


class Spy:
    """What an engine's run did, seen from its step loop: per admission, the tokens it was given and
    the tokens its prefix-cache hit served (a request resumed after recompute is given its
    generated tokens too); and the memory, to check that all of it is free at the end.

    ``prompts_only=True`` is the baseline: a running request's new tokens are not passed on, so
    only the blocks of whole prompts are cached, none that a decode fills."""

    def __init__(self, engine: Engine, prompts_only: bool = False) -> None:
        self.cached: dict[object, list[int]] = {}
        self.admitted_tokens: list[int] = []

        def watch(llm):
            runner = llm.engine_core.model_runner
            self.memory = memory = llm.engine_core.memory
            execute, allocate = runner.execute_model, memory.allocate_slots

            def execute_model(output):
                for new in output.scheduled_new_reqs:
                    if new.req_id not in output.blocks_to_swap_in:
                        self.cached.setdefault(new.req_id, []).append(new.num_computed_tokens)
                        self.admitted_tokens.append(len(new.token_ids))
                return execute(output)

            def allocate_slots(request, num_new_tokens, token_ids=None, **kwargs):
                if prompts_only and request.request_id in memory:
                    token_ids = None
                return allocate(request, num_new_tokens, token_ids, **kwargs)

            runner.execute_model = execute_model
            memory.allocate_slots = allocate_slots
            self.runner = runner

        built(engine, watch)

    @property
    def manager(self):
        return self.memory

    @property
    def num_blocks(self) -> int:
        return self.memory.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.memory.enable_caching

    def all_free(self) -> bool:
        return self.memory.num_free_blocks == self.num_blocks - 1 and not self.memory.request_ids


def spied(spies: list, model, prompts_only: bool = False, **kwargs) -> Engine:
    """An engine with a :class:`Spy` on it, appended to ``spies``."""
    engine = Engine(model, **kwargs)
    spies.append(Spy(engine, prompts_only))
    return engine


def kv_pools(holder) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Every layer's K pools and V pools, of a cache or a runner."""
    return holder.storage.k_caches, holder.storage.v_caches


def check_metrics(result: EngineResult, cache: Spy, requests: list[EngineRequest]) -> None:
    """The engine's prefix-cache counts agree with the cache's manager, and memory is all free."""
    assert cache.enable_prefix_caching
    stats = cache.manager.prefix_cache_stats  # a resumed request's lookups apart, as vLLM counts them
    assert (stats.queries + stats.preempted_queries, stats.hits + stats.preempted_hits) == (
        result.prefix_cache_queries,
        result.prefix_cache_hits,
    )
    # Every admission is looked up, re-admissions included, with the tokens each was given.
    assert result.prefix_cache_queries == sum(cache.admitted_tokens)
    assert result.prefix_cache_hits == sum(sum(counts) for counts in cache.cached.values())
    assert result.prefill_tokens_computed == result.prefix_cache_queries - result.prefix_cache_hits
    assert result.hit_rate == pytest.approx(result.prefix_cache_hits / result.prefix_cache_queries)
    assert list(result.tokens) == [r.request_id for r in requests]
    assert all(used <= cache.num_blocks for used in result.used_blocks)
    assert cache.all_free()  # cached blocks count as free


# ------------------------------------------------------------------------------- the model


def shared_prompts() -> tuple[list[int], list[int]]:
    """Two prompts sharing their first 9 tokens: in blocks of 4, two full blocks in common."""
    generator = torch.Generator().manual_seed(5)
    first = SYSTEM + torch.randint(0, 256, (5,), generator=generator).tolist()  # 14 tokens
    second = SYSTEM + torch.randint(0, 256, (4,), generator=generator).tolist()  # 13 tokens
    return first, second


def test_a_prefill_from_the_cache_gives_the_logits_and_kv_of_a_full_prefill(device: torch.device) -> None:
    model = TinyGPT(CONFIG, seed=1).to(device)
    first, second = shared_prompts()
    cache = PagedKVCache(CONFIG, 16, 4, device, enable_prefix_caching=True)
    plain = PagedKVCache(CONFIG, 16, 4, device)
    tokens = torch.tensor(second, device=device)
    with torch.no_grad():
        cache.add_sequence("a", len(first), token_ids=first)
        assert cache.num_cached_tokens("a") == 0
        model.prefill(torch.tensor(first, device=device), "a", cache)
        shared = cache.manager.get_block_table("a").block_ids[:2]
        before = [(k[shared].clone(), v[shared].clone()) for k, v in zip(*kv_pools(cache), strict=True)]

        cache.add_sequence("b", len(second), token_ids=second)
        assert cache.num_cached_tokens("b") == 8  # SYSTEM's two full blocks; the 9th token is computed
        cached_logits = model.prefill(tokens, "b", cache, start=8)
        plain.add_sequence("b", len(second))
        full_logits = model.prefill(tokens, "b", plain)
        full = model(tokens[None])[0]

    assert cached_logits.shape == (len(second) - 8, CONFIG.vocab_size)
    torch.testing.assert_close(cached_logits, full_logits[8:], **TOLERANCES)
    torch.testing.assert_close(cached_logits, full[8:], **TOLERANCES)
    # b reads a's two blocks, which nobody wrote again, and holds its own K/V after them.
    assert cache.manager.get_block_table("b").block_ids[:2] == shared
    assert all(cache.manager.ref_count(block) == 2 for block in shared)
    for layer in range(CONFIG.num_layers):
        k_before, v_before = before[layer]
        assert torch.equal(cache.storage.k_caches[layer][shared], k_before)
        assert torch.equal(cache.storage.v_caches[layer][shared], v_before)
        k, v = cache.read_kv(layer, "b")
        k_full, v_full = plain.read_kv(layer, "b")
        torch.testing.assert_close(k, k_full, **TOLERANCES)
        torch.testing.assert_close(v, v_full, **TOLERANCES)


def test_decoding_after_a_prefill_from_the_cache_matches_the_full_forward(device: torch.device) -> None:
    model = TinyGPT(CONFIG, seed=1).to(device)
    first, second = shared_prompts()
    cache = PagedKVCache(CONFIG, 16, 4, device, enable_prefix_caching=True)
    sequence = torch.tensor([*second, 7, 8, 9, 10, 11], device=device)  # the prompt, then 5 tokens
    with torch.no_grad():
        cache.add_sequence("a", len(first), token_ids=first)
        model.prefill(torch.tensor(first, device=device), "a", cache)
        cache.add_sequence("b", len(second), token_ids=second)
        got = [model.prefill(sequence[: len(second)], "b", cache, start=cache.num_cached_tokens("b"))]
        for position in range(len(second), len(sequence)):  # crosses the block boundary at 16
            got.append(model.decode_step(sequence[position : position + 1], ["b"], cache))
        full = model(sequence[None])[0]
    torch.testing.assert_close(torch.cat(got), full[8:], **TOLERANCES)


@pytest.mark.parametrize("start", [-1, True, 13, 20, 1.0])
def test_prefill_refuses_a_start_outside_the_prompt(model: TinyGPT, start) -> None:
    cache = PagedKVCache(CONFIG, 16, 4, enable_prefix_caching=True)
    _, second = shared_prompts()
    cache.add_sequence("b", len(second), token_ids=second)
    with pytest.raises(ValueError, match="start"):
        model.prefill(torch.tensor(second), "b", cache, start=start)


def test_the_cache_refuses_to_rewrite_or_skip_cached_positions(model: TinyGPT) -> None:
    first, second = shared_prompts()
    cache = PagedKVCache(CONFIG, 16, 4, enable_prefix_caching=True)
    with torch.no_grad():
        cache.add_sequence("a", len(first), token_ids=first)
        model.prefill(torch.tensor(first), "a", cache)
        cache.add_sequence("b", len(second), token_ids=second)
        snapshot = cache.manager.snapshot()
        k_before = [k.clone() for k in cache.storage.k_caches]
        # The whole prompt from position 0 would rewrite a's blocks: refused, and nothing is written.
        with pytest.raises(ValueError, match=r"first 8 tokens .* start=8"):
            model.prefill(torch.tensor(second), "b", cache)
        for start in (4, 9):  # rewrites a cached block; leaves position 8 unwritten
            with pytest.raises(ValueError, match=f"start {start}"):
                model.prefill(torch.tensor(second), "b", cache, start=start)
        q = torch.zeros(5, CONFIG.num_heads, CONFIG.head_dim)
        with pytest.raises(ValueError, match="q must be"):
            cache.attend_prefill(0, "b", q[:4], q, q, 8)
        with pytest.raises(ValueError, match="start"):
            cache.attend_prefill(0, "b", q, q, q, -8)
    assert cache.manager.snapshot() == snapshot
    assert all(torch.equal(k, b) for k, b in zip(cache.storage.k_caches, k_before, strict=True))


def test_one_lookup_serves_every_layer(model: TinyGPT) -> None:
    first, second = shared_prompts()
    cache = PagedKVCache(CONFIG, 16, 4, enable_prefix_caching=True)
    with torch.no_grad():
        cache.add_sequence("a", len(first), token_ids=first)
        model.prefill(torch.tensor(first), "a", cache)
    cache.add_sequence("b", len(second), token_ids=second)
    stats = cache.manager.prefix_cache_stats  # one query per prompt, not one per layer
    assert (stats.requests, stats.queries, stats.hits) == (2, len(first) + len(second), 8)


def test_without_prefix_caching_token_ids_change_nothing(model: TinyGPT) -> None:
    first, _ = shared_prompts()
    cache = PagedKVCache(CONFIG, 16, 4)
    assert not cache.enable_prefix_caching
    for seq_id in ("a", "b"):
        cache.add_sequence(seq_id, len(first), token_ids=first)
        assert cache.num_cached_tokens(seq_id) == 0
    assert set(cache.manager.get_block_table("a").block_ids).isdisjoint(
        cache.manager.get_block_table("b").block_ids
    )


# ------------------------------------------------------------------------------ the engine


def system_requests(max_new_tokens: int = 2) -> list[EngineRequest]:
    """Four prompts: the 9-token SYSTEM, then 3 tokens of their own (12 tokens, 3 blocks of 4)."""
    return [EngineRequest(i, [*SYSTEM, i, i + 1, i + 2], max_new_tokens) for i in range(4)]


def test_a_shared_system_prompt_is_computed_once_and_hit_by_every_later_request(
    model: TinyGPT, device: torch.device
) -> None:
    requests = system_requests()
    model = model.to(device)
    try:
        caches: list = []
        result = spied(caches, model, num_blocks=32, block_size=4, enable_prefix_caching=True).run(requests)
        plain = Engine(model, num_blocks=32, block_size=4).run(requests)
        assert_alone(model, result, requests)
    finally:
        model.to("cpu")
    (cache,) = caches
    # All four are admitted at step 0, one after another. Request 0 finds nothing; each later one
    # finds SYSTEM's two full blocks (8 tokens), not the third, which holds its own tokens.
    assert cache.cached == {0: [0], 1: [8], 2: [8], 3: [8]}
    assert (result.prefix_cache_queries, result.prefix_cache_hits) == (4 * 12, 3 * 8)
    assert result.prefill_tokens_computed == 12 + 3 * 4
    assert result.hit_rate == 0.5
    # Without caching: every prompt token is computed, nothing is looked up.
    assert (plain.prefill_tokens_computed, plain.prefix_cache_queries, plain.prefix_cache_hits) == (48, 0, 0)
    assert plain.hit_rate == 0.0
    # Blocks: 3 + 1 + 1 + 1 at step 0 (12 without), then each takes a block for its 13th token.
    assert result.used_blocks == [6, 10] and plain.used_blocks == [12, 16]
    assert result.held_tokens == plain.held_tokens == [48, 52]
    assert result.utilization == [48 / 24, 52 / 40]  # the two shared blocks serve four sequences
    assert result.tokens == plain.tokens
    check_metrics(result, cache, requests)


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_compute(model: TinyGPT) -> None:
    # "b" is SYSTEM's first 8 tokens: two full blocks, both cached, but its last token must be
    # computed, so only the first block is a hit.
    requests = [EngineRequest("a", SYSTEM, 3), EngineRequest("b", SYSTEM[:8], 3)]
    caches: list = []
    result = spied(caches, model, num_blocks=16, block_size=4, enable_prefix_caching=True).run(requests)
    assert caches[0].cached == {"a": [0], "b": [4]}
    assert result.prefill_tokens_computed == 9 + 4
    assert_alone(model, result, requests)
    check_metrics(result, caches[0], requests)


@pytest.mark.parametrize(
    ("other_new_tokens", "hits"),
    [
        (1, 4),  # c's prompt takes the never used block and a's last two: a's first block survives
        (5, 0),  # c also decodes into a's first block: nothing of a is left
    ],
)
def test_freed_blocks_stay_cached_until_reused_least_recently_freed_first(
    model: TinyGPT, other_new_tokens: int, hits: int
) -> None:
    # 4 blocks of 4 (and the null block). a (12 tokens, 3 blocks) finishes at step 0 and frees its
    # blocks last to first, so SYSTEM's first block is the last to be evicted. c (12 other tokens) runs next,
    # then b, which shares SYSTEM with a, arrives after c has finished.
    a = EngineRequest("a", [*SYSTEM, 1, 2, 3], 1)
    c = EngineRequest("c", list(range(50, 62)), other_new_tokens, arrival_step=1)
    b = EngineRequest("b", [*SYSTEM, 4, 5, 6], 1, arrival_step=other_new_tokens + 1)
    caches: list = []
    engine = spied(caches, model, num_blocks=5, block_size=4, enable_prefix_caching=True)
    result = engine.run([a, c, b])
    assert result.finished_step["c"] < result.admitted_step["b"]
    assert caches[0].cached == {"a": [0], "c": [0], "b": [hits]}
    assert_alone(model, result, [a, c, b])
    check_metrics(result, caches[0], [a, c, b])


def test_a_request_arriving_after_the_first_finished_reuses_its_freed_blocks(model: TinyGPT) -> None:
    first, second = (EngineRequest(i, SYSTEM + [i] * 5, 2, arrival_step=10 * i) for i in range(2))
    caches: list = []
    result = spied(caches, model, num_blocks=8, block_size=4, enable_prefix_caching=True).run([first, second])
    assert result.finished_step[0] < result.admitted_step[1] == 10
    assert caches[0].cached == {0: [0], 1: [8]}
    assert result.used_blocks[10] == 4  # the cached blocks came off the free list: 4 of 14 tokens
    assert_alone(model, result, [first, second])
    check_metrics(result, caches[0], [first, second])


@pytest.mark.lesson11
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_with_prefix_caching_keeps_the_text(
    model: TinyGPT, preemption: str, device: torch.device
) -> None:
    # Eight requests sharing SYSTEM, each ending at 12 + 10 - 1 = 21 tokens (6 blocks of 4): on 8
    # blocks, two admitted together outgrow the pool even with SYSTEM's two blocks shared.
    requests = system_requests(max_new_tokens=10) + [
        EngineRequest(i, [*SYSTEM, i, 1, i], 10, arrival_step=i % 3) for i in range(4, 8)
    ]
    model = model.to(device)
    try:
        caches: list = []
        engine = spied(
            caches,
            model,
            num_blocks=8,
            block_size=4,
            preemption=preemption,
            enable_prefix_caching=True,
        )
        result = engine.run(requests)
        assert_alone(model, result, requests)
    finally:
        model.to("cpu")
    assert result.preemptions_by_reason[preemption] >= 3
    # The four admitted beside request 0 at step 0 find SYSTEM's two blocks, cached when request 0's
    # prefill was scheduled (its K/V is written in the same forward, before any layer reads it).
    assert result.prefix_cache_hits >= 4 * 8
    check_metrics(result, caches[0], requests)
    if preemption == "swap":
        assert result.blocks_swapped_in == result.blocks_swapped_out > 0
        assert len(caches[0].cached) == len(requests) and all(len(c) == 1 for c in caches[0].cached.values())
    else:
        assert any(len(counts) > 1 for counts in caches[0].cached.values())  # admitted again


@st.composite
def shared_prefix_workloads(draw) -> list[EngineRequest]:
    """2 to 7 requests, each one of up to 3 shared prefixes (0 to 10 tokens) and its own 1 to 6 tokens,
    asking for up to 16 tokens: long enough to outgrow a tight budget."""
    prefixes = draw(st.lists(st.lists(st.integers(0, 255), max_size=10), min_size=1, max_size=3))
    n = draw(st.integers(2, 7))
    return [
        EngineRequest(
            i,
            draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 255), min_size=1, max_size=6)),
            draw(st.integers(1, 16)),
            arrival_step=draw(st.integers(0, 2)),
        )
        for i in range(n)
    ]


# As tests/test_engine.py's property test, of which this is the prefix-caching twin: a model run
# per example, 125 per preemption under ci and 25 in the dev profile; the prefix cache's own space
# is covered by the state machines of tests/test_prefix_cache.py and tests/test_stateful.py.
@pytest.mark.lesson11
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@settings(max_examples=max_examples(25))
@given(
    requests=shared_prefix_workloads(),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 2),
    watermark=st.sampled_from([0.0, 0.2]),
)
def test_any_shared_prefix_workload_gets_the_text_of_each_prompt_alone(
    model: TinyGPT, requests, block_size: int, extra_blocks: int, preemption: str, watermark: float
) -> None:
    num_blocks = min_num_blocks(requests, block_size) + extra_blocks
    caches: list = []
    engine = spied(
        caches,
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        preemption=preemption,
        watermark=watermark,
        enable_prefix_caching=True,
    )
    result = engine.run(requests)
    event(f"{preemption}: {'preempted' if result.preemptions else 'no preemption'}")
    event(f"hits: {'some' if result.prefix_cache_hits else 'none'}")
    target(float(result.preemptions), label="preemptions")  # steer towards tight, busy runs
    assert_alone(model, result, requests)
    check_metrics(result, caches[0], requests)
    assert result.prefix_cache_hits % block_size == 0
    for request in requests:
        # A hit leaves at least one token to compute: of the prompt at a first admission, of the
        # prompt and the generated tokens (at most max_new_tokens - 1) when a recomputed one resumes.
        first, *resumed = caches[0].cached[request.request_id]
        assert 0 <= first < len(request.prompt)
        assert all(0 <= c < len(request.prompt) + request.max_tokens - 1 for c in resumed)


# -------------------------------------------------------- blocks filled during decode, multi-turn


def expected_hits(prompt: list[int], computed: set[int], block_size: int) -> int:
    """The tokens a prompt finds: its longest run of leading full blocks whose chained hashes are
    ``computed``, at most ``len(prompt) - 1`` tokens."""
    hashes = chain_hashes(full_blocks(prompt, block_size))[: (len(prompt) - 1) // block_size]
    hits = next((i for i, h in enumerate(hashes) if h not in computed), len(hashes))
    return hits * block_size


def test_a_follow_up_turn_hits_the_blocks_its_answer_filled(model: TinyGPT, device: torch.device) -> None:
    prompt = [*SYSTEM, 1]  # 10 tokens: two full blocks of 4
    first = EngineRequest("turn1", prompt, 8)
    answer = alone(model, first)
    # The cache ends turn 1 holding 10 + 8 - 1 = 17 tokens (the last answer token is never fed):
    # four full blocks. The next turn is the prompt, the answer and a new message, 21 tokens.
    second = EngineRequest("turn2", [*prompt, *answer, 5, 6, 7], 4, arrival_step=10)
    model = model.to(device)
    try:
        results, caches = {}, {}
        for name, prompts_only in (("decode", False), ("prompts", True)):
            built: list = []
            engine = spied(
                built, model, prompts_only, num_blocks=16, block_size=4, enable_prefix_caching=True
            )
            results[name], caches[name] = engine.run([first, second]), built[0]
            assert_alone(model, results[name], [first, second])
    finally:
        model.to("cpu")
    assert results["decode"].finished_step["turn1"] < results["decode"].admitted_step["turn2"]
    assert caches["decode"].cached["turn2"] == [(10 + 8 - 1) // 4 * 4] == [16]
    assert caches["prompts"].cached["turn2"] == [10 // 4 * 4] == [8]
    assert results["decode"].prefill_tokens_computed == 10 + (21 - 16)
    assert results["prompts"].prefill_tokens_computed == 10 + (21 - 8)
    check_metrics(results["decode"], caches["decode"], [first, second])


@st.composite
def chats(draw) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """1 to 3 conversations under one system prompt: each turn's new message, and answer lengths."""
    system = draw(st.lists(st.integers(0, 255), max_size=6))
    num_turns = draw(st.integers(2, 3))
    messages = [
        [system + draw(st.lists(st.integers(0, 255), min_size=1, max_size=3))]
        + [draw(st.lists(st.integers(0, 255), min_size=1, max_size=4)) for _ in range(num_turns - 1)]
        for _ in range(draw(st.integers(1, 3)))
    ]
    answers = draw(st.lists(st.integers(1, 6), min_size=num_turns, max_size=num_turns))
    return messages, answers


@settings(max_examples=25)  # each example serves a few conversations through the model
@given(conversation=chats(), block_size=st.sampled_from([1, 2, 4]))
def test_multi_turn_chats_get_the_same_text_and_the_hits_the_chained_hashes_say(
    model: TinyGPT, conversation, block_size: int
) -> None:
    messages, answers = conversation
    gap = max(answers) + 1  # turn k arrives at step k * gap, once every turn before it has finished
    requests, prompts = [], [[] for _ in messages]
    for turn, length in enumerate(answers):
        for chat, said in enumerate(messages):
            prompts[chat] = prompts[chat] + said[turn]
            request = EngineRequest((chat, turn), prompts[chat], length, arrival_step=turn * gap)
            requests.append(request)
            prompts[chat] = prompts[chat] + alone(model, request)
    caches: list = []
    num_blocks = sum(blocks_for_tokens(len(r.prompt) + r.max_tokens, block_size) for r in requests)
    engine = spied(caches, model, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)
    result = engine.run(requests)
    assert_alone(model, result, requests)
    check_metrics(result, caches[0], requests)
    # No block was evicted (the pool holds every request at once), so a prompt finds exactly the
    # full blocks whose chained hashes were computed before it: the prompts admitted before it,
    # and the prompts and fed answer tokens (all but the last) of the turns that finished.
    computed: set[int] = set()
    for turn in range(len(answers)):
        this_turn = [r for r in requests if r.request_id[1] == turn]
        for request in this_turn:  # admitted together, in order
            assert result.admitted_step[request.request_id] == turn * gap
            assert caches[0].cached[request.request_id] == [
                expected_hits(request.prompt, computed, block_size)
            ]
            computed |= set(chain_hashes(full_blocks(request.prompt, block_size)))
        for request in this_turn:
            held = request.prompt + result.tokens[request.request_id][:-1]
            computed |= set(chain_hashes(full_blocks(held, block_size)))
    event(f"answer blocks hit: {result.prefix_cache_hits > 0}")


def test_prefix_caching_is_off_by_default(model: TinyGPT) -> None:
    requests = system_requests()
    caches: list = []
    engine = spied(caches, model, num_blocks=32, block_size=4)
    assert engine.enable_prefix_caching is False
    result = engine.run(requests)
    assert not caches[0].enable_prefix_caching
    assert result.prefill_tokens_computed == 48 and result.prefix_cache_queries == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
        (
            {"enable_prefix_caching": True, "mode": "contiguous", "max_model_len": 64},
            "enable_prefix_caching is a setting of the paged mode",
        ),
    ],
)
def test_bad_prefix_caching_arguments_raise_value_error_naming_them(model: TinyGPT, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(model, num_blocks=32, block_size=4, **kwargs)


def test_plot_metrics_shows_a_utilization_above_one(model: TinyGPT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = Engine(model, num_blocks=32, block_size=4, enable_prefix_caching=True).run(system_requests())
    assert max(result.utilization) == 2.0
    ax = plot_metrics(result)
    twin = next(other for other in ax.figure.axes if other is not ax)
    assert twin.get_ylim()[1] == pytest.approx(2.1)
    plt.close("all")


def test_prompts_that_share_no_full_block_hit_nothing(model: TinyGPT) -> None:
    rng = random.Random(4)
    requests = [EngineRequest(i, [rng.randrange(256) for _ in range(9)], 3) for i in range(5)]
    caches: list = []
    result = spied(caches, model, num_blocks=20, block_size=4, enable_prefix_caching=True).run(requests)
    assert result.prefix_cache_hits == 0 and result.prefill_tokens_computed == 45
    assert_alone(model, result, requests)
    check_metrics(result, caches[0], requests)

"""paged_kv.simulation.sharing: the shared-system-prompt workload, its ideal hits, serving it (lesson 08)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged_kv.core.kv_cache_manager import blocks_alone
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.simulation.sharing import (
    VOCAB_SIZE,
    ServeResult,
    SharedPromptRequest,
    ideal_cached_tokens,
    serve,
    system_prompt_requests,
)
from paged_kv.simulation.workload import SHAREGPT, sample_requests

pytestmark = pytest.mark.lesson08


# ------------------------------------------------------------------------------ the workload


def test_every_request_opens_with_its_system_prompt_and_has_sharegpt_lengths():
    requests = system_prompt_requests(40, 24, num_system_prompts=3, seed=5, scale=8)
    lengths = sample_requests(SHAREGPT, 40, 5)
    systems = {}
    for request, sampled in zip(requests, lengths, strict=True):
        assert isinstance(request, SharedPromptRequest)
        assert request.system_tokens == 24
        assert 0 <= request.system_prompt < 3
        system = systems.setdefault(request.system_prompt, request.token_ids[:24])
        assert request.token_ids[:24] == system
        assert len(request.token_ids) == 24 + max(1, sampled.prompt_tokens // 8)
        assert request.output_tokens == max(1, sampled.output_tokens // 8)
        assert all(0 <= token < VOCAB_SIZE for token in request.token_ids)
    assert sorted(systems) == [0, 1, 2]  # all three are used, and they differ
    assert len({tuple(system) for system in systems.values()}) == 3


def test_the_workload_is_seeded():
    first = system_prompt_requests(10, 16, num_system_prompts=2, seed=1)
    assert first == system_prompt_requests(10, 16, num_system_prompts=2, seed=1)
    assert first != system_prompt_requests(10, 16, num_system_prompts=2, seed=2)


def test_one_system_prompt_is_shared_by_all_and_user_prompts_differ():
    requests = system_prompt_requests(10, 20, seed=3, scale=8)
    assert {tuple(r.token_ids[:20]) for r in requests} == {tuple(requests[0].token_ids[:20])}
    assert {r.system_prompt for r in requests} == {0}
    assert len({tuple(r.token_ids[20:]) for r in requests}) == 10


def test_an_empty_system_prompt_leaves_the_user_prompt():
    requests = system_prompt_requests(5, 0, seed=0, scale=4)
    assert all(r.system_tokens == 0 and len(r.token_ids) >= 1 for r in requests)
    assert system_prompt_requests(0, 10) == []


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_requests": -1}, "num_requests"),
        ({"system_tokens": -2}, "system_tokens"),
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"scale": 0}, "scale"),
        ({"seed": -1}, "seed"),
        ({"num_requests": True}, "num_requests"),
        ({"system_tokens": 2.5}, "system_tokens"),
    ],
)
def test_bad_workload_arguments_are_value_errors_naming_them(kwargs, name):
    arguments = {"num_requests": 3, "system_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=name):
        system_prompt_requests(**arguments)


# ------------------------------------------------------------------------------ the ideal


def request(system_prompt: int, system_tokens: int = 10) -> SharedPromptRequest:
    return SharedPromptRequest([0] * (system_tokens + 1), 1, system_prompt, system_tokens)


def test_the_ideal_counts_every_request_but_the_first_of_each_system_prompt_in_full_blocks():
    requests = [request(0), request(1), request(0), request(0), request(1), request(2)]
    # 3 repeats (two of prompt 0, one of prompt 1) of a 10-token system prompt: 2 full blocks of 4.
    assert ideal_cached_tokens(requests, 4) == 3 * 8
    assert ideal_cached_tokens(requests, 5) == 3 * 10
    assert ideal_cached_tokens(requests, 16) == 0  # no full block
    assert ideal_cached_tokens([], 4) == 0
    with pytest.raises(ValueError, match="block_size"):
        ideal_cached_tokens(requests, 0)


# ------------------------------------------------------------------------------ serving


def test_serving_with_and_without_prefix_caching():
    requests = system_prompt_requests(10, system_tokens=20, seed=3, scale=8)
    prompt_tokens = sum(len(r.token_ids) for r in requests)
    without = serve(requests, num_blocks=200, block_size=4, max_running=3, caching=False)
    assert without == ServeResult(prompt_tokens, 0, PrefixCacheStats(), without.steps, 0)
    assert without.computed_tokens == prompt_tokens and without.hit_rate == 0.0
    cached = serve(requests, num_blocks=200, block_size=4, max_running=3)
    # Every request but the first finds the system prompt's 5 full blocks, and nothing else.
    assert cached.cached_tokens == ideal_cached_tokens(requests, 4) == 9 * 20
    assert cached.computed_tokens == prompt_tokens - 180
    assert cached.hit_rate == pytest.approx(180 / prompt_tokens)
    assert cached.stats == PrefixCacheStats(requests=10, queries=prompt_tokens, hits=180)


def test_one_system_prompt_stays_cached_however_tight_the_pool():
    requests = system_prompt_requests(10, system_tokens=20, seed=3, scale=8)
    tightest = max(max(blocks_alone(len(r.token_ids), r.output_tokens, 4)) for r in requests)
    # A live request holds the system prompt, or the one that held it freed it to the far end of the
    # free list, the last place eviction looks. Every admission after the first finds it; a tight
    # pool preempts, and a request admitted again finds it (and maybe more of its own prompt) again.
    for num_blocks, max_running in ((tightest, 3), (40, 3), (200, 1)):
        served = serve(requests, num_blocks, block_size=4, max_running=max_running)
        assert served.cached_tokens >= (9 + served.preemptions) * 20
        assert (served.cached_tokens == 9 * 20) == (served.preemptions == 0)


def test_several_system_prompts_need_memory_to_stay_cached():
    requests = system_prompt_requests(60, system_tokens=32, num_system_prompts=8, seed=0, scale=8)
    ideal = ideal_cached_tokens(requests, 4)
    small, large = (serve(requests, n, block_size=4, max_running=8) for n in (60, 4000))
    assert large.cached_tokens == ideal and large.preemptions == 0
    # A small pool evicts system prompts and preempts: its prefills compute more, hits and all.
    assert small.preemptions > 0 and small.computed_tokens > large.computed_tokens


def test_serving_nothing_finds_nothing():
    assert serve([], 1, 1, 1) == ServeResult(0, 0, PrefixCacheStats())
    assert serve([], 1, 1, 1).hit_rate == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"max_running": 0}, "max_running"),
        ({"num_blocks": 5}, "num_blocks=5 cannot hold request"),
    ],
)
def test_bad_serving_arguments_are_value_errors_naming_them(kwargs, match):
    requests = system_prompt_requests(4, system_tokens=16, seed=0, scale=8)
    arguments = {"num_blocks": 100, "block_size": 4, "max_running": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        serve(requests, **arguments)


def cached_with_unbounded_memory(requests: list[SharedPromptRequest], block_size: int) -> int:
    """The reference: the prompt tokens a prefix cache that forgets nothing serves.

    Each request finds its longest run of leading full blocks whose whole prefix an earlier prompt
    held (at most ``len - 1`` tokens), then every full block of its own prompt is remembered. Unlike
    :func:`ideal_cached_tokens` this counts user prompts that happen to start alike, too.
    """
    seen: set[tuple[int, ...]] = set()
    cached = 0
    for r in requests:
        ends = range(block_size, len(r.token_ids) + 1, block_size)
        limit = (len(r.token_ids) - 1) // block_size
        for end in ends[:limit]:
            if tuple(r.token_ids[:end]) not in seen:
                break
            cached += block_size
        seen.update(tuple(r.token_ids[:end]) for end in ends)
    return cached


@given(
    num_requests=st.integers(0, 12),
    system_tokens=st.integers(0, 24),
    num_system_prompts=st.integers(1, 4),
    block_size=st.integers(1, 8),
    max_running=st.integers(1, 5),
    extra_blocks=st.integers(0, 40),
    seed=st.integers(0, 1000),
)
def test_the_cache_finds_what_unbounded_memory_finds_when_it_never_evicts_and_at_most_that_otherwise(
    num_requests, system_tokens, num_system_prompts, block_size, max_running, extra_blocks, seed
):
    requests = system_prompt_requests(
        num_requests, system_tokens, num_system_prompts=num_system_prompts, seed=seed, scale=16
    )
    sizes = [max(blocks_alone(len(r.token_ids), r.output_tokens, block_size)) for r in requests]
    ideal = ideal_cached_tokens(requests, block_size)
    reference = cached_with_unbounded_memory(requests, block_size)
    prompt_tokens = sum(len(r.token_ids) for r in requests)
    assert ideal <= reference
    served = serve(requests, max(sizes, default=1) + extra_blocks, block_size, max_running)
    assert served.cached_tokens % block_size == 0
    # Every admission is looked up, a request preempted by recompute once more each time, apart.
    stats = served.stats
    assert (stats.requests, stats.preempted_requests) == (num_requests, served.preemptions)
    assert stats.queries + stats.preempted_queries == served.prompt_tokens
    assert stats.hits + stats.preempted_hits == served.cached_tokens
    if served.preemptions == 0:
        assert served.prompt_tokens == prompt_tokens
        assert 0 <= served.cached_tokens <= reference
    if num_system_prompts == 1:
        assert served.cached_tokens >= ideal  # the one system prompt is never evicted
    # A pool that holds every block the run ever takes never evicts.
    roomy = serve(requests, sum(sizes) + 1, block_size, max_running)
    assert roomy.preemptions == 0 and roomy.cached_tokens == reference
    assert serve(requests, sum(sizes) + 1, block_size, max_running, caching=False).cached_tokens == 0

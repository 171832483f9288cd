"""Hybrid models (lesson 13): sliding-window layers beside full-attention ones, from the tiny GPT to
Hugging Face's Mistral, Qwen2, Gemma 2 and Gemma 3, give exactly the tokens of the model alone on
every cache and in the engine, whose KV-cache groups free what the windows leave behind.

Every Hugging Face model is a tiny random-weight one built from a config here (no download), with a
window of 8 tokens and prompts longer than it. The reference is ``model.generate(do_sample=False)``
with Hugging Face's own cache, one prompt at a time.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_coordinator import peak_blocks
from paged_kv.core.kv_cache_groups import SlidingWindowSpec
from paged_kv.core.single_type_kv_cache_manager import NULL_BLOCK
from paged_kv.model.causal_lm import as_causal_lm
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.hf import SUPPORTED_LAYER_TYPES
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.scheduler import run_steps
from tests.helpers import max_examples

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.lesson13

VOCAB, WINDOW = 256, 8
HYBRIDS = {
    # name: (config class, model class, the config's own settings of its layers)
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": WINDOW, "num_hidden_layers": 6},
    ),
}


@functools.cache
def hybrid(name: str):
    """A seeded tiny random-weight model of ``name`` that generates a fixed number of tokens."""
    config_name, model_name, extra = HYBRIDS[name]
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**(sizes | extra))
    model = getattr(transformers, model_name)(config).eval()
    model.generation_config.eos_token_id = None
    return model


@functools.cache
def hf_tokens(name: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    model = hybrid(name)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, seed: int, shortest: int = 1, longest: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(shortest, longest))] for _ in range(n)]


BATCH = prompts(3, seed=1, shortest=10)  # longer than the window


def test_each_model_reads_its_layers_windows_scale_and_soft_cap():
    layers = {name: as_causal_lm(hybrid(name)).config for name in HYBRIDS}
    assert layers["mistral"].sliding_windows == (WINDOW,) * 4
    assert layers["qwen2"].sliding_windows == (None, None, WINDOW, WINDOW)
    assert layers["gemma2"].sliding_windows == (WINDOW, None, WINDOW, None)
    assert layers["gemma3"].sliding_windows == (WINDOW,) * 5 + (None,)
    assert layers["gemma2"].attn_softcap == 50.0 and layers["gemma3"].attn_softcap is None
    assert layers["gemma2"].attention_scale == 256**-0.5  # query_pre_attn_scalar, not head_dim
    assert layers["mistral"].attention_scale is None


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_generate_gives_hf_tokens_past_the_window(name, cache):
    out = generate(hybrid(name), BATCH, max_new_tokens=12, cache=cache, block_size=4)
    assert out.tokens == [hf_tokens(name, tuple(p), 12) for p in BATCH]


# Engine settings; a pool of None is the tightest that serves every request alone, plus two blocks.
# It preempts the models with full-attention groups of half their layers; a sliding group's blocks
# stay within its window, so Mistral's and Gemma 3's requests barely grow (see the next test).
ENGINE_CASES = {
    "ample pool": {"num_blocks": 200},
    "tight pool, recompute": {"num_blocks": None},
    "tight pool, swap": {"num_blocks": None, "preemption": "swap"},
    "token budget": {"num_blocks": None, "max_num_batched_tokens": 6},
    "prefix caching": {"num_blocks": 200, "enable_prefix_caching": True},
    "contiguous mode": {"num_blocks": 64, "mode": "contiguous", "max_model_len": 48},
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_the_engine_gives_hf_tokens_in_every_setting(name, case):
    settings_ = dict(ENGINE_CASES[case])
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(12)]  # shared, for the prefix cache
    batch = [system + p for p in prompts(3, seed=4, longest=6)] + prompts(2, seed=5, shortest=9)
    requests = [EngineRequest(i, p, 12) for i, p in enumerate(batch)]
    if settings_["num_blocks"] is None:
        groups = Engine(hybrid(name), num_blocks=200, block_size=4).kv_cache_groups
        longest = max(len(p) + 11 for p in batch)
        settings_["num_blocks"] = (
            1 + peak_blocks(groups, longest, settings_.get("max_num_batched_tokens")) + 2
        )
    result = Engine(hybrid(name), block_size=4, **settings_).run(requests)
    assert [result.tokens[i] for i in range(len(batch))] == [hf_tokens(name, tuple(p), 12) for p in batch]
    if case == "prefix caching":
        assert result.prefix_cache_hits >= 2 * 12
    if case.startswith("tight") and name in ("gemma2", "qwen2"):
        way = settings_.get("preemption", "recompute")
        assert result.preemptions_by_reason[way], result.preemptions_by_reason


def test_sliding_layers_preempt_only_under_a_budget_on_a_tight_pool():
    # Mistral slides in every layer: once prefilled, a request frees a block for each it takes. Under
    # a budget of 6 tokens, a pool of 7 blocks preempts the newest while chunks hold their window.
    batch = prompts(5, seed=5, shortest=9)
    requests = [EngineRequest(i, p, 12) for i, p in enumerate(batch)]
    result = Engine(hybrid("mistral"), num_blocks=7, block_size=4, max_num_batched_tokens=6).run(requests)
    assert result.preemptions
    assert [result.tokens[i] for i in range(5)] == [hf_tokens("mistral", tuple(p), 12) for p in batch]


def test_a_sliding_group_holds_the_window_while_a_full_one_holds_everything():
    # Gemma 2's groups: layers (0, 2) slide over 8 tokens, (1, 3) attend fully. One request of a
    # 10-token prompt decoding 60 tokens: blocks of 4.
    engine = Engine(hybrid("gemma2"), num_blocks=64, block_size=4)
    core = engine.new_llm_engine().engine_core
    scheduler, runner = core.scheduler, core.model_runner
    memory = scheduler.memory
    coordinator = memory.coordinator
    sliding = [m for m in coordinator.single_type_managers if isinstance(m.spec, SlidingWindowSpec)]
    request = EngineRequest("r", prompts(1, seed=6, shortest=10, longest=10)[0], 60)
    held = []
    arrivals = [(0, scheduler_request(request))]
    for _ in run_steps(scheduler, runner, arrivals):
        if "r" in memory:
            sliding_ids, full_ids = (
                memory.get_block_ids("r")[m.group_id] for m in coordinator.single_type_managers
            )
            held.append(sum(b != NULL_BLOCK for b in sliding_ids))
            tokens = memory.num_tokens("r")
            assert len(full_ids) == blocks_for_tokens(tokens, 4) and NULL_BLOCK not in full_ids
    assert len(sliding) == 1 and max(held[1:]) <= blocks_for_tokens(WINDOW - 1 + 1, 4) + 1
    assert coordinator.num_free_blocks == 63  # all back, but the null block


def scheduler_request(request: EngineRequest):
    from paged_kv.serving.request import EngineCoreRequest

    return EngineCoreRequest(
        request.request_id, len(request.prompt), request.max_tokens, tuple(request.prompt)
    )


# ------------------------------------------------------------------ the tiny GPT with windows


TINY_HYBRID = GPTConfig(
    num_layers=3, num_heads=4, head_dim=8, num_kv_heads=2, max_len=96, sliding_windows=(5, None, 3)
)


@functools.cache
def tiny_hybrid() -> TinyGPT:
    return TinyGPT(TINY_HYBRID, seed=11)


def alone(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    return generate(tiny_hybrid(), [list(prompt)], max_new_tokens, cache="contiguous").tokens[0]


@settings(max_examples=max_examples(12), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 16), st.integers(0, 4)), min_size=1, max_size=6),
    st.integers(0, 10_000),
    st.sampled_from([None, 4, 9]),
    st.booleans(),
    st.sampled_from(["recompute", "swap"]),
    st.integers(0, 12),
)
def test_the_tiny_gpt_with_windows_gives_each_prompts_tokens_alone(
    shapes, seed, budget, caching, preemption, extra_blocks
):
    """Any workload on any pool, budget, caching and preemption: the hybrid engine gives every request
    the tokens its prompt gets alone on the contiguous cache."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 256])  # a small vocabulary makes prefix hits
    requests = [
        EngineRequest(i, [rng.randrange(vocab) for _ in range(n)], m, arrival)
        for i, (n, m, arrival) in enumerate(shapes)
    ]
    engine = Engine(tiny_hybrid(), num_blocks=64, block_size=2)
    need = max(
        1 + sum(blocks_for_tokens(len(r.prompt) + r.max_tokens - 1, 2) for _ in engine.kv_cache_groups)
        for r in requests
    )
    engine = Engine(
        tiny_hybrid(),
        num_blocks=need + extra_blocks,
        block_size=2,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        preemption=preemption,
    )
    result = engine.run(requests)
    for r in requests:
        assert result.tokens[r.request_id] == alone(tuple(r.prompt), r.max_tokens)


def test_the_tiny_gpt_with_windows_gives_the_same_tokens_on_every_cache():
    batch = prompts(4, seed=7, longest=20)
    contiguous = generate(tiny_hybrid(), batch, 10, cache="contiguous")
    paged = generate(tiny_hybrid(), batch, 10, cache="paged", block_size=4)
    assert paged.tokens == contiguous.tokens
    torch.testing.assert_close(paged.logits, contiguous.logits, rtol=1e-4, atol=1e-4)
    windows = TinyGPT(GPTConfig(num_layers=3, num_heads=4, head_dim=8, num_kv_heads=2, max_len=96), seed=11)
    assert generate(windows, batch, 10, cache="contiguous").tokens != contiguous.tokens  # windows matter


# ---------------------------------------------------------------------------------- bad input


def test_an_unsupported_layer_type_is_refused_with_the_supported_ones_listed():
    model = hybrid("qwen2")
    saved = list(model.config.layer_types)
    model.config.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    try:
        with pytest.raises(ValueError, match="chunked_attention") as error:
            as_causal_lm(model)
        assert all(kind in str(error.value) for kind in SUPPORTED_LAYER_TYPES)
    finally:
        model.config.layer_types = saved


@pytest.mark.parametrize(
    ("layer_types", "match"),
    [
        (["full_attention"] * 3, "3 layer_types for its 4 layers"),
        (["sliding_attention"] * 4, "does not match its config"),  # layers 0 and 1 attend fully
    ],
)
def test_a_model_whose_layer_types_do_not_match_its_config_is_refused(layer_types, match):
    model = hybrid("qwen2")
    saved = list(model.config.layer_types)
    model.config.layer_types = layer_types
    try:
        with pytest.raises(ValueError, match=match):
            as_causal_lm(model)
    finally:
        model.config.layer_types = saved


def test_bad_windows_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="sliding_windows must give one window per layer"):
        GPTConfig(num_layers=2, sliding_windows=(4,))
    with pytest.raises(ValueError, match=r"sliding_windows\[1\]"):
        GPTConfig(num_layers=2, sliding_windows=(4, 0))
    with pytest.raises(ValueError, match="attn_softcap"):
        GPTConfig(attn_softcap=-1.0)


def test_a_cache_built_for_other_windows_is_refused():
    from paged_kv.model.kv_cache import PagedKVCache

    full = GPTConfig(num_layers=3, num_heads=4, head_dim=8, num_kv_heads=2, max_len=96)
    cache = PagedKVCache(full, num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="attend as"):
        generate(tiny_hybrid(), [[1, 2, 3]], 2, cache=cache)


def test_a_hybrid_request_too_long_for_the_pool_alone_is_refused():
    engine = Engine(tiny_hybrid(), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="null block"):
        engine.run([EngineRequest("long", list(range(30)), 10)])


def test_a_runner_refuses_block_ids_for_another_group_layout_and_changes_nothing():
    from paged_kv.kv.storage import KVStorage
    from paged_kv.serving.model_runner import ModelRunner
    from paged_kv.serving.outputs import NewRequestData, SchedulerOutput

    engine = Engine(tiny_hybrid(), num_blocks=32, block_size=4)
    groups = engine.kv_cache_groups  # (0, 2) slide with different windows: three groups of one layer
    config = TINY_HYBRID
    storage = KVStorage(3, 32, 4, config.num_kv_heads, config.head_dim, layer_tensors=[0, 0, 0])
    runner = ModelRunner(tiny_hybrid(), storage, max_num_reqs=2, max_blocks_per_req=8, kv_cache_groups=groups)
    good = NewRequestData("a", (1, 2, 3), ((1,), (2,), (3,)), 0)
    runner.execute_model(SchedulerOutput(0, {"a": 3}, 3, (good,)))
    before = (dict(runner.block_tables.rows), runner.block_tables.block_ids("a"))
    for block_ids, match in [(((4,),), "3 groups"), (((4,), (5, 6), (7,)), "each as long")]:
        bad = NewRequestData("b", (1, 2), block_ids, 0)
        with pytest.raises(ValueError, match=match):
            runner.execute_model(SchedulerOutput(1, {"b": 2}, 2, (bad,)))
        assert (dict(runner.block_tables.rows), runner.block_tables.block_ids("a")) == before

"""Hugging Face Llama, Qwen2 and Mistral models served from the paged cache give exactly HF's own tokens.

Every model is a tiny random-weight one built from a config here (no download). The reference is
``model.generate(do_sample=False)`` with Hugging Face's own cache, one prompt at a time.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_kv.model.causal_lm import CausalLM, as_causal_lm  # noqa: E402
from paged_kv.model.generation import generate  # noqa: E402
from paged_kv.model.hf import SUPPORTED_ARCHITECTURES, HFCausalLM  # noqa: E402
from paged_kv.model.kv_cache import PagedKVCache  # noqa: E402
from paged_kv.serving.engine import Engine, EngineRequest  # noqa: E402

pytestmark = pytest.mark.lesson09

VOCAB = 256
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # q/k/v biases
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
}


def tiny_config(arch: str, num_kv_heads: int = 2, **overrides):
    config_class, _, extra = ARCHITECTURES[arch]
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return config_class(**(sizes | extra | overrides))


@functools.cache
def tiny_model(arch: str, num_kv_heads: int = 2, device: str = "cpu", **overrides):
    """A seeded random-weight model that generates a fixed number of tokens (no EOS)."""
    torch.manual_seed(0)
    model = ARCHITECTURES[arch][1](tiny_config(arch, num_kv_heads, **overrides)).eval()
    model.generation_config.eos_token_id = None
    if arch == "qwen2":  # random biases, so that the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.to(device)


@functools.cache
def hf_tokens(model, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """What Hugging Face generates for the prompt alone, greedily, with its own cache."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, seed: int, longest: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_generate_gives_hf_tokens_for_a_ragged_batch(arch, num_kv_heads, device):
    model = tiny_model(arch, num_kv_heads, str(device))
    batch = prompts(4, seed=1)
    out = generate(model, batch, max_new_tokens=10, block_size=4)
    assert out.tokens == [hf_tokens(model, tuple(p), 10) for p in batch]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_generate_on_a_fragmented_pool_gives_hf_tokens(arch, device):
    model = tiny_model(arch, device=str(device))
    cache = PagedKVCache(as_causal_lm(model).config, num_blocks=40, block_size=4, device=device)
    for i in range(12):  # take the pool in small pieces, then give back every other one
        cache.add_sequence(f"filler-{i}", 3)
    for i in range(0, 12, 2):
        cache.free(f"filler-{i}")
    batch = prompts(3, seed=2, longest=12)
    out = generate(model, batch, max_new_tokens=8, cache=cache)
    assert out.tokens == [hf_tokens(model, tuple(p), 8) for p in batch]


def requests_sharing_a_prefix(seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(12)]
    return [
        EngineRequest(f"r{i}", system + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))], 6, i % 3)
        for i in range(6)
    ]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_engine_with_prefix_caching_gives_hf_tokens(arch, device):
    model = tiny_model(arch, device=str(device))
    requests = requests_sharing_a_prefix(seed=3)
    engine = Engine(model, num_blocks=40, block_size=4, enable_prefix_caching=True)
    result = engine.run(requests)
    assert result.prefix_cache_hits > 0
    for r in requests:
        assert result.tokens[r.request_id] == hf_tokens(model, tuple(r.prompt), r.max_tokens)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_follow_up_turn_reuses_the_blocks_the_hf_models_answer_filled(arch, device):
    model = tiny_model(arch, device=str(device))
    prompt = prompts(1, seed=4, longest=10)[0] + [7] * 10  # 11 to 20 tokens
    answer = hf_tokens(model, tuple(prompt), 8)
    turns = [EngineRequest("turn1", prompt, 8), EngineRequest("turn2", [*prompt, *answer, 1, 2], 3, 20)]
    result = Engine(model, num_blocks=40, block_size=4, enable_prefix_caching=True).run(turns)
    # Turn 1 leaves its prompt and 7 of its 8 answer tokens in the cache, cached whole block by block.
    assert result.prefix_cache_hits == (len(prompt) + 8 - 1) // 4 * 4
    for r in turns:
        assert result.tokens[r.request_id] == hf_tokens(model, tuple(r.prompt), r.max_tokens)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_engine_under_preemption_gives_hf_tokens(arch, preemption, device):
    model = tiny_model(arch, device=str(device))
    rng = random.Random(4)
    requests = [
        EngineRequest(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(4, 12))], 12)
        for i in range(5)
    ]
    result = Engine(model, num_blocks=12, block_size=4, preemption=preemption).run(requests)
    assert result.preemptions_by_reason[preemption] > 0
    for r in requests:
        assert result.tokens[r.request_id] == hf_tokens(model, tuple(r.prompt), r.max_tokens)


@pytest.mark.parametrize("budget", [1, 4, 7], ids=["budget-1", "block-size", "odd"])
def test_the_engine_under_a_token_budget_gives_hf_tokens(budget, device):
    """Chunked prefill (prompt chunks at an offset over the paged cache), with prefix caching, on a
    Hugging Face Llama: every step at most the budget, and Hugging Face's own tokens."""
    model = tiny_model("llama", device=str(device))
    requests = requests_sharing_a_prefix(seed=5)
    engine = Engine(
        model, num_blocks=40, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=budget
    )
    result = engine.run(requests)
    assert max(result.tokens_per_step) <= budget and result.prefix_cache_hits > 0
    for r in requests:
        assert result.tokens[r.request_id] == hf_tokens(model, tuple(r.prompt), r.max_tokens)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_the_engine_under_a_token_budget_and_preemption_gives_hf_tokens(preemption, device):
    """A recomputed request resumes by prefilling its prompt and generated tokens in chunks."""
    model = tiny_model("llama", device=str(device))
    rng = random.Random(4)
    requests = [
        EngineRequest(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(4, 12))], 12)
        for i in range(5)
    ]
    engine = Engine(model, num_blocks=12, block_size=4, preemption=preemption, max_num_batched_tokens=5)
    result = engine.run(requests)
    assert result.preemptions_by_reason[preemption] > 0 and max(result.tokens_per_step) <= 5
    for r in requests:
        assert result.tokens[r.request_id] == hf_tokens(model, tuple(r.prompt), r.max_tokens)


def test_the_wrapped_model_is_left_as_it_was():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    prompt = prompts(1, seed=5)[0]
    generate(model, [prompt], 4)
    assert model.config._attn_implementation == before
    assert hf_tokens(model, tuple(prompt), 4) == generate(model, [prompt], 4).tokens[0]
    model(torch.tensor([prompt]))  # HF's own forward still runs with its own attention


def test_the_sizes_come_from_the_hf_config():
    lm = HFCausalLM(tiny_model("qwen2", 1))
    assert isinstance(lm, CausalLM)
    config = lm.config
    assert (config.vocab_size, config.num_layers, config.num_heads, config.num_kv_heads) == (VOCAB, 2, 4, 1)
    assert (config.head_dim, config.max_len) == (16, 128)
    assert lm.dtype == torch.float32
    tensors = {id(t): t for t in (*lm.model.parameters(), *lm.model.buffers())}  # a tied weight once
    assert lm.weight_bytes == sum(t.numel() * 4 for t in tensors.values()) > 0


def test_a_sliding_window_no_longer_bounds_the_sequences():
    # Mistral slides in every layer: a sequence past its window attends to the window only, as HF's.
    model = tiny_model("mistral", sliding_window=16)
    assert as_causal_lm(model).config.max_len == model.config.max_position_embeddings
    prompt = prompts(1, seed=6, longest=8)[0]
    assert generate(model, [prompt], 24).tokens[0] == hf_tokens(model, tuple(prompt), 24)


# ------------------------------------------------------------------------------------- bad input


def test_an_unsupported_architecture_is_refused_with_the_supported_ones_listed():
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)
    )
    for call in (lambda: generate(gpt2, [[1, 2]], 2), lambda: Engine(gpt2, num_blocks=4)):
        with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
            call()
        assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="TinyGPT"):
        as_causal_lm("a model")


def test_a_subclass_of_a_supported_architecture_is_supported():
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    model = MyLlama(tiny_config("llama")).eval()
    model.generation_config.eos_token_id = None
    assert generate(model, [[1, 2, 3]], 4).tokens[0] == hf_tokens(model, (1, 2, 3), 4)


def test_a_prompt_past_the_model_positions_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_len 128"):
        generate(model, [[1] * 120], 9)
    with pytest.raises(ValueError, match="maximum model length of 128"):
        Engine(model, num_blocks=64, block_size=4).run([EngineRequest("r", [1] * 128, 1)])
    # A prompt and output past it stop there, as vLLM caps max_tokens: 8 tokens, not 9.
    assert (
        len(Engine(model, num_blocks=64, block_size=4).run([EngineRequest("r", [1] * 120, 9)]).tokens["r"])
        == 8
    )


def test_token_ids_outside_the_vocabulary_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"prompts\[1\].*\[0, 256\)"):
        generate(model, [[1], [256]], 2)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        Engine(model, num_blocks=8, block_size=4).run([EngineRequest("r", [-1], 2)])


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "num_layers"),
    [(4, 16, 2), (2, 8, 2), (2, 16, 3)],
    ids=["heads", "size", "layers"],
)
def test_a_cache_built_for_another_model_is_refused_before_anything_runs(num_kv_heads, head_dim, num_layers):
    model = tiny_model("llama")  # 2 layers of 2 K/V heads of size 16
    from paged_kv.model.config import GPTConfig

    other = GPTConfig(num_layers=num_layers, num_heads=4, head_dim=head_dim, num_kv_heads=num_kv_heads)
    cache = PagedKVCache(other, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="another model"):
        generate(model, [[1, 2, 3]], 2, cache=cache)
    assert cache.num_free_blocks == 8


# ------------------------------------------------------------------------- sizing from a budget


def test_the_engine_sizes_its_cache_from_a_budget_in_bytes():
    model = tiny_model("llama")
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 K/V heads of 16, 4 tokens, float32
    engine = Engine(model, kv_cache_memory_bytes=10 * per_block + per_block - 1, block_size=4)
    assert (engine.bytes_per_block, engine.num_blocks) == (per_block, 10)
    with pytest.raises(ValueError, match="holds no block"):
        Engine(model, kv_cache_memory_bytes=per_block - 1, block_size=4)


def test_the_engine_sizes_its_cache_from_a_share_of_the_device_as_vllm_starts(monkeypatch, caplog):
    import paged_kv.serving.kv_cache_planning as engine_module
    from paged_kv.kv.startup import estimate_activation_peak, model_shape

    model = tiny_model("llama")
    causal = as_causal_lm(model)
    weights, shape = causal.weight_bytes, model_shape(causal.config, causal.dtype)
    memory = 3 * weights + 2 * estimate_activation_peak(shape, 2048)
    monkeypatch.setattr(engine_module, "device_memory", lambda device: memory)
    with caplog.at_level("INFO", logger="paged_kv.engine"):
        engine = Engine(model, gpu_memory_utilization=0.75, block_size=4, max_num_batched_tokens=32)
    # vLLM's arithmetic by hand: the share rounded up, less the weights and the dummy step's peak.
    peak = estimate_activation_peak(shape, 32)
    available = -(-memory * 3 // 4) - weights - peak
    assert engine.num_blocks == available // engine.bytes_per_block
    report = engine.kv_cache_report
    assert (report.num_gpu_blocks, report.activation_peak_bytes, report.weight_bytes) == (
        engine.num_blocks,
        peak,
        weights,
    )
    assert [r.getMessage() for r in caplog.records] == [line.replace("GPU", "CPU") for line in report.lines]
    assert caplog.records[1].getMessage().startswith("CPU KV cache size: ")
    # Without a token budget the dummy step is vLLM's when nothing is chunked: max(max_model_len, 2048).
    unchunked = Engine(model, gpu_memory_utilization=0.75, block_size=4).kv_cache_report
    assert unchunked.max_num_batched_tokens == max(engine.max_model_len, 2048)
    assert Engine(model, num_blocks=8).kv_cache_report is None
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        Engine(model, gpu_memory_utilization=0.2, block_size=4)  # less than the weights


def test_the_engine_refuses_a_device_share_too_small_for_one_request_as_vllm_does(monkeypatch):
    import paged_kv.serving.kv_cache_planning as engine_module
    from paged_kv.kv.startup import estimate_activation_peak, model_shape

    model = tiny_model("llama")
    causal = as_causal_lm(model)
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # K and V, 2 layers, 2 K/V heads of 16, 4 tokens, float32
    peak = estimate_activation_peak(model_shape(causal.config, causal.dtype), 8)
    memory = 2 * (causal.weight_bytes + peak + 10 * per_block)  # half of it leaves 10 blocks
    monkeypatch.setattr(engine_module, "device_memory", lambda device: memory)
    sizes = {"gpu_memory_utilization": 0.5, "block_size": 4, "max_num_batched_tokens": 8}
    assert Engine(model, max_model_len=36, **sizes).num_blocks == 10  # 9 blocks and the null block
    assert causal.config.max_len > 36
    with pytest.raises(ValueError, match=r"max seq len \(37\).*estimated maximum model length is 36"):
        Engine(model, max_model_len=37, **sizes)


@pytest.mark.parametrize(
    "sizes",
    [{}, {"num_blocks": 8, "kv_cache_memory_bytes": 10**6}, {"num_blocks": 8, "gpu_memory_utilization": 0.5}],
)
def test_the_engine_takes_its_size_exactly_one_way(sizes):
    with pytest.raises(ValueError, match="one way"):
        Engine(tiny_model("llama"), **sizes)


# ------------------------------------------------------------------------- real weights, or not


def test_offline_load_model_builds_smollm2s_architecture_with_byte_tokens(monkeypatch):
    import paged_kv.model.hub as hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout: False)
    state = torch.random.get_rng_state()
    loaded = hub.load_model()
    assert torch.equal(torch.random.get_rng_state(), state)  # the global generator is left alone
    assert not loaded.real and loaded.note.startswith("offline")
    config = loaded.model.config
    for name, value in hub.SMOLLM2_ARCHITECTURE.items():
        found = config.rope_parameters[name] if name == "rope_theta" else getattr(config, name)
        assert found == value, name
    assert config.vocab_size == 256 and loaded.decode(loaded.encode("KV ✓")) == "KV ✓"
    lm = as_causal_lm(loaded.model)
    assert (lm.config.num_layers, lm.config.num_heads, lm.config.num_kv_heads) == (30, 9, 3)
    again = hub.load_model()
    assert torch.equal(again.model.lm_head.weight, loaded.model.lm_head.weight)  # seeded


def test_online_load_model_takes_the_hubs_weights_and_tokenizer(monkeypatch):
    import paged_kv.model.hub as hub

    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [len(text)]}

        def decode(self, ids):
            return f"<{ids}>"

    asked = []
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout: True)
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda name, dtype: asked.append((name, dtype)) or tiny_model("qwen2"),
    )
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name: Tokenizer())
    loaded = hub.load_model("some/model")
    assert loaded.real and asked == [("some/model", torch.float32)]
    assert loaded.encode("abc") == [3] and loaded.decode([1, 2]) == "<[1, 2]>"
    assert loaded.model.generation_config.eos_token_id is None


def test_prefill_batch_gives_each_prompt_its_own_logits(device):
    model = tiny_model("qwen2", device=str(device))
    lm = as_causal_lm(model)
    batch = [torch.tensor(p, device=device) for p in prompts(3, seed=7)]
    cache = PagedKVCache(lm.config, num_blocks=64, block_size=4, device=device)
    for i, prompt in enumerate(batch):
        cache.add_sequence(i, len(prompt))
    with torch.no_grad():
        together = lm.prefill_batch(batch, [0, 1, 2], cache)
        each = torch.cat([model(p[None]).logits[:, -1] for p in batch])
    torch.testing.assert_close(together, each, rtol=1e-4, atol=1e-4)


def test_generation_ends_at_the_models_end_of_sequence_tokens_as_hf_does():
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"][1](tiny_config("llama")).eval()
    model.generation_config.eos_token_id = None
    batch = prompts(3, seed=8)
    free_running = generate(model, batch, 12).tokens
    eos = free_running[0][3]  # a token the first prompt generates fourth
    model.generation_config.eos_token_id = [eos, VOCAB - 1]
    hf_tokens.cache_clear()  # the same model object, now with an end-of-sequence token
    out = generate(model, batch, 12)
    assert out.tokens[0] == free_running[0][: free_running[0].index(eos) + 1]
    for prompt, tokens in zip(batch, out.tokens, strict=True):
        assert tokens == hf_tokens(model, tuple(prompt), 12)
    assert len(out.logits) == max(len(t) for t in out.tokens)  # stopped once every prompt ended
    hf_tokens.cache_clear()


def test_the_engine_ends_requests_at_end_of_sequence_tokens_unless_told_to_ignore_them():
    torch.manual_seed(0)
    model = ARCHITECTURES["qwen2"][1](tiny_config("qwen2")).eval()
    model.generation_config.eos_token_id = None
    requests = [EngineRequest(i, p, 10, arrival_step=i) for i, p in enumerate(prompts(4, seed=9))]
    free_running = Engine(model, num_blocks=40, block_size=4).run(requests).tokens
    eos = free_running[0][2]
    model.generation_config.eos_token_id = eos
    hf_tokens.cache_clear()
    result = Engine(model, num_blocks=40, block_size=4).run(requests)
    for r in requests:
        assert result.tokens[r.request_id] == hf_tokens(model, tuple(r.prompt), 10)
        expected = free_running[r.request_id]
        assert result.tokens[r.request_id] == expected[: expected.index(eos) + 1 if eos in expected else None]
    assert Engine(model, num_blocks=40, block_size=4, ignore_eos=True).run(requests).tokens == free_running
    with pytest.raises(ValueError, match="ignore_eos"):
        Engine(model, num_blocks=40, ignore_eos="yes")
    hf_tokens.cache_clear()

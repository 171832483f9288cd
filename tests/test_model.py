"""The tiny GPT end to end: the same tokens and logits with a contiguous or a paged KV cache (lesson 09)."""

from __future__ import annotations

import pytest
import torch

from paged_kv import OutOfBlocksError, blocks_for_tokens
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import generate
from paged_kv.model.kv_cache import ContiguousKVCache, PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode

pytestmark = pytest.mark.lesson09

# The two caches compute the same float32 attention in a different order: logits agree to this.
TOLERANCES = {"rtol": 1e-4, "atol": 1e-4}
PROMPT_LENGTHS = (5, 17, 33)
BLOCK_SIZE = 4  # small, so every prompt and every few decode steps cross a block boundary
NEW_TOKENS = 10


def prompts(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def make_cache(kind: str, model: TinyGPT, device: torch.device, **paged):
    if kind == "contiguous":
        return ContiguousKVCache(model.config, device)
    return PagedKVCache(model.config, device=device, **{"num_blocks": 64, "block_size": BLOCK_SIZE, **paged})


def test_the_same_seed_gives_the_same_weights_on_any_device(device):
    a, b, other = TinyGPT(seed=3), TinyGPT(seed=3), TinyGPT(seed=4)
    on_device = TinyGPT(seed=3).to(device)
    for (name, pa), pb, po, pd in zip(
        a.named_parameters(), b.parameters(), other.parameters(), on_device.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, pd.cpu()), name
        if "norm" not in name and not name.endswith("bias"):
            assert not torch.equal(pa, po), name


def test_building_a_model_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    TinyGPT(seed=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_encode_and_decode_are_byte_level():
    assert encode("héllo") == [104, 195, 169, 108, 108, 111]
    assert decode(encode("héllo")) == "héllo"


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_prefill_then_decode_matches_the_full_forward(device, kind):
    model = TinyGPT(seed=0).to(device)
    tokens = torch.tensor(prompts((14,))[0], device=device)
    cache, prompt_len = make_cache(kind, model, device), 6
    with torch.no_grad():
        full = model(tokens[None])[0]  # (14, vocab), no cache
        cache.add_sequence("s", prompt_len)
        got = [model.prefill(tokens[:prompt_len], "s", cache)]
        for position in range(prompt_len, len(tokens)):  # teacher forcing, one token at a time
            got.append(model.decode_step(tokens[position : position + 1], ["s"], cache))
    torch.testing.assert_close(torch.cat(got), full, **TOLERANCES)


def test_greedy_generation_is_identical_with_either_cache(device):
    model = TinyGPT(seed=0).to(device)
    batch = prompts()
    contiguous = generate(model, batch, NEW_TOKENS, cache="contiguous")
    paged = generate(model, batch, NEW_TOKENS, cache="paged", block_size=BLOCK_SIZE)
    assert paged.tokens == contiguous.tokens
    assert [len(t) for t in paged.tokens] == [NEW_TOKENS] * len(batch)
    assert paged.logits.shape == (NEW_TOKENS, len(batch), model.config.vocab_size)
    torch.testing.assert_close(paged.logits, contiguous.logits, **TOLERANCES)
    # And both agree with running each finished sequence through the model with no cache.
    with torch.no_grad():
        for i, (prompt, new) in enumerate(zip(batch, paged.tokens, strict=True)):
            full = model(torch.tensor([prompt + new[:-1]], device=device))[0, len(prompt) - 1 :]
            torch.testing.assert_close(paged.logits[:, i], full, **TOLERANCES)


def test_the_paged_cache_takes_blocks_on_demand_and_frees_them():
    model, batch = TinyGPT(seed=0), prompts()
    cache = make_cache("paged", model, torch.device("cpu"), record=True)
    generate(model, batch, NEW_TOKENS, cache=cache)
    trace = cache.trace  # one manager for every layer: one trace
    for i, prompt in enumerate(batch):
        seq_id, held = f"prompt-{i}", len(prompt) + NEW_TOKENS - 1  # the last token is never fed back
        frames = [f for f in trace if f.seq_id == seq_id]
        allocate, *decode_frames, free = frames
        assert len(allocate.highlight) == blocks_for_tokens(len(prompt), BLOCK_SIZE)
        # One token per decode step, and a new block exactly when the token opens a block.
        lengths = [f.snapshot.tables[seq_id].num_tokens for f in decode_frames]
        assert lengths == list(range(len(prompt) + 1, held + 1))
        for frame, length in zip(decode_frames, lengths, strict=True):
            assert (frame.event == "new_block") is (length % BLOCK_SIZE == 1), (seq_id, length)
        assert free.event == "free" and len(free.highlight) == blocks_for_tokens(held, BLOCK_SIZE)
    assert cache.manager.seq_ids == () and cache.num_free_blocks == cache.num_blocks


def test_scattered_blocks_give_the_same_tokens(device):
    model, batch = TinyGPT(seed=0).to(device), prompts()
    cache = make_cache("paged", model, device, record=True)
    for n in range(8):  # fragment the pool: the free list ends up out of order
        cache.add_sequence(f"other-{n}", 1 + 3 * n)
    for n in range(0, 8, 2):
        cache.free(f"other-{n}")
    paged = generate(model, batch, NEW_TOKENS, cache=cache)
    contiguous = generate(model, batch, NEW_TOKENS, cache="contiguous")
    assert paged.tokens == contiguous.tokens
    torch.testing.assert_close(paged.logits, contiguous.logits, **TOLERANCES)
    tables = [f.highlight for f in cache.trace if f.event == "free" and f.seq_id[0] == "p"]
    assert any(list(t) != list(range(t[0], t[0] + len(t))) for t in tables), tables
    assert cache.manager.seq_ids == tuple(f"other-{n}" for n in range(1, 8, 2))


def test_running_out_of_blocks_raises_and_frees_the_batch():
    model = TinyGPT(seed=0)
    cache = make_cache("paged", model, torch.device("cpu"), num_blocks=6)
    with pytest.raises(OutOfBlocksError):
        generate(model, prompts((5, 9)), 12, cache=cache)
    assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"prompts": []}, "prompts"),
        ({"prompts": [[1], []]}, r"prompts\[1\]"),
        ({"prompts": [[1, 256]]}, r"prompts\[0\]"),
        ({"prompts": [[1, "a"]]}, r"prompts\[0\]"),
        ({"prompts": [[1] * 60]}, "max_len"),
        ({"cache": "ring"}, "cache"),
        ({"device": "meta"}, "device"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, named):
    model = TinyGPT(GPTConfig(max_len=64))
    arguments = {"prompts": [[1, 2, 3]], "max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=named):
        generate(model, **arguments)


def test_a_bad_config_raises_value_error_naming_the_field():
    with pytest.raises(ValueError, match="num_heads"):
        GPTConfig(num_heads=0)


def test_num_kv_heads_defaults_to_num_heads_and_must_divide_it():
    assert GPTConfig(num_heads=4).num_kv_heads == 4
    assert GPTConfig(num_heads=4, num_kv_heads=1).kv_dim == GPTConfig().head_dim
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="num_kv_heads"):
            GPTConfig(num_heads=4, num_kv_heads=bad)


def test_the_default_model_keeps_its_weights_with_num_kv_heads_explicit():
    plain, explicit = TinyGPT(GPTConfig(), seed=2), TinyGPT(GPTConfig(num_kv_heads=4), seed=2)
    for a, b in zip(plain.parameters(), explicit.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_a_grouped_query_tiny_gpt_decodes_as_its_full_forward(device, kind, num_kv_heads):
    model = TinyGPT(GPTConfig(num_heads=4, num_kv_heads=num_kv_heads), seed=0).to(device)
    assert model.blocks[0].qkv.out_features == 64 + 2 * num_kv_heads * 16
    tokens = torch.tensor(prompts((14,))[0], device=device)
    cache = make_cache(kind, model, device)
    if kind == "paged":
        assert cache.storage.k_caches[0].shape[1] == num_kv_heads  # only the K/V heads are stored
    with torch.no_grad():
        full = model(tokens[None])[0]
        cache.add_sequence("s", 6)
        got = [model.prefill(tokens[:6], "s", cache)]
        for position in range(6, len(tokens)):
            got.append(model.decode_step(tokens[position : position + 1], ["s"], cache))
    torch.testing.assert_close(torch.cat(got), full, **TOLERANCES)
    batch = prompts()
    paged = generate(model, batch, NEW_TOKENS, cache="paged", block_size=BLOCK_SIZE)
    assert paged.tokens == generate(model, batch, NEW_TOKENS, cache="contiguous").tokens


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_prefill_batch_packs_prompts_and_matches_one_prefill_each(device, kind):
    model = TinyGPT(seed=0).to(device)
    batch = [torch.tensor(p, device=device) for p in prompts()]
    alone, packed = make_cache(kind, model, device), make_cache(kind, model, device)
    ids = [f"s{i}" for i in range(len(batch))]
    with torch.no_grad():
        for seq_id, prompt in zip(ids, batch, strict=True):
            alone.add_sequence(seq_id, len(prompt))
            packed.add_sequence(seq_id, len(prompt))
        each = torch.stack([model.prefill(p, s, alone)[-1] for p, s in zip(batch, ids, strict=True)])
        together = model.prefill_batch(batch, ids, packed)
        torch.testing.assert_close(together, each, **TOLERANCES)
        # and the K/V each prompt left behind is the same: one decode step gives the same logits
        step = torch.tensor([1, 2, 3], device=device)
        torch.testing.assert_close(
            model.decode_step(step, ids, packed), model.decode_step(step, ids, alone), **TOLERANCES
        )


def test_prefill_batch_refuses_mismatched_or_bad_arguments():
    model, cache = TinyGPT(seed=0), ContiguousKVCache(GPTConfig())
    cache.add_sequence("a", 3)
    with pytest.raises(ValueError, match="as many"):
        model.prefill_batch([torch.tensor([1, 2, 3])], ["a", "b"], cache)
    with pytest.raises(ValueError, match="start"):
        model.prefill_batch([torch.tensor([1, 2, 3])], ["a"], cache, starts=[3])
    with pytest.raises(ValueError, match="at least one prompt"):
        model.prefill_batch([], [], cache)


def test_a_packed_prefill_on_the_paged_cache_is_one_backend_forward_per_layer(monkeypatch):
    from paged_kv.attention.backend import AttentionImpl

    calls = []
    real = AttentionImpl.forward

    def spy(self, query, key, value, kv_cache, metadata):
        calls.append((len(query), metadata.num_reqs, metadata.query_lens.tolist()))
        return real(self, query, key, value, kv_cache, metadata)

    monkeypatch.setattr(AttentionImpl, "forward", spy)
    model = TinyGPT(seed=0)
    generate(model, prompts(), 2, cache="paged", block_size=BLOCK_SIZE)
    prefill = [(sum(PROMPT_LENGTHS), 3, list(PROMPT_LENGTHS))] * model.config.num_layers
    decode = [(3, 3, [1, 1, 1])] * model.config.num_layers
    assert calls == prefill + decode  # the prompts packed in one forward, then one decode step


def test_a_packed_prefill_refuses_a_bad_layout_and_writes_nothing():
    model = TinyGPT(seed=0)
    cache = make_cache("paged", model, torch.device("cpu"))
    cache.add_sequence("a", 5)
    with pytest.raises(ValueError, match="cached tokens"):
        cache.begin_prefill(["a"], [1])
    k = torch.ones(5, 4, 16)
    with pytest.raises(RuntimeError, match="begin_prefill"):
        cache.attend_prefill_batch(0, ["a"], k, k, k)
    cache.begin_prefill(["a"], [0])
    with pytest.raises(ValueError, match="laid out 5"):
        cache.attend_prefill_batch(0, ["a"], k[:4], k[:4], k[:4])
    with pytest.raises(ValueError, match="k must have shape"):
        cache.attend_prefill_batch(0, ["a"], k, k[:, :2], k[:, :2])
    assert not cache.storage.k_caches[0].any()  # nothing was written


@pytest.mark.parametrize("backend", [None, "GATHER", "IN_PLACE", "CPU_ATTN"])
def test_step_attend_writes_each_layers_kv_and_attends_in_the_named_backend_as_the_layer_attends(backend):
    """Two requests (a chunk of 3 after 5 cached tokens, a decode after 6), two layers: full
    attention, then a window of 3 with a soft cap; each layer's output is the reference backend's
    over its own pool once the step's K/V are in."""
    from paged_kv.attention.paged import paged_prefill_attention
    from paged_kv.kv.storage import KVStorage
    from paged_kv.model.attend import step_attend
    from paged_kv.model.config import LayerAttention
    from paged_kv.model.step import BlockTables, prepare_attention

    from .test_varlen_attention import skip_unless_runnable

    if backend is not None and backend.isupper():
        skip_unless_runnable(backend, "cpu")
    tables = BlockTables(4, 4)
    tables.add_row("a", ([3, 0],))
    tables.add_row("b", ([1, 4],))
    metadata = prepare_attention(tables, ["a", "b"], [5, 6], [3, 1], 4)
    storage = KVStorage(2, 6, 4, 2, 8)
    gen = torch.Generator().manual_seed(9)
    for pool in (*storage.k_caches, *storage.v_caches):
        pool.copy_(torch.randn(pool.shape, generator=gen))  # the cached tokens, and stale slots
    q, k, v = torch.randn(1, 4, 4, 8, generator=gen), *torch.randn(2, 1, 4, 2, 8, generator=gen)
    layers = [LayerAttention(), LayerAttention(sliding_window=3, softcap=2.0)]
    attend = step_attend([metadata], storage, backend, None, layers)
    for layer, spec in enumerate(layers):
        out = attend(layer, q, k, v)
        slots = metadata.slot_mapping
        assert torch.equal(storage.k_caches[layer][slots // 4, :, slots % 4], k[0])
        expected = paged_prefill_attention(
            q[0], storage.k_caches[layer], storage.v_caches[layer], metadata.block_table,
            metadata.seq_lens, metadata.query_lens, backend="GATHER", **spec.window_and_cap(),
        )  # fmt: skip
        torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_step_attend_refuses_a_name_no_backend_has():
    from paged_kv.kv.storage import KVStorage
    from paged_kv.model.attend import step_attend

    with pytest.raises(ValueError, match=r"^attention_backend must be one of CPU_ATTN, .*got 'fast'"):
        step_attend([], KVStorage(1, 2, 4, 1, 8), "fast")

"""Paged decode attention equals contiguous attention over each sequence's tokens (lesson 05).

Also with grouped-query (GQA) and multi-query (MQA) attention: ``num_heads`` query heads over caches
of ``num_kv_heads`` heads, against SDPA over K/V repeated along the head axis (``repeat_interleave``,
Hugging Face's ``repeat_kv``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv import PagedKVCacheAllocator, blocks_for_tokens
from paged_kv.attention.backends.flex_attention import flex_available
from paged_kv.attention.paged import decode_attention, gather_kv, paged_attention, paged_prefill_attention

pytestmark = pytest.mark.lesson05

# Paged against contiguous attention. Half and bfloat16 are compared with float32 SDPA over the same
# (rounded) inputs, so the only error left is the final rounding of the output.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


# (num_heads, num_kv_heads): multi-head, grouped-query in groups of 2 and 4, multi-query.
HEADS = [
    pytest.param(4, 4, id="MHA-4"),
    pytest.param(4, 2, id="GQA-4/2"),
    pytest.param(4, 1, id="MQA-4/1"),
    pytest.param(8, 2, id="GQA-8/2"),
]
# Any head layout: 1 to 3 KV heads, each shared by 1 to 3 query heads.
head_layouts = st.tuples(st.integers(1, 3), st.integers(1, 3)).map(lambda kg: (kg[0] * kg[1], kg[0]))


def scattered_cache(
    lengths, block_size=4, num_kv_heads=2, head_dim=8, device="cpu", dtype=torch.float32, seed=0
):
    """Sequences ``0 .. len(lengths) - 1`` holding random K/V in blocks taken in a random order.

    Every block is first taken by a one-token filler, then the fillers are freed in a random order:
    the FIFO free list hands the blocks out in that order. Unused slots hold random garbage too.
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(blocks_for_tokens(n, block_size) for n in lengths) + 3
    cache = PagedKVCacheAllocator(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    for block in range(num_blocks):
        cache.allocate_for_sequence(("filler", block), 1)
    for block in torch.randperm(num_blocks, generator=gen).tolist():
        cache.free_sequence(("filler", block))
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=gen))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=gen))
    for seq_id, length in enumerate(lengths):
        cache.allocate_for_sequence(seq_id, length)
        k, v = (torch.randn(length, num_kv_heads, head_dim, generator=gen) for _ in "kv")
        cache.write_kv(seq_id, k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device))
    return cache


def kv_heads(cache):
    """The heads the cache stores: its K/V heads."""
    return cache.k_cache.shape[1]


def random_query(cache, batch, seed=1, num_heads=None):
    """``(batch, num_heads, head_dim)``; ``num_heads`` defaults to the cache's heads (multi-head)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, num_heads or kv_heads(cache), cache.head_dim, generator=gen)
    return query.to(dtype=cache.dtype, device=cache.device)


def repeat_kv(t, num_heads):
    """``t`` ``(..., num_kv_heads, tokens, dim)`` with each KV head repeated for its group of query heads.

    Query head ``h`` gets KV head ``h // (num_heads // num_kv_heads)``: Hugging Face's ``repeat_kv``.
    """
    return t.repeat_interleave(num_heads // t.shape[-3], dim=-3)


def test_repeat_kv_pairs_each_query_head_with_its_group_s_kv_head():
    kv = torch.arange(2.0).reshape(1, 2, 1, 1)  # KV head i holds the value i
    assert repeat_kv(kv, 6).flatten().tolist() == [0, 0, 0, 1, 1, 1]
    q, k, v = torch.randn(1, 6, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    gqa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, repeat_kv(k, 6), repeat_kv(v, 6)), gqa)


def test_the_kernels_group_the_query_heads_as_a_view_in_repeat_kv_order():
    """Heads 0-3 of 8 share KV head 0, heads 4-7 KV head 1; no copy of the queries is made."""
    from paged_kv.attention.heads import group_heads

    q = torch.arange(8.0).reshape(1, 8, 1)
    grouped = group_heads(q, 2, dim=1)
    assert grouped.shape == (1, 2, 4, 1) and grouped.data_ptr() == q.data_ptr()
    assert grouped[0, :, :, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(grouped.flatten(1, 2), q)


def reference(cache, query, seq_lens, scale=None):
    """SDPA, one sequence at a time, over the contiguous K/V read back from the cache (in float32),
    repeated to the query's heads."""
    rows = []
    for seq_id, seq_len in enumerate(seq_lens):
        kv = (t[:seq_len].transpose(0, 1)[None].float() for t in cache.read_kv(seq_id))
        k, v = (repeat_kv(t, query.shape[1]) for t in kv)
        q = query[seq_id, :, None][None].float()  # (1, H, 1, D) against (1, H, T, D)
        rows.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0, :, 0])
    return torch.stack(rows)


def run(cache, query, seq_lens, **kw):
    tables = cache.block_tables_tensor(range(len(seq_lens)))
    return paged_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens, **kw)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_one_sequence_in_scattered_blocks_matches_sdpa(device, num_heads, num_kv_heads):
    cache = scattered_cache([11], block_size=4, num_kv_heads=num_kv_heads, device=device)
    assert cache.get_block_mapping(0) != sorted(cache.get_block_mapping(0))  # really scattered
    query = random_query(cache, 1, num_heads=num_heads)
    out = run(cache, query, torch.tensor([11], device=device))
    assert out.shape == (1, num_heads, cache.head_dim)
    assert out.dtype == query.dtype and out.device == query.device
    torch.testing.assert_close(out, reference(cache, query, [11]), **TOLERANCES[torch.float32])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (6, 3), (6, 1)])
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_a_batch_of_different_lengths_matches_sdpa_per_sequence(device, table_dtype, num_heads, num_kv_heads):
    # length 1, exact multiples of the block size, and lengths that end in a partial block
    lengths = [1, 8, 13, 4, 7, 20]
    cache = scattered_cache(
        lengths, block_size=4, num_kv_heads=num_kv_heads, head_dim=16, device=device, seed=3
    )
    tables = cache.block_tables_tensor(range(len(lengths))).to(table_dtype)
    assert (tables == -1).any()  # the shorter rows are padded
    query = random_query(cache, len(lengths), num_heads=num_heads)
    seq_lens = torch.tensor(lengths, device=device)
    out = paged_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens)
    torch.testing.assert_close(out, reference(cache, query, lengths), **TOLERANCES[torch.float32])


def test_context_lens_may_be_a_list_of_ints(device):
    cache = scattered_cache([5, 2], device=device)
    query = random_query(cache, 2)
    as_tensor = torch.tensor([5, 2], device=device)
    torch.testing.assert_close(run(cache, query, [5, 2]), run(cache, query, as_tensor))


@given(
    block_size=st.integers(1, 8),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    heads=head_layouts,
    head_dim=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_paged_attention_equals_contiguous_attention(block_size, lengths, heads, head_dim, seed, data):
    """Over any first ``seq_len`` tokens of each sequence, not only all of them; any head layout."""
    num_heads, num_kv_heads = heads
    cache = scattered_cache(lengths, block_size, num_kv_heads, head_dim, seed=seed)
    seq_lens = [data.draw(st.integers(1, n), label=f"seq_len {i}") for i, n in enumerate(lengths)]
    query = random_query(cache, len(lengths), seed=seed + 1, num_heads=num_heads)
    out = run(cache, query, seq_lens)
    torch.testing.assert_close(out, reference(cache, query, seq_lens), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("garbage", ["valid ids", "out of range"])
def test_padding_values_never_matter(device, garbage):
    lengths = [1, 9, 4, 16]
    cache = scattered_cache(lengths, block_size=4, device=device)
    tables = cache.block_tables_tensor(range(len(lengths)))
    padding = tables == -1
    assert padding.any()
    if garbage == "valid ids":
        filler = torch.randint(0, cache.num_blocks, tables.shape, generator=torch.Generator().manual_seed(5))
    else:
        filler = torch.tensor([[cache.num_blocks + 7, -100]]).repeat(len(lengths), tables.shape[1])
        filler = filler[:, : tables.shape[1]]
    garbled = torch.where(padding, filler.to(tables), tables)
    query = random_query(cache, len(lengths))
    seq_lens = torch.tensor(lengths, device=device)
    clean = paged_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens)
    assert torch.equal(paged_attention(query, cache.k_cache, cache.v_cache, garbled, seq_lens), clean)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_within_a_looser_tolerance(device, dtype):
    lengths = [3, 12, 1, 17]
    cache = scattered_cache(lengths, block_size=4, head_dim=16, device=device, dtype=dtype, seed=7)
    query = random_query(cache, len(lengths))
    out = run(cache, query, lengths)
    assert out.dtype == dtype and out.device == query.device
    expected = reference(cache, query, lengths).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_half_precision_scores_are_computed_in_float32(device):
    """q · k of size ~1e5 overflows float16 (max 65504); after the small scale the logits are tame."""
    lengths = [6, 11]
    cache = scattered_cache(lengths, head_dim=16, device=device, dtype=torch.float16, seed=13)
    cache.k_cache.mul_(300)
    query = random_query(cache, len(lengths)) * 300
    assert (query.float() @ cache.k_cache.flatten(0, 2).float().T).abs().max() > 65504
    out = run(cache, query, lengths, scale=1e-4)
    assert out.isfinite().all()
    expected = reference(cache, query, lengths, scale=1e-4).half()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])


def test_float64_stays_float64(device):
    cache = scattered_cache([6, 3], device=device, dtype=torch.float64)
    query = random_query(cache, 2)
    out = run(cache, query, [6, 3])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(cache, query, [6, 3]).double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_a_custom_scale_matches_sdpa_with_that_scale(device, scale):
    lengths = [7, 2, 12]
    cache = scattered_cache(lengths, device=device, seed=11)
    query = random_query(cache, len(lengths))
    expected = reference(cache, query, lengths, scale=scale)
    torch.testing.assert_close(run(cache, query, lengths, scale=scale), expected, **TOLERANCES[torch.float32])


def test_the_default_scale_is_one_over_sqrt_head_dim(device):
    cache = scattered_cache([9], head_dim=16, device=device)
    query = random_query(cache, 1)
    torch.testing.assert_close(run(cache, query, [9]), run(cache, query, [9], scale=0.25))


def test_an_empty_batch_gives_an_empty_output(device):
    cache = scattered_cache([3], device=device)
    query = torch.zeros(0, kv_heads(cache), cache.head_dim, device=device)
    tables = torch.zeros(0, 0, dtype=torch.int32, device=device)
    out = paged_attention(query, cache.k_cache, cache.v_cache, tables, [])
    assert out.shape == (0, kv_heads(cache), cache.head_dim)


def test_the_inputs_are_not_modified(device):
    lengths = [5, 1, 8]
    cache = scattered_cache(lengths, device=device)
    query = random_query(cache, len(lengths))
    tables = cache.block_tables_tensor(range(len(lengths)))
    seq_lens = torch.tensor(lengths, device=device)
    inputs = (query, cache.k_cache, cache.v_cache, tables, seq_lens)
    before = [t.clone() for t in inputs]
    paged_attention(*inputs)
    for tensor, original in zip(inputs, before, strict=True):
        assert torch.equal(tensor, original)


# ------------------------------------------------------------------------------------- validation


def good_inputs(device):
    """A valid call: sequences of 5 and 2 tokens, block_size 4, tables [[b, b'], [b'', -1]]; 4 query
    heads over 2 KV heads of head_dim 8."""
    cache = scattered_cache([5, 2], block_size=4, num_kv_heads=2, device=device)
    return {
        "query": random_query(cache, 2, num_heads=4),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_tables": cache.block_tables_tensor([0, 1]),
        "seq_lens": torch.tensor([5, 2], device=device),
    }


BAD_INPUTS = {
    "query not a tensor": ("query", lambda a: a["query"].tolist()),
    "query 2-D": ("query", lambda a: a["query"][0]),
    "query of ints": ("query", lambda a: a["query"].long()),
    "k_cache 3-D": ("k_cache", lambda a: a["k_cache"][0]),
    "k_cache heads not dividing query's": ("k_cache", lambda a: a["k_cache"].repeat(1, 2, 1, 1)[:, :3]),
    "k_cache more heads than query": ("k_cache", lambda a: a["k_cache"].repeat(1, 4, 1, 1)),
    "k_cache other head_dim": ("k_cache", lambda a: a["k_cache"][..., :3]),
    "v_cache other heads": ("v_cache", lambda a: a["v_cache"][:, :1]),
    "k_cache other dtype": ("k_cache", lambda a: a["k_cache"].double()),
    "v_cache other block_size": ("v_cache", lambda a: a["v_cache"][:, :, :2]),
    "v_cache fewer blocks": ("v_cache", lambda a: a["v_cache"][:-1]),
    "v_cache other dtype": ("v_cache", lambda a: a["v_cache"].half()),
    "block_tables floats": ("block_tables", lambda a: a["block_tables"].float()),
    "block_tables bools": ("block_tables", lambda a: a["block_tables"] > 0),
    "block_tables 1-D": ("block_tables", lambda a: a["block_tables"][0]),
    "block_tables other batch": ("block_tables", lambda a: a["block_tables"][:1]),
    "block_tables id too large": ("block_tables", lambda a: a["block_tables"].fill_(a["k_cache"].shape[0])),
    "seq_lens floats": ("seq_lens", lambda a: a["seq_lens"].float()),
    "seq_lens not numbers": ("seq_lens", lambda a: ["five", "two"]),
    "seq_lens other batch": ("seq_lens", lambda a: a["seq_lens"][:1]),
    "seq_lens 2-D": ("seq_lens", lambda a: a["seq_lens"][None]),
    "seq_len of 0": ("seq_lens", lambda a: a["seq_lens"] * 0),
    "seq_len negative": ("seq_lens", lambda a: a["seq_lens"] - 6),
    "seq_len past the padding": ("seq_lens", lambda a: torch.tensor([5, 5]).to(a["seq_lens"])),
    "seq_len past the row": ("seq_lens", lambda a: torch.tensor([9, 2]).to(a["seq_lens"])),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_value_error_naming_the_argument(device, case):
    inputs = good_inputs(device)
    name, corrupt = BAD_INPUTS[case]
    inputs[name] = corrupt({key: t.clone() for key, t in inputs.items()})
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        paged_attention(**inputs)


@pytest.mark.parametrize(("num_heads", "cache_heads"), [(4, 3), (4, 8), (6, 4), (1, 2)])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_heads_that_do_not_group_name_k_cache_with_the_shape_expected(
    device, num_heads, cache_heads, prefill
):
    """Query heads must split into equal groups over the cache's heads; nothing is changed."""
    cache = scattered_cache([5, 2], num_kv_heads=cache_heads, device=device)
    query = random_query(cache, 2, num_heads=num_heads)
    tables = cache.block_tables_tensor([0, 1])
    args = (query, cache.k_cache, cache.v_cache, tables, [5, 2], *([[1, 1]] if prefill else []))
    before = [t.clone() for t in args[:4]]
    shape = r"\(num_blocks, num_kv_heads, block_size, 8\)"
    expected = rf"^k_cache must have shape {shape} with num_kv_heads dividing query's {num_heads} heads"
    with pytest.raises(ValueError, match=expected):
        (paged_prefill_attention if prefill else paged_attention)(*args)
    assert all(torch.equal(t, b) for t, b in zip(args[:4], before, strict=True))


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "block_tables", "seq_lens"])
def test_a_tensor_on_another_device_names_the_argument(device, name):
    inputs = good_inputs(device)
    inputs[name] = torch.empty_like(inputs[name], device="meta")
    with pytest.raises(ValueError, match=rf"^{name} is on meta"):
        paged_attention(**inputs)


# ------------------------------------------------------------------ one sequence: gather, attend


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "int32 row"])
def test_gather_kv_equals_read_kv(device, as_list):
    lengths = [8, 11, 5, 1]
    cache = scattered_cache(lengths, block_size=4, num_kv_heads=3, head_dim=5, device=device, seed=21)
    tables = cache.block_tables_tensor(range(len(lengths)))  # int32, padded with -1
    for seq_id, length in enumerate(lengths):
        table = cache.get_block_mapping(seq_id) if as_list else tables[seq_id]
        k, v = gather_kv(cache.k_cache, cache.v_cache, table, length)
        expected_k, expected_v = cache.read_kv(seq_id)
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
        assert k.is_contiguous() and k.device == cache.k_cache.device


def test_gather_kv_reads_a_prefix_and_never_the_padding(device):
    cache = scattered_cache([11], block_size=4, device=device)
    table = cache.get_block_mapping(0)
    expected_k, expected_v = cache.read_kv(0)
    for seq_len in range(12):
        k, v = gather_kv(cache.k_cache, cache.v_cache, [*table, -1, 10**6], seq_len)
        assert k.shape == (seq_len, kv_heads(cache), cache.head_dim)
        assert torch.equal(k, expected_k[:seq_len]) and torch.equal(v, expected_v[:seq_len])


def test_gather_kv_follows_the_table_order():
    k_cache = torch.arange(4.0).reshape(4, 1, 1, 1)  # 4 blocks of one token, K = block id
    k, v = gather_kv(k_cache, -k_cache, [2, 0, 3, -1], 3)
    assert k.flatten().tolist() == [2.0, 0.0, 3.0] and v.flatten().tolist() == [-2.0, -0.0, -3.0]


def gather_inputs():
    cache = scattered_cache([5], block_size=4)
    return {
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_table": cache.get_block_mapping(0),
        "seq_len": 5,
    }


BAD_GATHER_INPUTS = {
    "k_cache 3-D": ("k_cache", lambda a: a["k_cache"][0]),
    "k_cache not a tensor": ("k_cache", lambda a: a["k_cache"].tolist()),
    "v_cache other shape": ("v_cache", lambda a: a["v_cache"][:, :, :2]),
    "seq_len negative": ("seq_len", lambda a: -1),
    "seq_len a bool": ("seq_len", lambda a: True),
    "seq_len a float": ("seq_len", lambda a: 5.0),
    "block_table floats": ("block_table", lambda a: torch.tensor(a["block_table"], dtype=torch.float32)),
    "block_table 2-D": ("block_table", lambda a: torch.tensor([a["block_table"]])),
    "block_table not numbers": ("block_table", lambda a: ["a", "b"]),
    "block_table too short": ("block_table", lambda a: a["block_table"][:1]),
    "block_table with padding read": ("block_table", lambda a: [a["block_table"][0], -1]),
    "block_table id too large": ("block_table", lambda a: [a["block_table"][0], a["k_cache"].shape[0]]),
}


@pytest.mark.parametrize("case", list(BAD_GATHER_INPUTS))
def test_gather_kv_bad_input_is_a_value_error_naming_the_argument(case):
    inputs = gather_inputs()
    name, corrupt = BAD_GATHER_INPUTS[case]
    inputs[name] = corrupt(inputs)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        gather_kv(**inputs)


def sdpa(q, k, v, scale=None):
    """SDPA of q (heads, dim) over k, v (tokens, kv_heads, dim) repeated to q's heads, in float32."""
    k, v = (repeat_kv(t.float().transpose(0, 1)[None], q.shape[0]) for t in (k, v))
    return F.scaled_dot_product_attention(q.float()[None, :, None], k, v, scale=scale)[0, :, 0]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize(("tokens", "scale"), [(1, None), (7, None), (7, 0.5), (30, 3.0)])
def test_decode_attention_matches_sdpa(device, tokens, scale, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(tokens)
    shapes = [(num_heads, 16), *[(tokens, num_kv_heads, 16)] * 2]
    q, k, v = (torch.randn(*shape, generator=gen).to(device) for shape in shapes)
    out = decode_attention(q, k, v, scale)
    assert out.shape == (num_heads, 16) and out.dtype == q.dtype and out.device == q.device
    torch.testing.assert_close(out, sdpa(q, k, v, scale), **TOLERANCES[torch.float32])
    if tokens == 1:  # one token gets all the weight: each query head gets its KV head's V
        torch.testing.assert_close(out, v[0].repeat_interleave(num_heads // num_kv_heads, dim=0))


def test_decode_attention_survives_large_scores():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 16, generator=gen) * 100,
        torch.randn(9, 2, 16, generator=gen) * 100,
        torch.randn(9, 2, 16),
    )
    out = decode_attention(q, k, v)
    assert out.isfinite().all()
    torch.testing.assert_close(out, sdpa(q, k, v), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_in_half_precision_computes_in_float32(dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for shape in [(2, 16), (5, 2, 16), (5, 2, 16)])
    out = decode_attention(q, k, v)
    assert out.dtype == dtype
    torch.testing.assert_close(out, sdpa(q, k, v).to(dtype), **TOLERANCES[dtype])


BAD_DECODE_INPUTS = {
    "q 3-D": ("q", lambda a: a["q"][None]),
    "q of ints": ("q", lambda a: a["q"].long()),
    "k heads not dividing q's": ("k", lambda a: a["k"].repeat(1, 2, 1)[:, :3]),
    "k more heads than q": ("k", lambda a: a["k"].repeat(1, 4, 1)),
    "k 2-D": ("k", lambda a: a["k"][0]),
    "k other dtype": ("k", lambda a: a["k"].double()),
    "v other head_dim": ("v", lambda a: a["v"][..., :3]),
    "v on meta": ("v", lambda a: torch.empty_like(a["v"], device="meta")),
    "k and v of different lengths": ("k", lambda a: a["k"][:2]),
    "no tokens": ("k", lambda a: a["k"][:0]),
}


@pytest.mark.parametrize("case", list(BAD_DECODE_INPUTS))
def test_decode_attention_bad_input_is_a_value_error_naming_the_argument(case):
    inputs = {"q": torch.randn(4, 4), "k": torch.randn(3, 2, 4), "v": torch.randn(3, 2, 4)}  # 4 heads over 2
    name, corrupt = BAD_DECODE_INPUTS[case]
    inputs[name] = corrupt(inputs)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        decode_attention(**inputs)


@given(
    block_size=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    heads=head_layouts,
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_paged_attention_is_gather_kv_then_decode_attention_per_sequence(
    block_size, lengths, heads, seed, data
):
    num_heads, num_kv_heads = heads
    cache = scattered_cache(lengths, block_size, num_kv_heads=num_kv_heads, head_dim=4, seed=seed)
    seq_lens = [data.draw(st.integers(1, n), label=f"seq_len {i}") for i, n in enumerate(lengths)]
    query = random_query(cache, len(lengths), seed=seed + 1, num_heads=num_heads)
    tables = cache.block_tables_tensor(range(len(lengths)))
    one_by_one = torch.stack(
        [
            decode_attention(query[b], *gather_kv(cache.k_cache, cache.v_cache, tables[b], n))
            for b, n in enumerate(seq_lens)
        ]
    )
    torch.testing.assert_close(run(cache, query, seq_lens), one_by_one, **TOLERANCES[torch.float32])


# ------------------------------------------------------------------------------ prefill (causal)


def prefill_query(cache, query_lens, seed=1, num_heads=None):
    """Packed queries: ``sum(query_lens)`` rows, sequence after sequence; ``num_heads`` as for
    :func:`random_query`."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(sum(query_lens), num_heads or kv_heads(cache), cache.head_dim, generator=gen)
    return query.to(dtype=cache.dtype, device=cache.device)


def causal_mask(seq_len, query_len, device="cpu"):
    """``(query_len, seq_len)``: new token i sits at ``seq_len - query_len + i`` and sees up to it.

    Built explicitly: SDPA's ``is_causal`` aligns the mask top-left, which is wrong when
    ``query_len < seq_len`` (the new tokens are the last ones, not the first).
    """
    query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= query_positions[:, None]


def prefill_reference(cache, query, seq_lens, query_lens, scale=None):
    """SDPA, one sequence at a time, over its contiguous K/V (in float32) repeated to the query's
    heads, packed like ``query``."""
    rows, start = [], 0
    for seq_id, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        kv = (t[:seq_len].transpose(0, 1)[None].float() for t in cache.read_kv(seq_id))
        k, v = (repeat_kv(t, query.shape[1]) for t in kv)
        q = query[start : start + query_len].transpose(0, 1)[None].float()  # (1, H, Q, D)
        mask = causal_mask(seq_len, query_len, query.device)
        rows.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[0].transpose(0, 1))
        start += query_len
    return torch.cat(rows) if rows else query.float()


def run_prefill(cache, query, seq_lens, query_lens, **kw):
    tables = cache.block_tables_tensor(range(len(seq_lens)))
    return paged_prefill_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens, query_lens, **kw)


def test_the_reference_mask_is_sdpa_is_causal_for_a_fresh_prompt():
    cache = scattered_cache([9])
    query = prefill_query(cache, [9])
    k, v = (t.transpose(0, 1)[None] for t in cache.read_kv(0))
    causal = F.scaled_dot_product_attention(query.transpose(0, 1)[None], k, v, is_causal=True)
    torch.testing.assert_close(prefill_reference(cache, query, [9], [9]), causal[0].transpose(0, 1))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_prefill_of_a_ragged_batch_matches_sdpa_per_sequence(device, table_dtype, num_heads, num_kv_heads):
    # a fresh prompt, a chunk after a cached prefix, one new token, a chunk ending mid-block
    seq_lens, query_lens = [9, 13, 6, 20, 1], [9, 5, 1, 7, 1]
    cache = scattered_cache(seq_lens, 4, num_kv_heads, head_dim=16, device=device, seed=3)
    tables = cache.block_tables_tensor(range(len(seq_lens))).to(table_dtype)
    assert (tables == -1).any()
    assert cache.get_block_mapping(3) != sorted(cache.get_block_mapping(3))  # really scattered
    query = prefill_query(cache, query_lens, num_heads=num_heads)
    out = paged_prefill_attention(
        query, cache.k_cache, cache.v_cache, tables, torch.tensor(seq_lens, device=device), query_lens
    )
    assert out.shape == query.shape and out.dtype == query.dtype and out.device == query.device
    expected = prefill_reference(cache, query, seq_lens, query_lens)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1)])
def test_prefill_of_fresh_prompts_is_sdpa_is_causal(device, num_heads, num_kv_heads):
    """Also against SDPA's own grouped-query attention (``enable_gqa``), with no repeat of ours."""
    lengths = [5, 12, 1]
    cache = scattered_cache(lengths, block_size=4, num_kv_heads=num_kv_heads, device=device, seed=4)
    query = prefill_query(cache, lengths, num_heads=num_heads)
    out = run_prefill(cache, query, lengths, lengths)
    start = 0
    for seq_id, n in enumerate(lengths):
        k, v = (t.transpose(0, 1)[None] for t in cache.read_kv(seq_id))
        q = query[start : start + n].transpose(0, 1)[None]
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], expected, **TOLERANCES[torch.float32])
        start += n


def test_prefill_of_one_token_per_sequence_is_decode(device):
    lengths = [1, 8, 13, 4]
    cache = scattered_cache(lengths, block_size=4, device=device, seed=5)
    query = random_query(cache, len(lengths))
    decode = run(cache, query, lengths)
    torch.testing.assert_close(run_prefill(cache, query, lengths, [1] * len(lengths)), decode)


def test_a_sequence_with_no_new_tokens_contributes_no_rows(device):
    seq_lens, query_lens = [6, 9, 3], [2, 0, 3]
    cache = scattered_cache(seq_lens, device=device, seed=6)
    query = prefill_query(cache, query_lens)
    out = run_prefill(cache, query, seq_lens, query_lens)
    assert out.shape == (5, cache.num_heads, cache.head_dim)
    torch.testing.assert_close(
        out, prefill_reference(cache, query, seq_lens, query_lens), **TOLERANCES[torch.float32]
    )


@given(
    block_size=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    heads=head_layouts,
    head_dim=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_paged_prefill_equals_causal_contiguous_attention(block_size, lengths, heads, head_dim, seed, data):
    """Any context length up to what a sequence holds, any number of new tokens up to it (0 included),
    any head layout."""
    num_heads, num_kv_heads = heads
    cache = scattered_cache(lengths, block_size, num_kv_heads, head_dim, seed=seed)
    seq_lens = [data.draw(st.integers(1, n), label=f"seq_len {i}") for i, n in enumerate(lengths)]
    query_lens = [data.draw(st.integers(0, n), label=f"query_len {i}") for i, n in enumerate(seq_lens)]
    query = prefill_query(cache, query_lens, seed=seed + 1, num_heads=num_heads)
    out = run_prefill(cache, query, seq_lens, query_lens)
    expected = prefill_reference(cache, query, seq_lens, query_lens)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("garbage", ["valid ids", "out of range"])
def test_prefill_padding_values_never_matter(device, garbage):
    seq_lens, query_lens = [1, 9, 4, 16], [1, 3, 4, 2]
    cache = scattered_cache(seq_lens, block_size=4, device=device)
    tables = cache.block_tables_tensor(range(len(seq_lens)))
    padding = tables == -1
    assert padding.any()
    if garbage == "valid ids":
        filler = torch.randint(0, cache.num_blocks, tables.shape, generator=torch.Generator().manual_seed(5))
    else:
        filler = torch.full(tables.shape, cache.num_blocks + 7)
    garbled = torch.where(padding, filler.to(tables), tables)
    query = prefill_query(cache, query_lens)
    args = (torch.tensor(seq_lens, device=device), torch.tensor(query_lens, device=device))
    clean = paged_prefill_attention(query, cache.k_cache, cache.v_cache, tables, *args)
    assert torch.equal(paged_prefill_attention(query, cache.k_cache, cache.v_cache, garbled, *args), clean)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_in_half_precision_matches_within_a_looser_tolerance(device, dtype):
    seq_lens, query_lens = [3, 12, 17], [3, 4, 1]
    cache = scattered_cache(seq_lens, head_dim=16, device=device, dtype=dtype, seed=7)
    query = prefill_query(cache, query_lens)
    out = run_prefill(cache, query, seq_lens, query_lens)
    assert out.dtype == dtype
    expected = prefill_reference(cache, query, seq_lens, query_lens).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_prefill_half_precision_scores_are_computed_in_float32(device):
    seq_lens, query_lens = [6, 11], [6, 3]
    cache = scattered_cache(seq_lens, head_dim=16, device=device, dtype=torch.float16, seed=13)
    cache.k_cache.mul_(300)
    query = prefill_query(cache, query_lens) * 300
    out = run_prefill(cache, query, seq_lens, query_lens, scale=1e-4)
    assert out.isfinite().all()
    expected = prefill_reference(cache, query, seq_lens, query_lens, scale=1e-4).half()
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])


@pytest.mark.parametrize("scale", [None, 0.05, 3.0])
def test_prefill_with_a_custom_scale_matches_sdpa(device, scale):
    seq_lens, query_lens = [7, 12], [3, 12]
    cache = scattered_cache(seq_lens, device=device, seed=11)
    query = prefill_query(cache, query_lens)
    expected = prefill_reference(cache, query, seq_lens, query_lens, scale=scale)
    out = run_prefill(cache, query, seq_lens, query_lens, scale=scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_prefill_of_an_empty_batch_gives_an_empty_output(device):
    cache = scattered_cache([3], device=device)
    query = torch.zeros(0, kv_heads(cache), cache.head_dim, device=device)
    tables = torch.zeros(0, 0, dtype=torch.int32, device=device)
    out = paged_prefill_attention(query, cache.k_cache, cache.v_cache, tables, [], [])
    assert out.shape == (0, kv_heads(cache), cache.head_dim)


def good_prefill_inputs(device):
    """Sequences of 5 and 2 tokens, of which 3 and 2 are new: 5 packed query rows."""
    inputs = good_inputs(device)
    query = inputs["query"]
    inputs["query"] = torch.randn(5, *query.shape[1:], generator=torch.Generator().manual_seed(2)).to(query)
    inputs["query_lens"] = torch.tensor([3, 2], device=device)
    return inputs


BAD_PREFILL_INPUTS = {
    "query 2-D": ("query", lambda a: a["query"][0]),
    "query of ints": ("query", lambda a: a["query"].long()),
    "k_cache heads not dividing query's": ("k_cache", lambda a: a["k_cache"].repeat(1, 2, 1, 1)[:, :3]),
    "block_tables 1-D": ("block_tables", lambda a: a["block_tables"][0]),
    "seq_lens other batch": ("seq_lens", lambda a: a["seq_lens"][:1]),
    "seq_len of 0": ("seq_lens", lambda a: a["seq_lens"] * 0),
    "query_lens not a sequence of ints": ("query_lens", lambda a: ["three", "two"]),
    "query_lens floats": ("query_lens", lambda a: a["query_lens"].float()),
    "query_lens other batch": ("query_lens", lambda a: a["query_lens"][:1]),
    "query_lens 2-D": ("query_lens", lambda a: a["query_lens"][None]),
    "query_len negative": ("query_lens", lambda a: torch.tensor([3, -1]).to(a["query_lens"])),
    "query_len past the context": ("query_lens", lambda a: torch.tensor([2, 3]).to(a["query_lens"])),
    "query_lens not the rows of query": ("query_lens", lambda a: torch.tensor([2, 2]).to(a["query_lens"])),
}


@pytest.mark.parametrize("case", list(BAD_PREFILL_INPUTS))
def test_prefill_bad_input_is_a_value_error_naming_the_argument(device, case):
    inputs = good_prefill_inputs(device)
    name, corrupt = BAD_PREFILL_INPUTS[case]
    inputs[name] = corrupt({key: t.clone() for key, t in inputs.items()})
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        paged_prefill_attention(**inputs)


def test_prefill_query_lens_on_another_device_names_it(device):
    inputs = good_prefill_inputs(device)
    inputs["query_lens"] = torch.empty_like(inputs["query_lens"], device="meta")
    with pytest.raises(ValueError, match=r"^query_lens is on meta"):
        paged_prefill_attention(**inputs)


# --------------------------------------------------------------- the backends that run everywhere


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN"])
def test_every_backend_matches_sdpa_on_ragged_scattered_batches(device, backend, num_heads, num_kv_heads):
    lengths = [1, 8, 13, 4, 7, 20]
    cache = scattered_cache(lengths, block_size=4, num_kv_heads=num_kv_heads, device=device)
    query = random_query(cache, len(lengths), num_heads=num_heads)
    # Stale garbage, even NaN, in blocks nobody reads must not reach the output.
    unread = sorted(
        set(range(cache.num_blocks)) - {b for s in range(len(lengths)) for b in cache.get_block_mapping(s)}
    )
    cache.k_cache[unread] = float("nan")
    cache.v_cache[unread] = float("nan")
    out = run(cache, query, torch.tensor(lengths, device=device), backend=backend)
    torch.testing.assert_close(out, reference(cache, query, lengths), **TOLERANCES[torch.float32])


@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    block_size=st.integers(1, 6),
    cut=st.integers(0, 5),
    shared_prefix=st.integers(0, 3),
    heads=head_layouts,
    seed=st.integers(0, 2**16),
)
def test_reading_in_place_equals_gathering(lengths, block_size, cut, shared_prefix, heads, seed):
    num_heads, num_kv_heads = heads
    cache = scattered_cache(lengths, block_size=block_size, num_kv_heads=num_kv_heads, seed=seed)
    query = random_query(cache, len(lengths), seed=seed + 1, num_heads=num_heads)
    seq_lens = torch.tensor([max(1, n - cut) for n in lengths])  # attend to a prefix, too
    tables = cache.block_tables_tensor(range(len(lengths)))
    for row in range(1, len(lengths)):  # the first blocks of row 0, shared by every row long enough
        width = min(shared_prefix, blocks_for_tokens(int(seq_lens[row]), block_size), tables.shape[1])
        width = min(width, blocks_for_tokens(int(seq_lens[0]), block_size))
        tables[row, :width] = tables[0, :width]
    args = (query, cache.k_cache, cache.v_cache, tables, seq_lens)
    in_place = paged_attention(*args, backend="IN_PLACE")
    gathered = paged_attention(*args, backend="GATHER")
    torch.testing.assert_close(in_place, gathered, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_shared_blocks_are_read_in_place_by_every_row_that_holds_them(num_heads, num_kv_heads):
    cache = scattered_cache([8, 8, 8], block_size=4, num_kv_heads=num_kv_heads)
    query = random_query(cache, 3, num_heads=num_heads)
    tables = cache.block_tables_tensor([0, 1, 2])
    tables[1, 0] = tables[2, 0] = tables[0, 0]  # rows 1 and 2 read row 0's first block too, as after a fork
    lens = torch.tensor([8, 8, 8])
    expected = table_reference(query, cache.k_cache, cache.v_cache, tables, lens)
    for backend in ("GATHER", "IN_PLACE", "CPU_ATTN"):
        out = paged_attention(query, cache.k_cache, cache.v_cache, tables, lens, backend=backend)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32], msg=backend)


def test_an_unknown_backend_names_the_argument_and_the_valid_names():
    cache = scattered_cache([4])
    valid = "CPU_ATTN, TRITON_ATTN, FLEX_ATTENTION, GATHER, IN_PLACE, or None"
    with pytest.raises(ValueError, match=f"^backend must be one of {valid}.*got 'fast'"):
        run(cache, random_query(cache, 1), [4], backend="fast")


# ------------------------------------------------------------- FlexAttention, the optional CUDA path

needs_flex = pytest.mark.skipif(not flex_available(), reason="this torch has no FlexAttention (torch < 2.5)")


@needs_flex
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
def test_flex_matches_sdpa_on_ragged_scattered_batches(device, num_heads, num_kv_heads):
    """On CUDA this runs the compiled kernel; on a CPU the unfused reference of FlexAttention."""
    lengths = [1, 8, 13, 4, 7, 20]
    cache = scattered_cache(lengths, block_size=4, num_kv_heads=num_kv_heads, device=device)
    query = random_query(cache, len(lengths), num_heads=num_heads)
    unread = sorted(
        set(range(cache.num_blocks)) - {b for s in range(len(lengths)) for b in cache.get_block_mapping(s)}
    )
    cache.k_cache[unread] = 1e4  # large stale values in blocks nobody reads must not reach the output
    cache.v_cache[unread] = -1e4
    out = run(cache, query, torch.tensor(lengths, device=device), backend="FLEX_ATTENTION")
    torch.testing.assert_close(out, reference(cache, query, lengths), **TOLERANCES[torch.float32])


# Without torch.compile each FlexAttention call traces its mask anew (0.4 s on a CPU), so this test
# keeps to a few examples: test_every_backend_and_prefill_equal_the_reference_for_any_valid_table
# below also runs flex on every example, on random tables whose blocks repeat within and across
# rows, against the reference.
@needs_flex
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    block_size=st.integers(1, 6),
    cut=st.integers(0, 5),
    share=st.booleans(),
    heads=head_layouts,
    seed=st.integers(0, 2**16),
)
def test_flex_equals_gathering_also_with_shared_blocks(lengths, block_size, cut, share, heads, seed):
    num_heads, num_kv_heads = heads
    cache = scattered_cache(lengths, block_size=block_size, num_kv_heads=num_kv_heads, seed=seed)
    query = random_query(cache, len(lengths), seed=seed + 1, num_heads=num_heads)
    seq_lens = torch.tensor([max(1, n - cut) for n in lengths])
    tables = cache.block_tables_tensor(range(len(lengths)))
    if share and len(lengths) > 1:
        tables[-1, 0] = tables[0, 0]  # the last row reads the first row's first block, as after a fork
    flex = paged_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens, backend="FLEX_ATTENTION")
    gathered = paged_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens, backend="GATHER")
    torch.testing.assert_close(flex, gathered, **TOLERANCES[torch.float32])


@needs_flex
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flex_in_half_precision_matches_within_a_looser_tolerance(device, dtype):
    lengths = [5, 16, 9]
    cache = scattered_cache(lengths, block_size=4, device=device, dtype=dtype)
    query = random_query(cache, len(lengths))
    out = run(cache, query, lengths, backend="FLEX_ATTENTION")
    assert out.dtype == dtype and out.device == query.device
    torch.testing.assert_close(out, reference(cache, query, lengths).to(dtype), **TOLERANCES[dtype])


def test_flex_on_an_old_torch_is_a_value_error_naming_the_backend(monkeypatch):
    from paged_kv.attention.backends import flex_attention

    monkeypatch.setattr(flex_attention, "flex_available", lambda: False)
    cache = scattered_cache([4])
    with pytest.raises(ValueError, match=r"FLEX_ATTENTION needs torch 2\.5"):
        run(cache, random_query(cache, 1), [4], backend="FLEX_ATTENTION")


def table_reference(query, k_cache, v_cache, tables, seq_lens, query_lens=None):
    """SDPA per row over the K/V its table lists, entry by entry, in float32: the meaning of a table.

    Written without the package: entry ``j`` of a row contributes the slots of block ``tables[b, j]``
    at positions ``j * block_size ...``, whatever other entry (of this row or another) names the
    same block; the K/V heads are repeated to the query's heads. Decode (``query_lens`` None) is one
    query per row at its last position; prefill packs ``query_lens[b]`` queries per row, its last
    positions, each seeing up to its own.
    """
    block_size = k_cache.shape[2]
    query_lens = torch.ones_like(seq_lens) if query_lens is None else query_lens
    rows, start = [], 0
    for b, (seq_len, query_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), strict=True)):
        ids = tables[b, : -(-seq_len // block_size)].long()
        k, v = (
            repeat_kv(torch.cat(list(cache[ids].float()), dim=1)[:, :seq_len], query.shape[1])
            for cache in (k_cache, v_cache)
        )  # (H, T, D)
        q = query[start : start + query_len].transpose(0, 1).float()  # (H, Q, D)
        mask = causal_mask(seq_len, query_len)
        rows.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
        start += query_len
    return torch.cat(rows)


BACKENDS_HERE = ["GATHER", "IN_PLACE", "CPU_ATTN"] + (["FLEX_ATTENTION"] if flex_available() else [])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    heads=head_layouts,
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_every_backend_and_prefill_equal_the_reference_for_any_valid_table(
    num_blocks, block_size, lengths, heads, seed, data
):
    """Random tables drawn from a small pool, so blocks repeat within a row (a row lists a block
    twice) and across rows (shared blocks: the in-place path's shared branch), in any head layout."""
    gen = torch.Generator().manual_seed(seed)
    (num_heads, num_kv_heads), head_dim = heads, 4
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.randint(0, num_blocks, (len(lengths), width), generator=gen, dtype=torch.int32)
    kv_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(kv_shape, generator=gen) for _ in "kv")
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lengths)
    expected = table_reference(query, k_cache, v_cache, tables, seq_lens)
    for backend in BACKENDS_HERE:
        out = paged_attention(query, k_cache, v_cache, tables, seq_lens, backend=backend)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32], msg=backend)
    query_lens = torch.tensor(
        [data.draw(st.integers(0, n), label=f"query_len {i}") for i, n in enumerate(lengths)]
    )
    packed = torch.randn(int(query_lens.sum()), num_heads, head_dim, generator=gen)
    out = paged_prefill_attention(packed, k_cache, v_cache, tables, seq_lens, query_lens)
    expected = table_reference(packed, k_cache, v_cache, tables, seq_lens, query_lens)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32], msg="prefill")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("backend", BACKENDS_HERE)
def test_a_row_that_lists_one_block_twice_reads_it_twice(device, backend, num_heads, num_kv_heads):
    """Row 0 reads block 1 at entries 0 and 2 (the second time cut to 3 slots); row 1 reads it too."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(4, num_kv_heads, 4, 8, generator=gen).to(device) for _ in "kv")
    query = torch.randn(2, num_heads, 8, generator=gen).to(device)
    tables = torch.tensor([[1, 0, 1], [1, 3, 3]], device=device)
    seq_lens = torch.tensor([11, 12], device=device)
    out = paged_attention(query, k_cache, v_cache, tables, seq_lens, backend=backend)
    expected = table_reference(query.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), seq_lens.cpu())
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[torch.float32])

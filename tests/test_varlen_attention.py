"""One paged attention for an engine step: decodes, prompts and chunks packed together (lessons 06, 12).

``paged_prefill_attention`` (query lengths) and ``paged_attention_varlen`` (vLLM's
``query_start_loc``) in every backend, against SDPA with the causal mask at each sequence's offset
over its contiguous K/V: ragged batches mixing decodes (one query token), whole prompts and chunks
after cached tokens, sequences with no query token, every head layout, shuffled block tables padded
with ``-1``, stale data in every slot nobody wrote, float32 and float16. Triton runs in its
interpreter on the CPU (tests/conftest.py), compiled on CUDA; FlexAttention unfused on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.attention.backends import in_place
from paged_kv.attention.paged import paged_attention_varlen, paged_prefill_attention
from paged_kv.attention.registry import ATTENTION_BACKENDS, BACKENDS
from paged_kv.attention.triton_decode import query_tile_for, triton_available, triton_interpreted

from .helpers import max_examples
from .test_attention import TOLERANCES, head_layouts, prefill_query, prefill_reference, scattered_cache
from .test_attention import table_reference as table_reference_of

pytestmark = [
    pytest.mark.lesson06,
    pytest.mark.lesson12,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

# (num_heads, num_kv_heads): multi-head, grouped-query, multi-query.
HEADS = [pytest.param(4, 4, id="MHA"), pytest.param(4, 2, id="GQA"), pytest.param(4, 1, id="MQA")]

# A step as an engine packs it: a fresh prompt, a chunk after 8 cached tokens, a decode, a chunk
# ending mid-block, a sequence with nothing to compute, a decode.
SEQ_LENS = [9, 13, 6, 20, 4, 7]
QUERY_LENS = [9, 5, 1, 7, 0, 1]


def backends_on(device, dtype=torch.float32, cache_dtype=None) -> list[str]:
    """The backends that can run a ``dtype`` query over a ``cache_dtype`` cache (default ``dtype``) on
    ``device`` here: the Triton kernel where it compiles (CUDA) or interprets (CPU), FlexAttention
    where torch has it, the CPU kernel where a C compiler built it."""
    device = torch.device(device)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    runnable = []
    for name in ATTENTION_BACKENDS:
        if name == "TRITON_ATTN" and triton_available() and (device.type == "cuda") == triton_interpreted():
            continue  # the interpreter is for CPU tensors here, the compiler for CUDA ones
        if not BACKENDS[name].unavailable(device, dtype, cache_dtype):
            runnable.append(name)
    return runnable


def skip_unless_runnable(backend: str, device, dtype=torch.float32, cache_dtype=None) -> None:
    if backend not in backends_on(device, dtype, cache_dtype):
        pytest.skip(f"backend {backend!r} cannot run on {torch.device(device).type} here")


def starts_of(query_lens, device=None, dtype=torch.int32) -> torch.Tensor:
    """vLLM's ``query_start_loc``: 0, then the running sum of the query lengths."""
    lens = torch.as_tensor(query_lens, device=device)
    return torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(dtype)


def table_reference(packed, k_cache, v_cache, tables, seq_lens, query_lens):
    """``table_reference`` of a packed batch, skipping the sequences with no query token."""
    rows = [b for b, n in enumerate(query_lens.tolist()) if n]
    if not rows:
        return packed.float()
    index = torch.tensor(rows)
    return table_reference_of(packed, k_cache, v_cache, tables[index], seq_lens[index], query_lens[index])


# ------------------------------------------------------------------ every backend, the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN"])
def test_every_backend_equals_causal_sdpa_on_a_mixed_step(device, backend, num_heads, num_kv_heads, dtype):
    skip_unless_runnable(backend, device)
    cache = scattered_cache(SEQ_LENS, 4, num_kv_heads, head_dim=8, device=device, dtype=dtype, seed=21)
    tables = cache.block_tables_tensor(range(len(SEQ_LENS)))
    assert (tables == -1).any() and cache.get_block_mapping(3) != sorted(cache.get_block_mapping(3))
    query = prefill_query(cache, QUERY_LENS, seed=22, num_heads=num_heads)
    out = paged_prefill_attention(
        query,
        cache.k_cache,
        cache.v_cache,
        tables,
        torch.tensor(SEQ_LENS, device=device),
        QUERY_LENS,
        backend=backend,
    )
    assert out.shape == query.shape and out.dtype == dtype and out.device == query.device
    expected = prefill_reference(cache, query, SEQ_LENS, QUERY_LENS)  # float32, over the rounded inputs
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN"])
def test_a_step_of_decodes_and_one_of_prompts_equal_the_reference(device, backend):
    """The two ends of the mix: every query length 1 (auto's decode path), every row a whole prompt."""
    skip_unless_runnable(backend, device)
    lengths = [5, 12, 1, 8]
    cache = scattered_cache(lengths, 4, 2, head_dim=8, device=device, seed=23)
    tables, seq_lens = cache.block_tables_tensor(range(4)), torch.tensor(lengths, device=device)
    for query_lens in ([1, 1, 1, 1], lengths):
        query = prefill_query(cache, query_lens, seed=24, num_heads=4)
        out = paged_prefill_attention(
            query, cache.k_cache, cache.v_cache, tables, seq_lens, query_lens, backend=backend
        )
        expected = prefill_reference(cache, query, lengths, query_lens)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32], msg=str(query_lens))


@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN"])
def test_a_row_that_lists_one_block_twice_and_blocks_shared_between_rows(device, backend):
    """Row 0 reads block 1 at entries 0 and 2 (a chunk of 4 over it), row 1 shares block 1 (a chunk of 2)."""
    skip_unless_runnable(backend, device)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(4, 2, 4, 8, generator=gen).to(device) for _ in "kv")
    tables = torch.tensor([[1, 0, 1], [1, 3, 3]], device=device)
    seq_lens, query_lens = torch.tensor([11, 12], device=device), torch.tensor([4, 2], device=device)
    packed = torch.randn(6, 4, 8, generator=gen).to(device)
    out = paged_prefill_attention(packed, k_cache, v_cache, tables, seq_lens, query_lens, backend=backend)
    cpu = (t.cpu() for t in (packed, k_cache, v_cache, tables, seq_lens, query_lens))
    torch.testing.assert_close(out.cpu(), table_reference(*cpu), **TOLERANCES[torch.float32])


@settings(max_examples=max_examples(12), deadline=None)
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    heads=head_layouts,
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_torch_backends_equal_the_reference_for_any_packed_batch(
    num_blocks, block_size, lengths, heads, seed, data
):
    """Random tables from a small pool (blocks repeat within and across rows), any query length
    from 0 to a sequence's length, any head layout."""
    gen = torch.Generator().manual_seed(seed)
    (num_heads, num_kv_heads), head_dim = heads, 4
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.randint(0, num_blocks, (len(lengths), width), generator=gen, dtype=torch.int32)
    k_cache, v_cache = (
        torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen) for _ in "kv"
    )
    query_lens = torch.tensor(
        [data.draw(st.integers(0, n), label=f"query_len {i}") for i, n in enumerate(lengths)]
    )
    packed = torch.randn(int(query_lens.sum()), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lengths)
    expected = table_reference(packed, k_cache, v_cache, tables, seq_lens, query_lens)
    for backend in ("GATHER", "IN_PLACE", "CPU_ATTN"):
        out = paged_prefill_attention(packed, k_cache, v_cache, tables, seq_lens, query_lens, backend=backend)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32], msg=backend)


# ------------------------------------------------------------------------- vLLM's query_start_loc


@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN", "TRITON_ATTN"])
def test_query_start_loc_gives_what_query_lens_give(device, backend):
    """int32 starts as vLLM's runner holds them; with or without ``max_query_len`` and the checks."""
    skip_unless_runnable(backend, device)
    cache = scattered_cache(SEQ_LENS, 4, 2, head_dim=8, device=device, seed=25)
    tables, seq_lens = cache.block_tables_tensor(range(len(SEQ_LENS))), torch.tensor(SEQ_LENS, device=device)
    query = prefill_query(cache, QUERY_LENS, seed=26, num_heads=4)
    args = (query, cache.k_cache, cache.v_cache, tables, seq_lens)
    expected = paged_prefill_attention(*args, QUERY_LENS, backend=backend)
    starts = starts_of(QUERY_LENS, device)
    variants = [
        {},
        {"max_query_len": max(QUERY_LENS)},
        {"max_query_len": max(QUERY_LENS), "check": False},
        {"max_query_len": max(QUERY_LENS), "check": False, "query_start_loc_cpu": starts.cpu()},
    ]
    for kw in variants[3:] if backend == "TRITON_ATTN" else variants:  # the interpreter is slow
        out = paged_attention_varlen(*args, starts, backend=backend, **kw)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=str(kw))


def test_the_positional_signature_stays_and_the_backend_is_a_keyword():
    cache = scattered_cache([6, 3], seed=27)
    tables = cache.block_tables_tensor([0, 1])
    query = prefill_query(cache, [2, 3])
    by_position = paged_prefill_attention(query, cache.k_cache, cache.v_cache, tables, [6, 3], [2, 3], 0.5)
    expected = prefill_reference(cache, query, [6, 3], [2, 3], scale=0.5)
    torch.testing.assert_close(by_position, expected, **TOLERANCES[torch.float32])
    with pytest.raises(TypeError):
        paged_prefill_attention(query, cache.k_cache, cache.v_cache, tables, [6, 3], [2, 3], 0.5, "GATHER")


def good_varlen_inputs(device):
    """Sequences of 5 and 2 tokens, of which 3 and 2 are query tokens: 5 packed rows."""
    cache = scattered_cache([5, 2], block_size=4, device=device, seed=28)
    return {
        "query": prefill_query(cache, [3, 2], seed=29),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_tables": cache.block_tables_tensor([0, 1]),
        "seq_lens": torch.tensor([5, 2], device=device),
        "query_start_loc": torch.tensor([0, 3, 5], device=device),
    }


BAD_VARLEN_INPUTS = {
    "seq_lens floats": ("seq_lens", lambda a: a["seq_lens"].float(), "seq_lens must be an integer tensor"),
    "seq_lens other batch": ("seq_lens", lambda a: a["seq_lens"][:1], r"seq_lens must have shape \(2,\)"),
    "seq_len of 0": ("seq_lens", lambda a: a["seq_lens"] * 0, r"seq_lens\[0\] = 0 must be at least 1"),
    "starts floats": (
        "query_start_loc",
        lambda a: a["query_start_loc"].float(),
        "query_start_loc must be an",
    ),
    "starts too short": ("query_start_loc", lambda a: a["query_start_loc"][:2], r"must have shape \(3,\)"),
    "starts not from 0": ("query_start_loc", lambda a: a["query_start_loc"] + 1, "must start at 0"),
    "starts decreasing": (
        "query_start_loc",
        lambda a: torch.tensor([0, 6, 5]).to(a["seq_lens"]),
        "never decrease",
    ),
    "starts not ending at the rows": (
        "query_start_loc",
        lambda a: torch.tensor([0, 3, 4]).to(a["seq_lens"]),
        "end",
    ),
    "more query tokens than tokens": (
        "query_start_loc",
        lambda a: torch.tensor([0, 2, 5]).to(a["seq_lens"]),
        r"query_start_loc\[2\] - query_start_loc\[1\] = 3 query tokens, more than seq_lens\[1\] = 2",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VARLEN_INPUTS))
def test_varlen_bad_input_is_a_value_error_naming_the_argument(device, case):
    inputs = good_varlen_inputs(device)
    name, corrupt, message = BAD_VARLEN_INPUTS[case]
    inputs[name] = corrupt({key: t.clone() for key, t in inputs.items()})
    before = {key: t.clone() for key, t in inputs.items()}
    with pytest.raises(ValueError, match=rf"^{name}\b.*{message}|^{message}"):
        paged_attention_varlen(**inputs)
    assert all(torch.equal(inputs[key], before[key]) for key in inputs)  # nothing changed


def test_without_the_value_checks_the_shapes_are_still_checked(device):
    inputs = good_varlen_inputs(device)
    inputs["query_start_loc"] = inputs["query_start_loc"][:2]
    with pytest.raises(ValueError, match=r"^query_start_loc must have shape \(3,\)"):
        paged_attention_varlen(**inputs, check=False)
    inputs = good_varlen_inputs(device)
    with pytest.raises(ValueError, match=r"^max_query_len must be at least 0"):
        paged_attention_varlen(**inputs, max_query_len=-1)
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        paged_attention_varlen(**inputs, backend="fast")


def test_an_empty_step_and_a_step_of_no_query_tokens_give_empty_outputs(device):
    for backend in backends_on(device):
        inputs = good_varlen_inputs(device)
        inputs["query"] = inputs["query"][:0]
        inputs["query_start_loc"] = torch.zeros(3, dtype=torch.long, device=device)
        assert paged_attention_varlen(**inputs, backend=backend).shape == (0, 2, 8), backend
        inputs["block_tables"], inputs["seq_lens"] = inputs["block_tables"][:0], inputs["seq_lens"][:0]
        inputs["query_start_loc"] = inputs["query_start_loc"][:1]
        assert paged_attention_varlen(**inputs, backend=backend).shape == (0, 2, 8), backend


@pytest.mark.skipif(not torch.cuda.is_available(), reason="synchronisations are seen on CUDA only")
@pytest.mark.parametrize("backend", ["GATHER", "TRITON_ATTN"])
def test_the_hot_path_reads_nothing_back_from_the_gpu(backend):
    """With ``max_query_len`` given and ``check=False``, no call synchronises with the device."""
    skip_unless_runnable(backend, torch.device("cuda"))
    cache = scattered_cache(SEQ_LENS, 4, 2, head_dim=8, device="cuda", seed=30)
    args = (
        prefill_query(cache, QUERY_LENS, num_heads=4),
        cache.k_cache,
        cache.v_cache,
        cache.block_tables_tensor(range(len(SEQ_LENS))),
        torch.tensor(SEQ_LENS, device="cuda"),
        starts_of(QUERY_LENS, "cuda"),
    )
    kw = {"max_query_len": max(QUERY_LENS), "check": False, "backend": backend}
    paged_attention_varlen(*args, **kw)  # compiles the kernel first
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention_varlen(*args, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------ IN_PLACE's two halves


def spy(monkeypatch, module, name: str) -> list[tuple]:
    """Record the calls of ``module.<name>`` (the shapes of their first argument), still running it."""
    calls: list[tuple] = []
    real = getattr(module, name)

    def recording(first, *rest, **keywords):
        calls.append(tuple(first.shape))
        return real(first, *rest, **keywords)

    monkeypatch.setattr(module, name, recording)
    return calls


def test_in_place_reads_the_decodes_together_and_the_chunks_together(monkeypatch):
    """Five decodes, a sequence with nothing new, a chunk and a prompt: two products over the pool,
    one of the decodes (one query each) and one of the chunks (padded to the longest, 9)."""
    calls = spy(monkeypatch, in_place, "read_in_place")  # q: (rows, queries, heads, dim)
    lengths = [12] * 6 + [12, 9]
    cache = scattered_cache(lengths, block_size=4, seed=31)
    tables, seq_lens = cache.block_tables_tensor(range(8)), torch.tensor(lengths)
    mixed = [1, 1, 1, 0, 1, 1, 5, 9]
    query = prefill_query(cache, mixed)
    out = paged_prefill_attention(
        query, cache.k_cache, cache.v_cache, tables, seq_lens, mixed, backend="IN_PLACE"
    )
    torch.testing.assert_close(
        out, prefill_reference(cache, query, lengths, mixed), **TOLERANCES[torch.float32]
    )
    assert calls == [(5, 1, 2, 8), (2, 9, 2, 8)]
    calls.clear()
    decodes = prefill_query(cache, [1] * 8)
    paged_prefill_attention(
        decodes, cache.k_cache, cache.v_cache, tables, seq_lens, [1] * 8, backend="IN_PLACE"
    )
    assert calls == [(8, 1, 2, 8)]  # a step of decodes: one product, no split


# ------------------------------------------------------------------------- the Triton kernel's tiles

needs_kernel = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (Linux wheels only)"
)
KERNEL_DEVICE = torch.device("cpu" if triton_interpreted() else "cuda")


def test_a_decode_step_takes_one_query_token_per_program_and_a_chunk_up_to_16_rows():
    assert [query_tile_for(1, group) for group in (1, 4, 32)] == [1, 1, 1]
    assert [query_tile_for(5, group) for group in (1, 2, 4)] == [8, 8, 4]
    assert [query_tile_for(100, group) for group in (1, 2, 3, 16, 32)] == [16, 8, 5, 1, 1]


@needs_kernel
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2)])
def test_the_kernel_computes_a_prompt_of_several_tiles_in_vllms_layout(num_heads, num_kv_heads):
    """A prompt of 37 tokens (3 tiles of 16 with MHA, 8 with groups of 3: 5 tiles) beside a decode and a
    chunk, over K and V read in place from vLLM 0.33.0's layer layout, through their strides."""
    lengths, query_lens = [37, 20, 9], [37, 1, 6]
    cache = scattered_cache(lengths, 8, num_kv_heads, head_dim=8, device=KERNEL_DEVICE, seed=33)
    memory = torch.cat([cache.k_cache, cache.v_cache], dim=-1).transpose(1, 2).contiguous()
    view = memory.transpose(1, 2)  # (num_blocks, num_kv_heads, block_size, 2 * head_dim): vLLM's view
    k_view, v_view = view[..., :8], view[..., 8:]
    assert not k_view.is_contiguous()
    query = prefill_query(cache, query_lens, seed=34, num_heads=num_heads)
    tables, seq_lens = cache.block_tables_tensor(range(3)), torch.tensor(lengths, device=KERNEL_DEVICE)
    out = paged_prefill_attention(query, k_view, v_view, tables, seq_lens, query_lens, backend="TRITON_ATTN")
    torch.testing.assert_close(
        out, prefill_reference(cache, query, lengths, query_lens), **TOLERANCES[torch.float32]
    )


@needs_kernel
def test_the_kernel_never_reads_past_a_sequence_nor_a_padding_entry():
    """NaN in the tail of every last block and in every block nobody reads, and padding entries that
    name no block at all: the output is finite and unchanged."""
    lengths, query_lens = [3, 17, 8, 5], [3, 4, 1, 0]
    cache = scattered_cache(lengths, block_size=8, head_dim=8, device=KERNEL_DEVICE, seed=35)
    query = prefill_query(cache, query_lens, num_heads=4)
    tables, seq_lens = cache.block_tables_tensor(range(4)), torch.tensor(lengths, device=KERNEL_DEVICE)
    args = (seq_lens, query_lens)
    clean = paged_prefill_attention(query, cache.k_cache, cache.v_cache, tables, *args, backend="TRITON_ATTN")
    read = {b for seq in range(4) for b in cache.get_block_mapping(seq)}
    for cache_tensor in (cache.k_cache, cache.v_cache):
        cache_tensor[sorted(set(range(cache.num_blocks)) - read)] = float("nan")
        for seq, length in enumerate(lengths):
            cache_tensor[cache.get_block_mapping(seq)[-1], :, (length - 1) % 8 + 1 :] = float("nan")
    garbled = torch.where(tables == -1, 10**9, tables)  # an address far outside the cache
    out = paged_prefill_attention(query, cache.k_cache, cache.v_cache, garbled, *args, backend="TRITON_ATTN")
    assert torch.equal(out, clean) and not out.isnan().any()


@needs_kernel
@settings(max_examples=max_examples(4), deadline=None)
@given(
    num_blocks=st.integers(1, 5),
    block_size=st.sampled_from([1, 3, 4, 8]),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    heads=head_layouts,
    head_dim=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_kernel_equals_the_reference_for_any_packed_batch(
    num_blocks, block_size, lengths, heads, head_dim, seed, data
):
    """Random tables (blocks repeated within and across rows), block sizes, head counts and head dims
    that are not powers of two, any query length from 0 to a sequence's length."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.randint(0, num_blocks, (len(lengths), width), generator=gen, dtype=torch.int32)
    k_cache, v_cache = (
        torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen) for _ in "kv"
    )
    query_lens = torch.tensor(
        [data.draw(st.integers(0, n), label=f"query_len {i}") for i, n in enumerate(lengths)]
    )
    packed = torch.randn(int(query_lens.sum()), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lengths)
    expected = table_reference(packed, k_cache, v_cache, tables, seq_lens, query_lens)
    on_device = (t.to(KERNEL_DEVICE) for t in (packed, k_cache, v_cache, tables, seq_lens, query_lens))
    out = paged_prefill_attention(*on_device, backend="TRITON_ATTN")
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[torch.float32])

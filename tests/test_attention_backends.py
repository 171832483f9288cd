"""The attention backends' registry, their shared ``forward`` and the CPU kernel's build (lessons 05, 06).

Each backend's attention is held to the references in ``test_attention.py``,
``test_varlen_attention.py``, ``test_window_attention.py`` and ``test_fp8.py``, which run every
backend (``CPU_ATTN`` among them) on the same cases and property tests. Here: the names and the
platform's default, what ``forward`` writes and refuses, the layer's cache, and how the CPU kernel is
built, kept and missed.
"""

from __future__ import annotations

import ctypes
import shutil
from dataclasses import replace

import pytest
import torch

from paged_kv.attention import cpu_build
from paged_kv.attention.backend import AttentionImpl, LayerKVCache
from paged_kv.attention.backends import cpu_attn
from paged_kv.attention.backends.triton_attn import TritonAttentionImpl
from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.attention.paged import paged_attention, paged_prefill_attention
from paged_kv.attention.registry import (
    ATTENTION_BACKENDS,
    BACKENDS,
    attention_backend,
    check_backend_name,
    default_backend,
)
from paged_kv.kv.fp8 import fp8_dtypes
from paged_kv.kv.storage import KVStorage
from paged_kv.timing import torch_threads

from .test_attention import TOLERANCES, prefill_query, prefill_reference, scattered_cache
from .test_varlen_attention import backends_on, skip_unless_runnable

pytestmark = [
    pytest.mark.lesson05,
    pytest.mark.lesson06,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

HAS_KERNEL = not cpu_build.unavailable_reason()
needs_kernel = pytest.mark.skipif(
    not HAS_KERNEL, reason=f"no CPU kernel here: {cpu_build.unavailable_reason()}"
)


# ------------------------------------------------------------------------------------ the registry


def test_the_registry_names_vllms_backends_and_the_courses_own():
    assert ATTENTION_BACKENDS == ("CPU_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "GATHER", "IN_PLACE")
    assert all(BACKENDS[name].name == name and issubclass(BACKENDS[name], AttentionImpl) for name in BACKENDS)


@pytest.mark.parametrize(
    ("name", "expected"),
    [(None, None), ("CPU_ATTN", "CPU_ATTN"), ("GATHER", "GATHER"), ("IN_PLACE", "IN_PLACE")],
)
def test_a_name_is_a_backends_or_none_for_the_default(name, expected):
    assert check_backend_name(name) == expected


@pytest.mark.parametrize("bad", ["cpu_attn", "gather", "auto", "fast", "", 3, ["GATHER"], True])
def test_a_bad_name_is_a_value_error_naming_the_argument_and_listing_the_names(bad):
    names = "CPU_ATTN, TRITON_ATTN, FLEX_ATTENTION, GATHER, IN_PLACE, or None"
    with pytest.raises(
        ValueError, match=rf"^attention_backend must be one of {names} for the platform's default, got "
    ):
        check_backend_name(bad, "attention_backend")


def test_the_cpus_default_is_the_kernel_where_it_reads_the_dtypes_and_the_gather_elsewhere(monkeypatch):
    kernel = "CPU_ATTN" if HAS_KERNEL else "GATHER"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert default_backend("cpu", dtype) == kernel
    for cache_dtype in fp8_dtypes():
        assert default_backend("cpu", torch.float32, cache_dtype) == kernel
    assert default_backend("cpu", torch.float64) == "GATHER"  # the kernel computes in float32
    assert default_backend("meta", torch.float32) == "GATHER"
    assert attention_backend(None, "cpu", torch.float32) is BACKENDS[kernel]
    assert attention_backend("IN_PLACE", "cpu", torch.float32) is BACKENDS["IN_PLACE"]


def test_cudas_default_is_the_triton_kernel_where_it_can_run(monkeypatch):
    monkeypatch.setattr(TritonAttentionImpl, "unavailable", classmethod(lambda cls, *args: ""))
    assert default_backend("cuda", torch.float16) == "TRITON_ATTN"
    monkeypatch.setattr(TritonAttentionImpl, "unavailable", classmethod(lambda cls, *args: "no triton"))
    assert default_backend("cuda", torch.float16) == "GATHER"


def test_the_default_reads_the_query_and_cache_dtypes():
    """A float32 query over an fp8 cache: the CPU kernel reads fp8 in place, and refuses float64."""
    assert cpu_attn.CPUAttentionImpl.unavailable(
        torch.device("cpu"), torch.float64, torch.float64
    ).startswith("CPU_ATTN computes in float32")
    assert "not on meta" in cpu_attn.CPUAttentionImpl.unavailable(
        torch.device("meta"), torch.float32, torch.float32
    )


# ------------------------------------------------------------------------------- forward and the cache


def storage_and_step(dtype=torch.float32, **storage_kw):
    """A one-layer storage of 6 blocks of 4 holding two sequences of 6 and 3 tokens at scattered
    slots, and a step whose queries are their last 2 and 3 tokens (a chunk and a whole prompt)."""
    storage = KVStorage(1, 6, 4, 2, 8, dtype=dtype, **storage_kw)
    tables = torch.tensor([[4, 1], [2, -1]], dtype=torch.int32)
    positions = torch.tensor([4, 5, 0, 1, 2])
    rows = torch.tensor([0, 0, 1, 1, 1])
    slots = tables.long()[rows, positions // 4] * 4 + positions % 4
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 2, 5]),
        query_start_loc_cpu=torch.tensor([0, 2, 5]),
        query_lens=torch.tensor([2, 3]),
        seq_lens=torch.tensor([6, 3]),
        block_table=tables,
        num_reqs=2,
        max_query_len=3,
        slot_mapping=slots,
    )
    gen = torch.Generator().manual_seed(0)
    earlier = torch.randn(2, 4, 2, 8, generator=gen)  # sequence 0's first 4 tokens, in block 4
    storage.write(0, torch.tensor([4]), earlier[0], earlier[1])
    q = torch.randn(5, 4, 8, generator=gen)
    k, v = torch.randn(2, 5, 2, 8, generator=gen)
    return storage, metadata, q, k, v


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_forward_writes_the_new_kv_at_the_slots_then_attends_over_the_cache(backend):
    skip_unless_runnable(backend, "cpu")
    storage, metadata, q, k, v = storage_and_step()
    impl = BACKENDS[backend](4, 8, num_kv_heads=2)
    out = impl.forward(q, k, v, LayerKVCache.of_layer(storage, 0), metadata)
    for token, slot in enumerate(metadata.slot_mapping.tolist()):
        assert torch.equal(storage.k_caches[0][slot // 4, :, slot % 4], k[token])
        assert torch.equal(storage.v_caches[0][slot // 4, :, slot % 4], v[token])
    again = impl.forward(q, None, None, LayerKVCache(storage.k_caches[0], storage.v_caches[0]), metadata)
    torch.testing.assert_close(out, again, **TOLERANCES[torch.float32])
    gathered = BACKENDS["GATHER"](4, 8, num_kv_heads=2).forward(
        q, None, None, LayerKVCache.of_layer(storage, 0), metadata
    )
    torch.testing.assert_close(out, gathered, **TOLERANCES[torch.float32])


def test_forward_over_an_fp8_storage_quantizes_and_measures_the_scales_at_the_first_write():
    storage, metadata, q, k, v = storage_and_step(torch.float8_e4m3fn, calculate_kv_scales=True)
    storage.scales_to_calculate = {0}  # the earlier write measured them: measure at this one
    before = LayerKVCache.of_layer(storage, 0)
    out = BACKENDS["GATHER"](4, 8, num_kv_heads=2).forward(q, k, v, before, metadata)
    after = LayerKVCache.of_layer(storage, 0)
    assert (after.k_scale, after.v_scale) != (before.k_scale, before.v_scale)  # read after the write
    assert after.k_scale == pytest.approx(float(k.abs().max()) / 448)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_forward_refuses_half_a_write_a_write_with_nowhere_to_go_and_a_mismatched_layer():
    storage, metadata, q, k, v = storage_and_step()
    impl = BACKENDS["GATHER"](4, 8, num_kv_heads=2)
    cache = LayerKVCache.of_layer(storage, 0)
    with pytest.raises(ValueError, match=r"^key and value must be given together"):
        impl.forward(q, k, None, cache, metadata)
    with pytest.raises(ValueError, match=r"^kv_cache has no storage to write key and value through"):
        impl.forward(q, k, v, LayerKVCache(cache.k_cache, cache.v_cache), metadata)
    with pytest.raises(ValueError, match=r"^metadata has no slot_mapping"):
        impl.forward(q, k, v, cache, replace(metadata, slot_mapping=None))
    with pytest.raises(ValueError, match=r"^query must be \(num_tokens, 8, 8\) over a cache of 2 K/V heads"):
        BACKENDS["GATHER"](8, 8, num_kv_heads=2).forward(q, None, None, cache, metadata)
    with pytest.raises(ValueError, match=r"^block_table must be an integer tensor"):
        bad = replace(metadata, block_table=metadata.block_table.float())
        impl.forward(q, None, None, cache, bad)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"num_heads": 0}, "^num_heads must be at least 1"),
        ({"num_kv_heads": 3}, "^num_kv_heads 3 must divide num_heads 4"),
        ({"scale": 0.0}, "^scale must be a positive finite number"),
        ({"sliding_window": 0}, "^sliding_window must be at least 1"),
        ({"logits_soft_cap": -1.0}, "^logits_soft_cap must be a positive finite number"),
        ({"logits_soft_cap": True}, "^logits_soft_cap must be a positive finite number"),
    ],
)
def test_an_implementation_refuses_bad_settings_naming_them(keywords, message):
    settings = {"num_heads": 4, "head_size": 8} | keywords
    with pytest.raises(ValueError, match=message):
        BACKENDS["GATHER"](**settings)


def test_the_default_scale_is_one_over_the_root_of_the_head_size_and_the_repr_says_it_all():
    impl = BACKENDS["IN_PLACE"](4, 16, num_kv_heads=2, sliding_window=8, logits_soft_cap=50.0)
    assert impl.scale == 0.25 and impl.num_kv_heads == 2
    assert repr(impl) == (
        "InPlaceImpl(IN_PLACE: 4 heads over 2, head_size 16, scale 0.25, sliding_window 8, "
        "logits_soft_cap 50.0)"
    )


def test_a_layer_cache_checks_its_scales_and_reads_a_storage_layer():
    storage = KVStorage(2, 4, 4, 2, 8, dtype=torch.float8_e5m2, k_scale=[1.0, 0.5], v_scale=[2.0, 0.25])
    cache = LayerKVCache.of_layer(storage, 1)
    assert cache.k_cache is storage.k_caches[1] and (cache.k_scale, cache.v_scale) == (0.5, 0.25)
    assert cache.is_fp8 and cache.num_blocks == 4 and cache.block_size == 4
    float_pool = torch.zeros(4, 2, 4, 8)
    with pytest.raises(ValueError, match=r"^k_scale and v_scale apply to fp8 caches"):
        LayerKVCache(float_pool, float_pool, k_scale=2.0)
    with pytest.raises(ValueError, match=r"^v_scale must be a positive finite number"):
        LayerKVCache(float_pool, float_pool, v_scale=float("nan"))
    with pytest.raises(ValueError, match=r"^k_cache must be a torch.Tensor"):
        LayerKVCache([0.0], float_pool)


def test_metadata_counts_its_tokens_on_the_host_and_knows_a_step_of_decodes():
    _, metadata, *_ = storage_and_step()
    assert metadata.num_tokens == 5 and not metadata.is_decode_only
    decodes = replace(metadata, max_query_len=1, query_start_loc_cpu=torch.arange(3))
    assert decodes.is_decode_only and decodes.num_tokens == 2


# ------------------------------------------------------------------------------------- the CPU kernel


@needs_kernel
def test_the_kernel_reads_a_strided_view_of_vllms_layer_layout_in_place():
    """K and V side by side in the last axis, slots before heads in memory (vLLM 0.33.0's layer)."""
    lengths, query_lens = [37, 20, 9], [37, 1, 6]
    cache = scattered_cache(lengths, 8, 2, head_dim=8, seed=33)
    memory = torch.cat([cache.k_cache, cache.v_cache], dim=-1).transpose(1, 2).contiguous()
    view = memory.transpose(1, 2)
    k_view, v_view = view[..., :8], view[..., 8:]
    assert not k_view.is_contiguous()
    query = prefill_query(cache, query_lens, seed=34, num_heads=6)
    tables, seq_lens = cache.block_tables_tensor(range(3)), torch.tensor(lengths)
    out = paged_prefill_attention(query, k_view, v_view, tables, seq_lens, query_lens, backend="CPU_ATTN")
    torch.testing.assert_close(
        out, prefill_reference(cache, query, lengths, query_lens), **TOLERANCES[torch.float32]
    )


@needs_kernel
def test_the_kernel_gives_the_same_numbers_on_one_thread_and_on_several():
    """A step large enough for OpenMP (above PARALLEL_WORK): each task computes alone, so the threads
    change nothing, bit for bit."""
    lengths, query_lens = [300, 260, 90, 64], [1, 64, 90, 1]
    cache = scattered_cache(lengths, 16, 2, head_dim=32, seed=40)
    query = prefill_query(cache, query_lens, seed=41, num_heads=4)
    tables, seq_lens = cache.block_tables_tensor(range(4)), torch.tensor(lengths)
    assert sum(query_lens) * tables.shape[1] * 16 * 4 * 32 >= cpu_attn.PARALLEL_WORK
    args = (query, cache.k_cache, cache.v_cache, tables, seq_lens, query_lens)
    with torch_threads(1):
        one = paged_prefill_attention(*args, backend="CPU_ATTN")
    with torch_threads(2):
        two = paged_prefill_attention(*args, backend="CPU_ATTN")
    assert torch.equal(one, two)
    torch.testing.assert_close(
        one, prefill_reference(cache, query, lengths, query_lens), **TOLERANCES[torch.float32]
    )


@needs_kernel
def test_the_kernel_is_called_through_ctypes_cdll_which_releases_the_gil():
    lib, reason = cpu_build._built()
    assert reason == "" and isinstance(lib, ctypes.CDLL) and not isinstance(lib, ctypes.PyDLL)
    assert cpu_build.cpu_kernel().argtypes == cpu_build.ARGTYPES


@pytest.mark.parametrize("dtype", [torch.float16, *fp8_dtypes()], ids=str)
def test_the_lookup_tables_hold_every_bit_patterns_value(dtype):
    table = cpu_attn._lookup_table(dtype)
    bits = 16 if dtype == torch.float16 else 8
    assert table.shape == (1 << bits,) and table.dtype == torch.float32
    signed = torch.int16 if bits == 16 else torch.int8
    for pattern in (0, 1, 0x3C, (1 << (bits - 1)) - 1, 1 << (bits - 1), (1 << bits) - 1):
        value = torch.tensor([pattern - (1 << bits) * (pattern >= 1 << (bits - 1))], dtype=signed).view(dtype)
        torch.testing.assert_close(
            table[pattern : pattern + 1], value.float(), equal_nan=True, rtol=0, atol=0
        )
    assert cpu_attn._lookup_table(torch.float32) is None and cpu_attn._lookup_table(torch.bfloat16) is None


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A cache folder of this test's own and a process that has not looked for the kernel yet;
    afterwards the usual library is found again."""
    monkeypatch.setenv("PAGED_KV_CACHE_DIR", str(tmp_path))
    cpu_build.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_build.cache_clear()


@needs_kernel
def test_the_library_is_built_once_into_a_file_keyed_by_its_source(fresh_build, monkeypatch):
    assert cpu_build.unavailable_reason() == ""
    (built,) = fresh_build.glob("cpu_attn-*")
    stamp = built.stat().st_mtime_ns
    cpu_build.cache_clear()
    assert cpu_build.unavailable_reason() == "" and built.stat().st_mtime_ns == stamp  # loaded, not built
    edited = fresh_build / "cpu_attn.c"
    edited.write_text(cpu_build.SOURCE.read_text() + "\n/* an edit */\n")
    monkeypatch.setattr(cpu_build, "SOURCE", edited)
    cpu_build.cache_clear()
    assert cpu_build.unavailable_reason() == ""
    assert len(list(fresh_build.glob("cpu_attn-*"))) == 2  # another key: built anew beside the first


def test_without_a_compiler_the_default_gathers_and_the_kernel_says_why(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    reason = cpu_build.unavailable_reason()
    assert reason.startswith("no C compiler found (looked for $CC, cc, gcc and clang on the PATH)")
    assert cpu_build.cpu_kernel() is None and default_backend("cpu", torch.float32) == "GATHER"
    cache = scattered_cache([5, 9])
    query, tables = prefill_query(cache, [1, 1], num_heads=2), cache.block_tables_tensor([0, 1])
    with pytest.raises(ValueError, match=r"^CPU_ATTN cannot be built here: no C compiler found"):
        paged_attention(query, cache.k_cache, cache.v_cache, tables, [5, 9], backend="CPU_ATTN")
    expected = paged_attention(query, cache.k_cache, cache.v_cache, tables, [5, 9], backend="GATHER")
    assert torch.equal(paged_attention(query, cache.k_cache, cache.v_cache, tables, [5, 9]), expected)


@pytest.mark.skipif(shutil.which("false") is None, reason="no `false` command to stand for a broken compiler")
def test_a_compiler_that_fails_every_flag_set_is_reported_with_its_command(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("false"))
    reason = cpu_build.unavailable_reason()
    assert " -O3 " in reason and "failed" in reason and not list(fresh_build.glob("cpu_attn-*"))
    assert "CPU_ATTN" not in backends_on("cpu")

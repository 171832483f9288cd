"""Sizing the KV cache from a memory budget (lessons 00 and 09): bytes per token and block, budgets."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_kv.kv import sizing
from paged_kv.kv.sizing import KVCacheSpec, device_memory, format_bytes, kv_cache_budget
from paged_kv.kv.storage import KVStorage

pytestmark = [pytest.mark.lesson09, pytest.mark.lesson14]

KiB, MiB, GiB = 2**10, 2**20, 2**30
LLAMA_3_8B = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
SMOLLM2_135M = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)

FLOAT_DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])
COUNTS = st.integers(min_value=1, max_value=128)
SPECS = st.builds(KVCacheSpec, COUNTS, COUNTS, COUNTS, FLOAT_DTYPES)


# ------------------------------------------------------------------------------ KVCacheSpec


def test_llama_3_8b_costs_128_kib_per_token_and_2_mib_per_block_of_16():
    assert LLAMA_3_8B.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072 == 128 * KiB
    assert LLAMA_3_8B.bytes_per_block(16) == 2 * MiB
    # Grouped-query attention: the 32 query heads do not count, the 8 KV heads do.
    llama_2_7b = KVCacheSpec(num_layers=32, num_kv_heads=32, head_dim=128, dtype=torch.float16)
    assert llama_2_7b.bytes_per_token == 512 * KiB == 4 * LLAMA_3_8B.bytes_per_token


def test_smollm2_135m_costs_23040_bytes_per_token_in_16_bit():
    assert SMOLLM2_135M.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert KVCacheSpec(30, 3, 64, torch.float16).bytes_per_token == 23040
    assert KVCacheSpec(30, 3, 64, torch.float32).bytes_per_token == 2 * 23040
    assert SMOLLM2_135M.bytes_per_block(16) == 368640


def test_num_blocks_is_the_floor_of_budget_over_block_bytes():
    block = LLAMA_3_8B.bytes_per_block(16)
    assert LLAMA_3_8B.num_blocks(0, 16) == 0
    assert LLAMA_3_8B.num_blocks(block - 1, 16) == 0  # less than one block holds no block
    assert LLAMA_3_8B.num_blocks(block, 16) == 1
    assert LLAMA_3_8B.num_blocks(10 * block + block - 1, 16) == 10
    assert LLAMA_3_8B.num_blocks(40 * GiB, 16) == 20480
    assert LLAMA_3_8B.num_blocks(40 * GiB, 32) == 10240


def test_the_spec_is_frozen_and_compares_by_value():
    with pytest.raises(AttributeError):
        LLAMA_3_8B.num_layers = 16  # type: ignore[misc]
    assert KVCacheSpec(32, 8, 128, torch.bfloat16) == LLAMA_3_8B
    assert len({LLAMA_3_8B, KVCacheSpec(32, 8, 128, torch.bfloat16), SMOLLM2_135M}) == 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((0, 8, 128, torch.bfloat16), "num_layers must be at least 1, got 0"),
        ((32, -1, 128, torch.bfloat16), "num_kv_heads must be at least 1, got -1"),
        ((32, 8, 0, torch.bfloat16), "head_dim must be at least 1, got 0"),
        ((32.0, 8, 128, torch.bfloat16), "num_layers must be an integer"),
        ((32, True, 128, torch.bfloat16), "num_kv_heads must be an integer, got the bool"),
        ((32, 8, 128, torch.int8), "dtype must be a floating point torch.dtype, got torch.int8"),
        ((32, 8, 128, "bfloat16"), "dtype must be a floating point torch.dtype"),
    ],
)
def test_a_bad_spec_is_a_value_error_naming_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        KVCacheSpec(*arguments)


def test_integer_like_counts_are_stored_as_ints():
    spec = KVCacheSpec(torch.tensor(32), 8, 128, torch.bfloat16)
    assert type(spec.num_layers) is int and spec == LLAMA_3_8B


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: LLAMA_3_8B.bytes_per_block(0), "block_size must be at least 1, got 0"),
        (lambda: LLAMA_3_8B.bytes_per_block(16.0), "block_size must be an integer"),
        (lambda: LLAMA_3_8B.num_blocks(-1, 16), "budget_bytes must be at least 0, got -1"),
        (lambda: LLAMA_3_8B.num_blocks(1.5e9, 16), "budget_bytes must be an integer"),
        (lambda: LLAMA_3_8B.num_blocks(2**30, 0), "block_size must be at least 1, got 0"),
    ],
)
def test_bad_block_size_or_budget_is_a_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@given(SPECS, st.integers(min_value=0, max_value=2**45), st.integers(min_value=1, max_value=256))
def test_num_blocks_is_the_most_that_fit(spec, budget, block_size):
    blocks, block = spec.num_blocks(budget, block_size), spec.bytes_per_block(block_size)
    assert blocks * block <= budget < (blocks + 1) * block


@given(SPECS, st.integers(min_value=1, max_value=256), st.integers(min_value=1, max_value=8))
def test_bytes_scale_linearly_in_layers_heads_dim_and_block_size(spec, block_size, factor):
    block = spec.bytes_per_block(block_size)
    assert spec.bytes_per_block(block_size * factor) == factor * block
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        scaled = KVCacheSpec(**{**vars(spec), name: getattr(spec, name) * factor})
        assert scaled.bytes_per_block(block_size) == factor * block, name
    assert block == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * block_size * spec.dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_layers", "block_size", "kv_heads", "head_dim"), [(1, 16, 4, 32), (3, 4, 2, 8)])
def test_the_spec_agrees_with_the_storage_it_sizes(device, dtype, num_layers, block_size, kv_heads, head_dim):
    # Positional arguments: (num_layers, num_blocks, block_size, KV heads, head_dim, dtype, device).
    storage = KVStorage(num_layers, 2, block_size, kv_heads, head_dim, dtype, device)
    spec = KVCacheSpec(num_layers, kv_heads, head_dim, dtype)
    assert spec.bytes_per_block(block_size) == storage.bytes_per_block
    pools = (*storage.k_caches, *storage.v_caches)
    assert spec.num_blocks(sum(p.numel() * p.element_size() for p in pools), block_size) == 2


# ------------------------------------------------------------------------------ device_memory


def test_device_memory_of_this_device(device):
    if device.type == "cuda":
        assert device_memory(device) == torch.cuda.get_device_properties(device).total_memory
    else:
        assert device_memory(device) == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert device_memory(str(device)) == device_memory(device) > 0


def test_device_memory_says_when_the_cpu_memory_cannot_be_read(monkeypatch):
    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(sizing.os, "sysconf", no_sysconf)
    with pytest.raises(OSError, match=r"cannot read this machine's physical memory .* budget in bytes"):
        device_memory("cpu")
    monkeypatch.setattr(sizing.os, "sysconf", lambda name: -1)
    with pytest.raises(OSError, match="reports no physical memory"):
        device_memory("cpu")
    monkeypatch.delattr(sizing.os, "sysconf")  # Windows has none
    with pytest.raises(OSError, match="give the KV cache budget in bytes"):
        device_memory("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_device_memory_of_a_missing_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="device 'cuda' is not available: no CUDA GPU is visible"):
        device_memory("cuda")


def test_device_memory_of_a_gpu_index_past_the_last_is_a_value_error(monkeypatch):
    monkeypatch.setattr(sizing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sizing.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 'cuda:3' does not exist: 1 CUDA GPU\(s\)"):
        device_memory("cuda:3")


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("meta", "device_memory reads CUDA and CPU memory, not 'meta'"),
        ("no-such-device", "a device string such as 'cpu' or 'cuda:0', got 'no-such-device'"),
        (3.5, r"device must be a torch.device or a device string .*, got 3.5"),
    ],
)
def test_device_memory_of_another_kind_of_device_is_a_value_error(device, message):
    with pytest.raises(ValueError, match=message):
        device_memory(device)


# ------------------------------------------------------------------------------ kv_cache_budget


def test_the_budget_is_the_allowed_memory_less_the_model():
    assert kv_cache_budget(1000, 0.5, 100) == 400
    assert kv_cache_budget(1000, 1.0, 0) == 1000
    assert kv_cache_budget(1000, 1, 999) == 1
    # Llama-3-8B in bf16 on a 24 GiB GPU at 0.9: the weights leave about 6.6 GiB, 3,400 blocks of 16.
    budget = kv_cache_budget(24 * GiB, 0.9, int(8.03e9) * 2)
    assert budget == int(24 * GiB * 0.9) - 16_060_000_000 == 7_132_823_398
    assert LLAMA_3_8B.num_blocks(budget, 16) == 3401


@pytest.mark.parametrize(
    ("non_kv", "message"),
    [
        (
            500,
            r"no memory is left for the KV cache: the model takes 500 B of the 500 B that "
            r"gpu_memory_utilization=0.5 allows \(of 1000 B\), which leaves nothing",
        ),
        (
            3 * KiB,
            r"the model takes 3 KiB of the 1 KiB that gpu_memory_utilization=0.5 allows \(of 2 KiB\), "
            r"2 KiB more than that",
        ),
    ],
)
def test_no_room_left_says_how_much_is_missing(non_kv, message):
    total = 1000 if non_kv == 500 else 2 * KiB
    with pytest.raises(ValueError, match=message):
        kv_cache_budget(total, 0.5, non_kv)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((0, 0.9, 0), "total_memory must be at least 1, got 0"),
        ((2.4e10, 0.9, 0), "total_memory must be an integer"),
        ((1000, 0.9, -1), "non_kv_memory must be at least 0, got -1"),
        ((1000, 0, 0), r"gpu_memory_utilization must be in \(0, 1\], got 0"),
        ((1000, 1.5, 0), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ((1000, -0.1, 0), r"gpu_memory_utilization must be in \(0, 1\], got -0.1"),
        ((1000, math.nan, 0), r"gpu_memory_utilization must be in \(0, 1\], got nan"),
        ((1000, "0.9", 0), "gpu_memory_utilization must be a number, got str"),
        ((1000, True, 0), "gpu_memory_utilization must be a number, got bool"),
    ],
)
def test_bad_budget_arguments_are_value_errors_naming_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        kv_cache_budget(*arguments)


@given(
    st.integers(min_value=1, max_value=2**44),
    st.floats(min_value=0.01, max_value=1.0),
    st.integers(min_value=0, max_value=2**44),
)
def test_the_budget_and_the_model_share_exactly_the_allowed_memory(total, utilization, non_kv):
    allowed = int(total * utilization)
    if non_kv >= allowed:
        with pytest.raises(ValueError, match="no memory is left for the KV cache"):
            kv_cache_budget(total, utilization, non_kv)
    else:
        assert kv_cache_budget(total, utilization, non_kv) + non_kv == allowed <= total


# ------------------------------------------------------------------------------ format_bytes


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (640, "640 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (23040, "22.5 KiB"),
        (131072, "128 KiB"),
        (2 * MiB, "2 MiB"),
        (MiB - 1, "1.0 MiB"),  # 1023.999 KiB rounds up to the next unit, not to "1024.0 KiB"
        (int(5.4 * GiB), "5.4 GiB"),
        (3 * 2**40, "3 TiB"),
        (2**50, "1024 TiB"),
    ],
)
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize(("value", "message"), [(-1, "must be at least 0"), (1.5, "must be an integer")])
def test_format_bytes_refuses_what_is_not_a_byte_count(value, message):
    with pytest.raises(ValueError, match=f"num_bytes {message}"):
        format_bytes(value)

"""Who picks the block size (lesson 14): the backends' kernel block sizes and vLLM 0.33.0's choice."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.kv.block_size import (
    BACKEND_BLOCK_SIZES,
    CPU_DEFAULT_BLOCK_SIZE,
    DEFAULT_BLOCK_SIZE,
    EXACT_SIZES_ONLY,
    MultipleOf,
    common_block_size,
    kernel_block_size,
    preferred_block_size,
    supports_block_size,
)

pytestmark = pytest.mark.lesson14

# ------------------------------------------------------------------------------ vLLM's backends


def test_the_defaults_are_vllms():
    assert DEFAULT_BLOCK_SIZE == 16  # CacheConfig.DEFAULT_BLOCK_SIZE
    assert CPU_DEFAULT_BLOCK_SIZE == 128  # CpuPlatform.update_block_size_for_backend


@pytest.mark.parametrize(
    ("backends", "default", "expected"),
    [
        (["FLASH_ATTN"], 16, 16),
        (["FLASHINFER"], 16, 16),
        (["TRITON_ATTN"], 16, 16),
        (["FLEX_ATTENTION"], 16, 16),
        (["ROCM_ATTN"], 16, 16),
        (["CPU_ATTN"], CPU_DEFAULT_BLOCK_SIZE, 128),  # the CPU platform starts from 128, a multiple of 32
        (["CPU_ATTN"], 16, 32),  # from 16, CPU_ATTN takes its smallest size
        (["FLASHMLA"], 16, 64),
        (["CUTLASS_MLA"], 16, 128),
        (["FLASHINFER_MLA"], 16, 32),
        (["CPU_MLA"], CPU_DEFAULT_BLOCK_SIZE, 16),  # exactly 16, no multiple
        (["FLASHINFER", "FLASHMLA"], 16, 64),  # 16 is no multiple of 64; lcm(16, 64) = 64
        (["FLASH_ATTN", "FLASHINFER"], 16, 16),  # both accept the default
        (["FLASHINFER", "CUTLASS_MLA"], 16, 128),  # an exact 16 accepts 128, a multiple of it
        (["TRITON_ATTN", "CPU_ATTN"], 16, 32),
        (["FLASH_ATTN", "FLASHINFER"], CPU_DEFAULT_BLOCK_SIZE, 128),
    ],
)
def test_vllms_backends_get_vllms_block_size(backends, default, expected):
    assert common_block_size(backends, default) == expected
    if len(backends) == 1:
        assert preferred_block_size(backends[0], default) == expected


def test_names_and_lists_are_the_same_backends():
    lists = [list(BACKEND_BLOCK_SIZES[name]) for name in ("FLASHINFER", "FLASHMLA")]
    assert common_block_size(lists) == common_block_size(["FLASHINFER", "FLASHMLA"]) == 64
    assert common_block_size(["FLASH_ATTN", [64]]) == 64


def test_backends_with_no_common_size_are_refused_with_each_ones_sizes():
    with pytest.raises(ValueError, match=r"CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]"):
        common_block_size(["CPU_MLA", "CPU_ATTN"], CPU_DEFAULT_BLOCK_SIZE)  # lcm 32: CPU_MLA takes 16 only
    with pytest.raises(ValueError, match=r"backend 1: \[128\]"):
        common_block_size(["CPU_MLA", [128]])


def test_the_lcm_matters():
    assert common_block_size([[24], [MultipleOf(16)]]) == 48
    assert common_block_size([[24, 32], [MultipleOf(16)]]) == 32  # the smallest candidate, not the first
    assert common_block_size([[64, 16], [MultipleOf(24)]]) == 48  # 48 before 192
    assert common_block_size([[MultipleOf(3)], [MultipleOf(4)], [MultipleOf(5)]]) == 60
    assert common_block_size([[], [64]]) == 64  # no sizes: any size, 1 in the LCMs
    assert common_block_size([[], []]) == 16
    assert common_block_size([]) == 16  # no backend: the default, as vLLM's
    assert common_block_size([[MultipleOf(48)], [MultipleOf(32)]], 128) == 96


def test_the_manager_rule_accepts_multiples_of_exact_sizes_and_the_kernel_rule_does_not():
    assert supports_block_size([64], 128) and supports_block_size("FLASHMLA", 192)
    assert not supports_block_size([64], 32)
    assert supports_block_size([], 7)  # an empty list accepts anything
    assert not supports_block_size("CPU_MLA", 32) and supports_block_size([16], 32)
    assert kernel_block_size(128, "FLASHMLA") == 64  # 128 is split into two kernel blocks of 64
    assert kernel_block_size(128, "CUTLASS_MLA") == 128


def test_a_hybrid_models_544_token_blocks():
    assert kernel_block_size(544, "FLASH_ATTN") == 544  # a multiple of 16: not split
    assert kernel_block_size(544, "TRITON_ATTN") == 544
    assert kernel_block_size(544, "FLASHINFER") == 32  # 17 kernel blocks of 32; 544 is no multiple of 64
    with pytest.raises(ValueError, match="no kernel block of \\[64\\] divides a block of 544"):
        kernel_block_size(544, "FLASHMLA")
    with pytest.raises(ValueError, match="manager_block_size"):
        kernel_block_size(16, [])  # vLLM's kernel rule finds no size in an empty list


def test_multiple_of_is_vllms():
    assert MultipleOf(16) == MultipleOf(16) and repr(MultipleOf(16)) == "MultipleOf(16)"
    with pytest.raises(AttributeError):
        MultipleOf(16).base = 32  # type: ignore[misc]
    assert all(name == name.upper() for name in BACKEND_BLOCK_SIZES)
    assert set(BACKEND_BLOCK_SIZES) >= EXACT_SIZES_ONLY


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: MultipleOf(0), "base must be at least 1"),
        (lambda: MultipleOf(True), "base must be an integer"),
        (lambda: MultipleOf(16.0), "base must be an integer"),
        (lambda: common_block_size("FLASH_ATTN"), "backends must be a list of backends"),
        (lambda: common_block_size(None), "backends must be a list"),
        (lambda: common_block_size([16, 32]), "backends\\[0\\] must be a backend's name or its list"),
        (lambda: common_block_size([[0]]), "backends\\[0\\]\\[0\\] must be at least 1"),
        (lambda: common_block_size([[16], ["x"]]), "backends\\[1\\]\\[0\\] must be an integer"),
        (lambda: common_block_size(["NOPE"]), "backends\\[0\\]: no backend named 'NOPE'"),
        (lambda: common_block_size(["FLASH_ATTN"], 0), "default_block_size must be at least 1"),
        (lambda: supports_block_size([16], 0), "block_size must be at least 1"),
        (lambda: supports_block_size({16}, 16), "supported must be a backend's name or its list"),
        (lambda: preferred_block_size([16], 16.0), "default_block_size must be an integer"),
        (lambda: kernel_block_size(True, [16]), "manager_block_size must be an integer"),
        (lambda: kernel_block_size(16, "nope"), "supported: no backend named"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------ properties

SIZES = st.one_of(st.integers(1, 48), st.builds(MultipleOf, st.integers(1, 48)))
BACKEND = st.one_of(
    st.lists(SIZES, min_size=0, max_size=3),
    st.sampled_from(sorted(set(BACKEND_BLOCK_SIZES) - EXACT_SIZES_ONLY)),
)
DEFAULTS = st.sampled_from([1, 16, 32, 128, 24])


def _candidates(backends: list) -> list[int]:
    sizes = [BACKEND_BLOCK_SIZES[b] if isinstance(b, str) else b for b in backends]
    bases = [[s.base if isinstance(s, MultipleOf) else s for s in group] or [1] for group in sizes]
    return sorted({math.lcm(*choice) for choice in itertools.product(*bases)})


@settings(max_examples=40, deadline=None)
@given(st.lists(BACKEND, min_size=1, max_size=3), DEFAULTS)
def test_the_choice_is_accepted_by_every_backend_and_no_smaller_candidate_is(backends, default):
    chosen = common_block_size(backends, default)
    assert all(supports_block_size(backend, chosen) for backend in backends)
    if all(supports_block_size(backend, default) for backend in backends):
        assert chosen == default
    elif len(backends) == 1:
        assert chosen == preferred_block_size(backends[0], default)
    else:
        candidates = _candidates(backends)
        assert chosen in candidates
        assert not [c for c in candidates if c < chosen and all(supports_block_size(b, c) for b in backends)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 600), BACKEND)
def test_a_kernel_block_divides_the_manager_block_and_the_kernels_accept_it(manager, backend):
    sizes = BACKEND_BLOCK_SIZES[backend] if isinstance(backend, str) else backend
    try:
        kernel = kernel_block_size(manager, backend)
    except ValueError:
        assert not any(manager % _base(s) == 0 for s in sizes), "a size divides the manager block"
        return
    assert manager % kernel == 0
    exact = [s for s in sizes if isinstance(s, int)]
    if kernel != manager:
        assert kernel in exact and kernel == max(s for s in exact if manager % s == 0)
    else:
        assert manager in exact or any(isinstance(s, MultipleOf) and manager % s.base == 0 for s in sizes)


def _base(size) -> int:
    return size.base if isinstance(size, MultipleOf) else size


def test_the_docstring_examples_hold():
    import doctest

    from paged_kv.kv import block_size

    assert doctest.testmod(block_size).failed == 0

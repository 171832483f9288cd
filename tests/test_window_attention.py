"""Sliding-window attention and logit soft-capping, in every backend of paged attention.

Hybrid models (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2 and 3) have layers that attend to
a sliding window of ``W`` tokens: the query at position ``p`` sees positions ``max(0, p - W + 1) ..
p`` (Hugging Face's ``kv_idx > q_idx - sliding_window``, vLLM's FlashAttention ``window_size=(W - 1,
0)``); Gemma 2 soft-caps its scaled scores, ``c * tanh(s / c)``, before the mask and the softmax.
``paged_attention``, ``paged_prefill_attention`` and ``paged_attention_varlen`` take both, as
``sliding_window`` and ``softcap``, in every backend: the reference here is contiguous attention
written without the package (einsum scores, the soft cap, the sliding causal mask), itself checked
against SDPA with an explicit boolean mask.

An engine frees the blocks that fall wholly before a sliding-window layer's window and puts its
null block (block 0, never written) in their table entries, or leaves ids of blocks that other
sequences own by now: every case here does so after computing the expected output, fills the null
block, the blocks those entries named and the free blocks with NaN, and expects the same finite
output. The Triton kernel runs in its interpreter on the CPU (slow): a handful of small cases.
"""

from __future__ import annotations

import collections
import inspect
import re
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.attention.paged import paged_attention, paged_attention_varlen, paged_prefill_attention
from paged_kv.attention.registry import ATTENTION_BACKENDS
from paged_kv.attention.triton_decode import triton_available, triton_interpreted

from .helpers import max_examples
from .test_attention import HEADS, TOLERANCES, causal_mask, head_layouts, repeat_kv
from .test_varlen_attention import backends_on, skip_unless_runnable, starts_of

pytestmark = [
    pytest.mark.lesson13,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

BACKENDS = list(ATTENTION_BACKENDS)

# A step as an engine packs it: a fresh prompt of 9 (two tiles of the kernel with 2 query heads per
# KV head), a chunk of 5 after 8 cached tokens, a decode, a chunk of 7 ending mid-block, a sequence
# with nothing to compute, a decode.
SEQ_LENS = [9, 13, 6, 20, 4, 7]
QUERY_LENS = [9, 5, 1, 7, 0, 1]


# ------------------------------------------------------------------------------------ the reference


def sliding_mask(seq_len: int, query_len: int, window: int | None) -> torch.Tensor:
    """``(query_len, seq_len)``: query token ``i``, at ``q_idx = seq_len - query_len + i``, sees
    ``kv_idx <= q_idx`` and, with a window, ``kv_idx > q_idx - window`` (Hugging Face's
    ``sliding_window_overlay``: its last ``window`` positions, itself included)."""
    q_idx = torch.arange(seq_len - query_len, seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    mask = kv_idx <= q_idx
    return mask if window is None else mask & (kv_idx > q_idx - window)


def reference(packed, k_cache, v_cache, tables, seq_lens, query_lens, window=None, softcap=None, scale=None):
    """Contiguous attention per sequence, in float32 on the CPU, written without the package: the K/V
    its table lists, entry by entry, repeated to the query's heads; scores ``scale * q · k``, then
    ``softcap * tanh(scores / softcap)`` (Hugging Face's Gemma 2 eager attention), then the sliding
    causal mask and the softmax. Sequences with no query token contribute no row."""
    block_size, num_heads, head_dim = k_cache.shape[2], packed.shape[1], packed.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    rows, start = [], 0
    for b, (seq_len, query_len) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), strict=True)):
        if not query_len:
            continue
        ids = tables[b, : -(-seq_len // block_size)].long().cpu()
        k, v = (
            repeat_kv(torch.cat(list(cache[ids].float().cpu()), dim=1)[:, :seq_len], num_heads)
            for cache in (k_cache, v_cache)
        )  # (heads, tokens, dim)
        q = packed[start : start + query_len].float().cpu().transpose(0, 1)  # (heads, queries, dim)
        scores = torch.einsum("hqd,hkd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~sliding_mask(seq_len, query_len, window), float("-inf"))
        rows.append(torch.einsum("hqk,hkd->hqd", scores.softmax(-1), v).transpose(0, 1))
        start += query_len
    return torch.cat(rows) if rows else packed.float().cpu()


@pytest.mark.parametrize("window", [None, 1, 3, 4, 7, 50])
def test_the_reference_is_sdpa_with_the_sliding_causal_mask(window):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(6, 2, 4, 8, generator=gen) for _ in "kv")
    tables, seq_lens, query_lens = torch.tensor([[3, 1, 5, 0], [2, 4, -1, -1]]), [14, 7], [6, 1]
    packed = torch.randn(7, 4, 8, generator=gen)
    out = reference(
        packed, k_cache, v_cache, tables, torch.tensor(seq_lens), torch.tensor(query_lens), window
    )
    expected = []
    for b, (n, new, start) in enumerate(zip(seq_lens, query_lens, [0, 6], strict=True)):
        k, v = (
            repeat_kv(torch.cat(list(c[tables[b, : -(-n // 4)]]), dim=1)[:, :n], 4)
            for c in (k_cache, v_cache)
        )
        q = packed[start : start + new].transpose(0, 1)
        mask = sliding_mask(n, new, window)
        expected.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1))
        if window is None:
            assert torch.equal(mask, causal_mask(n, new))
    torch.testing.assert_close(out, torch.cat(expected), **TOLERANCES[torch.float32])


@pytest.mark.parametrize(("window", "softcap"), [(3, 50.0), (5, 1.0), (None, 2.0)])
def test_the_reference_is_hugging_faces_gemma_2_eager_attention_under_its_sliding_window_mask(
    window, softcap
):
    """Gemma 2's ``eager_attention_forward`` (the cap applied to the scaled scores, then the mask
    added) under the mask of ``masking_utils``: ``causal_mask_function`` and
    ``sliding_window_overlay``, at the positions of a chunk of 6 after 8 cached tokens."""
    masking = pytest.importorskip("transformers.masking_utils")
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    gen = torch.Generator().manual_seed(14)
    k_cache, v_cache = (torch.randn(5, 2, 4, 8, generator=gen) for _ in "kv")
    tables, seq_lens, query_lens = torch.tensor([[4, 1, 3, 0]]), torch.tensor([14]), torch.tensor([6])
    packed = torch.randn(6, 4, 8, generator=gen)
    out = reference(packed, k_cache, v_cache, tables, seq_lens, query_lens, window, softcap)

    mask_function = masking.causal_mask_function
    if window is not None:
        mask_function = masking.and_masks(mask_function, masking.sliding_window_overlay(window))
    q_idx, kv_idx = torch.arange(8, 14)[:, None], torch.arange(14)[None, :]
    allowed = mask_function(0, 0, q_idx, kv_idx)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    k, v = (torch.cat(list(c[tables[0]]), dim=1)[None, :, :14] for c in (k_cache, v_cache))
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    hf, _ = gemma2.eager_attention_forward(
        module, packed.transpose(0, 1)[None], k, v, additive, softcap=softcap, scaling=8**-0.5
    )
    torch.testing.assert_close(out, hf[0], **TOLERANCES[torch.float32])


def test_the_window_counts_the_query_itself_as_hugging_face_and_vllm_do():
    """W = 3 at position 5 sees 3, 4, 5: ``kv_idx > q_idx - W`` (FlashAttention's window_size=(W - 1, 0))."""
    assert sliding_mask(6, 1, 3).nonzero()[:, 1].tolist() == [3, 4, 5]
    assert sliding_mask(6, 1, 1).nonzero()[:, 1].tolist() == [5]
    assert sliding_mask(2, 1, 5).nonzero()[:, 1].tolist() == [0, 1]


# ------------------------------------------------------------------------------------- the cases


@dataclass
class Case:
    """A packed step whose entries before each window name the null block or stale blocks, NaN
    where no query may look, and the output expected of it."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    expected: torch.Tensor
    dead: int  # the table entries moved off their blocks (before a window)

    def run(self, backend, window, softcap=None, **kw):
        args = (self.query, self.k_cache, self.v_cache, self.tables, self.seq_lens, self.query_lens)
        return paged_prefill_attention(*args, backend=backend, sliding_window=window, softcap=softcap, **kw)


def first_entries(seq_lens, query_lens, window, block_size) -> list[int]:
    """The first table entry each sequence's window reaches: the block of ``first query position -
    window + 1`` (every entry before it lies wholly before the windows of its query tokens)."""
    return [max(0, n - new - window + 1) // block_size for n, new in zip(seq_lens, query_lens, strict=True)]


def windowed_case(
    seq_lens,
    query_lens,
    window,
    softcap=None,
    *,
    block_size=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    stale=False,
) -> Case:
    """Sequences of ``seq_lens`` tokens, their blocks scattered over a pool whose block 0 is the null
    block (two more blocks are free), ``query_lens`` packed query tokens each.

    The expected output is the reference on the whole, clean pool. Then, with a window, as an engine
    leaves a sliding-window layer's tables: each entry wholly before the window of its sequence's
    first query token names the null block, or with ``stale`` any other block of the pool (another
    sequence's, or a free one), and every block no entry from a window on names (the null block,
    the free ones, those the moved entries named) is filled with NaN."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(needed) + 2
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((len(seq_lens), max(needed)), -1, dtype=torch.int32)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)])
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in "kv")
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens, new = torch.tensor(seq_lens), torch.tensor(query_lens)
    expected = reference(query, k_cache, v_cache, tables, lens, new, window, softcap)

    dead = 0
    if window is not None:
        firsts = first_entries(seq_lens, query_lens, window, block_size)
        live = {int(tables[b, j]) for b, n in enumerate(needed) for j in range(firsts[b], n)}
        for b, first in enumerate(firsts):
            for j in range(first):
                tables[b, j] = int(torch.randint(1, num_blocks, (1,), generator=gen)) if stale else 0
                dead += 1
        for cache in (k_cache, v_cache):
            cache[sorted(set(range(num_blocks)) - live)] = float("nan")
    on = {"device": device}
    return Case(
        query.to(**on),
        k_cache.to(**on),
        v_cache.to(**on),
        tables.to(**on),
        lens.to(**on),
        new.to(**on),
        expected,
        dead,
    )


def check(out, case: Case, dtype=torch.float32, msg=""):
    assert out.shape == case.query.shape and out.dtype == case.query.dtype and out.device == case.query.device
    assert torch.isfinite(out).all(), msg
    torch.testing.assert_close(out.float().cpu(), case.expected, **TOLERANCES[dtype], msg=msg)


# ----------------------------------------------------------------- every backend, the reference

# (window, softcap): smaller than, equal to and larger than the block size of 4; one token; larger
# than every sequence; Gemma 2's cap of 50 and caps small enough to bend the scores; a cap alone.
WINDOWS = [(1, None), (3, 1.0), (4, None), (5, 50.0), (8, 2.0), (100, None), (None, 1.0)]


@pytest.mark.parametrize(("window", "softcap"), WINDOWS, ids=lambda x: str(x))
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_equals_the_reference_on_a_mixed_step_whatever_lies_before_the_windows(
    device, backend, window, softcap
):
    skip_unless_runnable(backend, device)
    case = windowed_case(SEQ_LENS, QUERY_LENS, window, softcap, device=device, seed=1, stale=window == 5)
    assert case.dead or window is None or window >= 20
    check(case.run(backend, window, softcap), case, msg=backend)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_head_layout_with_a_window_and_a_soft_cap(device, backend, num_heads, num_kv_heads):
    skip_unless_runnable(backend, device)
    case = windowed_case(
        SEQ_LENS, QUERY_LENS, 6, 1.5, num_heads=num_heads, num_kv_heads=num_kv_heads, device=device, seed=2
    )
    check(case.run(backend, 6, 1.5), case, msg=backend)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_with_a_window_and_a_soft_cap(device, backend, dtype):
    """Computed in float32 (``IN_PLACE`` gathers half caches; ``FLEX_ATTENTION`` and ``TRITON_ATTN``
    accumulate in float32), against the float32 reference over the same rounded inputs."""
    skip_unless_runnable(backend, device)
    case = windowed_case(SEQ_LENS, QUERY_LENS, 5, 2.0, dtype=dtype, device=device, seed=3, stale=True)
    check(case.run(backend, 5, 2.0), case, dtype, msg=backend)


@pytest.mark.parametrize("window", [1, 4, 6, 100])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_with_a_window_equals_the_reference(device, backend, window):
    """``paged_attention``: one query token per sequence, at its last position."""
    skip_unless_runnable(backend, device)
    lengths = [1, 4, 5, 13, 16, 9]
    softcap = 3.0 if window == 6 else None
    case = windowed_case(lengths, [1] * 6, window, softcap, device=device, seed=4, stale=window == 4)
    out = paged_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.tables,
        case.seq_lens,
        backend=backend,
        sliding_window=window,
        softcap=softcap,
    )
    check(out, case, msg=backend)


@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN", "TRITON_ATTN"])
def test_the_varlen_call_takes_both_with_the_engines_host_metadata(device, backend):
    """``paged_attention_varlen`` with ``max_query_len``, ``query_start_loc_cpu`` and ``check=False``,
    as a model runner calls it once per layer."""
    skip_unless_runnable(backend, device)
    case = windowed_case(SEQ_LENS, QUERY_LENS, 3, 2.5, device=device, seed=5)
    starts = starts_of(QUERY_LENS, device)
    args = (case.query, case.k_cache, case.v_cache, case.tables, case.seq_lens, starts)
    variants = [{}, {"max_query_len": 9, "query_start_loc_cpu": starts.cpu(), "check": False}]
    for kw in variants[1:] if backend == "TRITON_ATTN" else variants:  # the interpreter is slow
        out = paged_attention_varlen(*args, backend=backend, sliding_window=3, softcap=2.5, **kw)
        check(out, case, msg=f"{backend} {kw}")


@given(
    block_size=st.sampled_from([1, 2, 3, 4, 5, 8]),
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=5),
    window=st.none() | st.integers(1, 30),
    softcap=st.none() | st.floats(0.25, 60.0),
    heads=head_layouts,
    stale=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
@settings(max_examples=max_examples(25), deadline=None)
def test_the_torch_backends_equal_the_reference_for_any_packed_batch_window_and_cap(
    block_size, lengths, window, softcap, heads, stale, seed, data
):
    """Any block size, any query length from 0 to a sequence's length (decodes, chunks, prompts and
    sequences with nothing to compute), any window and cap, any head layout; the entries before the
    windows on the null block or stale blocks, everything no query may see NaN."""
    num_heads, num_kv_heads = heads
    query_lens = [data.draw(st.integers(0, n), label=f"query_len {i}") for i, n in enumerate(lengths)]
    case = windowed_case(
        lengths,
        query_lens,
        window,
        softcap,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=4,
        seed=seed,
        stale=stale,
    )
    for backend in backends_on(torch.device("cpu")):
        if backend != "TRITON_ATTN":
            check(case.run(backend, window, softcap), case, msg=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_of_one_token_gives_each_query_its_own_value(device, backend):
    """W = 1: each query token sees itself alone, so its output is its own V (each query head the V
    of its group's KV head), whatever the scores and the cap."""
    skip_unless_runnable(backend, device)
    case = windowed_case(SEQ_LENS, QUERY_LENS, 1, 0.5, device=device, seed=6)
    out = case.run(backend, 1, 0.5)
    rows = []
    for b, (n, new) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        for p in range(n - new, n):
            block = int(case.tables[b, p // 4])
            rows.append(case.v_cache[block, :, p % 4].repeat_interleave(2, dim=0))  # (heads, dim)
    torch.testing.assert_close(out, torch.stack(rows), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("backend", ["GATHER", "IN_PLACE", "CPU_ATTN", "FLEX_ATTENTION"])
def test_a_window_as_long_as_the_sequences_and_a_huge_cap_change_nothing(device, backend):
    skip_unless_runnable(backend, device)
    case = windowed_case(SEQ_LENS, QUERY_LENS, None, device=device, seed=7)
    full = case.run(backend, None)
    # (flex runs over a copy of the windows' blocks, in another order: equal up to rounding)
    torch.testing.assert_close(case.run(backend, max(SEQ_LENS)), full, **TOLERANCES[torch.float32])
    torch.testing.assert_close(case.run(backend, None, 1e6), full, **TOLERANCES[torch.float32])
    # and the cases above are not vacuous: a small cap and a short window do change the output
    assert not torch.allclose(case.run(backend, None, 0.5), full, atol=1e-3)
    assert not torch.allclose(case.run(backend, 3), full, atol=1e-3)


# ---------------------------------------------------------------------------- the Triton kernel

needs_interpreter = pytest.mark.skipif(
    not (triton_available() and triton_interpreted()),
    reason="a kernel's loads are recorded in Triton's interpreter, on the CPU, only",
)


@needs_interpreter
def test_the_kernel_never_loads_an_entry_or_a_block_before_its_programs_windows():
    """Each program starts its block loop at the block of ``first query position - W + 1``: the
    entries before it are never read, nor the null block they name. Sequence 0's prompt of 20 tokens
    spans two tiles (16 query tokens, one query head per KV head), the second starting later."""
    from paged_kv.checks.lesson12 import loaded_addresses

    seq_lens, query_lens, window = [20, 13, 9], [20, 1, 3], 3
    case = windowed_case(seq_lens, query_lens, window, num_heads=2, num_kv_heads=2, seed=9)
    firsts = first_entries(seq_lens, query_lens, window, 4)
    assert firsts == [0, 2, 1]
    table = case.tables.data_ptr(), case.tables.data_ptr() + case.tables.nbytes
    null_k = case.k_cache[0].data_ptr(), case.k_cache[1].data_ptr()
    null_v = case.v_cache[0].data_ptr(), case.v_cache[1].data_ptr()
    with loaded_addresses(*table) as entries, loaded_addresses(*null_k) as k, loaded_addresses(*null_v) as v:
        out = case.run("TRITON_ATTN", window)
    check(out, case)
    assert not k and not v  # the null block, which the entries before the windows name
    width, size = case.tables.shape[1], case.tables.element_size()
    loads = collections.Counter(divmod((address - table[0]) // size, width) for address in entries)
    expected = {(b, j) for b, n in enumerate(seq_lens) for j in range(firsts[b], -(-n // 4))}
    assert set(loads) == expected
    # The prompt's two tiles (programs for 2 KV heads each): the first loops over blocks 0 .. 3, the
    # second, its tokens at 16 .. 19 seeing 14 .. 19, over blocks 3 .. 4 only.
    assert [loads[0, j] for j in range(5)] == [2, 2, 2, 4, 2]


def kernel_without_window_and_cap():
    """The package's kernel as lesson 12's exercise has it written: without the two trailing
    constexprs (their branches dropped), through lesson 12's check's source editing."""
    from paged_kv.attention.triton_kernel import paged_attention_kernel
    from paged_kv.checks.lesson12 import mistaken

    source = inspect.getsource(paged_attention_kernel)
    parameters = re.findall(r"\n    (?:SLIDING_WINDOW|SOFTCAP): tl\.constexpr = [^\n]*", source)
    assert len(parameters) == 2
    edits = [(line, "") for line in parameters] + [("SLIDING_WINDOW", "0"), ("SOFTCAP", "0.0")]
    kernel = mistaken(*edits)
    assert list(inspect.signature(kernel).parameters)[-1] == "HEAD_DIM_PADDED"
    return kernel


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (Linux wheels only)")
def test_a_kernel_without_the_two_constexprs_still_launches_and_refuses_a_window_or_a_cap():
    from paged_kv.attention.triton_decode import triton_attention

    device = torch.device("cpu" if triton_interpreted() else "cuda")
    kernel = kernel_without_window_and_cap()
    case = windowed_case([6, 9], [2, 3], None, device=device, seed=10)
    starts = starts_of([2, 3], device)
    args = (case.query, case.k_cache, case.v_cache, case.tables, case.seq_lens, starts, 3, None, kernel)
    check(triton_attention(*args), case)
    for name, kw in (("sliding_window", {"sliding_window": 4}), ("softcap", {"softcap": 2.0})):
        with pytest.raises(ValueError, match=rf"^{name} needs a kernel with the trailing constexpr"):
            triton_attention(*args, **kw)


# --------------------------------------------------------------------------------------- bad input

BAD_WINDOWS = [0, -3, True, False, 2.0, "4", [4]]
BAD_SOFTCAPS = [0, -1.0, float("nan"), float("inf"), True, "1.0", torch.tensor(1.0), 1j]


def calls(device):
    """Each public function on good inputs, taking extra keywords."""
    case = windowed_case([5, 2], [3, 2], None, device=device, seed=11)
    args = (case.query, case.k_cache, case.v_cache, case.tables, case.seq_lens)
    decode = windowed_case([5, 2], [1, 1], None, device=device, seed=12)
    decode_args = (decode.query, decode.k_cache, decode.v_cache, decode.tables, decode.seq_lens)
    starts = starts_of([3, 2], device)
    return {
        "paged_attention": lambda **kw: paged_attention(*decode_args, **kw),
        "paged_prefill_attention": lambda **kw: paged_prefill_attention(*args, case.query_lens, **kw),
        "paged_attention_varlen": lambda **kw: paged_attention_varlen(*args, starts, **kw),
        "paged_attention_varlen unchecked": lambda **kw: paged_attention_varlen(
            *args, starts, check=False, **kw
        ),
    }


@pytest.mark.parametrize(
    "function",
    [
        "paged_attention",
        "paged_prefill_attention",
        "paged_attention_varlen",
        "paged_attention_varlen unchecked",
    ],
)
def test_a_bad_window_or_cap_is_a_value_error_naming_it(device, function):
    call = calls(device)[function]
    good = call()
    for window in BAD_WINDOWS:
        with pytest.raises(ValueError, match=r"^sliding_window must be"):
            call(sliding_window=window)
    for softcap in BAD_SOFTCAPS:
        with pytest.raises(ValueError, match=r"^softcap must be a positive finite number"):
            call(softcap=softcap)
    # the neighbours of the bad values are good, and None is the default
    torch.testing.assert_close(call(sliding_window=None, softcap=None), good, rtol=0, atol=0)
    for kw in (
        {"sliding_window": 1},
        {"sliding_window": np.int64(3)},
        {"softcap": 2},
        {"softcap": np.float32(1e-3)},
    ):
        assert torch.isfinite(call(**kw)).all(), kw


def test_a_bad_window_is_named_before_any_work_and_changes_nothing(device):
    case = windowed_case([5, 2], [3, 2], None, device=device, seed=13)
    before = [t.clone() for t in (case.query, case.k_cache, case.v_cache, case.tables)]
    with pytest.raises(ValueError, match=r"^sliding_window must be at least 1, got 0"):
        case.run("GATHER", 0)
    with pytest.raises(ValueError, match=r"^sliding_window must be an integer, got the bool True"):
        case.run("GATHER", True)
    with pytest.raises(ValueError, match=r"^softcap must be a positive finite number or None, got -2"):
        case.run("GATHER", None, -2)
    after = (case.query, case.k_cache, case.v_cache, case.tables)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_the_new_arguments_are_keywords_after_the_old_ones():
    for function in (paged_attention, paged_prefill_attention, paged_attention_varlen):
        parameters = inspect.signature(function).parameters
        assert list(parameters)[-2:] == ["sliding_window", "softcap"]
        assert all(
            parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ("sliding_window", "softcap")
        )
        assert parameters["sliding_window"].default is None and parameters["softcap"].default is None


def test_an_empty_step_and_a_step_of_no_query_tokens_give_empty_outputs_with_a_window(device):
    for backend in backends_on(device):
        case = windowed_case([5, 2], [0, 0], 2, device=device, seed=15)
        assert case.run(backend, 2, 1.0).shape == (0, 4, 8), backend
        empty = (
            case.query,
            case.k_cache,
            case.v_cache,
            case.tables[:0],
            case.seq_lens[:0],
            case.query_lens[:0],
        )
        assert paged_prefill_attention(*empty, backend=backend, sliding_window=2).shape == (0, 4, 8)
        decode = paged_attention(*empty[:-1], backend=backend, sliding_window=2, softcap=1.0)
        assert decode.shape == (0, 4, 8), backend

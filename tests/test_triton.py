"""The Triton kernel's decode equals the reference: interpreted on the CPU, compiled on CUDA (lessons 05, 12).

The kernel serves packed batches of several query tokens per sequence too: tests/test_varlen_attention.py.
Here ``paged_attention(..., backend="TRITON_ATTN")`` against ``backend="GATHER"`` (and, for tables that
repeat a block, against SDPA over what each table lists): scattered, repeated and shared blocks,
context lengths from one token to several blocks, block sizes 8, 16 and 32, every head layout,
float32, float16 and bfloat16, and the cache in this course's layout or in vLLM v1's, read through
its strides. On the CPU the kernel runs in Triton's interpreter, which is slow: sizes stay small.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_kv.attention.paged import paged_attention
from paged_kv.attention.triton_decode import triton_available, triton_interpreted

from .test_attention import HEADS, TOLERANCES, head_layouts, random_query, scattered_cache, table_reference

if not triton_available():
    pytest.skip("triton is not installed (it publishes Linux wheels only)", allow_module_level=True)

pytestmark = [pytest.mark.lesson05, pytest.mark.lesson12]


# Where the tests that need no particular device run the kernel: the CPU when Triton interprets
# (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU), CUDA when it compiles.
KERNEL_DEVICE = torch.device("cpu" if triton_interpreted() else "cuda")


@pytest.fixture
def kernel_device(device):
    """``device``, where this process can run the kernel: Triton compiles or interprets, not both."""
    if device.type == "cpu" and not triton_interpreted():
        pytest.skip("Triton compiles for CUDA in this process; CPU tensors need its interpreter")
    return device


def both(query, k_cache, v_cache, tables, seq_lens):
    """The kernel's output and the reference's, for the same inputs."""
    return tuple(
        paged_attention(query, k_cache, v_cache, tables, seq_lens, backend=backend)
        for backend in ("TRITON_ATTN", "GATHER")
    )


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_the_kernel_equals_the_reference_on_scattered_blocks(
    kernel_device, block_size, num_heads, num_kv_heads
):
    # one token, exactly one and three full blocks, and partial last blocks of 1 and block_size - 1
    lengths = [1, block_size, 2 * block_size + 1, 3 * block_size, block_size - 1]
    cache = scattered_cache(lengths, block_size, num_kv_heads, head_dim=16, device=kernel_device)
    assert cache.get_block_mapping(3) != sorted(cache.get_block_mapping(3))  # really scattered
    query = random_query(cache, len(lengths), num_heads=num_heads)
    tables = cache.block_tables_tensor(range(len(lengths)))
    out, expected = both(
        query, cache.k_cache, cache.v_cache, tables, torch.tensor(lengths, device=kernel_device)
    )
    assert out.shape == query.shape and out.dtype == query.dtype and out.device == query.device
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_blocks_repeated_in_a_row_and_shared_between_rows(
    kernel_device, table_dtype, num_heads, num_kv_heads
):
    """Row 0 lists block 1 three times (the last time cut to 5 slots), rows 1 and 2 share blocks 0 and 1."""
    gen = torch.Generator().manual_seed(4)
    shape = (5, num_kv_heads, 8, 16)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(kernel_device) for _ in "kv")
    query = torch.randn(3, num_heads, 16, generator=gen).to(kernel_device)
    tables = torch.tensor(
        [[1, 3, 1, 1], [0, 1, 4, -1], [0, 1, -1, -1]], dtype=table_dtype, device=kernel_device
    )
    seq_lens = torch.tensor([29, 17, 16], device=kernel_device)
    out, gathered = both(query, k_cache, v_cache, tables, seq_lens)
    expected = table_reference(query.cpu(), k_cache.cpu(), v_cache.cpu(), tables.cpu(), seq_lens.cpu())
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(out, gathered, **TOLERANCES[torch.float32])


def vllm_kv(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed):
    """K and V views, in this course's axis order, of one vLLM 0.33.0 layer cache.

    vLLM's memory for a layer is ``(num_blocks, block_size, num_kv_heads, 2 * head_size)``; its
    backends receive the view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` and cut
    the last axis into K and V. Neither half is contiguous: the kernel reads vLLM's memory in place,
    through the strides.
    """
    shape = (num_blocks, block_size, num_kv_heads, 2 * head_dim)
    memory = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)
    view = memory.transpose(1, 2)
    return view[..., :head_dim], view[..., head_dim:]


@pytest.mark.parametrize("layout", ["course", "vllm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_dtype_and_both_layouts(kernel_device, dtype, layout):
    """Half and bfloat16 caches are accumulated in float32, as the reference computes them; they
    differ in the final rounding only (the interpreter of triton 3.9 truncates float32 to bfloat16
    where a GPU rounds to nearest: one bfloat16 ulp, within the tolerance)."""
    num_blocks, block_size, num_kv_heads, head_dim = 9, 16, 2, 16
    if layout == "course":
        gen = torch.Generator().manual_seed(5)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        k_cache, v_cache = (
            torch.randn(shape, generator=gen).to(dtype=dtype, device=kernel_device) for _ in "kv"
        )
    else:
        k_cache, v_cache = vllm_kv(num_blocks, block_size, num_kv_heads, head_dim, dtype, kernel_device, 5)
        assert not k_cache.is_contiguous()  # read in place, through vLLM's strides
    query = torch.randn(3, 4, head_dim, generator=torch.Generator().manual_seed(6)).to(
        dtype=dtype, device=kernel_device
    )
    tables = torch.tensor([[7, 2, 5], [0, 8, -1], [3, -1, -1]], device=kernel_device)
    out, expected = both(query, k_cache, v_cache, tables, torch.tensor([40, 17, 1], device=kernel_device))
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_views_of_any_strides_are_read_where_they_lie(kernel_device):
    """A transposed query, a cache that is every other block of a larger one, a table that is a
    column slice: the kernel follows each tensor's strides, so none needs copying first."""
    gen = torch.Generator().manual_seed(8)
    k_pool, v_pool = (torch.randn(12, 2, 8, 8, generator=gen).to(kernel_device) for _ in "kv")
    k_cache, v_cache = k_pool[::2], v_pool[::2]  # 6 blocks, a block stride twice the contiguous one
    query = torch.randn(4, 2, 8, generator=gen).to(kernel_device).transpose(0, 1)  # (2, 4, 8)
    wide = torch.tensor([[9, 5, 0, 3], [9, 1, 4, 2]], device=kernel_device)
    tables = wide[:, 1:]  # rows 4 entries apart, not 3
    assert not (query.is_contiguous() or k_cache.is_contiguous() or tables.is_contiguous())
    out, expected = both(query, k_cache, v_cache, tables, torch.tensor([20, 9], device=kernel_device))
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_slots_and_entries_past_the_context_are_never_read(kernel_device):
    """NaN in the unused tail of each last block and in every block nobody reads, and padding entries
    that name no block at all: the kernel masks them, so its output is finite and unchanged."""
    lengths = [3, 17, 8]
    cache = scattered_cache(lengths, block_size=8, head_dim=8, device=kernel_device, seed=9)
    query = random_query(cache, len(lengths))
    tables = cache.block_tables_tensor(range(len(lengths)))
    seq_lens = torch.tensor(lengths, device=kernel_device)
    clean = paged_attention(query, cache.k_cache, cache.v_cache, tables, seq_lens, backend="TRITON_ATTN")
    read = {b for seq in range(len(lengths)) for b in cache.get_block_mapping(seq)}
    for cache_tensor in (cache.k_cache, cache.v_cache):
        cache_tensor[sorted(set(range(cache.num_blocks)) - read)] = float("nan")
        for seq, length in enumerate(lengths):
            cache_tensor[cache.get_block_mapping(seq)[-1], :, (length - 1) % 8 + 1 :] = float("nan")
    garbled = torch.where(tables == -1, 10**9, tables)  # an address far outside the cache
    out = paged_attention(query, cache.k_cache, cache.v_cache, garbled, seq_lens, backend="TRITON_ATTN")
    assert torch.equal(out, clean)


def test_an_empty_batch_gives_an_empty_output(kernel_device):
    k_cache = torch.randn(3, 2, 4, 8, device=kernel_device)
    query, tables = torch.randn(0, 2, 8, device=kernel_device), torch.zeros(0, 2, dtype=torch.int32)
    out = paged_attention(query, k_cache, k_cache, tables.to(kernel_device), [], backend="TRITON_ATTN")
    assert out.shape == (0, 2, 8)


@settings(max_examples=30, deadline=None)
@given(
    num_blocks=st.integers(1, 5),
    block_size=st.sampled_from([1, 3, 4, 8]),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    heads=head_layouts,
    head_dim=st.sampled_from([1, 3, 8]),
    scale=st.none() | st.floats(0.05, 2.0),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_equals_the_reference_for_any_valid_table(
    num_blocks, block_size, lengths, heads, head_dim, scale, seed
):
    """Random tables drawn from a small pool (so blocks repeat within and across rows), block sizes,
    head counts and head dims that are not powers of two (the kernel pads them and masks the rest)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    width = max(-(-n // block_size) for n in lengths)
    tables = torch.randint(0, num_blocks, (len(lengths), width), generator=gen, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen) for _ in "kv")
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    query, k_cache, v_cache, tables = (t.to(KERNEL_DEVICE) for t in (query, k_cache, v_cache, tables))
    seq_lens = torch.tensor(lengths, device=KERNEL_DEVICE)
    out = paged_attention(query, k_cache, v_cache, tables, seq_lens, scale, backend="TRITON_ATTN")
    expected = paged_attention(query, k_cache, v_cache, tables, seq_lens, scale, backend="GATHER")
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


# ------------------------------------------------------------------------------------ bad input


def test_it_takes_the_checked_inputs_of_every_backend():
    cache = scattered_cache([5])
    query, tables = random_query(cache, 1), cache.block_tables_tensor([0])
    with pytest.raises(ValueError, match="k_cache must have shape"):
        paged_attention(query[..., :4], cache.k_cache, cache.v_cache, tables, [5], backend="TRITON_ATTN")
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9 must be at least 1 and fit"):
        paged_attention(query, cache.k_cache, cache.v_cache, tables, [9], backend="TRITON_ATTN")
    with pytest.raises(ValueError, match=r"k_cache has dtype torch\.float16 but query has torch\.float32"):
        paged_attention(query, cache.k_cache.half(), cache.v_cache, tables, [5], backend="TRITON_ATTN")


def one_sequence(dtype=torch.float32):
    """A call of the kernel on one sequence of 5 tokens, on the CPU, to be made inside ``pytest.raises``."""
    cache = scattered_cache([5], dtype=dtype)
    query, tables = random_query(cache, 1), cache.block_tables_tensor([0])
    return lambda: paged_attention(query, cache.k_cache, cache.v_cache, tables, [5], backend="TRITON_ATTN")


def test_a_dtype_the_kernel_does_not_read_is_a_value_error():
    with pytest.raises(ValueError, match="TRITON_ATTN reads float32, float16, bfloat16 caches"):
        one_sequence(torch.float64)()


def test_changing_triton_interpret_after_triton_was_imported_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0" if triton_interpreted() else "1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET has changed since triton was imported"):
        one_sequence()()


def test_without_triton_the_backend_is_a_value_error_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    assert not triton_available() and not triton_interpreted()
    with pytest.raises(ValueError, match="TRITON_ATTN needs the triton package"):
        one_sequence()()


def python(code: str) -> str:
    """What ``code`` prints, run by this interpreter in a fresh process without ``TRITON_INTERPRET``."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


ONE_SEQUENCE = """
import sys, torch, paged_kv
k, q, table = torch.randn(2, 1, 4, 8), torch.randn(1, 1, 8), torch.tensor([[1, 0]])
print(tuple(paged_kv.paged_attention(q, k, k, table, [6]).shape), sys.modules.get("triton") is not None)
from paged_kv.attention.triton_decode import triton_available, triton_interpreted
print(triton_available(), triton_interpreted())
try:
    paged_kv.paged_attention(q, k, k, table, [6], backend="TRITON_ATTN")
except ValueError as error:
    print(error)
"""


def test_the_package_imports_and_attends_where_triton_cannot_be_imported():
    out = python("import sys; sys.modules['triton'] = None" + ONE_SEQUENCE).splitlines()
    assert out == [
        "(1, 1, 8) False",
        "False False",
        "TRITON_ATTN needs the triton package (Linux wheels only): it is not installed",
    ]


def test_compiled_triton_refuses_cpu_tensors_naming_the_interpreter():
    """Without TRITON_INTERPRET at its import, Triton compiles; ``import paged_kv`` never imports it."""
    out = python(ONE_SEQUENCE).splitlines()
    assert out[:2] == ["(1, 1, 8) False", "True False"]
    assert out[2] == (
        "TRITON_ATTN compiles for CUDA; on cpu tensors it runs in Triton's interpreter only: "
        "set TRITON_INTERPRET=1 in the environment before triton is first imported"
    )


def test_the_cpus_default_is_never_the_kernel(monkeypatch):
    from paged_kv.attention.backends import triton_attn

    def refuse(*args, **keywords):
        raise AssertionError("the default ran the Triton kernel")

    monkeypatch.setattr(triton_attn, "triton_attention", refuse)
    for lengths in ([5], [4] * 16):
        cache = scattered_cache(lengths)
        query, tables = random_query(cache, len(lengths)), cache.block_tables_tensor(range(len(lengths)))
        paged_attention(query, cache.k_cache, cache.v_cache, tables, lengths)


def _loads_seen() -> bool:
    from paged_kv.checks.lesson12 import loads_seen
    from paged_kv.device import default_device

    return loads_seen(default_device())


LOADS_SEEN = pytest.mark.skipif(
    not _loads_seen(), reason="the loads of a kernel are recorded in Triton's interpreter, on the CPU, only"
)


@LOADS_SEEN
def test_the_kernel_check_sees_every_table_entry_a_kernel_reads():
    """Exercise 12's check records the loads of a launch (lesson12.table_reads): the package's kernel
    reads exactly entries j < ceil(seq_lens[b] / block_size) of each row b with a query token (a
    sequence with none has no program with work), a loop one block too long the entry after them
    as well."""
    from paged_kv.attention.triton_kernel import paged_attention_kernel
    from paged_kv.checks.lesson12 import CASES, LOOP, _inputs, launch, loads_seen, mistaken, table_reads

    one_long = mistaken((LOOP, f"{LOOP} + 1"))
    for case, (_, seq_lens, query_lens, block_size, *_) in enumerate(CASES):
        inputs, _ = _inputs(case)
        assert loads_seen(inputs[0].device)
        working = [(b, n) for b, (n, new) in enumerate(zip(seq_lens, query_lens, strict=True)) if new]
        held = {(b, j) for b, n in working for j in range(-(-n // block_size))}
        with table_reads(inputs[3]) as read:
            launch(paged_attention_kernel, *inputs)
        assert read == held
        with table_reads(inputs[3]) as read:
            launch(one_long, *inputs)
        assert read == held | {(b, -(-n // block_size)) for b, n in working}


@LOADS_SEEN
def test_the_kernel_checks_cases_keep_reads_one_slot_off_inside_their_tensors():
    """K and V one slot before or after their own, a loop one block too long, queries read from the
    wrong row or with token and head swapped: every load stays in memory of the case's tensors (the
    guard blocks around the caches, the rows around the query, the table's column of padding)."""
    from paged_kv.checks.lesson12 import CASES, LOOP, _inputs, launch, loaded_addresses, mistaken

    kernels = [
        mistaken((f"slots[:, None] * {x}_stride_slot", f"(slots[:, None] {sign} 1) * {x}_stride_slot"))
        for x in "kv"
        for sign in "+-"
    ]
    kernels.append(mistaken((LOOP, f"{LOOP} + 1")))
    kernels.append(
        mistaken(
            ("token = tile * QUERY_TILE + rows // GROUP", "token = tile * QUERY_TILE + rows % GROUP"),
            ("heads = kv_head * GROUP + rows % GROUP", "heads = kv_head * GROUP + rows // GROUP"),
        )
    )
    for case in range(len(CASES)):
        inputs, _ = _inputs(case)
        starts = torch.nn.functional.pad(torch.cumsum(inputs[-1], 0), (1, 0))
        memory = [
            (storage.data_ptr(), storage.data_ptr() + storage.nbytes())
            for storage in {
                t.untyped_storage().data_ptr(): t.untyped_storage() for t in (*inputs, starts)
            }.values()
        ]
        for kernel in kernels:
            with loaded_addresses() as addresses:
                launch(kernel, *inputs, query_start_loc=starts)
            assert addresses
            assert all(any(start <= a < end for start, end in memory) for a in addresses)

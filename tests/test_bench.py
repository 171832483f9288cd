"""The benchmarks' baselines compute what the package computes, and run_all writes its table.

Correctness only: nothing here asserts a time (the machines are shared and noisy); the timings
and their ratios live in bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_allocator  # noqa: E402
import bench_slot_mapping  # noqa: E402
import run_all  # noqa: E402

from paged_kv import BlockAllocator, PagedKVCacheAllocator  # noqa: E402
from paged_kv.mapping import slot_mapping  # noqa: E402


@pytest.mark.lesson02
def test_blog_style_manager_builds_the_same_tables_as_the_package():
    block_size = 4
    cache = PagedKVCacheAllocator(40, block_size, num_heads=1, head_dim=1)
    blog = bench_allocator.BlogStyleBlockManager(40, block_size)
    script = [
        ("allocate", "a", 5),
        ("allocate", "b", 8),
        ("allocate", "c", 0),
        ("append", "a", 3),
        ("append", "a", 1),
        ("append", "b", 1),
        ("append", "c", 1),
        ("release", "b", None),
        ("allocate", "d", 13),
        ("append", "c", 7),
        ("append", "d", 0),
        ("release", "a", None),
        ("allocate", "e", 9),
        ("append", "e", 20),
    ]
    for action, seq_id, count in script:
        if action == "allocate":
            assert blog.allocate(seq_id, count) == cache.allocate_for_sequence(seq_id, count).block_ids
        elif action == "append":
            cache.append_tokens(seq_id, count)
            assert blog.append_tokens(seq_id, count) == cache.get_block_mapping(seq_id)
        else:
            assert blog.release(seq_id) == cache.free_sequence(seq_id)
        assert set(blog.block_tables) == set(cache.seq_ids)
        for live in blog.block_tables:
            assert blog.block_tables[live] == cache.get_block_mapping(live)
            assert blog.token_counts[live] == cache.sequence_length(live)
        assert list(blog.free_block_ids) == list(cache._allocator.free_block_ids)


@pytest.mark.lesson02
def test_pop_front_allocator_hands_out_blocks_like_block_allocator():
    package, naive = BlockAllocator(6), bench_allocator.PopFrontAllocator(6)
    taken = []
    for _ in range(4):
        block_id = package.allocate()
        assert naive.allocate() == block_id
        taken.append(block_id)
    for block_id in (taken[2], taken[0]):
        assert naive.free(block_id) == package.free(block_id)
    for _ in range(4):
        assert naive.allocate() == package.allocate()
    assert naive.free_block_ids == list(package.free_block_ids)


@pytest.mark.lesson03
@pytest.mark.parametrize(("num_tokens", "block_size"), [(1, 16), (37, 4), (256, 16), (100, 7)])
def test_loop_slot_mapping_equals_the_vectorised_one(num_tokens, block_size):
    table = bench_slot_mapping.scattered_block_table(num_tokens, block_size, seed=num_tokens)
    assert len(table) == -(-num_tokens // block_size) == len(set(table))
    vectorised = slot_mapping(torch.tensor(table), torch.arange(num_tokens), block_size).tolist()
    assert bench_slot_mapping.loop_slot_mapping(table, num_tokens, block_size) == vectorised


@pytest.mark.lesson02
@pytest.mark.lesson03
def test_run_all_quick_writes_a_table_with_every_row(tmp_path, capsys):
    output = tmp_path / "RESULTS.md"
    assert run_all.main(["--quick", "--output", str(output)]) == 0
    assert {"bench_allocator", "bench_slot_mapping"} <= set(run_all.bench_modules())
    expected_rows = [
        row.name for module in (bench_allocator, bench_slot_mapping) for row in module.run(**module.QUICK)
    ]
    assert len(expected_rows) >= 6
    text = output.read_text(encoding="utf-8")
    printed = capsys.readouterr().out
    for name in expected_rows:
        assert f"| {name} |" in text
        assert name in printed
    assert "## Machine" in text and "- CPU: " in text and f"- torch: {torch.__version__}" in text
    assert "## bench_allocator" in text and "## bench_slot_mapping" in text


@pytest.mark.lesson02
def test_rows_carry_ratios_and_targets():
    rows = bench_allocator.run(**bench_allocator.QUICK)
    flat = [row for row in rows if row.met is not None]
    assert len(flat) == 1 and flat[0].met == (flat[0].ratio <= bench_allocator.FLAT_LIMIT)
    for row in rows:
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0

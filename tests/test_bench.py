"""The benchmarks' baselines compute what the package computes, and run_all writes its table.

Correctness only: nothing here asserts a time (the machines are shared and noisy); the timings
and their ratios live in bench/RESULTS.md. ``run_all.py --quick`` runs once for the test run (the
``quick_run`` fixture, every bench at its tiny sizes); the tests of one bench's rows read that
run's rows rather than running the bench again.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import bench_allocator  # noqa: E402
import bench_attention  # noqa: E402
import bench_cache_salt  # noqa: E402
import bench_engine  # noqa: E402
import bench_hf  # noqa: E402
import bench_overhead  # noqa: E402
import bench_prefix_cache  # noqa: E402
import bench_slot_mapping  # noqa: E402
import bench_step  # noqa: E402
import bench_triton  # noqa: E402
import run_all  # noqa: E402
from _nano_style import NanoStyleBlockManager, NanoStyleScheduler, NanoStyleSequence, prepare_decode  # noqa: E402
from _timing import FLAT_LIMIT, Row, markdown_table, spread_of, text_table  # noqa: E402

from paged_kv import BlockAllocator, BlockManager, PagedKVCacheAllocator  # noqa: E402
from paged_kv.attention.paged import gather_kv  # noqa: E402
from paged_kv.attention.registry import default_backend  # noqa: E402
from paged_kv.attention.triton_decode import triton_available, triton_interpreted  # noqa: E402
from paged_kv.core.kv_cache_manager import KVCacheManager  # noqa: E402
from paged_kv.kv.slots import slot_mapping  # noqa: E402
from paged_kv.model.config import GPTConfig  # noqa: E402
from paged_kv.model.generation import generate  # noqa: E402
from paged_kv.model.tiny_gpt import TinyGPT  # noqa: E402
from paged_kv.serving.engine import EngineRequest  # noqa: E402
from paged_kv.serving.request import EngineCoreRequest  # noqa: E402


@dataclass
class QuickRun:
    """What ``run_all.main(["--quick", ...])`` computed, wrote and printed."""

    results: list[tuple[str, list[Row], float]]  # as run_all.run_benchmarks returns them
    markdown: str
    printed: str

    def rows(self, module) -> list[Row]:
        (rows,) = [rows for name, rows, _ in self.results if name == module.__name__]
        return rows


@pytest.fixture(scope="module")
def quick_run(once_per_run) -> QuickRun:
    """``bench/run_all.py --quick --output FILE`` once for the test run, every bench at its tiny sizes."""
    return once_per_run("bench_quick_run", run_all_quick)


def run_all_quick(folder: Path) -> QuickRun:
    output = folder / "RESULTS.md"
    seen: list[tuple[str, list[Row], float]] = []
    run_benchmarks = run_all.run_benchmarks

    def recorded(names, quick=False):
        results = run_benchmarks(names, quick=quick)
        seen.extend(results)
        return results

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(run_all, "run_benchmarks", recorded)
        assert run_all.main(["--quick", "--output", str(output)]) == 0
    return QuickRun(seen, output.read_text(encoding="utf-8"), printed.getvalue())


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
        assert list(blog.free_block_ids) == list(cache.manager.allocator.free_block_ids)


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
def test_run_all_quick_writes_a_table_with_every_row(quick_run):
    assert [name for name, _, _ in quick_run.results] == run_all.bench_modules()  # every bench, once
    modules = (
        bench_allocator,
        bench_attention,
        bench_engine,
        bench_prefix_cache,
        bench_slot_mapping,
        bench_step,
        bench_triton,
    )
    assert {module.__name__ for module in modules} <= set(run_all.bench_modules())
    expected_rows = [row.name for module in modules for row in quick_run.rows(module)]
    assert len(expected_rows) >= 11
    text, printed = quick_run.markdown, quick_run.printed
    for name in expected_rows:
        assert f"| {name} |" in text
        assert name in printed
    assert "## Machine" in text and "- CPU: " in text and f"- torch: {torch.__version__}" in text
    for module in modules:
        assert f"## {module.__name__}" in text


@pytest.mark.lesson02
def test_rows_carry_ratios_and_targets(quick_run):
    rows = quick_run.rows(bench_allocator)
    targeted = [row for row in rows if row.met is not None]
    target, slots_target = bench_allocator.APPEND_TARGET, bench_allocator.SLOTS_TARGET
    assert [row.target for row in targeted] == [
        f"<= {target}x",
        f"<= {slots_target}x",
        f"<= {FLAT_LIMIT}x (flat)",
    ]
    facade, slots, flat = targeted
    assert "PagedKVCacheAllocator.append_tokens" in facade.name and "may_append" in facade.name
    assert "KVCacheManager.allocate_slots" in slots.name
    assert facade.met == (facade.ratio <= target) and flat.met == (flat.ratio <= FLAT_LIMIT)
    assert slots.met == (slots.ratio <= slots_target)
    low, high = facade.spread
    assert low <= facade.ratio <= high
    for row in rows:
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0


@pytest.mark.parametrize("path", ["facade", "append_tokens", "allocate_slots"])
def test_the_nano_style_baseline_takes_the_blocks_each_package_path_takes(path):
    """The lessons' paths number blocks from 0; the engine's pool keeps block 0 as its null block,
    so its tables are nano-vllm's shifted by one."""
    nano = NanoStyleBlockManager(64, 4)
    seqs = [NanoStyleSequence(n) for n in (1, 4, 5, 8)]
    if path == "allocate_slots":
        memory = KVCacheManager(65, 4)
        requests = [EngineCoreRequest(seq_id, len(seq), 10) for seq_id, seq in enumerate(seqs)]
        append = memory.allocate_slots
        tables = lambda: [[b - 1 for b in memory.get_block_ids(r.request_id)[0]] for r in requests]  # noqa: E731
        free = lambda: [b - 1 for b in memory.block_pool.free_block_ids]  # noqa: E731
        for request in requests:
            memory.allocate_slots(request, request.num_prompt_tokens)
    else:
        cache = PagedKVCacheAllocator(64, 4, num_heads=1, head_dim=1)
        manager = cache.manager if path == "facade" else BlockManager(64, 4)
        requests = list(range(len(seqs)))
        append = cache.append_tokens if path == "facade" else manager.append_tokens
        tables = lambda: [manager.table(i).block_ids for i in requests]  # noqa: E731
        free = lambda: list(manager.allocator.free_block_ids)  # noqa: E731
        for seq_id, seq in enumerate(seqs):
            manager.allocate(seq_id, len(seq))
    for seq in seqs:
        nano.allocate(seq)
    for _ in range(9):  # nano-vllm appends the token first, then asks for its block
        for request, seq in zip(requests, seqs, strict=True):
            seq.num_tokens += 1
            assert nano.can_append(seq)
            nano.may_append(seq)
            append(request, 1)
        assert [seq.block_table for seq in seqs] == tables()
    assert list(nano.free_block_ids) == free()


def test_the_nano_style_scheduler_preempts_the_newest_and_frees_what_finishes():
    scheduler = NanoStyleScheduler(num_blocks=4, block_size=2)
    for seq_id in (0, 1):
        scheduler.add(NanoStyleSequence(2, [seq_id] * 2, max_tokens=4, seq_id=seq_id))
    seqs, prefill = scheduler.schedule()
    assert prefill and [s.seq_id for s in seqs] == [0, 1] and len(scheduler.block_manager.free_block_ids) == 2
    for token in (7, 8):  # 3 tokens each, then 4: the first decode token opens a block for each
        scheduler.postprocess(seqs, [token, token])
        seqs, prefill = scheduler.schedule()
        assert not prefill and [s.seq_id for s in seqs] == [0, 1]
    assert not scheduler.block_manager.free_block_ids
    scheduler.postprocess(seqs, [9, 9])  # 5 tokens each: the next token opens a block, none is free
    seqs, _ = scheduler.schedule()  # so the newest (1) is preempted, and 0 takes one of its blocks
    assert [s.seq_id for s in seqs] == [0] and [s.seq_id for s in scheduler.waiting] == [1]
    inputs = prepare_decode(seqs, 2)
    table = seqs[0].block_table
    assert [t.tolist() for t in inputs] == [[9], [4], [5], [table[2] * 2], [table]]
    scheduler.postprocess(seqs, [10])  # its 4th token: it finishes and frees its 3 blocks
    assert not scheduler.running and len(scheduler.block_manager.free_block_ids) == 4


def test_step_bench_engines_hold_the_same_tables_and_decode_alike():
    lengths = bench_step.prompt_lengths(8, 40)
    package = bench_step.PackageEngine(lengths, 20, 4, None)
    nano = bench_step.NanoEngine(lengths, 20, 4)
    assert bench_step.start_decoding(package) == bench_step.start_decoding(nano) == 1
    clock = [0.0, 0.0, 0.0]
    for _ in range(10):
        package.step(clock)
        nano.step(clock)
        shifted = {r: [b - 1 for b in ids] for r, ids in package.tables().items()}  # block 0: the null block
        assert shifted == nano.tables()
    assert all(t > 0 for t in clock)
    assert [len(r.output_token_ids) for r in package.scheduler.running] == [11] * 8
    assert all(len(seq) - seq.num_prompt_tokens == 11 for seq in nano.scheduler.running)
    budgeted = bench_step.PackageEngine(lengths, 20, 4, 16)
    assert bench_step.start_decoding(budgeted) > 1  # prefilled in chunks of the budget


def test_step_bench_rows_compare_the_step_and_its_phases(quick_run):
    rows = quick_run.rows(bench_step)
    whole, budgeted, *phases = rows
    for row in (whole, budgeted):
        assert row.target == "<= 1.0x" and row.met == (row.ratio <= 1.0)
        assert row.spread[0] <= row.ratio <= row.spread[1]
    assert "max_num_batched_tokens=16,384" in budgeted.name
    assert [row.name.split(", phase ")[1].split(":")[0] for row in phases] == list(bench_step.PHASES)
    for row in rows:
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0


def test_overhead_bench_engine_and_bare_forward_generate_the_same_tokens(quick_run):
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 17, 9)]
    model = bench_overhead.TinyGPT(bench_overhead.CONFIG, seed=0)
    bare, engine = bench_overhead.BareForward(model, prompts), bench_overhead.EngineStep(model, prompts, 6, 4)
    for _ in range(4):
        bare.step()
        engine.step()
    assert engine.tokens == bare.tokens and [len(t) for t in bare.tokens] == [5, 5, 5]
    assert engine.tokens[1] == generate(model, [prompts[1]], 5, cache="contiguous").tokens[0]
    (row,) = quick_run.rows(bench_overhead)
    assert row.target == f"<= {bench_overhead.TARGET:.1f}x" and row.ratio > 0 and row.spread is not None


def test_a_row_shows_the_spread_of_its_rounds():
    ratio, spread = spread_of([1.5, 0.5, 1.0])
    assert (ratio, spread) == (1.0, (0.5, 1.5))
    row = Row("r", 1.0, 1.0, ratio, "—", None, spread=spread)
    assert "| 1.00x (0.50-1.50) |" in markdown_table([row]) and "1.00x (0.50-1.50)" in text_table([row])
    assert "| 1.00x |" in markdown_table([Row("r", 1.0, 1.0, 1.0, "—", None)])


@pytest.mark.lesson05
@pytest.mark.parametrize(("context", "block_size"), [(1, 16), (37, 4), (64, 16), (50, 7)])
def test_attention_bench_holds_the_same_kv_paged_and_contiguous(context, block_size):
    case = bench_attention.make_case(3, 2, 8, context, block_size, seed=context)
    tables = case["block_tables"]
    assert sorted(tables.flatten().tolist()) == list(range(len(case["k_cache"])))  # every block, once
    for b in range(3):
        k, v = gather_kv(case["k_cache"], case["v_cache"], tables[b], context)
        assert torch.equal(k, case["k"][b].transpose(0, 1)) and torch.equal(v, case["v"][b].transpose(0, 1))
    gathered_k, gathered_v = bench_attention.gather_only(case)
    assert torch.equal(gathered_k[:, :, :context], case["k"]) and torch.equal(
        gathered_v[:, :, :context], case["v"]
    )
    torch.testing.assert_close(bench_attention.paged(case), bench_attention.contiguous(case))
    bench_attention.check_equal(case)  # what the bench runs before timing


@pytest.mark.lesson05
def test_attention_bench_gives_the_defaults_ratio_to_sdpa_with_its_target_spread_and_build_time(quick_run):
    rows = quick_run.rows(bench_attention)
    (targeted,) = [row for row in rows if row.met is not None]
    default = default_backend("cpu", torch.float32)
    assert f"{default} (the default)" in targeted.name and "vs contiguous SDPA" in targeted.name
    assert (
        targeted.target == f"<= {bench_attention.TARGET_SLOWDOWN}x" and bench_attention.TARGET_SLOWDOWN == 1.3
    )
    assert targeted.met == (targeted.ratio <= bench_attention.TARGET_SLOWDOWN)
    low, high = targeted.spread
    assert low <= targeted.ratio <= high
    built = [row for row in rows if "built from its source" in row.name]
    assert len(built) == (default == "CPU_ATTN") and all(
        row.unit == "s" and row.measured > 0 for row in built
    )


@pytest.mark.lesson05
def test_attention_bench_check_catches_a_wrong_cache():
    case = bench_attention.make_case(2, 2, 8, 20, 4)
    case["k_cache"] = case["k_cache"].flip(0)  # the blocks no longer where the tables say
    with pytest.raises(AssertionError, match="differs"):
        bench_attention.check_equal(case)


@pytest.mark.lesson09
def test_engine_bench_modes_generate_identical_tokens():
    config = GPTConfig(num_layers=1, num_heads=2, head_dim=8, max_len=64)
    requests = bench_engine.scaled_requests(8, scale=32, max_len=64, seed=1)
    assert all(len(r.prompt) + r.max_tokens <= 64 for r in requests)
    runs = bench_engine.serve(requests, config, num_blocks=32, block_size=4)
    paged, contiguous = runs["paged"][0], runs["contiguous"][0]
    assert paged.tokens == contiguous.tokens
    assert [len(tokens) for tokens in paged.tokens.values()] == [r.max_tokens for r in requests]
    model = TinyGPT(config, seed=0).eval()
    first = requests[0]
    alone = generate(model, [first.prompt], first.max_tokens).tokens[0]
    assert paged.tokens[first.request_id] == alone
    assert contiguous.peak_running <= 32 * 4 // 64


@pytest.mark.lesson09
def test_engine_bench_rows_report_concurrency_against_the_target(quick_run):
    rows = quick_run.rows(bench_engine)
    mean = rows[0]
    assert "mean concurrent" in mean.name and "ShareGPT-shaped" in mean.name
    assert mean.ratio == pytest.approx(mean.measured / mean.baseline)
    assert mean.met == (mean.ratio >= bench_engine.TARGET_CONCURRENCY)
    for row in rows:
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0


@pytest.mark.lesson08
def test_deque_free_list_takes_and_frees_like_block_allocator():
    package, baseline = BlockAllocator(8), bench_prefix_cache.DequeFreeList(8)
    for block_id in (3, 5, 0, 7):
        package.take(block_id)
        baseline.take(block_id)
    for block_id in (5, 0):
        assert package.free(block_id) == baseline.free(block_id)
    package.take(6)
    baseline.take(6)
    assert list(baseline.free_block_ids) == list(package.free_block_ids) == [1, 2, 4, 5, 0]
    with pytest.raises(ValueError):
        baseline.take(3)
    middle = bench_prefix_cache.middle_blocks(100, 50)
    assert all(25 <= b < 75 for b in middle)


@pytest.mark.lesson08
def test_prefix_cache_bench_rows_report_flatness_and_hit_rate(quick_run):
    rows = quick_run.rows(bench_prefix_cache)
    flat = [row for row in rows if "(flat)" in row.target]
    assert len(flat) == 1 and flat[0].met == (flat[0].ratio <= FLAT_LIMIT)
    hit = next(row for row in rows if "hit rate" in row.name)
    assert hit.ratio == pytest.approx(hit.measured / hit.baseline) and hit.met
    for row in rows:
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0


@pytest.mark.lesson08
def test_cache_salt_bench_hits_under_its_salt_and_misses_under_a_new_one():
    model = TinyGPT(GPTConfig(num_layers=1, num_heads=2, head_dim=8, max_len=64), seed=0)
    timer = bench_cache_salt.FirstTokenTimer(model, list(range(40, 73)), block_size=8, num_blocks=32)
    first = timer.first_token("hit")  # the shared salt's first request: nothing cached yet
    assert timer.computed["hit"] == {33}
    timer.computed["hit"].clear()
    assert [timer.first_token(kind) for kind in ("hit", "miss", "miss", "hit")] == [first] * 4
    assert timer.computed == {"hit": {1}, "miss": {33}}  # 4 blocks hit, the last token computed
    assert first == generate(model, [list(range(40, 73))], 1, cache="contiguous").tokens[0][0]


@pytest.mark.lesson08
def test_cache_salt_bench_rows_count_the_tokens_a_hit_saves_and_time_both(quick_run):
    timing, counting = quick_run.rows(bench_cache_salt)
    quick = bench_cache_salt.QUICK
    assert (counting.measured, counting.baseline) == (16, quick["prompt_tokens"])  # one block computed
    assert counting.ratio == counting.baseline / counting.measured
    assert timing.unit == "ms" and timing.measured > 0 and timing.baseline > 0
    assert timing.spread[0] <= timing.ratio <= timing.spread[1] and timing.met == (timing.ratio > 1)


@pytest.mark.lesson09
def test_engine_bench_prefix_caching_computes_only_what_the_cache_lacks():
    requests = bench_engine.shared_prefix_requests(8, system_tokens=12, scale=32, max_len=64, seed=1)
    assert all(r.prompt[:12] == requests[0].prompt[:12] for r in requests)
    assert all(len(r.prompt) > 12 and len(r.prompt) + r.max_tokens <= 64 for r in requests)
    config = GPTConfig(num_layers=1, num_heads=2, head_dim=8, max_len=64)
    runs = bench_engine.prefix_caching(requests, config, num_blocks=64, block_size=4)
    on, off = runs["on"][0], runs["off"][0]
    assert on.tokens == off.tokens
    prompt_tokens = sum(len(r.prompt) for r in requests)
    assert (off.prefill_tokens_computed, off.prefix_cache_queries) == (prompt_tokens, 0)
    # Every request but the first finds the system prompt's three full blocks of 4, and nothing more.
    assert (on.prefix_cache_queries, on.prefix_cache_hits) == (prompt_tokens, 7 * 12)
    assert on.prefill_tokens_computed == prompt_tokens - 7 * 12


@pytest.mark.lesson09
def test_hf_bench_pads_a_static_batch_and_counts_its_slots():
    batch = [EngineRequest("a", [5, 6], 3), EngineRequest("b", [1, 2, 3, 4], 1)]
    input_ids, mask = bench_hf.padded_batch(batch)
    assert input_ids.tolist() == [[0, 0, 5, 6], [1, 2, 3, 4]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    # 3 steps (prefill, 2 decodes) of 2 rows of 4, 5, 6 slots; "a" holds 2, 3, 4 of its own, "b" 4 each time.
    assert bench_hf.padded_slots(batch) == (2 * (4 + 5 + 6), (2 + 3 + 4) + 3 * 4)
    assert bench_hf.padded_slots(batch[:1]) == (2 + 3 + 4, 2 + 3 + 4)  # alone: nothing wasted
    assert [[r.request_id for r in b] for b in bench_hf.static_batches(batch * 2, 3)] == [
        ["a", "b", "a"],
        ["b"],
    ]
    served = bench_hf.Served({}, 0, 30, 21)
    assert served.kv_bytes_per_token_held(7) == pytest.approx(7 * 30 / 21)
    with pytest.raises(ValueError, match="does not show"):
        bench_hf.Served({}, 100, None, None).kv_bytes_per_token_held(7)


@pytest.mark.lesson09
def test_hf_bench_systems_serve_the_same_greedy_tokens():
    model = bench_hf.tiny_llama(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=32)
    assert model.config.eos_token_id is None and model.generation_config.eos_token_id is None
    requests = bench_engine.scaled_requests(5, scale=64, max_len=32, seed=3)
    assert len({len(r.prompt) for r in requests}) > 1  # the padding has something to do
    engine = bench_hf.Engine(model, num_blocks=32, block_size=4)
    served = {
        "engine": bench_hf.serve_engine(engine, requests),
        "generate_batch": bench_hf.serve_continuous_batching(model, requests, 32, 4, max_batch_tokens=64),
        "static": bench_hf.serve_static(model, requests, batch_size=2),
    }
    for result in served.values():
        assert [len(result.tokens[r.request_id]) for r in requests] == [r.max_tokens for r in requests]
        assert result.tokens == served["engine"].tokens
    for request in requests[:2]:
        assert bench_hf.generate_alone(model, request) == served["engine"].tokens[request.request_id]
    first = requests[0]
    plain = model.generate(torch.tensor([first.prompt]), max_new_tokens=first.max_tokens, do_sample=False)
    assert plain[0, len(first.prompt) :].tolist() == served["engine"].tokens[first.request_id]
    ours, theirs, static = served.values()
    assert ours.kv_bytes_allocated == 32 * engine.bytes_per_block <= theirs.kv_bytes_allocated
    assert theirs.reserved_slots is None and static.kv_bytes_allocated == 0
    assert ours.held_slots <= ours.reserved_slots and static.held_slots < static.reserved_slots
    # equal_requests counts the requests whose tokens match: here all but the one spoiled.
    assert bench_hf.equal_requests(ours.tokens, {**theirs.tokens, requests[0].request_id: [-1]}) == 4


@pytest.mark.lesson09
def test_hf_bench_quick_run_reports_speed_equality_and_bytes(quick_run):
    results = [result for result in quick_run.results if result[0] == "bench_hf"]
    [(name, rows, _)] = results
    assert name == "bench_hf" and "bench_hf" in run_all.bench_modules()
    speed, net, fixed, forwards, static_speed, alone, batched, same_forwards, padded, allocated, held = rows
    assert "Engine vs generate_batch, fixed costs included" in speed.name and speed.unit == "tokens/s"
    assert speed.target == ">= 1.2x" and speed.met == (speed.ratio >= bench_hf.TARGET_SPEEDUP)
    assert speed.spread[0] <= speed.ratio <= speed.spread[1]
    assert "less its fixed cost" in net.name and net.met is None  # tiny runs: often no figure (nan)
    assert "fixed cost of a call" in fixed.name and fixed.unit == "ms" and "% of a run" in fixed.target
    assert fixed.ratio == pytest.approx(fixed.baseline / fixed.measured)
    assert "one forward per step (the Engine) vs two" in forwards.name and forwards.met is None
    assert "static batches" in static_speed.name and static_speed.met is None
    for row in (alone, batched, same_forwards, padded):  # the greedy tokens are equal, request by request
        assert row.unit == "requests" and row.measured == row.baseline and row.ratio == 1.0
    assert alone.met is True and same_forwards.met is True
    assert batched.baseline == same_forwards.baseline == bench_hf.QUICK["num_requests"]
    assert padded.baseline == bench_hf.QUICK["static_requests"]
    assert allocated.ratio >= 1.0  # transformers' cache holds the same blocks, plus its trash sectors
    assert held.ratio > 1.0  # padded batches reserve more per token they hold than blocks on demand
    for row in (speed, fixed, forwards, static_speed, alone, batched, same_forwards, padded, allocated, held):
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0
    text = run_all.results_markdown(results, quick=True)
    assert "## bench_hf" in text and all(f"| {row.name} |" in text for row in rows)


@pytest.mark.lesson09
def test_two_forward_runner_splits_mixed_steps_and_generates_the_same_tokens():
    model = bench_hf.tiny_llama(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=32)
    requests = bench_engine.scaled_requests(8, scale=64, max_len=32, seed=3)
    settings = {"num_blocks": 32, "block_size": 4, "max_num_batched_tokens": 8}
    one, two = bench_hf.Engine(model, **settings), bench_hf.TwoForwardEngine(model, **settings)
    forwards = []
    inner = one.model.forward_step

    def counted(input_ids, *args):
        forwards.append(len(input_ids))
        return inner(input_ids, *args)

    one.model.forward_step = two.model.forward_step = counted
    try:
        first = one.run(requests)
        one_forwards = list(forwards)
        forwards.clear()
        second = two.run(requests)
    finally:
        del one.model.forward_step, two.model.forward_step
    assert second.tokens == first.tokens
    assert first.scheduled_tokens == second.scheduled_tokens  # the same scheduler decisions
    runner = two.runner
    assert runner.steps == first.steps == len(one_forwards) and runner.mixed_steps > 0
    assert len(forwards) == runner.steps + runner.mixed_steps  # two forwards where a step mixes
    assert sum(forwards) == sum(one_forwards) == sum(first.tokens_per_step)  # the same tokens run


@pytest.mark.lesson12
def test_triton_bench_case_has_lesson_10s_lengths_over_scattered_blocks():
    case = bench_triton.lesson_case(4, 4, 16, block_size=16, max_blocks=4, seed=3)
    lengths = case["seq_lens"].tolist()
    assert lengths[0] == 64 and all(1 <= n <= 64 for n in lengths) and len(set(lengths)) > 1
    assert case["block_tables"].shape == (4, 4) and case["query"].shape == (4, 4, 16)
    for b, length in enumerate(lengths):  # the cache holds each sequence's K/V at its table's blocks
        k, _ = gather_kv(case["k_cache"], case["v_cache"], case["block_tables"][b], length)
        assert torch.equal(k, case["k"][b, :, :length].transpose(0, 1))


@pytest.mark.lesson12
def test_triton_bench_check_catches_a_wrong_backend():
    case = bench_triton.lesson_case(2, 2, 8, block_size=4, max_blocks=2)
    bench_triton.check_close(case, "IN_PLACE", bench_triton.attention(case, "GATHER"))
    with pytest.raises(AssertionError, match="backend 'GATHER' differs"):
        bench_triton.check_close(case, "GATHER", bench_triton.attention(case, "GATHER").flip(0))


@pytest.mark.lesson12
@pytest.mark.skipif(not triton_available(), reason="triton is not installed (it publishes Linux wheels only)")
def test_triton_bench_quick_times_the_interpreter_or_the_compiled_kernel(quick_run):
    rows, printed = quick_run.rows(bench_triton), quick_run.printed
    if triton_interpreted():
        (row,) = rows
        assert "Triton's interpreter" in row.name and "backend='GATHER'" in row.name
        assert "the compiled kernel vs SDPA, FLEX_ATTENTION and IN_PLACE is skipped" in printed
    else:
        assert [row.name.rsplit(", vs ", 1)[1] for row in rows] == [
            "contiguous SDPA",
            "backend='FLEX_ATTENTION'",
            "backend='IN_PLACE'",
        ]
        assert "the interpreter's CPU row is skipped" in printed
    for row in rows:
        assert row.met is None and row.target == "—"
        assert row.measured > 0 and row.baseline > 0 and row.ratio > 0

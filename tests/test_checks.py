"""The notebook checks: a tick when the code is right, the call, the answers and a hint when not."""

from __future__ import annotations

import pytest
import torch

from paged_kv import blocks_for_tokens
from paged_kv.checks import TASKS, CheckFailed, check
from paged_kv.checks._core import answers, diagnose
from paged_kv.kv.slots import read_kv


def test_a_correct_answer_prints_a_tick(capsys):
    check("00.blocks_for_tokens", blocks_for_tokens)
    assert (
        capsys.readouterr().out
        == "\N{CHECK MARK} 00.blocks_for_tokens blocks for a number of tokens: all 8 checks passed\n"
    )


def test_a_wrong_answer_names_the_call_the_answers_and_a_hint():
    with pytest.raises(CheckFailed) as caught:
        check("00.blocks_for_tokens", lambda n, b: n // b)
    assert str(caught.value).splitlines() == [
        "\N{BALLOT X} 00.blocks_for_tokens (blocks for a number of tokens)",
        "  called:   blocks_for_tokens(1, 16)",
        "  expected: 1",
        "  got:      0",
        "  hint:     n // b rounds down and leaves the last tokens without a slot (17 tokens in blocks of "
        "16 need 2 blocks); round up: ceil(n / b) in integers is -(-n // b) or (n + b - 1) // b",
    ]
    assert isinstance(caught.value, AssertionError)


def test_a_crash_in_learner_code_is_reported_as_a_failed_check():
    with pytest.raises(CheckFailed, match="got:      ZeroDivisionError"):
        check("00.blocks_for_tokens", lambda n, b: n // 0)


def test_a_stub_is_reported_as_not_implemented():
    def stub(n, b):
        raise NotImplementedError("use //")

    with pytest.raises(
        NotImplementedError, match=r"task 00\.blocks_for_tokens \(.*\) is not implemented yet: use //"
    ):
        check("00.blocks_for_tokens", stub)


def test_an_unknown_task_lists_the_known_ones():
    with pytest.raises(KeyError, match=r"00\.blocks_for_tokens"):
        check("99.nothing", None)


def test_task_ids_are_lesson_dot_name():
    for task_id, registered in TASKS.items():
        assert registered.task_id == task_id
        lesson, _, name = task_id.partition(".")
        assert len(lesson) == 2 and lesson.isdigit() and name.isidentifier(), task_id


# ------------------------------------------------------------- hints from what the code did


def test_the_late_boundary_rule_gets_the_late_hint_not_the_early_one():
    with pytest.raises(CheckFailed) as caught:
        check("04.needs_new_block", lambda n, held, size: n > held * size)
    message = str(caught.value)
    assert "hint:     your rule takes the block one token late" in message
    assert "one token early" not in message


def test_the_early_boundary_rule_still_gets_the_early_hint():
    with pytest.raises(CheckFailed, match=r"hint: .*takes the block one token early"):
        check("04.needs_new_block", lambda n, held, size: (n + 1) % size == 0)


def test_an_unknown_mistake_gets_the_hint_of_the_failing_case_and_the_rule():
    with pytest.raises(CheckFailed) as caught:
        check("04.needs_new_block", lambda n, held, size: n == held * size and size != 16)
    assert "48 tokens fill 3 blocks of 16" in str(caught.value)
    assert "num_tokens == num_blocks_held * block_size" in str(caught.value)


def test_diagnose_names_the_first_mistake_the_code_repeats_on_every_probe():
    mistakes = [(lambda n: n + 1, "plus one"), (lambda n: n * 2, "doubled")]
    probe = answers([(0,), (1,), (3,)], convert=int)
    assert diagnose(lambda n: 2 * n, mistakes, probe, "no idea") == "doubled"
    assert diagnose(lambda n: n - 1, mistakes, probe, "no idea") == "no idea"
    assert diagnose(lambda n: 1 // n, mistakes, probe, "no idea") == "no idea"  # raises on a probe


def test_a_mistake_that_cannot_run_on_the_probe_is_skipped():
    mistakes = [(lambda n: 1 // 0, "never"), (lambda n: n + 1, "plus one")]
    assert diagnose(lambda n: n + 1, mistakes, answers([(1,)], int)) == "plus one"


def write_kv_k_into_both(k_cache, v_cache, block_table, k, v, start_position=0):
    positions = torch.arange(start_position, start_position + k.shape[0])
    block_ids, offsets = block_table[positions // k_cache.shape[2]], positions % k_cache.shape[2]
    k_cache[block_ids, :, offsets] = k
    v_cache[block_ids, :, offsets] = k


def test_k_written_into_both_caches_is_named_not_blamed_on_the_axis_order():
    with pytest.raises(CheckFailed) as caught:
        check("03.write_read_kv", write_kv_k_into_both, read_kv)
    message = str(caught.value)
    assert "v_cache holds K: your code writes k into both caches" in message
    assert "axes" not in message


# ------------------------------------------------------------------ the learner's own lines


def test_an_exception_shows_the_learners_own_line_and_a_hint():
    def blocks(n, b):
        return int(n / b) + [0][n]  # IndexError for n > 0

    with pytest.raises(CheckFailed) as caught:
        check("00.blocks_for_tokens", blocks)
    lines = str(caught.value).splitlines()
    assert "  got:      IndexError: list index out of range" in lines
    where = lines.index(next(line for line in lines if line.startswith("  where:")))
    assert lines[where] == f"  where:    test_checks.py, line {blocks.__code__.co_firstlineno + 1}, in blocks"
    assert lines[where + 1].strip() == "return int(n / b) + [0][n]  # IndexError for n > 0"
    assert lines[-1].startswith("  hint:     ceil(n / b)")
    assert not any("paged_kv" in line for line in lines[where:-1]), "frames of the checks are trimmed"


def test_an_exception_outside_the_checks_guards_is_a_failed_check_with_the_learners_line():
    def physical_location(block_table, position, block_size):
        if position == 10:  # the one call the check makes without a guard of its own
            raise RuntimeError("no")
        return block_table[position // block_size], position % block_size

    with pytest.raises(CheckFailed) as caught:
        check("03.physical_location", physical_location)
    lines = str(caught.value).splitlines()
    assert lines[1:4] == [
        "  called:   the check of 03.physical_location",
        "  expected: no exception",
        "  got:      RuntimeError: no",
    ]
    assert lines[5].strip() == 'raise RuntimeError("no")'


def test_an_attribute_error_in_the_learners_code_gets_a_hint_about_init():
    class Block:
        def __init__(self, block_id, ref_count=0):
            self.block_id = block_id

        def __repr__(self):
            return f"Block({self.block_id}, {self.ref_count})"

    with pytest.raises(CheckFailed, match="assign it in __init__"):
        check("01.block", Block)


# ---------------------------------------------------------- a task that uses an earlier one

LATE_RULE_AND_DECODE_STEP = """
from paged_kv.reference.lesson04 import finish_and_admit

def needs_new_block(num_tokens, num_blocks_held, block_size):
    return num_tokens > num_blocks_held * block_size

def decode_step(cache, seq_ids):
    needs = [needs_new_block(cache.sequence_length(s), len(cache.get_block_mapping(s)), cache.block_size)
             for s in seq_ids]
    taken = {}
    for seq_id, needed in zip(seq_ids, needs):
        taken[seq_id] = cache.append_block_to_sequence(seq_id) if needed else None
        cache.append_tokens(seq_id, 1)
    return taken
"""

ALLOCATOR_STUB_AND_CACHE = """
import torch

class BlockAllocator:
    def __init__(self, num_blocks):
        raise NotImplementedError("keep the free list")

class SequenceAllocator:
    def __init__(self, num_blocks, block_size):
        self.allocator = BlockAllocator(num_blocks)

class PagedKVCacheAllocator(SequenceAllocator):
    def __init__(self, num_blocks, block_size, num_heads, head_dim, dtype=torch.float32, device="cpu"):
        super().__init__(num_blocks, block_size)
        shape = (num_blocks, num_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
"""


def learner_code(source: str) -> dict:
    """Define ``source`` as a learner's file would (its own file name, its own globals)."""
    namespace: dict = {"__name__": "mine"}
    exec(compile(source, "mine.py", "exec"), namespace)
    return namespace


def test_a_task_failing_through_an_earlier_failing_task_says_so():
    mine = learner_code(LATE_RULE_AND_DECODE_STEP)
    with pytest.raises(CheckFailed) as caught:
        check("04.decode_step", mine["decode_step"])
    lines = str(caught.value).splitlines()
    assert lines[1] == (
        "  first:    this uses your `needs_new_block`, which failed above (04.needs_new_block): "
        "fix that task first"
    )
    assert caught.value.blocked_by == ("04.needs_new_block",)


def test_a_task_using_only_right_code_blames_itself():
    with pytest.raises(CheckFailed) as caught:
        check("04.decode_step", lambda cache, seq_ids: {seq_id: None for seq_id in seq_ids})
    assert "first:" not in str(caught.value) and caught.value.blocked_by == ()


def test_a_task_stopped_by_an_earlier_tasks_stub_says_whose_stub():
    mine = learner_code(ALLOCATOR_STUB_AND_CACHE)
    with pytest.raises(NotImplementedError) as caught:
        check("02.kv_cache", mine["PagedKVCacheAllocator"])
    assert str(caught.value) == (
        "task 02.kv_cache (the K/V cache, allocated once) is not implemented yet (this uses your "
        "`BlockAllocator`, which is not implemented yet (02.block_allocator)): keep the free list"
    )

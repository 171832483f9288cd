"""What a learner sees at the end of two exercises when a task is wrong.

Exercise 04's closing run and exercise 12's "your kernel at work" cell name a wrong rule or kernel,
on the wrong implementations of tests/grading/wrong/ (the graded suite proves the checks' feedback;
these prove the two cells')."""

from __future__ import annotations

import pytest
import torch

from paged_kv.checks import CheckFailed
from paged_kv.checks.lesson04 import watched_step
from paged_kv.kv.cache import PagedKVCacheAllocator

from ..helpers import lesson_marks


def exercise_step(needs_new_block):
    """The exercise's decode_step (its solution), on a given boundary rule."""

    def decode_step(cache, seq_ids):
        needs = {
            s: needs_new_block(cache.sequence_length(s), len(cache.get_block_mapping(s)), cache.block_size)
            for s in seq_ids
        }
        taken = {}
        for s in seq_ids:
            taken[s] = cache.append_block_to_sequence(s) if needs[s] else None
            cache.append_tokens(s, 1)
        return taken

    return decode_step


@pytest.mark.lesson04
@pytest.mark.parametrize(
    ("rule", "tokens", "message"),
    [
        (lambda n, held, size: n > held * size, 4, "cache.append_tokens took block 1 for it itself"),
        (
            lambda n, held, size: (n + 1) % size == 0,
            3,
            "needs_new_block(3, 1, 4) returned True, it should return False",
        ),
    ],
    ids=["late", "early"],
)
def test_the_closing_run_of_exercise_04_stops_at_a_wrong_rule(rule, tokens, message):
    cache = PagedKVCacheAllocator(4, 4, 1, 1)
    cache.allocate_for_sequence("b", tokens)
    with pytest.raises(CheckFailed, match="step 1 went wrong") as failure:
        watched_step(1, exercise_step(rule), cache, ["b"], rule)
    assert message in str(failure.value)


@pytest.mark.lesson04
def test_the_closing_run_of_exercise_04_lets_a_right_rule_run():
    cache = PagedKVCacheAllocator(4, 4, 1, 1)
    cache.allocate_for_sequence("b", 4)
    rule = lambda n, held, size: n == held * size  # noqa: E731
    assert watched_step(1, exercise_step(rule), cache, ["b"], rule) == {"b": 1}


@pytest.mark.lesson12
@pytest.mark.parametrize(
    ("kernel", "equal"),
    [pytest.param(k, e, marks=lesson_marks("12")) for k, e in (("right", True), ("tail_unmasked", False))],
)
def test_exercise_12s_kernel_at_work_says_a_kernel_without_the_tail_mask_is_wrong(kernel, equal):
    from paged_kv.attention import triton_language  # noqa: F401  (sets Triton's mode before it is imported)
    from paged_kv.attention.paged import paged_prefill_attention
    from paged_kv.attention.triton_decode import triton_attention
    from paged_kv.attention.triton_kernel import paged_attention_kernel
    from paged_kv.checks.lesson12 import compare_with_gather, fill_stale
    from tests.grading.wrong import _kernels

    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 10, 2, 8, 16)
    tables = torch.tensor([[7, 2, 5], [0, -1, -1], [3, 9, -1]])
    seq_lens, query_lens = torch.tensor([20, 6, 13]), torch.tensor([1, 6, 4])
    query = torch.randn(11, 4, 16)
    starts = torch.tensor([0, 1, 7, 11])
    gathered = paged_prefill_attention(
        query, k_cache, v_cache, tables, seq_lens, query_lens, backend="GATHER"
    )
    fill_stale(k_cache, v_cache, tables, seq_lens)
    chosen = paged_attention_kernel if kernel == "right" else getattr(_kernels, kernel)
    mine = triton_attention(query, k_cache, v_cache, tables, seq_lens, starts, 6, None, kernel=chosen)
    said = compare_with_gather(mine, gathered, starts)
    assert said.startswith(f"your kernel equals the gather: {equal}")
    if not equal:
        assert "wrong, all NaN: sequence 0's token 0; sequence 1's tokens 0, 1, 2, 3, 4, 5" in said
        assert "a zero weight does not cancel it (0 * NaN is NaN)" in said

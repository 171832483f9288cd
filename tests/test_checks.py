"""The notebook checks: a tick when the code is right, the call, the answers and a hint when not."""

from __future__ import annotations

import pytest

from paged_kv import blocks_for_tokens
from paged_kv.checks import TASKS, CheckFailed, check


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
        "  hint:     ceil(n / b) in integers is -(-n // b) or (n + b - 1) // b",
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

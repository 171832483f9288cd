"""The multi-turn bench's baseline caches prompt blocks only, and its ideal is what the package serves.

Correctness only, on the bench's tiny sizes: the numbers live in bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_multiturn

from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.workloads import chat_requests, ideal_hits

pytestmark = pytest.mark.lesson08

CONFIG = GPTConfig(num_layers=1, num_heads=2, head_dim=8, max_len=64)


@pytest.fixture(scope="module")
def chats():
    model = TinyGPT(CONFIG, seed=0).eval()
    requests, answers = chat_requests(model, 3, 3, 4, (2, 5), (3, 6), seed=1)
    return model, requests, answers


def test_each_turn_is_the_previous_prompt_its_answer_and_a_new_message(chats):
    _, requests, answers = chats
    by_id = {r.request_id: r for r in requests}
    for (chat, turn), request in by_id.items():
        assert request.max_tokens == len(answers[(chat, turn)])
        if turn:
            previous = by_id[(chat, turn - 1)]
            assert request.prompt[: len(previous.prompt)] == previous.prompt
            assert request.prompt[len(previous.prompt) :][: previous.max_tokens] == answers[(chat, turn - 1)]
            assert request.arrival_step > previous.arrival_step + previous.max_tokens - 1


def test_the_package_serves_the_ideal_and_the_baseline_caches_prompt_blocks_only(chats):
    model, requests, answers = chats
    results = {name: engine.run(requests) for name, engine in bench_multiturn.engines(model, 64, 4).items()}
    assert results["decode"].tokens == results["prompts"].tokens == answers
    assert results["decode"].prefix_cache_hits == ideal_hits(requests, answers, 4)
    # The baseline's ideal: the same, with no answer token fed (as if every answer were 1 token).
    prompt_only = {request_id: answer[-1:] for request_id, answer in answers.items()}
    assert results["prompts"].prefix_cache_hits == ideal_hits(requests, prompt_only, 4)
    assert results["prompts"].prefix_cache_hits < results["decode"].prefix_cache_hits


def test_the_quick_run_meets_its_targets():
    rows = bench_multiturn.run(**bench_multiturn.QUICK)
    assert all(row.met is not False for row in rows)
    assert all(row.measured > 0 and row.baseline > 0 for row in rows)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_chats": 0}, "num_chats"),
        ({"num_turns": True}, "num_turns"),
        ({"system_tokens": -1}, "system_tokens"),
        ({"message": (5, 2)}, r"message\[1\]"),
        ({"answer": (0, 3)}, r"answer\[0\]"),
        ({"answer": [3, 6]}, "answer must be a"),
    ],
)
def test_chat_requests_names_a_bad_argument(kwargs, match):
    model = TinyGPT(CONFIG, seed=0).eval()
    settings = {"num_chats": 2, "num_turns": 2, "system_tokens": 4, "message": (2, 5), "answer": (3, 6)}
    with pytest.raises(ValueError, match=match):
        chat_requests(model, **(settings | kwargs))

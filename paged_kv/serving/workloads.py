"""Multi-turn chat, served by the engine (lesson 14, ``bench/bench_multiturn.py``).

A chat resends the whole conversation at every turn: each prompt is the previous prompt, the model's
answer to it and a new message, all under one system prompt. :func:`chat_requests` builds such a
workload with the model's real answers (greedy, each prompt alone), so that a prefix cache that keeps
the blocks a turn filled while decoding serves the next turn's prompt from them; :func:`ideal_hits`
is what an unbounded cache of full blocks serves, the yardstick of a hit rate.

Invariants: turn ``k`` of every conversation arrives at step ``k * gap``, with ``gap`` one more than
the longest answer, so each turn has finished when the next arrives (on a pool that admits a whole
turn at once); ``answers[request_id]`` holds exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

from paged_kv.core.prefix_cache import chain_hashes, full_blocks
from paged_kv.model.causal_lm import CausalLM
from paged_kv.model.generation import generate
from paged_kv.serving.engine import EngineRequest
from paged_kv.validate import check_count


def chat_requests(
    model: CausalLM | object,
    num_chats: int,
    num_turns: int,
    system_tokens: int,
    message: tuple[int, int],
    answer: tuple[int, int],
    seed: int = 0,
) -> tuple[list[EngineRequest], dict[Hashable, list[int]]]:
    """Every turn of every conversation, turn by turn (request ids ``(chat, turn)``), and each one's
    answer: the tokens ``model`` generates greedily for that prompt alone.

    A prompt is the conversation so far: a ``system_tokens``-token system prompt shared by every
    chat and a first message, then for each later turn the previous answer and a new message.
    Message and answer lengths are drawn uniformly from the inclusive ranges ``message`` and
    ``answer``, token ids uniformly from ``[0, 256)``, all from ``seed``.

    Raises:
        ValueError: a count below 1 (``system_tokens`` may be 0), or a range that is not two
            positive integers in order, named.
    """
    num_chats = check_count("num_chats", num_chats, minimum=1)
    num_turns = check_count("num_turns", num_turns, minimum=1)
    system_tokens = check_count("system_tokens", system_tokens)
    for name, bounds in (("message", message), ("answer", answer)):
        if not (isinstance(bounds, tuple) and len(bounds) == 2):
            raise ValueError(f"{name} must be a (low, high) tuple of token counts, got {bounds!r}")
        check_count(f"{name}[1]", bounds[1], minimum=check_count(f"{name}[0]", bounds[0], minimum=1))
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_tokens)]
    lengths = [[rng.randint(*answer) for _ in range(num_chats)] for _ in range(num_turns)]
    gap = max(max(turn) for turn in lengths) + 1
    history = [list(system) for _ in range(num_chats)]
    requests, answers = [], {}
    for turn in range(num_turns):
        for chat in range(num_chats):
            history[chat] += [rng.randrange(256) for _ in range(rng.randint(*message))]
            request = EngineRequest((chat, turn), list(history[chat]), lengths[turn][chat], turn * gap)
            requests.append(request)
            alone = generate(model, [request.prompt], request.max_tokens, cache="contiguous")
            answers[request.request_id] = alone.tokens[0]
            history[chat] += answers[request.request_id]
    return requests, answers


def ideal_hits(requests: list[EngineRequest], answers: dict[Hashable, list[int]], block_size: int) -> int:
    """The prompt tokens an unbounded cache of full blocks serves: for each prompt, its leading full
    blocks whose chained hashes an earlier prompt or fed answer token computed (at most
    ``len(prompt) - 1`` tokens, since the last prompt token is always computed).

    Requests are taken in arrival order, those of one step in order, each seeing the prompts
    admitted before it and the answers of the steps before (all but each answer's last token,
    which is sampled and never fed).
    """
    block_size = check_count("block_size", block_size, minimum=1)
    computed: set[int] = set()
    hits = 0
    for step in sorted({r.arrival_step for r in requests}):
        arriving = [r for r in requests if r.arrival_step == step]
        for request in arriving:
            hashes = chain_hashes(full_blocks(request.prompt, block_size))
            usable = hashes[: (len(request.prompt) - 1) // block_size]
            hits += block_size * next((i for i, h in enumerate(usable) if h not in computed), len(usable))
            computed.update(hashes)
        for request in arriving:
            held = request.prompt + answers[request.request_id][:-1]
            computed.update(chain_hashes(full_blocks(held, block_size)))
    return hits

"""Checks of exercise 10: a real model's KV bytes per token from its config, one step of the token
budget's schedule, and the step that samples each request's first token.

The bytes per token are checked on Hugging Face ``transformers`` configs built offline (Llama-2-7B's,
Llama-3-8B's, Qwen2-7B's, Mistral-7B's, Mistral-NeMo-12B's and SmolLM2-135M's published sizes) and
on plain objects that lack the optional fields, then against the package: tiny random-weight
Llama, Qwen2 and Mistral models built from configs, whose one-token block the
:class:`~paged_kv.serving.engine.Engine` sizes as it reads the config (:mod:`paged_kv.model.hf`).
The schedule is checked on hand cases at the budget's edges, then step by step against what the
engine's :class:`~paged_kv.serving.scheduler.Scheduler` scheduled under ``max_num_batched_tokens``
on a random stream with blocks to spare (each step's running and waiting requests replayed from
``EngineResult.scheduled_tokens``), as lesson 09 checks its admission rule against the engine. The
first-token steps are checked on hand cases, then against ``EngineResult.first_token_step`` on the
same runs.

When an answer is wrong, :func:`~paged_kv.checks._core.diagnose` runs the learner's function and
small wrong implementations of the classic mistakes on the task's cases and names the mistake that
answers the same: query heads counted instead of K/V heads, the head size taken from
``hidden_size`` although the config gives one, K and V counted once, the layers or the bytes
forgotten; prompts scheduled before the running requests, a chunk not capped by the budget left,
the running requests left out of the budget, a prompt that does not fit passed over for a later one,
entries of 0 tokens, ``budget=None`` read as no tokens; the step of the first chunk, of the first
token after the prompt (``>`` for ``>=``), of the first one-token entry, or of the last chunk of
more than one token.

``transformers`` is imported by the first task's check only, when it runs: importing every lesson's
checks stays quick.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from types import SimpleNamespace

import torch

from paged_kv.checks._core import Checker, Mistake, answers, diagnose, task
from paged_kv.checks.lesson09 import _one_thread
from paged_kv.device import default_device
from paged_kv.model.config import GPTConfig
from paged_kv.model.hub import SMOLLM2_ARCHITECTURE
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.engine_result import EngineResult

Step = list[tuple[Hashable, int]]


# ------------------------------------------------------------------------------- Task 1

RULE = (
    "2 (K and V) * num_hidden_layers * num_key_value_heads * head_dim * bytes_per_number, with "
    "num_key_value_heads = num_attention_heads when it is None or missing and head_dim = hidden_size // "
    "num_attention_heads when it is None or missing"
)


def _kv_heads(config: object) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config: object) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _query_heads(config: object, size: int) -> int:
    return 2 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * size


def _head_dim_from_width(config: object, size: int) -> int:
    width = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * _kv_heads(config) * width * size


def _k_only(config: object, size: int) -> int:
    return config.num_hidden_layers * _kv_heads(config) * _head_dim(config) * size


def _one_layer(config: object, size: int) -> int:
    return 2 * _kv_heads(config) * _head_dim(config) * size


def _numbers(config: object, size: int) -> int:
    return 2 * config.num_hidden_layers * _kv_heads(config) * _head_dim(config)


BYTES_MISTAKES: list[Mistake] = [
    (
        _query_heads,
        "you counted the query heads: the cache holds the K/V heads only, num_key_value_heads, which "
        "grouped-query attention makes fewer than num_attention_heads",
    ),
    (
        _head_dim_from_width,
        "the head size comes from hidden_size // num_attention_heads although the config gives "
        "head_dim: use config.head_dim when it is set (Mistral-NeMo's heads are 128 wide, not 5120 // 32)",
    ),
    (_k_only, "K and V are counted once: the cache keeps both, so multiply by 2"),
    (_one_layer, "one layer only: every layer keeps its own K and V, so multiply by num_hidden_layers"),
    (
        _numbers,
        "you counted numbers, not bytes: multiply by bytes_per_number (2 in 16-bit, 1 in fp8, 4 in float32)",
    ),
]


def _real_configs() -> list[tuple[str, object, int, int, str]]:
    """``(name, config, bytes_per_number, expected, hint)`` on published sizes, built offline."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    llama2 = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32
    )
    llama3 = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    return [
        (
            "Llama-2-7B: 32 layers, 32 heads of 128, no grouped-query attention",
            llama2,
            2,
            524288,
            "2 (K and V) * 32 layers * 32 K/V heads * 128 * 2 bytes: " + RULE,
        ),
        (
            "Llama-3-8B: 32 layers, 32 query heads over 8 K/V heads of 128",
            llama3,
            2,
            131072,
            "the cache holds the 8 K/V heads (num_key_value_heads), not the 32 query heads: "
            "2 * 32 * 8 * 128 * 2",
        ),
        ("Llama-3-8B in fp8", llama3, 1, 65536, "one byte per number: half the 16-bit figure"),
        ("Llama-3-8B in float32", llama3, 4, 262144, "four bytes per number: twice the 16-bit figure"),
        (
            "Qwen2-7B: 28 layers, 28 query heads over 4 K/V heads, hidden_size 3584",
            Qwen2Config(
                hidden_size=3584,
                intermediate_size=18944,
                num_hidden_layers=28,
                num_attention_heads=28,
                num_key_value_heads=4,
            ),
            2,
            57344,
            "Qwen2's config gives no head_dim: it is hidden_size // num_attention_heads = 3584 // 28 = 128 "
            "(getattr(config, 'head_dim', None) or ...)",
        ),
        (
            "Mistral-7B: 32 layers, 32 query heads over 8 K/V heads of 128",
            MistralConfig(
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
            ),
            2,
            131072,
            "2 * 32 layers * 8 K/V heads * 128 * 2 bytes",
        ),
        (
            "Mistral-NeMo-12B: 40 layers, 32 query heads over 8 K/V heads, head_dim 128, hidden_size 5120",
            MistralConfig(
                hidden_size=5120,
                intermediate_size=14336,
                num_hidden_layers=40,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
            ),
            2,
            163840,
            "its config gives head_dim = 128, which is not 5120 // 32 = 160: use config.head_dim when it "
            "is set",
        ),
        (
            "SmolLM2-135M: 30 layers, 9 query heads over 3 K/V heads of 64 (the lesson's model)",
            LlamaConfig(**SMOLLM2_ARCHITECTURE),
            2,
            23040,
            "2 * 30 layers * 3 K/V heads * 64 * 2 bytes = 22.5 KiB, as the lesson computed",
        ),
    ]


def _plain_configs() -> list[tuple[str, object, int, int, str]]:
    """Config objects without the optional fields, or with them set to None."""
    return [
        (
            "SimpleNamespace(num_hidden_layers=12, num_attention_heads=12, hidden_size=768)  # no K/V "
            "heads, no head_dim",
            SimpleNamespace(num_hidden_layers=12, num_attention_heads=12, hidden_size=768),
            2,
            36864,
            "a config may have no num_key_value_heads and no head_dim attribute at all: then there are as "
            "many K/V heads as query heads, and head_dim = hidden_size // num_attention_heads "
            "(getattr(config, name, None))",
        ),
        (
            "SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=None, "
            "head_dim=None, hidden_size=64)",
            SimpleNamespace(
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=None,
                head_dim=None,
                hidden_size=64,
            ),
            4,
            1024,
            "None means the default: num_key_value_heads None is num_attention_heads, head_dim None is "
            "hidden_size // num_attention_heads (getattr(config, name, None) or the default)",
        ),
    ]


def _tiny_models() -> list[tuple[str, torch.nn.Module, int]]:
    """Tiny random-weight models of the three architectures on the default device, and their dtype's bytes."""
    import transformers

    sizes = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    built = [
        (
            "a tiny Llama: 2 layers, 4 query heads over 2 K/V heads of 16, float32",
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(**sizes, num_hidden_layers=2, num_key_value_heads=2),
            torch.float32,
        ),
        (
            "a tiny Qwen2: 3 layers, 4 query heads over 1 K/V head of 16, float32",
            transformers.Qwen2ForCausalLM,
            transformers.Qwen2Config(**sizes, num_hidden_layers=3, num_key_value_heads=1),
            torch.float32,
        ),
        (
            "a tiny Mistral: 2 layers, 4 query heads over 2 K/V heads of 32 (head_dim given), bfloat16",
            transformers.MistralForCausalLM,
            transformers.MistralConfig(
                **sizes, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, sliding_window=None
            ),
            torch.bfloat16,
        ),
    ]
    torch.manual_seed(0)
    return [
        (what, model_class(config).to(device=default_device(), dtype=dtype).eval(), dtype.itemsize)
        for what, model_class, config, dtype in built
    ]


@task("10.kv_bytes_per_token", "a real model's K/V bytes per token, from its config")
def _kv_bytes_per_token(c: Checker, kv_bytes_per_token) -> None:
    try:
        import transformers  # noqa: F401  (the configs and tiny models below are built with it)
    except ImportError as error:
        c.fail(
            "import transformers",
            "the course's dependencies installed",
            f"ImportError: {error}",
            "this check builds Hugging Face configs: install the course's extra, pip install -e '.[course]' "
            "(make lab does)",
        )
    configs = _real_configs()
    probe = answers([(config, size) for _, config, size, _, _ in configs], convert=lambda n: n)
    for what, config, size, expected, case_hint in [*configs, *_plain_configs()]:
        call = f"kv_bytes_per_token(config, {size})  # {what}"

        def hint(case_hint: str = case_hint) -> str:
            return diagnose(kv_bytes_per_token, BYTES_MISTAKES, probe, case_hint)

        got = c.equal(call, lambda config=config, size=size: kv_bytes_per_token(config, size), expected, hint)
        c.holds(
            f"type({call.split('  #')[0]})",
            type(got) is int,
            "int",
            type(got).__name__,
            "return an int: compute head_dim with //, not /",
        )
    for what, model, size in _tiny_models():
        engine = Engine(model, num_blocks=2, block_size=1)  # blocks of one token, in every layer
        call = f"kv_bytes_per_token(model.config, {size})  # {what}"
        got = c.run(call, lambda model=model, size=size: kv_bytes_per_token(model.config, size))
        c.holds(
            call,
            got == engine.bytes_per_block,
            f"{engine.bytes_per_block} (Engine(model, num_blocks=2, block_size=1).bytes_per_block)",
            got,
            lambda: diagnose(kv_bytes_per_token, BYTES_MISTAKES, probe, RULE),
        )


# ------------------------------------------------------------------------------- Task 2

SCHEDULE = (
    "running requests first, in order, each min(tokens it lacks, budget left); then waiting ones in "
    "queue order, each min(prompt tokens, budget left), stopping when the budget is spent; no entry of "
    "0 tokens"
)


def _pairs(got: object) -> object:
    """A learner's step as a list of ``(request_id, tokens)`` tuples, whatever the sequences it used."""
    try:
        return [(request_id, tokens) for request_id, tokens in got]
    except (TypeError, ValueError):
        return got


def _schedule(
    running, waiting, budget, *, order="running first", cap=True, counted="all", queue="fcfs", zeros=False
):
    """One step under ``budget``, right by default; each keyword is a classic mistake."""
    left = 0 if budget is None and counted == "none is zero" else budget
    groups = [("running", running), ("waiting", waiting)]
    if order == "prompts first":
        groups.reverse()
    scheduled = []
    for kind, requests in groups:
        for request_id, wanted in requests:
            if left is None:
                n = wanted
            elif kind == "waiting" and queue == "whole or skip":
                if wanted > left:
                    continue
                n = wanted
            else:
                n = wanted if not cap and left > 0 else min(wanted, max(left, 0))
            if n == 0 and not zeros:
                if kind == "waiting":
                    break
                continue
            scheduled.append((request_id, n))
            if left is not None and not (kind == "running" and counted == "prompts only"):
                left -= n
    return scheduled


SCHEDULE_MISTAKES: list[Mistake] = [
    (
        functools.partial(_schedule, order="prompts first"),
        "the waiting prompts are scheduled before the running requests: the running ones come first "
        "(every decode gets its token before any prompt chunk), then the queue",
    ),
    (
        functools.partial(_schedule, cap=False),
        "a chunk is not capped by the budget left, so the step runs more tokens than the budget: each "
        "request gets min(tokens it needs, budget left)",
    ),
    (
        functools.partial(_schedule, counted="prompts only"),
        "the running requests' tokens are not taken from the budget: the decodes (and the partly "
        "prefilled prompt) spend it too, before the queue gets what is left",
    ),
    (
        functools.partial(_schedule, queue="whole or skip"),
        "a prompt that does not fit the budget left is passed over and a later, shorter one admitted: "
        "admission is first come, first served. The request at the front gets a chunk, min(prompt "
        "tokens, budget left), and once the budget is spent admission stops",
    ),
    (
        functools.partial(_schedule, zeros=True),
        "entries of 0 tokens are listed: a request that gets no token this step is not scheduled, "
        "leave it out (and stop admitting once the budget is spent)",
    ),
    (
        functools.partial(_schedule, counted="none is zero"),
        "budget=None means no budget, not a budget of 0: every running request gets all the tokens it "
        "lacks and every waiting prompt all of its tokens",
    ),
]

SCHEDULE_CASES: list[tuple[list, list, int | None, list, str]] = [  # running, waiting, budget, expected, hint
    (
        [("a", 1), ("b", 1)],
        [("c", 5)],
        None,
        [("a", 1), ("b", 1), ("c", 5)],
        "budget=None means no budget: the decodes get their token, the waiting prompt all of its tokens "
        "(min(n, None) fails: test for None first)",
    ),
    (
        [("a", 1), ("b", 1)],
        [("c", 5), ("d", 4)],
        8,
        [("a", 1), ("b", 1), ("c", 5), ("d", 1)],
        "2 decodes take 2 of the 8 tokens, c's whole prompt 5, and d gets the last 1 as a first chunk",
    ),
    ([], [("a", 19)], 8, [("a", 8)], "a 19-token prompt under a budget of 8: a first chunk of 8"),
    (
        [("a", 11)],
        [("b", 5)],
        8,
        [("a", 8)],
        "the partly prefilled a lacks 11 and takes the whole budget: b waits (no entry of 0 tokens)",
    ),
    (
        [("a", 3)],
        [("b", 5)],
        8,
        [("a", 3), ("b", 5)],
        "a's last chunk of 3 leaves 5 tokens, all of b's prompt",
    ),
    (
        [("a", 1), ("b", 1), ("c", 1)],
        [("d", 2)],
        3,
        [("a", 1), ("b", 1), ("c", 1)],
        "the 3 decodes spend the budget of 3: nothing is left for d, which is not listed",
    ),
    (
        [],
        [("long", 20), ("short", 2)],
        10,
        [("long", 10)],
        "first come, first served: the long prompt at the front takes a chunk of 10, and the short one "
        "behind it waits",
    ),
    (
        [("p", 4)],
        [("x", 3), ("y", 3), ("z", 1)],
        10,
        [("p", 4), ("x", 3), ("y", 3)],
        "p's 4 and two prompts of 3 spend the budget of 10 exactly: admission stops before z",
    ),
    (
        [("a", 1)],
        [("x", 3), ("y", 2)],
        100,
        [("a", 1), ("x", 3), ("y", 2)],
        "a budget larger than the step needs: everyone gets all it lacks",
    ),
    ([], [], 8, [], "nothing running, nothing waiting: an empty step, []"),
    (
        [("a", 1), ("p", 7)],
        [("x", 4)],
        None,
        [("a", 1), ("p", 7), ("x", 4)],
        "budget=None means no budget: everyone gets all it needs, the partly prefilled prompt too",
    ),
]


def _model() -> TinyGPT:
    return (
        TinyGPT(GPTConfig(num_layers=1, num_heads=1, head_dim=4, max_len=64), seed=0)
        .to(default_device())
        .eval()
    )


def _stream(seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [
        EngineRequest(
            f"r{i}",
            [rng.randrange(256) for _ in range(rng.choice([rng.randint(1, 6), rng.randint(7, 24)]))],
            rng.randint(1, 6),
            arrival_step=rng.randrange(10),
        )
        for i in range(12)
    ]


@functools.cache
def _engine_runs() -> tuple[tuple[str, int | None, tuple[EngineRequest, ...], EngineResult], ...]:
    """The engine under three budgets and none, on random streams, with blocks to spare (no preemption)."""
    model = _model()
    runs = []
    for seed, budget in ((1, 8), (2, 5), (3, 16), (4, None)):
        requests = _stream(seed)
        result = Engine(model, num_blocks=256, block_size=4, max_num_batched_tokens=budget).run(requests)
        what = f"12 random requests, max_num_batched_tokens={budget}, 256 blocks of 4"
        runs.append((what, budget, tuple(requests), result))
    return tuple(runs)


def _replayed_states(requests: Sequence[EngineRequest], result: EngineResult) -> list[tuple[Step, Step]]:
    """Each step's ``(running, waiting)`` as ``schedule_step`` takes them, replayed from what the
    engine scheduled in the steps before it: running requests in admission order with the tokens
    they lack (1 for a decode), arrived requests in queue order with their prompt's tokens."""
    prompt = {r.request_id: len(r.prompt) for r in requests}
    wanted = {r.request_id: r.max_tokens for r in requests}
    pending = sorted(requests, key=lambda r: r.arrival_step)  # stable, as the engine adds them
    waiting: list[Hashable] = []
    running: dict[Hashable, list[int]] = {}  # computed tokens, generated tokens
    states = []
    for step, scheduled in enumerate(result.scheduled_tokens):
        while pending and pending[0].arrival_step <= step:
            waiting.append(pending.pop(0).request_id)
        lacking = [(r, prompt[r] - done if done < prompt[r] else 1) for r, (done, _) in running.items()]
        states.append((lacking, [(r, prompt[r]) for r in waiting]))
        for request_id, n in scheduled:
            if request_id in waiting:
                waiting.remove(request_id)
                running[request_id] = [0, 0]
            done, generated = running[request_id]
            if done < prompt[request_id]:
                done += n
                generated += done == prompt[request_id]  # the chunk that ends the prompt samples
            else:
                generated += 1
            running[request_id] = [done, generated]
        for request_id in [r for r, (_, generated) in running.items() if generated == wanted[r]]:
            del running[request_id]
    return states


@task("10.schedule_step", "one step under the token budget")
@_one_thread
def _schedule_step(c: Checker, schedule_step) -> None:
    probe = answers([case[:3] for case in SCHEDULE_CASES], convert=_pairs)

    def hint(default: str) -> Callable[[], str]:
        return lambda: diagnose(schedule_step, SCHEDULE_MISTAKES, probe, default)

    for running, waiting, budget, expected, case_hint in SCHEDULE_CASES:
        c.equal(
            f"schedule_step({running}, {waiting}, {budget})",
            lambda running=running, waiting=waiting, budget=budget: _pairs(
                schedule_step(list(running), list(waiting), budget)
            ),
            expected,
            hint(case_hint),
        )
    for what, budget, requests, result in _engine_runs():
        for step, (running, waiting) in enumerate(_replayed_states(requests, result)):
            engine = list(result.scheduled_tokens[step])
            call = f"schedule_step({running}, {waiting}, {budget})"
            got = c.run(
                call,
                lambda running=running, waiting=waiting, budget=budget: _pairs(
                    schedule_step(list(running), list(waiting), budget)
                ),
            )
            c.holds(
                f"{call}  # step {step} of an Engine run: {what}",
                got == engine,
                f"{engine}, what the engine's scheduler ran",
                got,
                hint(SCHEDULE),
            )


# ------------------------------------------------------------------------------- Task 3

FIRST_TOKEN = (
    "add up each request's scheduled tokens step by step: its first token is sampled in the step where "
    "the sum reaches its prompt's length (>=), the step of the chunk that completes the prompt"
)


def _entries(
    scheduled_tokens: Iterable[Iterable[tuple[Hashable, int]]],
) -> Iterable[tuple[int, Hashable, int]]:
    for step, scheduled in enumerate(scheduled_tokens):
        for request_id, n in scheduled:
            yield step, request_id, n


def _first_chunk(scheduled_tokens, prompt_lens) -> dict:
    found: dict = {}
    for step, request_id, _ in _entries(scheduled_tokens):
        found.setdefault(request_id, step)
    return found


def _one_late(scheduled_tokens, prompt_lens) -> dict:
    found, done = {}, dict.fromkeys(prompt_lens, 0)
    for step, request_id, n in _entries(scheduled_tokens):
        done[request_id] += n
        if done[request_id] > prompt_lens[request_id]:
            found.setdefault(request_id, step)
    return found


def _first_single(scheduled_tokens, prompt_lens) -> dict:
    found: dict = {}
    for step, request_id, n in _entries(scheduled_tokens):
        if n == 1:
            found.setdefault(request_id, step)
    return found


def _last_chunk_of_several(scheduled_tokens, prompt_lens) -> dict:
    found: dict = {}
    for step, request_id, n in _entries(scheduled_tokens):
        if n > 1:
            found[request_id] = step
    return found


FIRST_TOKEN_MISTAKES: list[Mistake] = [
    (
        _first_chunk,
        "you gave the step of each request's first chunk: under a budget a prompt can take several "
        "steps, and only the chunk that reaches the end of the prompt samples a token",
    ),
    (
        _one_late,
        "one step late: the first token is sampled in the step whose chunk brings the scheduled tokens to "
        "the prompt's length, so compare with >=, not >",
    ),
    (
        _first_single,
        "you gave the step of the first decode (the first entry of one token): the first token is sampled "
        "by the chunk that completes the prompt, the step before the decodes start",
    ),
    (
        _last_chunk_of_several,
        "you took every entry of one token for a decode: a prompt chunk can be one token long too (a "
        "one-token prompt, or the last token of a longer one), so count the tokens against the "
        "prompt's length",
    ),
]

FIRST_TOKEN_CASES: list[tuple[list, dict, dict, str]] = [  # scheduled_tokens, prompt_lens, expected, hint
    (
        [[("a", 5)], [("a", 1)], [("a", 1)]],
        {"a": 5},
        {"a": 0},
        "a's whole prompt of 5 in step 0: step 0 samples its first token, then it decodes",
    ),
    (
        [[("a", 8)], [("a", 8)], [("a", 3), ("b", 5)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)]],
        {"a": 19, "b": 5},
        {"a": 2, "b": 2},
        "the lesson's schedule: a's 19 tokens in chunks of 8, 8 and 3 (steps 0 to 2); b's 5 in step 2",
    ),
    (
        [[("a", 8)], [("a", 1)], [("a", 1)], [("a", 1)]],
        {"a": 9},
        {"a": 1},
        "a 9-token prompt under a budget of 8: its last chunk, in step 1, is one token long, and samples",
    ),
    (
        [[("x", 1), ("y", 3)], [("y", 1)]],
        {"x": 1, "y": 3},
        {"x": 0, "y": 0},
        "a one-token prompt is a chunk of one token that completes the prompt: it samples in step 0",
    ),
    (
        [[("a", 8)], [("a", 8)]],
        {"a": 19},
        {},
        "a has 16 of its 19 prompt tokens computed: no step sampled its first token yet, so it is not in "
        "the result",
    ),
    (
        [(), (), (("a", 4),), (("a", 1),)],
        {"a": 4},
        {"a": 2},
        "steps with nothing scheduled count too: the result gives each request the index of its step",
    ),
]


@task("10.first_token_steps", "the step that samples each request's first token")
@_one_thread
def _first_token_steps(c: Checker, first_token_steps) -> None:
    runs = _engine_runs()
    probe_cases = [case[:2] for case in FIRST_TOKEN_CASES]
    probe_cases += [
        (result.scheduled_tokens, {r.request_id: len(r.prompt) for r in requests})
        for _, _, requests, result in runs
    ]
    probe = answers(probe_cases, convert=lambda found: dict(found))

    def hint(default: str) -> Callable[[], str]:
        return lambda: diagnose(first_token_steps, FIRST_TOKEN_MISTAKES, probe, default)

    for scheduled, prompt_lens, expected, case_hint in FIRST_TOKEN_CASES:
        c.equal(
            f"first_token_steps({scheduled}, {prompt_lens})",
            lambda scheduled=scheduled, prompt_lens=prompt_lens: first_token_steps(
                scheduled, dict(prompt_lens)
            ),
            expected,
            hint(case_hint),
        )
    for what, _, requests, result in runs:
        prompt_lens = {r.request_id: len(r.prompt) for r in requests}
        call = f"first_token_steps(result.scheduled_tokens, {prompt_lens})  # an Engine run: {what}"
        c.equal(
            call,
            lambda result=result, prompt_lens=prompt_lens: first_token_steps(
                result.scheduled_tokens, dict(prompt_lens)
            ),
            result.first_token_step,
            hint(FIRST_TOKEN + " (result.first_token_step is the engine's own record)"),
        )

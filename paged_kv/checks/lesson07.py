"""Checks of exercise 07: size classes, contiguous reservations and a continuous-batching scheduler."""

from __future__ import annotations

from collections import deque

from paged_kv.checks._core import Checker, task
from paged_kv.simulation.workload import (
    CONTIGUOUS_KINDS,
    ContiguousPolicy,
    Request,
    next_power_of_two,
    sample_requests,
    simulate,
)

POW2_HINT = "the smallest power of two >= n is 1 << (n - 1).bit_length()"
EXACT_POWER_HINT = (
    "an exact power of two is its own size class (16 stays 16): rounding it up again is what "
    "1 << n.bit_length(), or a loop that doubles while p <= n, does"
)
ONE_HINT = "1 = 2**0 is a power of two, so the answer for 1 is 1 (a loop that starts at p = 2 is off by one)"


@task("07.next_power_of_two", "the next power of two", needs=("next_power_of_two",))
def _next_power_of_two(c: Checker, next_power_of_two_fn) -> None:
    for n, expected in [(3, 4), (5, 8), (17, 32), (300, 512)]:
        c.equal(f"next_power_of_two({n})", lambda n=n: next_power_of_two_fn(n), expected, POW2_HINT)
    for n in (16, 2, 1024):
        c.equal(f"next_power_of_two({n})", lambda n=n: next_power_of_two_fn(n), n, EXACT_POWER_HINT)
    c.equal("next_power_of_two(1)", lambda: next_power_of_two_fn(1), 1, ONE_HINT)
    c.equal("next_power_of_two(1025)", lambda: next_power_of_two_fn(1025), 2048, POW2_HINT)
    result = c.run("next_power_of_two(300)", lambda: next_power_of_two_fn(300))
    c.holds(
        "type(next_power_of_two(300))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a size in slots is an int: math.pow(2, k) and 2.0 ** k return floats",
    )
    c.raises(
        "next_power_of_two(0)",
        lambda: next_power_of_two_fn(0),
        ValueError,
        "no power of two is the answer for n < 1: raise ValueError",
    )
    wrong = c.run(
        "[next_power_of_two(n) for n in range(1, 4097)]",
        lambda: next(
            (n for n in range(1, 4097) if next_power_of_two_fn(n) != next_power_of_two(n)),
            None,
        ),
    )
    if wrong is not None:
        c.equal(f"next_power_of_two({wrong})", lambda: next_power_of_two_fn(wrong), next_power_of_two(wrong))
    c.holds("next_power_of_two(n) for n from 1 to 4096", wrong is None, "paged_kv's answers", wrong)


FINAL_LENGTH_ROUNDED_HINT = (
    "the vLLM paper's Orca (Pow2) rounds only the output up to a power of two: the prompt's 300 tokens "
    "are known and get exactly 300 slots, the 1-token output 1 (rounding the final length, 301, would "
    "reserve 512)"
)
PROMPT_ONLY_HINT = (
    "a contiguous slot is reserved once, at admission, for the final length prompt + output, not for "
    "the prompt alone: it cannot grow later (only the paged policy starts with the prompt's blocks)"
)


@task("07.reserved_tokens", "what a contiguous slot reserves")
def _reserved_tokens(c: Checker, reserved_tokens) -> None:
    c.equal(
        'reserved_tokens("max", 100, 200, 2048)',
        lambda: reserved_tokens("max", 100, 200, 2048),
        2048,
        "'max' reserves max_model_len for every request, whatever its length",
    )
    c.equal(
        'reserved_tokens("oracle", 100, 200, 2048)',
        lambda: reserved_tokens("oracle", 100, 200, 2048),
        300,
        PROMPT_ONLY_HINT,
    )
    c.equal(
        'reserved_tokens("pow2", 300, 1, 2048)',
        lambda: reserved_tokens("pow2", 300, 1, 2048),
        301,
        FINAL_LENGTH_ROUNDED_HINT,
    )
    c.equal(
        'reserved_tokens("pow2", 100, 200, 2048)',
        lambda: reserved_tokens("pow2", 100, 200, 2048),
        356,
        "the prompt's 100 slots plus the next power of two of the output, 256 for 200 tokens: 356",
    )
    c.equal(
        'reserved_tokens("pow2", 200, 64, 2048)',
        lambda: reserved_tokens("pow2", 200, 64, 2048),
        264,
        "an output of 64 tokens is already a power of two: its room is 64, so 200 + 64 = 264, not 328",
    )
    c.equal(
        'reserved_tokens("pow2", 150, 200, 400)',
        lambda: reserved_tokens("pow2", 150, 200, 400),
        400,
        "cap the reservation at max_model_len: 150 + 256 = 406, but no sequence is longer than 400",
    )
    for kind, max_model_len, expected in [("max", 2048, 2048), ("pow2", 2048, 2048), ("oracle", 2048, 2048)]:
        c.equal(
            f'reserved_tokens("{kind}", 1024, 1024, {max_model_len})',
            lambda kind=kind, m=max_model_len: reserved_tokens(kind, 1024, 1024, m),
            expected,
            "a request of exactly max_model_len tokens fits: raise only when it is longer (>, not >=)",
        )
    c.equal(
        'reserved_tokens("pow2", 250, 250, 500)',
        lambda: reserved_tokens("pow2", 250, 250, 500),
        500,
        "250 + 256 = 506 is more than max_model_len (500): cap at max_model_len",
    )
    c.raises(
        'reserved_tokens("exact", 100, 200, 2048)',
        lambda: reserved_tokens("exact", 100, 200, 2048),
        ValueError,
        "the kinds are 'max', 'pow2' and 'oracle': anything else is a ValueError mentioning kind",
        match="kind",
    )
    for kind in ("oracle", "max"):
        c.raises(
            f'reserved_tokens("{kind}", 10, 10, 16)',
            lambda kind=kind: reserved_tokens(kind, 10, 10, 16),
            ValueError,
            "20 tokens cannot fit in a model of max_model_len 16, whatever the kind: raise a ValueError "
            "mentioning max_model_len",
            match="max_model_len",
        )
    for name, max_model_len in (("sharegpt", 2048), ("alpaca", 512)):
        requests = sample_requests(name, 200, seed=0)
        for kind in CONTIGUOUS_KINDS:
            policy = ContiguousPolicy(kind, max_model_len)
            cases = [(r.prompt_tokens, r.output_tokens, policy.reservation(r)) for r in requests]
            call = (
                f'reserved_tokens("{kind}", prompt, output, {max_model_len}) for 200 {name}-shaped requests'
            )
            wrong = c.run(
                call,
                lambda kind=kind, m=max_model_len, cases=cases: next(
                    ((p, o, e) for p, o, e in cases if reserved_tokens(kind, p, o, m) != e), None
                ),
            )
            if wrong is not None:
                prompt, output, expected = wrong
                c.equal(
                    f'reserved_tokens("{kind}", {prompt}, {output}, {max_model_len})',
                    lambda kind=kind, p=prompt, o=output, m=max_model_len: reserved_tokens(kind, p, o, m),
                    expected,
                    f"a {name}-shaped request: the package's ContiguousPolicy reserves {expected}",
                )
            c.holds(call, wrong is None, "paged_kv's reservations", wrong)


# ------------------------------------------------------------------------------ task 3


def final_length(request: Request) -> int:
    """The ``reserve`` function the checks use: each request reserves exactly its final length."""
    return request.total_tokens


def _ids(sequences) -> list:
    return [seq.request.request_id for seq in sequences]


def _waiting_ids(batcher) -> list:
    return [request.request_id for request in batcher.waiting]


STEP0_HINT = (
    "a request admitted in this step prefills, and its prefill samples its first output token: a, with "
    "1 output token, finishes in the step it is admitted; decode the running sequences before you "
    "admit (a newcomer does not decode in its prefill step), and admit before you release"
)
NEW_HINT = "a request admitted in this step has generated 1 token: its prefill samples its first output token"
RELEASE_HINT = (
    "a finished sequence's reservation goes back to free_tokens at once, in the step it finishes, "
    "while the others keep running; holding it until the whole batch is done is static batching"
)
SKIP_HINT = (
    "first come first served: stop at the first waiting request that does not fit, even if a later "
    "one would; letting a small request jump ahead can starve a large one for ever"
)


def _serve(batcher_class, requests: list[Request], reserve, budget: int, limit: int) -> list[int]:
    """Sequences in the forward pass at each step, as ``simulate`` counts them (finishing ones included)."""
    batcher = batcher_class(budget, reserve)
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    running, done, step = [], 0, 0
    while done < len(requests) and step < limit:
        arrivals = []
        while pending and pending[0].arrival_step <= step:
            arrivals.append(pending.popleft())
        finished = list(batcher.step(arrivals))
        running.append(len(batcher.running) + len(finished))
        done += len(finished)
        step += 1
    return running


@task("07.continuous_batcher", "a continuous-batching scheduler", needs=("ContinuousBatcher",))
def _continuous_batcher(c: Checker, batcher_class) -> None:
    a, b, request_c = Request("a", 0, 2, 1), Request("b", 0, 2, 4), Request("c", 0, 3, 1)
    batcher = c.run("ContinuousBatcher(10, final_length)", lambda: batcher_class(10, final_length))
    step0 = "batcher = ContinuousBatcher(10, final_length); batcher.step([a, b, c])"
    c.equal(step0, lambda: batcher.step([a, b, request_c]), ["a"], STEP0_HINT)
    c.equal(
        "running ids after step 0",
        lambda: _ids(batcher.running),
        ["b"],
        "admit from the front of the queue while it fits: a (3 slots) and b (6) fit in 10, c (4) does "
        "not; a finished, so only b runs on",
    )
    c.equal(
        "waiting ids after step 0", lambda: _waiting_ids(batcher), ["c"], "c does not fit: it stays queued"
    )
    c.equal("batcher.free_tokens after step 0", lambda: batcher.free_tokens, 4, RELEASE_HINT)
    c.equal(
        "[seq.generated for seq in batcher.running] after step 0",
        lambda: [seq.generated for seq in batcher.running],
        [1],
        NEW_HINT,
    )
    c.equal(
        "batcher.step()  # step 1",
        lambda: batcher.step(),
        ["c"],
        "c fits in the 4 slots a gave back: it is admitted at step 1, while b still runs, and its "
        "prefill samples its only token",
    )
    c.equal(
        "running ids after step 1", lambda: _ids(batcher.running), ["b"], "a finished sequence leaves running"
    )
    c.equal(
        "[seq.generated for seq in batcher.running] after step 1",
        lambda: [seq.generated for seq in batcher.running],
        [2],
        "every running sequence decodes one token per step",
    )
    c.equal("batcher.step()  # step 2", lambda: batcher.step(), [])
    c.equal("batcher.step()  # step 3", lambda: batcher.step(), ["b"], "b has 4 output tokens: steps 0 to 3")
    c.equal(
        "(batcher.free_tokens, running ids, waiting ids) after step 3",
        lambda: (batcher.free_tokens, _ids(batcher.running), _waiting_ids(batcher)),
        (10, [], []),
        "when everyone has finished, the whole budget is free again",
    )

    x, y, z, w = Request("x", 0, 4, 4), Request("y", 0, 3, 2), Request("z", 0, 1, 1), Request("w", 1, 1, 2)
    batcher = c.run("ContinuousBatcher(10, final_length)", lambda: batcher_class(10, final_length))
    c.equal(
        "batcher = ContinuousBatcher(10, final_length); batcher.step([x, y, z])",
        lambda: batcher.step([x, y, z]),
        [],
        SKIP_HINT,
    )
    c.equal(
        "running ids after step 0 (x: 8 slots, y: 5, z: 2)", lambda: _ids(batcher.running), ["x"], SKIP_HINT
    )
    c.equal("waiting ids after step 0", lambda: _waiting_ids(batcher), ["y", "z"], SKIP_HINT)
    c.equal("batcher.step([w])  # step 1, w needs 3 slots", lambda: batcher.step([w]), [])
    c.equal(
        "waiting ids after step 1",
        lambda: _waiting_ids(batcher),
        ["y", "z", "w"],
        "arrivals join the back of the queue, and wait behind the requests already there",
    )
    c.equal("batcher.step()  # step 2", lambda: batcher.step(), [])
    c.equal("batcher.step()  # step 3", lambda: batcher.step(), ["x"], "x has 4 output tokens: steps 0 to 3")
    queue_hint = "once x has released its 8 slots, admit the queue in order: y, z, then w (5 + 2 + 3 slots)"
    c.equal("batcher.step()  # step 4", lambda: batcher.step(), ["z"], queue_hint + "; z finishes at once")
    c.equal("running ids after step 4", lambda: _ids(batcher.running), ["y", "w"], queue_hint)

    requests = sample_requests("alpaca", 30, seed=0, arrival_rate=1.0)
    for policy, written, reserve in (
        (
            ContiguousPolicy("oracle", compact=True),
            'ContiguousPolicy("oracle", compact=True)',
            "final_length",
        ),
        (ContiguousPolicy("max", 512), 'ContiguousPolicy("max", 512)', "lambda r: 512"),
    ):
        expected = simulate(requests, policy, 1024).running
        call = f"running sequences at each step of 30 alpaca requests, ContinuousBatcher(1024, {reserve})"
        got = c.run(
            call,
            lambda policy=policy, expected=expected: _serve(
                batcher_class, requests, policy.reservation, 1024, len(expected) + 100
            ),
        )
        difference = _first_difference(got, expected)
        c.holds(
            call,
            difference is None,
            f"the running counts of simulate(requests, {written}, 1024), {len(expected)} steps",
            difference,
            "follow the four phases in order: arrivals join the queue, running sequences decode, the "
            "queue is admitted from the front while it fits (each newcomer's prefill samples its first "
            "token), finished sequences release at once",
        )


def _first_difference(got: list[int], expected: list[int]) -> str | None:
    """Where two per-step series first differ, in words; None when they are equal."""
    for step in range(max(len(got), len(expected))):
        mine = got[step] if step < len(got) else "no step"
        theirs = expected[step] if step < len(expected) else "no step"
        if mine != theirs:
            return f"at step {step}: {mine} running, where simulate has {theirs}"
    return None

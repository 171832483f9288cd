"""Checks of exercise 16: stop strings and what a stream may send, the children of a request with ``n``
completions, and an abort that frees a running request's blocks at once.

Each task is checked on examples that isolate one rule (the stop string listed first wins and is left
out, a hold of the longest stop less one and none once finished, a trailing ``\\ufffd`` not sent, a
text shorter than the hold sending nothing, a single completion keeping its id, ``seed + i`` and a seed
of 0, a shared block freed by its last holder only, the last block first, a waiting request just
leaving...), then against the package on many cases: ``cut_at_stop`` and ``sendable`` against
:class:`paged_kv.serving.output_processor.OutputProcessor` (each on random texts, then both together on
random token streams, some ending in half a UTF-8 character, whose every output they must reproduce),
``child_requests`` against the processor's child ids and the engine's child seeds, and ``abort`` against
:class:`~paged_kv.core.single_type_kv_cache_manager.FullAttentionManager` freeing tables over a
:class:`~paged_kv.core.block_allocator.BlockAllocator` (through the package's reference,
:mod:`paged_kv.reference.lesson16`). When an answer is wrong, the check runs the learner's code
beside the classic mistakes, written as small wrong implementations, and names the one it behaves like
(:func:`~paged_kv.checks._core.diagnose`).
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable

from paged_kv.checks._core import Checker, diagnose, outcome, task
from paged_kv.reference.lesson16 import abort as package_abort
from paged_kv.reference.lesson16 import child_requests as package_children
from paged_kv.reference.lesson16 import cut_at_stop as package_cut
from paged_kv.reference.lesson16 import sendable as package_sendable
from paged_kv.serving.output_processor import OutputProcessor
from paged_kv.serving.sampling_params import SamplingParams

# ------------------------------------------------------------------------------- Task 1

CUT_RULE = (
    "try the stop strings in the order listed: the first one found anywhere in the text (text.find(s) != "
    "-1) ends it, and the text is cut just before it: return (text[:at], s); when none is found, return "
    "(text, None)"
)
EARLIEST_NOT_LISTED = (
    "vLLM tries the stop strings in the order they are listed, and the first one found ends the text, "
    "even when another, listed later, starts earlier (check_stop_strings: `for stop_str in stop: ... "
    "return`). Streaming checks after every token, so two stop strings are in the text at once only when "
    "one step completed both; then the list decides, not the position"
)
STOP_KEPT = (
    "the stop string is left out of the text (vLLM's default, include_stop_str_in_output=False): cut at "
    "its start, text[:at], not after it"
)
LAST_OCCURRENCE = (
    "the first occurrence of the stop string ends the text: the text stops there, whatever follows. Use "
    "text.find(s), not text.rfind(s)"
)
ONLY_AT_THE_END = (
    "a stop string anywhere in the text ends it, not only at its end: a token may bring the stop string "
    "and more characters after it (find it with text.find(s), not text.endswith(s))"
)
FINISH_REASON_RETURNED = (
    "the second item is the stop_reason, the stop string that matched ('\\n', '.'...); 'stop' is the "
    "finish_reason, which the engine sets beside it"
)
SENDABLE_RULE = (
    "finished: the whole text; else drop the trailing '\\ufffd' characters first (text.rstrip('\\ufffd')), "
    "then hold back hold = max(len(s) for s in stop) - 1 characters (0 without stop strings): "
    "text[:max(len(text) - hold, 0)]"
)
HOLD_FULL = (
    "hold back the longest stop string's length less one: a text that ends with its first len - 1 "
    "characters might still become it, but if all len characters were there the stop string would have "
    "been found already (vLLM: stop_buffer_length = max(len(s) for s in stop) - 1)"
)
HOLD_FIRST = (
    "the hold comes from the longest stop string, not the first one listed: any of them may be starting "
    "at the end of the text (max(len(s) for s in stop) - 1)"
)
HOLD_SHORTEST = (
    "the hold comes from the longest stop string, not the shortest: a longer one may be starting earlier "
    "in the tail (max(len(s) for s in stop) - 1)"
)
HOLD_WHEN_FINISHED = (
    "a finished text is sent whole: no stop string can come any more, so nothing is held back "
    "(vLLM: buffer_length = 0 if finished else stop_buffer_length)"
)
STRIP_WHEN_FINISHED = (
    "a finished text is sent as it is, a trailing '\\ufffd' included: no more bytes will come to complete "
    "that character, so it stays"
)
NO_STRIP = (
    "a trailing '\\ufffd' is a character whose bytes have not all arrived (the tokenizer decoded half a "
    "UTF-8 character): leave it out while the stream runs, text.rstrip('\\ufffd'), so the client never "
    "reads a replacement character the next token will fix"
)
STRIP_ONE = (
    "drop every trailing '\\ufffd', not only the last one: a character of 3 or 4 bytes whose first bytes "
    "came in separate tokens decodes as several (text.rstrip('\\ufffd'))"
)
STRIP_ALL = (
    "only a trailing '\\ufffd' may still be completed; one inside the text is followed by other "
    "characters, so it is final: text.rstrip('\\ufffd'), not text.replace('\\ufffd', '')"
)
HOLD_THEN_STRIP = (
    "drop the trailing '\\ufffd' first, then hold back: the characters held back are real ones that may "
    "start a stop string, and a '\\ufffd' is not a character yet"
)
MINUS_ZERO = (
    "text[:-hold] is '' when hold is 0 (-0 is 0): with no stop strings, or only one-character ones, "
    "nothing is held back. Slice with text[:len(text) - hold], or test `if hold`"
)
WRAPS_AROUND = (
    "a text shorter than the hold sends nothing: len(text) - hold is negative then, and text[:-1] keeps "
    "all but one character (Python counts a negative index from the end). Take max(len(text) - hold, 0)"
)
NO_STOPS_RAISES = (
    "with no stop strings nothing is held back: max() of an empty sequence raises ValueError; use "
    "max((len(s) for s in stop), default=1) - 1, or test `if stop` first"
)


def _cut(
    text: str,
    stop: list[str],
    *,
    earliest: bool = False,
    keep: bool = False,
    last: bool = False,
    at_end: bool = False,
    finish_reason: bool = False,
) -> tuple[str, str | None]:
    """The rule, or a classic mistake (a keyword changed)."""
    found = []
    for order, s in enumerate(stop):
        if at_end:
            at = len(text) - len(s) if text.endswith(s) else -1
        else:
            at = text.rfind(s) if last else text.find(s)
        if at != -1:
            found.append((at, order, s))
    if not found:
        return text, None
    at, _, s = min(found) if earliest else found[0]
    return text[: at + len(s) if keep else at], "stop" if finish_reason else s


CUT_MISTAKES: list[tuple[Callable[..., object], str]] = [
    (lambda t, s: _cut(t, s, earliest=True), EARLIEST_NOT_LISTED),
    (lambda t, s: _cut(t, s, keep=True), STOP_KEPT),
    (lambda t, s: _cut(t, s, last=True), LAST_OCCURRENCE),
    (lambda t, s: _cut(t, s, at_end=True), ONLY_AT_THE_END),
    (lambda t, s: _cut(t, s, finish_reason=True), FINISH_REASON_RETURNED),
]


def _sendable(
    text: str,
    stop: list[str],
    finished: bool,
    *,
    hold_of: Callable[[list[str]], int] = lambda stop: max((len(s) for s in stop), default=1) - 1,
    hold_finished: bool = False,
    strip_finished: bool = False,
    strip: str = "trailing",
    strip_first: bool = True,
    slicing: str = "guarded",
) -> str:
    """The rule, or a classic mistake (a keyword changed)."""
    if finished and not hold_finished:
        return text.rstrip("\ufffd") if strip_finished else text

    def stripped(value: str) -> str:
        if strip == "trailing":
            return value.rstrip("\ufffd")
        if strip == "one":
            return value[:-1] if value.endswith("\ufffd") else value
        if strip == "all":
            return value.replace("\ufffd", "")
        return value

    hold = hold_of(stop)
    if strip_first:
        text = stripped(text)
    if slicing == "minus":
        text = text[:-hold]
    elif slicing == "wraps":
        text = text[: len(text) - hold]
    else:
        text = text[: max(len(text) - hold, 0)]
    return text if strip_first else stripped(text)


SENDABLE_MISTAKES: list[tuple[Callable[..., object], str]] = [
    (
        lambda t, s, f: _sendable(t, s, f, hold_of=lambda stop: max((len(x) for x in stop), default=0)),
        HOLD_FULL,
    ),
    (lambda t, s, f: _sendable(t, s, f, hold_of=lambda stop: len(stop[0]) - 1 if stop else 0), HOLD_FIRST),
    (
        lambda t, s, f: _sendable(t, s, f, hold_of=lambda stop: min((len(x) for x in stop), default=1) - 1),
        HOLD_SHORTEST,
    ),
    (lambda t, s, f: _sendable(t, s, f, hold_finished=True), HOLD_WHEN_FINISHED),
    (lambda t, s, f: _sendable(t, s, f, strip_finished=True), STRIP_WHEN_FINISHED),
    (lambda t, s, f: _sendable(t, s, f, strip="none"), NO_STRIP),
    (lambda t, s, f: _sendable(t, s, f, strip="one"), STRIP_ONE),
    (lambda t, s, f: _sendable(t, s, f, strip="all"), STRIP_ALL),
    (lambda t, s, f: _sendable(t, s, f, strip_first=False), HOLD_THEN_STRIP),
    (lambda t, s, f: _sendable(t, s, f, slicing="minus"), MINUS_ZERO),
    (lambda t, s, f: _sendable(t, s, f, slicing="wraps"), WRAPS_AROUND),
    (lambda t, s, f: _sendable(t, s, f, hold_of=lambda stop: max(len(x) for x in stop) - 1), NO_STOPS_RAISES),
]

# (text, stop, why): each isolates one rule
CUT_EXAMPLES: list[tuple[str, list[str], str]] = [
    ("Hello world", [], "no stop strings: the whole text, and no stop_reason"),
    ("Hello world", ["\n"], "no stop string in the text"),
    ("Hello.\nBye", ["\n"], "the text before the stop string, which is left out"),
    ("ending", ["ing"], "a stop string at the very end of the text"),
    ("User: hi", ["User:"], "a stop string at the start: nothing is left"),
    ("a. b. c.", ["."], "its first occurrence ends the text"),
    ("Yes!\nNo.", ["\n", "."], "both are in the text: '\\n' is listed first"),
    ("Yes!\nNo.", [".", "\n"], "'.' is listed first: it wins, although '\\n' comes earlier"),
    ("x</s>y", ["s", "</s>"], "one stop string inside another: the one listed first"),
    ("abc", ["abcd"], "a stop string longer than the text is not in it"),
]  # fmt: skip

# (text, stop, finished, why)
SENDABLE_EXAMPLES: list[tuple[str, list[str], bool, str]] = [
    ("Hello", [], False, "no stop strings: nothing held back"),
    ("Hello", [], True, "finished: everything"),
    ("Hello", ["\n"], False, "a one-character stop string: 1 - 1 = 0 held back"),
    ("Hello wor", ["world"], False, "the last 4 characters may be the start of 'world'"),
    ("Hello wor", ["world"], True, "finished: nothing held back"),
    ("Hello", ["\n", "STOP"], False, "the longest stop string sets the hold: 4 - 1 = 3"),
    ("Hello", ["STOP", "\n"], False, "the longest, wherever it is listed"),
    ("Hello", ["ab", "STOP"], False, "the longest, not the shortest"),
    ("caf\ufffd", [], False, "half a character at the end is not sent yet"),
    ("\u20ac\ufffd\ufffd", [], False, "two bytes of a 3-byte character: both '\\ufffd' go"),
    ("a\ufffdb", [], False, "a '\\ufffd' inside the text is final: it is sent"),
    ("Hello wo\ufffd", ["world"], False, "the '\\ufffd' goes first, then 4 characters are held back"),
    ("caf\ufffd", ["\n"], True, "finished: everything, a trailing '\\ufffd' too"),
    ("ab", ["abcd"], False, "a text shorter than the hold: nothing yet, 'ab' may start 'abcd'"),
    ("", ["abc"], False, "no text yet"),
]  # fmt: skip

_ALPHABET = "ab.\n c\ufffd"
_STOP_CHOICES = ("\n", ".", "ab", "a", "b.", "c\n", "abc", "\n\n", "ba b", " ", "\ufffd")


def _random_stops(rng: random.Random) -> list[str]:
    return rng.sample(_STOP_CHOICES, rng.choice((0, 1, 1, 2, 2, 3)))


def _random_texts(count: int, seed: int) -> list[tuple[str, list[str], bool]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 12)))
        cases.append((text, _random_stops(rng), rng.random() < 0.25))
    return cases


def _cut_call(text: str, stop: list[str]) -> str:
    return f"cut_at_stop({text!r}, {stop!r})"


def _sendable_call(text: str, stop: list[str], finished: bool) -> str:
    return f"sendable({text!r}, {stop!r}, finished={finished})"


def _cut_hint(cut: Callable[..., object]) -> str:
    cases = [(text, stop) for text, stop, _ in CUT_EXAMPLES]
    cases += [(text, stop) for text, stop, _ in _random_texts(150, 151)]

    def probe(fn: Callable[..., object]) -> list:
        return [outcome(lambda t=t, s=s: fn(t, list(s))) for t, s in cases]

    return diagnose(cut, CUT_MISTAKES, probe, CUT_RULE)


def _sendable_hint(send: Callable[..., object]) -> str:
    cases = [(text, stop, finished) for text, stop, finished, _ in SENDABLE_EXAMPLES] + _random_texts(
        150, 152
    )

    def probe(fn: Callable[..., object]) -> list:
        return [outcome(lambda t=t, s=s, f=f: fn(t, list(s), f)) for t, s, f in cases]

    return diagnose(send, SENDABLE_MISTAKES, probe, SENDABLE_RULE)


# A token stream: token ids index TOKENS, and the text is their bytes decoded as UTF-8, a character
# whose bytes have not all come decoding as '\ufffd' ('é' is b"\xc3\xa9", '€' b"\xe2\x82\xac").
TOKENS = (
    b"a",
    b"b",
    b"c",
    b"ab",
    b".",
    b"\n",
    b" ",
    b"c.",
    b"\xc3",
    b"\xa9",
    b"\xe2",
    b"\x82",
    b"\xac",
    b"User",
)
FIRST_TOKENS = (b"Hello", b"Hi ab", b"Well.")
STREAM_STOPS = ("\n", ".", "ab", "c.", "b a", "\n\n", "\u00e9", "\u20ac", "User", "ser:")


def _decode(tokens: tuple[bytes, ...]) -> str:
    return b"".join(tokens).decode("utf-8", errors="replace")


def _random_streams(count: int, seed: int) -> list[tuple[tuple[bytes, ...], list[str]]]:
    """Random streams of 2 to 12 tokens with 0 to 3 stop strings of up to 4 characters. The first token
    has 5 characters, more than any hold: the package's processor lets a shorter text through (see the
    WRAPS_AROUND rule), so that case is checked on texts only."""
    rng = random.Random(seed)
    streams = []
    for _ in range(count):
        tokens = (rng.choice(FIRST_TOKENS), *(rng.choice(TOKENS) for _ in range(rng.randint(1, 11))))
        streams.append((tokens, rng.sample(STREAM_STOPS, rng.choice((0, 1, 2, 2, 3)))))
    return streams


def _processor_stream(tokens: tuple[bytes, ...], stop: list[str]) -> list[tuple]:
    """``(text, finish_reason, stop_reason)`` of each output of the package's OutputProcessor, fed one token
    a step (the last step finishes the request by length unless a stop string ends it first)."""
    processor = OutputProcessor(decode=lambda ids: _decode(tuple(tokens[i] for i in ids)))
    processor.add_request("request", [0], SamplingParams(stop=tuple(stop)))
    seen = []
    for step in range(len(tokens)):
        last = step == len(tokens) - 1
        by_length = last and package_cut(_decode(tokens[: step + 1]), stop)[1] is None
        outputs, _ = processor.process_outputs({"request": step}, ["request"] if by_length else [])
        completion = outputs[0].outputs[0]
        seen.append((completion.text, completion.finish_reason, completion.stop_reason))
        if completion.finished:
            break
    return seen


def _learner_stream(cut: Callable, send: Callable, tokens: tuple[bytes, ...], stop: list[str]) -> list[tuple]:
    """The same outputs from ``cut_at_stop`` and ``sendable``: each step's text cut at a stop string (which
    finishes it), else what a running stream may send, and the whole text at the last step."""
    seen = []
    for step in range(len(tokens)):
        text = _decode(tokens[: step + 1])
        kept, reason = cut(text, list(stop))
        if reason is not None:
            seen.append((send(kept, list(stop), True), "stop", reason))
            break
        if step == len(tokens) - 1:
            seen.append((send(text, list(stop), True), "length", None))
        else:
            seen.append((send(text, list(stop), False), None, None))
    return seen


def _stream_text(tokens: tuple[bytes, ...], stop: list[str]) -> str:
    return f"tokens {[t.decode('latin-1') if t.isascii() else t for t in tokens]} with stop={stop!r}"


@task(
    "16.stop_strings",
    "stop strings: where a completion ends and what a stream may send",
    needs=("cut_at_stop", "sendable"),
)
def _stop_strings(c: Checker, cut_at_stop, sendable) -> None:
    def cut_hint() -> str:  # derived only when an expectation fails
        return _cut_hint(cut_at_stop)

    def sendable_hint() -> str:
        return _sendable_hint(sendable)

    def expect_cut(text: str, stop: list[str], why: str) -> None:
        c.equal(
            f"{_cut_call(text, stop)}  # {why}",
            lambda: cut_at_stop(text, list(stop)),
            package_cut(text, stop),
            cut_hint,
        )

    def expect_sendable(text: str, stop: list[str], finished: bool, why: str) -> None:
        c.equal(
            f"{_sendable_call(text, stop, finished)}  # {why}",
            lambda: sendable(text, list(stop), finished),
            package_sendable(text, stop, finished),
            sendable_hint,
        )

    for text, stop, why in CUT_EXAMPLES:
        expect_cut(text, stop, why)
    cases = _random_texts(300, 15)
    call = f"cut_at_stop(...) on {len(cases)} random texts against the package's OutputProcessor"
    wrong = c.run(
        call,
        lambda: next(
            (case for case in cases if cut_at_stop(case[0], list(case[1])) != package_cut(*case[:2])), None
        ),
        cut_hint,
    )
    if wrong is not None:
        expect_cut(*wrong[:2], "a random text")
    c.holds(call, wrong is None, "the package's text and stop_reason for every text", wrong, cut_hint)

    for text, stop, finished, why in SENDABLE_EXAMPLES:
        expect_sendable(text, stop, finished, why)
    call = f"sendable(...) on {len(cases)} random texts against the package's streams"
    wrong = c.run(
        call,
        lambda: next(
            (case for case in cases if sendable(case[0], list(case[1]), case[2]) != package_sendable(*case)),
            None,
        ),
        sendable_hint,
    )
    if wrong is not None:
        expect_sendable(*wrong, "a random text")
    c.holds(call, wrong is None, "the package's sendable text for every text", wrong, sendable_hint)

    def stream_hint() -> str:
        rule = cut_hint()
        return rule if rule != CUT_RULE else sendable_hint()

    streams = _random_streams(150, 15)
    call = (
        f"cut_at_stop and sendable on {len(streams)} random token streams against the package's "
        "OutputProcessor"
    )

    def first_wrong_stream() -> tuple | None:
        for tokens, stop in streams:
            if _learner_stream(cut_at_stop, sendable, tokens, stop) != _processor_stream(tokens, stop):
                return tokens, stop
        return None

    wrong = c.run(call, first_wrong_stream, stream_hint)
    if wrong is not None:
        tokens, stop = wrong
        expected = _processor_stream(tokens, stop)
        got = _learner_stream(cut_at_stop, sendable, tokens, stop)
        for step, (want, have) in enumerate(zip(expected, got, strict=False)):
            c.holds(
                f"step {step + 1} of {_stream_text(tokens, stop)}: (text, finish_reason, stop_reason)",
                want == have,
                f"{want!r}, as the package's OutputProcessor outputs it",
                repr(have),
                stream_hint,
            )
        c.holds(
            f"the outputs of {_stream_text(tokens, stop)}",
            len(expected) == len(got),
            f"{len(expected)} outputs, the last one finished",
            f"{len(got)} outputs",
            stream_hint,
        )
    c.holds(call, wrong is None, "the package's outputs at every step of every stream", wrong, stream_hint)


# ------------------------------------------------------------------------------- Task 2

CHILD_RULE = (
    "n == 1: [(request_id, seed)], the request itself; else child i (0 .. n - 1) is (f'{i}_{request_id}', "
    "seed + i), or None for its seed when seed is None"
)
SAME_SEED = (
    "each child gets its own seed, seed + i: with one seed for all, the n completions would draw the same "
    "random numbers and come out identical"
)
ID_SUFFIX = (
    "vLLM puts the index first: child i is f'{i}_{request_id}' (ParentRequest.get_child_info), not "
    "f'{request_id}_{i}'"
)
SINGLE_RENAMED = (
    "a request with n == 1 keeps its own id and seed: vLLM makes no ParentRequest for it, and "
    "[(request_id, seed)] is what the core sees"
)
FROM_ONE = "children count from 0: child 0 is f'0_{request_id}' with seed + 0, the parent's seed itself"
SEED_FROM_ONE = (
    "child i's seed is seed + i, from i = 0: the first child keeps the request's seed (seed + 0), not "
    "seed + 1"
)
NONE_SEED_NUMBERED = (
    "a request without a seed (None) gives its children no seed either: None stays None, not 0 + i "
    "((seed or 0) + i turns None into seeds)"
)
ZERO_SEED_DROPPED = (
    "a seed of 0 is a seed: test `seed is None`, not `if seed`, or seed 0 becomes None and its children "
    "lose their reproducible draws"
)
NOT_TUPLES = "each child is a tuple (child_id, child_seed), and the result a list of them"
NONE_SEED_RAISES = (
    "a request without a seed (None) gives its children no seed either: None + i raises TypeError; give "
    "None when seed is None"
)


def _children(
    request_id: object,
    n: int,
    seed: int | None,
    *,
    same_seed: bool = False,
    suffix: bool = False,
    rename_single: bool = False,
    from_one: bool = False,
    seed_from_one: bool = False,
    none_numbered: bool = False,
    zero_dropped: bool = False,
    as_lists: bool = False,
    none_raises: bool = False,
) -> list:
    """The rule, or a classic mistake (a keyword changed)."""
    if n == 1 and not rename_single:
        pairs = [(request_id, seed)]
    else:
        pairs = []
        for i in range(n):
            index = i + 1 if from_one else i
            child = f"{request_id}_{index}" if suffix else f"{index}_{request_id}"
            offset = index + 1 if seed_from_one else index
            if same_seed:
                child_seed = seed
            elif none_numbered:
                child_seed = (seed or 0) + offset
            elif zero_dropped:
                child_seed = seed + offset if seed else None
            elif none_raises:
                child_seed = seed + offset  # type: ignore[operator]
            else:
                child_seed = None if seed is None else seed + offset
            pairs.append((child, child_seed))
    return [list(pair) for pair in pairs] if as_lists else pairs


CHILD_MISTAKES: list[tuple[Callable[..., object], str]] = [
    (lambda r, n, s: _children(r, n, s, same_seed=True), SAME_SEED),
    (lambda r, n, s: _children(r, n, s, suffix=True), ID_SUFFIX),
    (lambda r, n, s: _children(r, n, s, rename_single=True), SINGLE_RENAMED),
    (lambda r, n, s: _children(r, n, s, from_one=True), FROM_ONE),
    (lambda r, n, s: _children(r, n, s, seed_from_one=True), SEED_FROM_ONE),
    (lambda r, n, s: _children(r, n, s, none_numbered=True), NONE_SEED_NUMBERED),
    (lambda r, n, s: _children(r, n, s, zero_dropped=True), ZERO_SEED_DROPPED),
    (lambda r, n, s: _children(r, n, s, as_lists=True), NOT_TUPLES),
    (lambda r, n, s: _children(r, n, s, none_raises=True), NONE_SEED_RAISES),
]

# (request_id, n, seed, why)
CHILD_EXAMPLES: list[tuple[object, int, int | None, str]] = [
    ("cmpl-7", 1, None, "one completion: the request itself"),
    ("cmpl-7", 1, 42, "one completion keeps its id and its seed"),
    ("cmpl-7", 3, 42, "three children, seeds 42, 43, 44"),
    ("cmpl-7", 2, None, "no seed: the children have none either"),
    ("cmpl-8", 4, 0, "a seed of 0 is a seed"),
    (17, 2, 5, "an int request id: the children's ids are strings"),
    ("chat", 16, 1000, "n = 16, the most the package's engine takes"),
]


def _random_parents(count: int, seed: int) -> list[tuple[object, int, int | None]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        request_id = rng.choice((f"cmpl-{rng.randint(0, 999)}", rng.randint(0, 99), "r"))
        n = rng.choice((1, 1, 2, 3, 4, 8, 16))
        cases.append((request_id, n, rng.choice((None, 0, 1, rng.randint(0, 10**6)))))
    return cases


def _child_call(request_id: object, n: int, seed: int | None) -> str:
    return f"child_requests({request_id!r}, {n}, {seed})"


def _child_hint(children: Callable[..., object]) -> str:
    cases = [case[:3] for case in CHILD_EXAMPLES] + _random_parents(100, 151)

    def probe(fn: Callable[..., object]) -> list:
        return [outcome(lambda case=case: fn(*case)) for case in cases]

    return diagnose(children, CHILD_MISTAKES, probe, CHILD_RULE)


@task("16.child_requests", "the children of a request with n completions", needs=("child_requests",))
def _child_requests(c: Checker, child_requests) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _child_hint(child_requests)

    def expect(request_id: object, n: int, seed: int | None, why: str) -> None:
        c.equal(
            f"{_child_call(request_id, n, seed)}  # {why}",
            lambda: child_requests(request_id, n, seed),
            package_children(request_id, n, seed),
            hint,
        )

    for case in CHILD_EXAMPLES:
        expect(*case)
    cases = _random_parents(200, 15)
    call = f"child_requests(...) on {len(cases)} random requests against the package's engine"
    wrong = c.run(
        call,
        lambda: next((case for case in cases if child_requests(*case) != package_children(*case)), None),
        hint,
    )
    if wrong is not None:
        expect(*wrong, "a random request")
    c.holds(call, wrong is None, "the package's children for every request", wrong, hint)


# ------------------------------------------------------------------------------- Task 3

ABORT_RULE = (
    "for each id of request_ids in order, skipping ids seen already: a running one gives back its table's "
    "blocks, the last first (reversed(table)), each block appended to free_blocks only when no other table "
    "still holds it (count each block's holders over block_tables), then its table is deleted and it "
    "leaves running; a waiting one just leaves waiting; an unknown one is skipped. Change the lists and the "
    "dict in place and return the ids finished, in the order given"
)
BLOCKS_NOT_RETURNED = (
    "an aborted running request's blocks never reach free_blocks: they stay out of the pool for good, "
    "and the abort exists to give them back before the next step. Append each block of its table to "
    "free_blocks (the last first) once no other table holds it, then delete the table"
)
NO_REF_COUNTS = (
    "a block another table still holds (a prefix both requests share) must stay in use: count each block's "
    "holders over block_tables (collections.Counter) and free a block only when its count drops to 0"
)
TABLE_ORDER = (
    "a request gives its blocks back the last first, for table in reversed(...): the free list is the "
    "cache's eviction order, and a cached prefix must lose its last block before its first (lesson 08; "
    "vLLM's SingleTypeKVCacheManager.free)"
)
COUNTS_NOT_UPDATED = (
    "when two holders of a block are aborted in the same call, the block is freed when the second one "
    "leaves: decrease the block's count as each table goes, and free it when the count reaches 0 (counts "
    "taken before the call say the block is shared for ever)"
)
WAITING_TABLE = (
    "a waiting request holds no blocks: it has no entry in block_tables, so it just leaves waiting. Look a "
    "table up only for a running request"
)
UNKNOWN_RAISES = (
    "an id that is neither running nor waiting (unknown, or finished already) is skipped: an abort may come "
    "after the request finished. Test `in running` / `in waiting` before list.remove"
)
STAYS_RUNNING = "an aborted running request leaves running: running.remove(request_id)"
TABLE_KEPT = "an aborted request's table goes: del block_tables[request_id], once its blocks are given back"
DUPLICATES = (
    "an id given twice is finished once and returned once: skip an id already finished (a request found "
    "at the start is not found again after it left)"
)
RUNNING_FIRST = (
    "finish the requests in the order of request_ids, and return them in that order, a running one and "
    "a waiting one alike, not the running ones first"
)
FREED_AT_HEAD = (
    "a freed block goes to the tail of the free list (free_blocks.append): the head is the next block "
    "allocated, so the block freed longest ago is reused (and its cached prefix evicted) first"
)
NOT_IN_PLACE = (
    "change running, waiting, free_blocks and block_tables themselves, in place: `running = [...]` inside "
    "the function makes a new list the scheduler never sees. Use running.remove(...), "
    "free_blocks.append(...), del block_tables[...]"
)


def _abort(
    running: list,
    waiting: list,
    free_blocks: list,
    block_tables: dict,
    request_ids: list,
    *,
    give_back: bool = True,
    ref_counts: bool = True,
    reverse: bool = True,
    recount: bool = True,
    waiting_table: bool = False,
    skip_unknown: bool = True,
    leave_running: bool = True,
    drop_table: bool = True,
    dedupe: bool = True,
    given_order: bool = True,
    at_tail: bool = True,
    in_place: bool = True,
) -> list:
    """The rule, or a classic mistake (a keyword changed)."""
    holders = Counter(b for table in block_tables.values() for b in table)
    before = dict(holders)
    now_running, now_waiting = list(running), list(waiting)
    order = list(request_ids)
    if not given_order:
        asked = set(order)
        order = [r for r in running if r in asked] + [r for r in waiting if r in asked]
    finished: list = []
    for request_id in order:
        if request_id in finished:
            if not dedupe:
                finished.append(request_id)
            continue
        if request_id in now_running:
            table = block_tables[request_id]
            for block_id in reversed(table) if reverse else list(table):
                holders[block_id] -= 1
                if not ref_counts:
                    freed = True
                elif recount:
                    freed = holders[block_id] == 0
                else:
                    freed = before[block_id] == 1
                if freed and give_back:
                    if at_tail:
                        free_blocks.append(block_id)
                    else:
                        free_blocks.insert(0, block_id)
            if drop_table:
                del block_tables[request_id]
            if leave_running:
                now_running.remove(request_id)
        elif request_id in now_waiting:
            if waiting_table:
                _ = block_tables[request_id]  # the mistake: a waiting request has no table
            now_waiting.remove(request_id)
        elif not skip_unknown:
            raise ValueError(f"list.remove(x): {request_id!r} not in list")
        else:
            continue
        finished.append(request_id)
    if in_place:
        running[:] = now_running
        waiting[:] = now_waiting
    return finished


ABORT_MISTAKES: list[tuple[Callable[..., object], str]] = [
    (lambda *a: _abort(*a, give_back=False), BLOCKS_NOT_RETURNED),
    (lambda *a: _abort(*a, ref_counts=False), NO_REF_COUNTS),
    (lambda *a: _abort(*a, reverse=False), TABLE_ORDER),
    (lambda *a: _abort(*a, recount=False), COUNTS_NOT_UPDATED),
    (lambda *a: _abort(*a, waiting_table=True), WAITING_TABLE),
    (lambda *a: _abort(*a, skip_unknown=False), UNKNOWN_RAISES),
    (lambda *a: _abort(*a, leave_running=False), STAYS_RUNNING),
    (lambda *a: _abort(*a, drop_table=False), TABLE_KEPT),
    (lambda *a: _abort(*a, dedupe=False), DUPLICATES),
    (lambda *a: _abort(*a, given_order=False), RUNNING_FIRST),
    (lambda *a: _abort(*a, at_tail=False), FREED_AT_HEAD),
    (lambda *a: _abort(*a, in_place=False), NOT_IN_PLACE),
]

State = tuple[list, list, list, dict]
"""``(running, waiting, free_blocks, block_tables)`` before an abort."""

# (state, request_ids, why): each isolates one rule
ABORT_EXAMPLES: list[tuple[State, list, str]] = [
    ((["a"], [], [5], {"a": [0, 1, 2]}), ["a"],
     "a running request: its blocks go to the tail, the last first"),
    ((["a"], ["b", "c"], [5], {"a": [0]}), ["b"], "a waiting request holds no blocks: it just leaves"),
    ((["a"], ["b"], [5], {"a": [0]}), ["x"], "an unknown id is skipped: nothing changes"),
    ((["a", "b"], [], [5], {"a": [0, 1, 2], "b": [0, 1, 3]}), ["a"],
     "blocks 0 and 1 are b's too: only a's own block 2 is freed"),
    ((["a", "b"], [], [5], {"a": [0, 1, 2], "b": [0, 1, 3]}), ["a", "b"],
     "both holders of 0 and 1 leave: b frees them, after its own 3"),
    ((["a", "b"], [], [], {"a": [0, 1], "b": [2, 3]}), ["b", "a"], "in the order of request_ids"),
    ((["a"], ["w"], [], {"a": [4, 7]}), ["w", "a"],
     "a waiting one, then a running one: returned in that order"),
    ((["a", "b"], ["w"], [9], {"a": [0, 1], "b": [2]}), ["a", "a", "w", "w"],
     "an id given twice is finished once"),
    ((["a", "b", "c"], [], [8], {"a": [0, 1, 2], "b": [0, 1], "c": [0, 3]}), ["b", "c", "a"],
     "a block held by three tables goes with the last of them"),
    ((["a", "b"], ["w"], [6], {"a": [3, 5], "b": [1]}), [], "nothing to abort: nothing changes"),
    ((["a", "b"], ["w"], [6], {"a": [3, 5], "b": [1]}), ["w", "x", "b", "a", "b"],
     "waiting, unknown, running and repeated ids together"),
]  # fmt: skip


def _random_states(count: int, seed: int) -> list[tuple[State, list]]:
    """Random schedulers: up to 4 running requests, some sharing a cached prefix of up to 2 blocks, up to
    3 waiting ones, block ids in a random order; and ids to abort, known, unknown and repeated."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        ids = list(range(rng.randint(3, 14)))
        rng.shuffle(ids)
        prefix = ids[: rng.randint(0, 2)]
        rest = ids[len(prefix) :]
        running = [f"r{i}" for i in range(rng.randint(0, 4))]
        waiting = [f"w{i}" for i in range(rng.randint(0, 3))]
        tables = {}
        for request_id in running:
            shared = prefix[: rng.randint(0, len(prefix))]
            tables[request_id] = shared + [rest.pop() for _ in range(min(len(rest), rng.randint(0, 3)))]
        held = {b for table in tables.values() for b in table}
        free = [b for b in ids if b not in held]
        rng.shuffle(free)
        known = [*running, *waiting, "x", "y"]
        request_ids = [rng.choice(known) for _ in range(rng.randint(0, 5))]
        cases.append(((running, waiting, free, tables), request_ids))
    return cases


def _copy(state: State) -> State:
    return copy.deepcopy(state)


def _observe(fn: Callable[..., object], state: State, request_ids: list) -> object:
    """``(returned, running, waiting, free_blocks, block_tables)`` after ``fn`` on a copy of ``state``, or the
    name of the error it raised."""
    running, waiting, free, tables = _copy(state)

    def call() -> tuple:
        returned = fn(running, waiting, free, tables, list(request_ids))
        return returned, running, waiting, free, tables

    return outcome(call)


def _abort_call(state: State, request_ids: list) -> str:
    running, waiting, free, tables = state
    return f"abort({running!r}, {waiting!r}, {free!r}, {tables!r}, {request_ids!r})"


def _abort_hint(abort: Callable[..., object]) -> str:
    cases = [(state, ids) for state, ids, _ in ABORT_EXAMPLES] + _random_states(100, 151)

    def probe(fn: Callable[..., object]) -> list:
        return [_observe(fn, state, ids) for state, ids in cases]

    return diagnose(abort, ABORT_MISTAKES, probe, ABORT_RULE)


@task("16.abort", "an abort that frees a running request's blocks at once", needs=("abort",))
def _abort_task(c: Checker, abort) -> None:
    def hint() -> str:  # derived only when an expectation fails
        return _abort_hint(abort)

    def expect(state: State, request_ids: list, why: str) -> None:
        call = _abort_call(state, request_ids)
        expected = _observe(package_abort, state, request_ids)
        running, waiting, free, tables = _copy(state)
        returned = c.run(
            f"{call}  # {why}", lambda: abort(running, waiting, free, tables, list(request_ids)), hint
        )
        names = ("returned", "running", "waiting", "free_blocks", "block_tables")
        for name, got, want in zip(names, (returned, running, waiting, free, tables), expected, strict=True):
            where = f"{call}  # {why}" if name == "returned" else f"{call}; {name}  # {why}"
            c.equal(where, lambda got=got: got, want, hint)

    for state, request_ids, why in ABORT_EXAMPLES:
        expect(state, request_ids, why)
    cases = _random_states(300, 15)
    call = f"abort(...) on {len(cases)} random schedulers against the package's KV-cache manager"

    def first_wrong() -> tuple | None:
        for state, request_ids in cases:
            if _observe(abort, state, request_ids) != _observe(package_abort, state, request_ids):
                return state, request_ids
        return None

    wrong = c.run(call, first_wrong, hint)
    if wrong is not None:
        expect(*wrong, "a random scheduler")
    c.holds(call, wrong is None, "the package's lists, tables and free blocks after every abort", wrong, hint)

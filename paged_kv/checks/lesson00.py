"""Checks of exercise 00: the waste arithmetic of paged and contiguous layouts.

When an answer is wrong, the check runs the learner's code beside the classic mistakes, written as small
wrong implementations, and names the one it behaves like (:func:`~paged_kv.checks._core.diagnose`).
"""

from __future__ import annotations

from paged_kv.checks._core import Checker, answers, diagnose, task

SEED_REQUESTS = [9, 17, 33, 5, 41, 12]
CEILING_HINT = "ceil(n / b) in integers is -(-n // b) or (n + b - 1) // b"
CEILING_MISTAKES = [
    (
        lambda n, b: n // b,
        "n // b rounds down and leaves the last tokens without a slot (17 tokens in blocks of 16 need 2 "
        f"blocks); round up: {CEILING_HINT}",
    ),
    (
        lambda n, b: n // b + 1,
        "n // b + 1 is one block too many whenever n is a multiple of b (0 tokens need no block, 16 "
        f"tokens one block of 16); {CEILING_HINT}",
    ),
    (
        lambda n, b: round(n / b),
        f"round(n / b) rounds to the nearest block count, down for 17 tokens in blocks of 16; {CEILING_HINT}",
    ),
]
# Both sides of every block boundary, for blocks of 1, 3, 4 and 16.
CEILING_PROBES = [(n, b) for b in (1, 3, 4, 16) for n in range(0, 3 * b + 2)]


@task("00.blocks_for_tokens", "blocks for a number of tokens")
def _blocks_for_tokens(c: Checker, blocks_for_tokens) -> None:
    result = c.run("blocks_for_tokens(33, 16)", lambda: blocks_for_tokens(33, 16), CEILING_HINT)
    c.holds(
        "type(blocks_for_tokens(33, 16))",
        type(result) is int,
        "int",
        type(result).__name__,
        "a count of blocks is an int, not a float: `/` is true division (33 / 16 is 2.0625) and "
        "numpy's ceil returns a float; stay in integers with -(-n // b)",
    )
    for tokens, size, expected, hint in [
        (0, 16, 0, "zero tokens need zero blocks"),
        (1, 16, 1, "one token needs a block"),
        (16, 16, 1, "16 tokens fill exactly one block of 16, the second block starts with the 17th token"),
        (17, 16, 2, "the 17th token needs a second block"),
        (33, 16, 3, "33 tokens need 3 blocks of 16"),
        (41, 16, 3, "41 tokens need 3 blocks of 16"),
        (5, 1, 5, "with blocks of 1, every token is a block"),
    ]:
        c.equal(
            f"blocks_for_tokens({tokens}, {size})",
            lambda tokens=tokens, size=size: blocks_for_tokens(tokens, size),
            expected,
            lambda hint=hint: (
                diagnose(blocks_for_tokens, CEILING_MISTAKES, answers(CEILING_PROBES, int), "")
                or f"{hint}; {CEILING_HINT}"
            ),
        )


@task("00.paged_usage", "what a paged cache reserves and wastes")
def _paged_usage(c: Checker, paged_usage) -> None:
    c.equal(
        f"paged_usage({SEED_REQUESTS}, 16)",
        lambda: paged_usage(SEED_REQUESTS, 16),
        {
            "used_blocks": 11,
            "reserved_tokens": 176,
            "internal_fragmentation_tokens": 59,
            "block_utilization": 117 / 176,
        },
        "each request holds its own blocks_for_tokens(tokens, 16) blocks, rounded up per request "
        "(not blocks_for_tokens of the total: a block holds one request's tokens); reserved = blocks * 16",
    )
    c.equal(
        "paged_usage([9], 16)",
        lambda: paged_usage([9], 16),
        {
            "used_blocks": 1,
            "reserved_tokens": 16,
            "internal_fragmentation_tokens": 7,
            "block_utilization": 9 / 16,
        },
    )
    c.equal(
        "paged_usage([], 16)",
        lambda: paged_usage([], 16),
        {
            "used_blocks": 0,
            "reserved_tokens": 0,
            "internal_fragmentation_tokens": 0,
            "block_utilization": 0.0,
        },
        "with nothing reserved, utilization is 0.0 (avoid dividing by zero)",
    )


@task("00.contiguous_usage", "what contiguous slots reserve and waste")
def _contiguous_usage(c: Checker, contiguous_usage) -> None:
    c.equal(
        f"contiguous_usage({SEED_REQUESTS})",
        lambda: contiguous_usage(SEED_REQUESTS),
        {"reserved_tokens": 246, "internal_fragmentation_tokens": 129, "utilization": 117 / 246},
        "by default every request reserves a slot as long as the longest one, 41 tokens, not as long as "
        "itself",
    )
    c.equal(
        "contiguous_usage([300, 5000, 70], slot_tokens=8000)",
        lambda: contiguous_usage([300, 5000, 70], slot_tokens=8000),
        {"reserved_tokens": 24000, "internal_fragmentation_tokens": 18630, "utilization": 5370 / 24000},
        "when slot_tokens is given, every request reserves exactly that",
    )
    c.equal(
        "contiguous_usage([])",
        lambda: contiguous_usage([]),
        {"reserved_tokens": 0, "internal_fragmentation_tokens": 0, "utilization": 0.0},
        "max([]) fails: use max(request_tokens, default=0)",
    )

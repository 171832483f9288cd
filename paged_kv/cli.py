"""The command line: ``python -m paged_kv fragmentation | simulate | check-env`` (lessons 00 and 07).

Bad arguments print one line on stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from paged_kv.core.block import blocks_for_tokens
from paged_kv.env_check import report
from paged_kv.errors import OutOfBlocksError
from paged_kv.simulation.fragmentation import fragmentation_report
from paged_kv.simulation.workload import WORKLOADS, compare_policies, format_table

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``prog: error: message``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _whole_number(minimum: int) -> Callable[[str], int]:
    """An argument type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number of at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _whole_number(1)
_non_negative_int = _whole_number(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _token_counts(text: str) -> list[int]:
    counts = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated whole numbers such as 9,17,33, got {item.strip()!r}"
            ) from None
        if value < 0:
            raise argparse.ArgumentTypeError(
                f"a request cannot hold a negative number of tokens, got {value}"
            )
        counts.append(value)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m paged_kv", description="Tools of the paged_kv course.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    fragmentation = commands.add_parser(
        "fragmentation",
        help="paged blocks against a contiguous fixed slot per request, as JSON",
        description="Allocate each request in a paged cache and compare the waste with reserving "
        "one contiguous slot as long as the longest request.",
    )
    fragmentation.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (16)")
    fragmentation.add_argument(
        "--total-blocks", type=_positive_int, default=64, help="blocks in the pool (64)"
    )
    fragmentation.add_argument(
        "--request-tokens",
        type=_token_counts,
        default=[9, 17, 33, 5, 41, 12],
        help="comma-separated token counts, one per request (9,17,33,5,41,12)",
    )

    simulate = commands.add_parser(
        "simulate",
        help="a concurrent workload: paged blocks (vLLM) against contiguous reservation (Orca), as a table",
        description="Serve seeded synthetic requests with paged blocks (vLLM) and with contiguous "
        "reservation at the maximum length, at the prompt plus the next power of two of the output and "
        "at the exact final length (the vLLM paper's Orca (Max), (Pow2) and (Oracle), laid out first "
        "fit in one address space), "
        "in the same token budget, and print how many sequences run at once, the memory utilization, "
        "the steps to finish and the output tokens per step; with --json, also where the memory went.",
    )
    simulate.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="sharegpt", help="the length distribution (sharegpt)"
    )
    simulate.add_argument("--num-requests", type=_positive_int, default=200, help="requests to serve (200)")
    simulate.add_argument(
        "--budget-tokens", type=_positive_int, default=32768, help="KV cache size in tokens (32768)"
    )
    simulate.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (16)")
    simulate.add_argument(
        "--arrival-rate",
        type=_positive_float,
        default=None,
        help="mean requests arriving per step (default: all arrive at step 0)",
    )
    simulate.add_argument("--seed", type=_non_negative_int, default=0, help="random seed (0)")
    simulate.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of the table: each policy's figures and the shares of the KV memory "
        "holding token states, reservation, internal and external fragmentation (the vLLM paper's "
        "Figure 2), over the steps at which a request waited",
    )

    commands.add_parser(
        "check-env",
        help="print versions and OK/FAIL per requirement, for bug reports",
        description="Print the versions of Python, torch, ipywidgets, matplotlib, JupyterLab and nbval, "
        "the device default_device() picks, and OK or FAIL for each requirement.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check-env":
        text, ok = report()
        print(text)
        return 0 if ok else 1
    if args.command == "simulate":
        return _simulate(parser, args)
    try:
        result = fragmentation_report(args.request_tokens, args.block_size, args.total_blocks)
    except OutOfBlocksError:
        needed = sum(blocks_for_tokens(n, args.block_size) for n in args.request_tokens)
        message = (
            f"the requests need {needed} blocks of {args.block_size} tokens "
            f"but --total-blocks is {args.total_blocks}"
        )
        parser.exit(USAGE_ERROR, f"{parser.prog} fragmentation: error: {message}\n")
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    dist = WORKLOADS[args.workload]
    if args.budget_tokens < dist.max_model_len:
        message = (
            f"--budget-tokens must hold one sequence of the maximum length, {dist.max_model_len} tokens "
            f"for {dist.name}, got {args.budget_tokens}"
        )
        parser.exit(USAGE_ERROR, f"{parser.prog} simulate: error: {message}\n")
    try:
        results = compare_policies(
            dist, args.num_requests, args.budget_tokens, args.seed, args.arrival_rate, args.block_size
        )
    except ValueError as error:  # a block larger than the budget, say
        parser.exit(USAGE_ERROR, f"{parser.prog} simulate: error: {error}\n")
    first = results[0]
    if args.json:
        report = {
            "workload": dist.name,
            "num_requests": first.num_requests,
            "budget_tokens": first.budget_tokens,
            "block_size": args.block_size,
            "arrival_rate": args.arrival_rate,
            "seed": args.seed,
            "policies": [result.summary() for result in results],
        }
        print(json.dumps(report, indent=2))
        return 0
    arrivals = "all at step 0" if args.arrival_rate is None else f"{args.arrival_rate:g} per step"
    print(
        f"workload {dist.name}: {first.num_requests} requests (mean prompt "
        f"{first.prompt_tokens / first.num_requests:.1f}, mean output "
        f"{first.output_tokens / first.num_requests:.1f} tokens), budget {first.budget_tokens} tokens, "
        f"arrivals {arrivals}, seed {args.seed}"
    )
    print(format_table(results))
    return 0


def main_entry() -> NoReturn:
    """The ``paged-kv`` console script and ``python -m paged_kv``."""
    sys.exit(main())

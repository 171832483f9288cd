"""The command line: ``python -m paged_kv fragmentation | simulate | check-env | serve`` (lessons 00, 07, 15).

``paged-kv serve`` (lesson 16) starts an OpenAI-compatible server over the course's engine, as
``vllm serve`` does: see :func:`build_serve_app` and :mod:`paged_kv.entrypoints.openai`.

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
from paged_kv.serving.scheduler import SCHEDULING_POLICIES
from paged_kv.simulation.fragmentation import fragmentation_report
from paged_kv.simulation.workload import WORKLOADS, compare_policies, format_table

USAGE_ERROR = 2
DEFAULT_NUM_BLOCKS = 512
"""The pool of ``paged-kv serve`` when neither ``--num-gpu-blocks-override`` nor
``--gpu-memory-utilization`` is given: 8,192 tokens in blocks of 16. (vLLM takes 90 % of the GPU
by default; on a CPU that would be the machine's RAM, so the course serves a fixed pool unless asked.)"""
TINY_MODEL_NAME = "tiny-gpt"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
_logprobs_limit = _whole_number(-1)
"""``--max-logprobs``: a whole number, -1 for the whole vocabulary (vLLM's)."""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {value}")
    return value


def _kv_events_config(text: str):
    """``--kv-events-config``: vLLM's JSON object of ``KVEventsConfig`` fields, checked now."""
    from paged_kv.serving.engine_args import kv_events_config

    try:
        return kv_events_config(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _kv_offloading_size(text: str) -> float:
    """``--kv-offloading-size``: GiB of host memory for the offloaded KV cache, a positive number."""
    from paged_kv.kv_offload.cpu.spec import cpu_bytes_to_use

    try:
        size = float(text)
        cpu_bytes_to_use(size)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"kv_offloading_size: {error}") from None
    return size


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
    _add_serve_parser(commands)
    return parser


def _add_serve_parser(commands) -> None:
    """``serve``: vLLM's ``vllm serve`` flags, by vLLM's names, for the course's engine (lesson 16)."""
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the engine, as `vllm serve` (lesson 16)",
        description="Serve a model with the course's engine behind OpenAI's API (/v1/models, "
        "/v1/completions, /v1/chat/completions), with /health, vLLM's /metrics and the live page /kv. "
        "The model is load_model(NAME)'s: the Hugging Face Hub's when it answers, else a random-weight "
        "stand-in of SmolLM2-135M's architecture with byte tokens. Stop it with Ctrl-C.",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="the model to load and the name it is served under "
        "(default: HuggingFaceTB/SmolLM2-135M; with --tiny: tiny-gpt)",
    )
    serve.add_argument(
        "--tiny",
        action="store_true",
        help="serve the course's TinyGPT (random weights, byte tokens, 256 positions): starts at once",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="the port to listen on (8000)")
    memory = serve.add_mutually_exclusive_group()
    memory.add_argument(
        "--num-gpu-blocks-override",
        type=_positive_int,
        default=None,
        help=f"blocks in the KV-cache pool, its null block among them (default {DEFAULT_NUM_BLOCKS})",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=None,
        help="size the pool as vLLM does: this fraction of the device's memory (the machine's RAM on a "
        "CPU), less the weights and the activations",
    )
    serve.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (16)")
    serve.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="the longest prompt plus output (default: the model's context length)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=None,
        help="the most requests running at once (no limit)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=None,
        help="the most tokens a step schedules; longer prompts are prefilled in chunks (no limit)",
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the cached blocks of a shared prompt prefix (on by default, as in vLLM v1)",
    )
    serve.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="the order of waiting requests: fcfs (arrival), or priority (a request's priority, lower "
        "first; the running request of the largest (priority, arrival) is preempted first), as vLLM's",
    )
    serve.add_argument(
        "--max-logprobs",
        type=_logprobs_limit,
        default=20,
        help="the most log-probabilities a request may ask for per token (logprobs, top_logprobs, "
        "prompt_logprobs); -1: the whole vocabulary (20, vLLM's default)",
    )
    serve.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="publish the pool's KV-cache events, as vLLM's: a JSON object of KVEventsConfig fields, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\' (a ZMQ PUB socket on '
        'tcp://127.0.0.1:5557 unless "endpoint" says otherwise; off by default)',
    )
    serve.add_argument(
        "--kv-offloading-size",
        type=_kv_offloading_size,
        default=None,
        metavar="GIB",
        help="keep evicted KV blocks in this many GiB of host memory and load a prefix hit from there, "
        "as vLLM's native offloading (off by default)",
    )
    serve.add_argument(
        "--kv-offloading-backend",
        choices=("native",),
        default="native",
        help="the offloading connector's backend (vLLM's native one, the only one here)",
    )
    serve.add_argument(
        "--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info", help="uvicorn's log level (info)"
    )


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
    if args.command == "serve":
        return _serve(parser, args)
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


def build_serve_app(args: argparse.Namespace):
    """The app ``paged-kv serve`` serves, from its parsed arguments, and the lines it prints first.

    The model is moved to :func:`~paged_kv.device.default_device` (``PAGED_KV_DEVICE`` chooses).

    Raises:
        ImportError: the server's packages (FastAPI, uvicorn, prometheus_client) are missing.
        ValueError: the engine refused a setting (its message names it).
    """
    from paged_kv.device import default_device
    from paged_kv.entrypoints.openai.api_server import build_app
    from paged_kv.serving.async_llm import AsyncLLM
    from paged_kv.serving.engine_args import EngineArgs

    if args.tiny:
        from paged_kv.model.tiny_gpt import TinyGPT, decode, encode

        name, model = args.model or TINY_MODEL_NAME, TinyGPT()
        note = "the course's TinyGPT: random weights, byte tokens"
    else:
        from paged_kv.model.hub import SMOLLM2, load_model

        loaded = load_model(args.model or SMOLLM2)
        name, model, encode, decode, note = (
            loaded.name,
            loaded.model,
            loaded.encode,
            loaded.decode,
            loaded.note,
        )
    model = model.to(default_device())
    num_blocks = args.num_gpu_blocks_override
    if num_blocks is None and args.gpu_memory_utilization is None:
        num_blocks = DEFAULT_NUM_BLOCKS
    engine_args = EngineArgs(
        num_gpu_blocks_override=num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs,
        kv_events_config=args.kv_events_config,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
    )
    async_llm = AsyncLLM.from_engine_args(model, engine_args, decode=decode)
    app = build_app(async_llm, model_name=name, encode=encode)
    config = async_llm.vllm_config
    cache = config.cache_config
    lines = [
        note,
        f"{cache.num_gpu_blocks} blocks of {cache.block_size} tokens, max_model_len "
        f"{config.model_config.max_model_len}, "
        f"prefix caching {'on' if cache.enable_prefix_caching else 'off'}, "
        f"on {config.device_config.device}",
        f"serving {name!r} at http://{args.host}:{args.port}/v1 (Ctrl-C stops it)",
    ]
    publisher = async_llm.llm_engine.engine_core.scheduler.kv_event_publisher.get_publisher_config()
    if publisher is not None:
        lines.insert(2, f"KV-cache events published on {publisher.endpoint} (topic {publisher.topic!r})")
    return app, lines


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        app, lines = build_serve_app(args)
    except ImportError as error:
        missing = error.name or str(error)
        message = (
            f"{missing} is missing: the server needs the course's packages: pip install 'paged_kv[course]'"
        )
        parser.exit(USAGE_ERROR, f"{parser.prog} serve: error: {message}\n")
    except ValueError as error:
        parser.exit(USAGE_ERROR, f"{parser.prog} serve: error: {error}\n")
    from paged_kv.entrypoints.openai import launcher

    for line in lines:
        print(line, flush=True)
    launcher.serve_http(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


def main_entry() -> NoReturn:
    """The ``paged-kv`` console script and ``python -m paged_kv``."""
    sys.exit(main())

"""The engine against what a user would pick instead: Hugging Face's own ways to serve the same requests.

One tiny Llama-architecture model (random weights, seeded, float32, on the CPU; grouped-query
attention, 8 query heads over 2 K/V heads; no BOS, EOS or pad token, so every request generates
exactly its ``max_new_tokens``) serves one seeded ShareGPT-shaped workload
(:func:`bench_engine.scaled_requests`: lengths divided by ``scale`` to fit the model's maximum
positions), every request arriving at once, three ways:

1. ``engine``: :class:`paged_kv.Engine` on ``num_blocks`` blocks of ``block_size`` tokens;
2. ``generate_batch``: transformers' continuous batching with its paged cache, sized to the same
   ``num_blocks`` pages of ``block_size`` tokens (``ContinuousBatchingConfig(page_size=block_size,
   num_blocks=num_blocks)``, so it sizes nothing from the machine's memory). ``generate_batch`` itself
   takes one ``max_new_tokens`` for every prompt, so the requests go through the manager it is built
   on (``model.continuous_batching_context_manager``, ``add_request(..., max_new_tokens=...)``,
   ``get_result``), each with its own length, exactly as ``generate_batch`` drives it;
3. ``static``: ``model.generate`` on static batches of ``batch_size`` requests in arrival order,
   left-padded with an attention mask, each batch running until its longest request's
   ``max_new_tokens``; a request's tokens past its own ``max_new_tokens`` are not counted.

Each system is timed end to end (building its cache included, the Engine's too) after a warm-up
run, the three interleaved round by round (:func:`paged_kv.timing.compare_times`), with the same
torch threads. The rows give generated tokens per second (the same tokens for all three: each
request's own ``max_new_tokens``) and the ratios Engine / generate_batch (target >= 1.0x) and
Engine / static, each the median of the per-round ratios. A call of continuous batching has a
fixed cost whatever it serves (starting and joining its thread, two ``gc.collect()`` when it
stops), so the same rounds also time one tiny request on the Engine and on continuous batching,
and a row gives that cost (and, in its name, both speeds less it). Then the greedy tokens
compared request by request, the K/V bytes allocated up front per token generated, and the K/V
bytes reserved per token held (blocks in use against the padded batches' cache).

    .venv/bin/python bench/bench_hf.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import compress
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, compare_thread_times, spread_of, text_table
from bench_engine import scaled_requests

from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.engine_result import EngineResult
from paged_kv.serving.model_runner import ModelRunner
from paged_kv.serving.outputs import ModelRunnerOutput, SchedulerOutput
from paged_kv.timing import Timings, compare_times, torch_threads

TARGET_SPEEDUP = 1.2
"""Issue 21's target: the Engine generates at least 1.2 times as many tokens per second as
``generate_batch`` on a workload where each side's fixed cost is under :data:`FIXED_SHARE` of its run."""

FIXED_SHARE = 0.05
"""The share of a run the fixed cost of a call may take for the speed-up to count (issue 21)."""

SYSTEMS = ("engine", "generate_batch", "static")

NO_EOS = -1
"""The end-of-sequence id transformers' continuous batching takes for "none" (no token has it)."""


def tiny_llama(
    *,
    vocab_size: int = 256,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    max_len: int = 256,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A random-weight ``LlamaForCausalLM``, seeded by ``seed``, in float32 and in eval mode.

    Its feed-forward is twice ``hidden_size`` wide and ``max_len`` is its maximum positions. It has no
    BOS, EOS or pad token, in its config and its generation config, so nothing ends a generation
    early: every request generates exactly ``max_new_tokens``.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_len,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


@dataclass(frozen=True)
class Served:
    """What one system generated, ``tokens[request_id]`` (exactly ``max_new_tokens`` ids each), and
    its K/V memory: ``kv_bytes_allocated`` taken for the cache up front (0 when the cache grows as it
    goes); ``reserved_slots`` and ``held_slots``, the token slots its cache reserved and the tokens
    of the requests it held in them, each summed over the run's steps (``None`` when the system does
    not show them). ``held_slots <= reserved_slots``."""

    tokens: dict[Hashable, list[int]]
    kv_bytes_allocated: int
    reserved_slots: int | None
    held_slots: int | None

    def kv_bytes_per_token_held(self, bytes_per_token: int) -> float:
        """K/V bytes reserved per token held, over the run: ``bytes_per_token * reserved / held``.

        Raises:
            ValueError: the system did not show its slots.
        """
        if self.reserved_slots is None or self.held_slots is None:
            raise ValueError("this system does not show the slots it reserved and held")
        return bytes_per_token * self.reserved_slots / self.held_slots


def serve_engine(engine: Engine, requests: Sequence[EngineRequest]) -> Served:
    """``engine.run(requests)``: its pool of ``num_blocks`` blocks is allocated up front; the slots
    are its steps' ``reserved_tokens`` (blocks in use times ``block_size``) and ``held_tokens``."""
    result = engine.run(requests)
    allocated = engine.num_blocks * engine.bytes_per_block
    return Served(result.tokens, allocated, sum(result.reserved_tokens), sum(result.held_tokens))


def serve_continuous_batching(
    model: LlamaForCausalLM,
    requests: Sequence[EngineRequest],
    num_blocks: int,
    block_size: int,
    max_batch_tokens: int | None = None,
) -> Served:
    """transformers' continuous batching on ``num_blocks`` pages of ``block_size`` tokens per layer,
    greedy, each request with its own ``max_new_tokens`` and no end-of-sequence token.

    ``max_batch_tokens`` bounds the tokens of one forward pass (``None``: transformers' default,
    8,192). The bytes allocated are those of the cache's one flat tensor, which holds its pages in
    sectors (plus two never-used "trash" sectors for padding tokens); how many of them it used at its
    peak and over the run is the manager thread's business, not shown (the slots are ``None``).

    Raises:
        RuntimeError: the manager's thread stopped before every request finished, or its cache does
            not hold the ``num_blocks`` blocks it was given.
    """
    generation = GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=NO_EOS)
    batching = ContinuousBatchingConfig(
        page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens
    )
    results = {}
    with (
        torch.no_grad(),
        model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=batching, block=True
        ) as manager,
    ):
        for request in requests:
            manager.add_request(
                request.prompt, str(request.request_id), request.max_tokens, eos_token_id=NO_EOS
            )
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                done = f"{len(results)} of {len(requests)}"
                raise RuntimeError(f"generate_batch's thread stopped with {done} requests done")
        cache = manager.batch_processor.cache
        if cache.num_blocks != num_blocks:
            raise RuntimeError(f"generate_batch's cache holds {cache.num_blocks} blocks, not {num_blocks}")
        allocated = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    tokens = {r.request_id: list(results[str(r.request_id)].generated_tokens) for r in requests}
    return Served(tokens, allocated, None, None)


def static_batches(requests: Sequence[EngineRequest], batch_size: int) -> list[list[EngineRequest]]:
    """``requests`` cut into batches of ``batch_size`` in arrival order (the last may be shorter)."""
    return [list(requests[i : i + batch_size]) for i in range(0, len(requests), batch_size)]


def padded_batch(batch: Sequence[EngineRequest], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of ``batch`` left-padded with ``pad_id`` to the longest: ``(input_ids, attention_mask)``,
    both ``(len(batch), longest)``, the mask 1 on the prompt's tokens and 0 on the padding."""
    longest = max(len(r.prompt) for r in batch)
    pads = [longest - len(r.prompt) for r in batch]
    input_ids = torch.tensor([[pad_id] * pad + list(r.prompt) for pad, r in zip(pads, batch, strict=True)])
    mask = torch.tensor([[0] * pad + [1] * len(r.prompt) for pad, r in zip(pads, batch, strict=True)])
    return input_ids, mask


def padded_slots(batch: Sequence[EngineRequest]) -> tuple[int, int]:
    """The token slots HF's cache reserves for a static batch and the requests' own tokens it holds,
    each summed over the batch's steps: ``(reserved, held)``.

    With ``L`` the longest prompt and ``m`` the longest ``max_new_tokens``, the batch runs ``m``
    steps: the prefill (step 0) and ``m - 1`` decodes; after step ``s`` every row holds ``L + s``
    slots (left padding included), and a request of prompt ``p`` and output ``o`` holds
    ``p + min(s, o - 1)`` of its own tokens (its last token is never fed back; the tokens past its
    own ``o`` are not its own).
    """
    longest, steps = max(len(r.prompt) for r in batch), max(r.max_tokens for r in batch)
    reserved = sum(len(batch) * (longest + s) for s in range(steps))
    held = sum(len(r.prompt) + min(s, r.max_tokens - 1) for r in batch for s in range(steps))
    return reserved, held


def serve_static(model: LlamaForCausalLM, requests: Sequence[EngineRequest], batch_size: int) -> Served:
    """``model.generate`` (greedy, HF's own cache) on :func:`static_batches`, each :func:`padded_batch`
    generating its longest ``max_new_tokens`` for every row; each request keeps its own first
    ``max_new_tokens``. The cache grows as it goes, so nothing is allocated up front; the slots are
    the batches' :func:`padded_slots`, added up."""
    tokens, reserved, held = {}, 0, 0
    for batch in static_batches(requests, batch_size):
        input_ids, mask = padded_batch(batch)
        longest = max(r.max_tokens for r in batch)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        for request, row in zip(batch, out[:, input_ids.shape[1] :].tolist(), strict=True):
            tokens[request.request_id] = row[: request.max_tokens]
        batch_reserved, batch_held = padded_slots(batch)
        reserved, held = reserved + batch_reserved, held + batch_held
    return Served(tokens, 0, reserved, held)


def generate_alone(model: LlamaForCausalLM, request: EngineRequest) -> list[int]:
    """``model.generate`` of the request's prompt alone (greedy, HF's own cache): its tokens. A static
    batch of one, which has no padding."""
    return serve_static(model, [request], batch_size=1).tokens[request.request_id]


def equal_requests(ours: dict[Hashable, list[int]], theirs: dict[Hashable, list[int]]) -> int:
    """How many of ``theirs``' requests got exactly the tokens ``ours`` gave them."""
    return sum(ours[request_id] == tokens for request_id, tokens in theirs.items())


class TwoForwardRunner(ModelRunner):
    """The runner as it was before issue 21, for the bench: each step runs **two** forwards, the
    step's prefill chunks packed in the first and its decodes in the second, each with its own
    :func:`~paged_kv.model.step.prepare_attention` metadata, on the same
    :class:`~paged_kv.serving.outputs.SchedulerOutput` as :class:`ModelRunner` (whose checks, state
    updates and forward it keeps). A request decodes when its scheduled token is one it sampled
    (past the tokens it was given). :attr:`steps` and :attr:`mixed_steps` count the steps run and
    those that needed both forwards.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = self.mixed_steps = 0

    @torch.no_grad()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self._check(output)
        self._update_states(output)
        scheduled, state = output.num_scheduled_tokens, self.state
        rows = [self.block_tables.row(r) for r in scheduled]
        prefilling = (state.num_computed_tokens[rows] < state.prefill_len[rows]).tolist()
        prefills = list(compress(scheduled, prefilling))
        decodes = [r for r, p in zip(scheduled, prefilling, strict=True) if not p]
        self.steps += 1
        self.mixed_steps += bool(prefills and decodes)
        sampled, logprobs, prompt_logprobs = {}, {}, {}
        for req_ids in (prefills, decodes):
            if req_ids:
                out = self._run(req_ids, [scheduled[r] for r in req_ids])
                sampled.update(out.sampled_token_ids)
                logprobs.update(out.logprobs)
                prompt_logprobs.update(out.prompt_logprobs)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)


class TwoForwardEngine(Engine):
    """The package's :class:`~paged_kv.serving.engine.Engine` with :class:`TwoForwardRunner` in
    place of its runner: the same scheduler, memory and storage. :attr:`runner` is the last run's."""

    runner: TwoForwardRunner | None = None

    def new_llm_engine(self):
        llm = super().new_llm_engine()
        core = llm.engine_core
        runner, tables = core.model_runner, core.model_runner.block_tables
        self.runner = core.model_runner = TwoForwardRunner(
            runner.model, runner.storage, max_num_reqs=tables.max_num_reqs,
            max_blocks_per_req=tables.max_blocks_per_req, attention_backend=runner.attention_backend,
        )  # fmt: skip
        return llm


ONE_REQUEST = (EngineRequest("one", [1, 2, 3], 1),)
"""The smallest call, one 3-token prompt generating one token: what a call costs whatever it serves."""


def compare(
    engine: Engine,
    model: LlamaForCausalLM,
    requests: Sequence[EngineRequest],
    *,
    max_batch_tokens: int | None,
    repeats: int,
    threads: int,
) -> tuple[dict[str, Served], Timings]:
    """Time ``engine`` (built on ``model``) and transformers' continuous batching on as many blocks of
    the same size serving ``requests``, interleaved round by round, and in the same rounds both
    serving :data:`ONE_REQUEST` (named ``"engine, one request"`` and ``"generate_batch, one
    request"``), the fixed cost of a call. Every contestant is called once first, untimed, on
    :data:`ONE_REQUEST` (a warm-up that costs little).

    Returns what each system served on ``requests`` (its last run) and the timings.
    """
    servers: dict[str, Callable[[Sequence[EngineRequest]], Served]] = {
        "engine": lambda batch: serve_engine(engine, batch),
        "generate_batch": lambda batch: serve_continuous_batching(
            model, batch, engine.num_blocks, engine.block_size, max_batch_tokens
        ),
    }
    served: dict[str, Served] = {}

    def serve_all(name: str) -> Callable[[], None]:
        def call() -> None:
            served[name] = servers[name](requests)

        return call

    contestants: dict[str, Callable[[], object]] = {}
    for name in servers:
        contestants[name] = serve_all(name)
        contestants[f"{name}, one request"] = lambda name=name: servers[name](ONE_REQUEST)
    with torch_threads(threads):
        for name in servers:
            servers[name](ONE_REQUEST)
    timings = compare_times(contestants, repeats=repeats, warmup=0, threads=threads)
    return served, timings


def compare_static(
    engine: Engine, model: LlamaForCausalLM, requests: Sequence[EngineRequest], *, batch_size: int,
    repeats: int, warmup: int, threads: int,
) -> tuple[dict[str, Served], Timings]:  # fmt: skip
    """Time ``engine`` and static batches of ``batch_size`` (``model.generate``) on ``requests``,
    interleaved round by round after ``warmup`` untimed runs each: what each served, and the timings."""
    served: dict[str, Served] = {}

    def engine_call() -> None:
        served["engine"] = serve_engine(engine, requests)

    def static_call() -> None:
        served["static"] = serve_static(model, requests, batch_size)

    timings = compare_times({"engine": engine_call, "static": static_call}, repeats=repeats,
                            warmup=warmup, threads=threads)  # fmt: skip
    return served, timings


def compare_forwards(
    model: LlamaForCausalLM, requests: Sequence[EngineRequest], *, num_blocks: int, block_size: int,
    budget: int, repeats: int, warmup: int, threads: int,
) -> tuple[dict[str, EngineResult], TwoForwardEngine, Timings]:  # fmt: skip
    """Time the Engine (one forward per step) against :class:`TwoForwardEngine` (two) on ``requests``
    under ``max_num_batched_tokens=budget``, interleaved round by round after ``warmup`` untimed runs
    each, in the CPU time of this thread (both run there): the two results of their last runs, the
    two-forward engine (its runner counts the mixed steps) and the timings."""
    settings = {"num_blocks": num_blocks, "block_size": block_size, "max_num_batched_tokens": budget}
    engines = {"one forward": Engine(model, **settings), "two forwards": TwoForwardEngine(model, **settings)}
    results: dict[str, EngineResult] = {}

    def call(name: str) -> Callable[[], None]:
        def run_it() -> None:
            results[name] = engines[name].run(requests)

        return run_it

    timings = compare_thread_times({name: call(name) for name in engines}, repeats=repeats, warmup=warmup,
                                   threads=threads)  # fmt: skip
    return results, engines["two forwards"], timings


def net_ratios(timings: Timings) -> list[float]:
    """Per round, generate_batch's time less its fixed cost over the Engine's less its own: the
    speed-up without the fixed cost of a call (rounds where either difference is not positive are
    left out)."""
    s = timings.samples
    ratios = []
    names = ("generate_batch", "generate_batch, one request", "engine", "engine, one request")
    rounds = zip(*(s[name] for name in names), strict=True)
    for cb, cb_one, ours, ours_one in rounds:
        if cb > cb_one and ours > ours_one:
            ratios.append((cb - cb_one) / (ours - ours_one))
    return ratios


def run(
    num_requests: int = 448,
    scale: int = 8,
    max_len: int = 256,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    block_size: int = 16,
    num_blocks: int = 256,
    batch_size: int = 8,
    static_requests: int = 64,
    forward_requests: int = 64,
    budget: int = 128,
    arrival_gap: int = 2,
    forward_repeats: int = 5,
    max_batch_tokens: int | None = 1024,
    alone: int = 4,
    repeats: int = 3,
    warmup: int = 1,
    threads: int = 1,
) -> list[Row]:
    """The rows: ``num_requests`` ShareGPT-shaped requests (lengths / ``scale``) served by the Engine
    and by continuous batching; the first ``static_requests`` of them by the Engine and by static
    batches; the first ``forward_requests``, one arriving every ``arrival_gap`` steps (so that most
    admissions prefill beside decodes), by the Engine and :class:`TwoForwardEngine` under a token
    budget of ``budget``.

    ``alone`` requests (the first ones) are also generated one at a time by ``model.generate`` to
    check the Engine's tokens against HF's own cache with no batching. ``max_batch_tokens`` bounds
    a forward pass of continuous batching: 1,024 here, because transformers' default of 8,192 sizes
    its attention mask for 8,192 query tokens and ran about 10 % slower on this workload on a 2-core
    CPU (``None`` restores the default). ``threads`` torch threads (1 by default, as the other
    benches: the tiny model's ops are too small to share, and the machine is). ``warmup`` untimed
    runs precede the static and the one-or-two-forwards comparisons; the long one is warmed by
    :data:`ONE_REQUEST` only.
    """
    model = tiny_llama(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        max_len=max_len,
    )  # fmt: skip
    requests = scaled_requests(num_requests, scale, max_len)
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size)
    bytes_per_token = engine.kv_spec.bytes_per_token
    served, timings = compare(engine, model, requests, max_batch_tokens=max_batch_tokens, repeats=repeats,
                              threads=threads)  # fmt: skip
    few = requests[:static_requests]
    static_served, static_timings = compare_static(
        engine, model, few, batch_size=batch_size, repeats=repeats, warmup=warmup, threads=threads
    )
    budgeted = [replace(r, arrival_step=i * arrival_gap) for i, r in enumerate(requests[:forward_requests])]
    forwards, two_engine, forward_timings = compare_forwards(
        model, budgeted, num_blocks=num_blocks, block_size=block_size, budget=budget,
        repeats=forward_repeats, warmup=warmup, threads=threads,
    )  # fmt: skip
    ours, cb = served["engine"], served["generate_batch"]
    alone_tokens = {r.request_id: generate_alone(model, r) for r in requests[:alone]}
    generated = sum(r.max_tokens for r in requests)
    few_generated = sum(r.max_tokens for r in few)
    budget_generated = sum(r.max_tokens for r in budgeted)
    speed = {system: generated / timings.median(system) for system in servers_of(timings)}
    speedup, spread = spread_of(1 / r for r in round_ratios(timings, "engine", "generate_batch"))
    fixed = {system: timings.median(f"{system}, one request") for system in ("engine", "generate_batch")}
    share = {system: fixed[system] / timings.median(system) for system in fixed}
    net = {system: timings.median(system) - fixed[system] for system in fixed}
    net_speed = {system: generated / t if t > 0 else float("nan") for system, t in net.items()}
    net_speedup, net_spread = spread_of(net_ratios(timings) or [float("nan")])
    static_speedup, static_spread = spread_of(1 / r for r in round_ratios(static_timings, "engine", "static"))
    forward_speedup, forward_spread = spread_of(
        1 / r for r in round_ratios(forward_timings, "one forward", "two forwards")
    )
    equal = {
        "generate_batch": equal_requests(ours.tokens, cb.tokens),
        "static": equal_requests(static_served["engine"].tokens, static_served["static"].tokens),
        "alone": equal_requests(ours.tokens, alone_tokens),
        "forwards": equal_requests(forwards["one forward"].tokens, forwards["two forwards"].tokens),
    }
    runner = two_engine.runner
    model_name = (
        f"HF Llama (random, {num_layers} layers, hidden {hidden_size}, {num_heads} query heads over "
        f"{num_kv_heads} K/V, fp32), {{n}} ShareGPT-shaped requests (lengths / {scale}, {{tokens:,}} tokens "
        f"to generate), {num_blocks} blocks of {block_size}"
    )
    name = model_name.format(n=num_requests, tokens=generated)
    few_name = model_name.format(n=static_requests, tokens=few_generated)
    budget_name = model_name.format(n=forward_requests, tokens=budget_generated).replace(
        "requests", f"requests arriving one every {arrival_gap} steps", 1
    )
    plural = "s" if threads != 1 else ""
    note = f"CPU, {threads} thread{plural}, median of {repeats} rounds, range in brackets"
    forward_note = f"CPU, {threads} thread{plural}, thread CPU time, median of {forward_repeats} rounds"
    shares = f"Engine {100 * share['engine']:.1f} %, generate_batch {100 * share['generate_batch']:.1f} %"
    per_token = {
        "engine": static_served["engine"].kv_bytes_per_token_held(bytes_per_token),
        "static": static_served["static"].kv_bytes_per_token_held(bytes_per_token),
    }
    return [
        Row(f"{name}: generated tokens/s, Engine vs generate_batch, fixed costs included ({note})",
            speed["engine"], speed["generate_batch"], speedup,
            f">= {TARGET_SPEEDUP:.1f}x", speedup >= TARGET_SPEEDUP, "tokens/s", spread),
        Row(f"{name}: generated tokens/s, Engine vs generate_batch, each less its fixed cost ({note})",
            net_speed["engine"], net_speed["generate_batch"], net_speedup, "—", None, "tokens/s", net_spread),
        Row(f"{name}: the fixed cost of a call, one 3-token prompt generating 1 token, Engine vs "
            f"generate_batch ({note}; its share of the run: {shares})", 1e3 * fixed["engine"],
            1e3 * fixed["generate_batch"], fixed["generate_batch"] / fixed["engine"],
            f"< {100 * FIXED_SHARE:.0f} % of a run, both", max(share.values()) < FIXED_SHARE, "ms"),
        Row(f"{budget_name}, max_num_batched_tokens={budget}: generated tokens/s, one forward per step "
            f"(the Engine) vs two (prefill chunks, then decodes; {runner.mixed_steps} of {runner.steps} "
            f"steps mix both) ({forward_note})",
            budget_generated / forward_timings.median("one forward"),
            budget_generated / forward_timings.median("two forwards"), forward_speedup, "—", None,
            "tokens/s", forward_spread),
        Row(f"{few_name}: generated tokens/s, Engine vs HF generate, static batches of {batch_size} ({note})",
            few_generated / static_timings.median("engine"), few_generated / static_timings.median("static"),
            static_speedup, "—", None, "tokens/s", static_spread),
        Row(f"{name}: greedy tokens equal, Engine vs HF generate of each prompt alone (the first {alone})",
            equal["alone"], alone, equal["alone"] / alone, "all", equal["alone"] == alone, "requests"),
        Row(f"{name}: greedy tokens equal, Engine vs generate_batch",
            equal["generate_batch"], num_requests, equal["generate_batch"] / num_requests, "—", None,
            "requests"),
        Row(f"{budget_name}, max_num_batched_tokens={budget}: greedy tokens equal, one forward a step vs two",
            equal["forwards"], forward_requests, equal["forwards"] / forward_requests, "all",
            equal["forwards"] == forward_requests, "requests"),
        Row(f"{few_name}: greedy tokens equal, Engine vs static padded batches (padding can move floats)",
            equal["static"], static_requests, equal["static"] / static_requests, "—", None, "requests"),
        Row(f"{name}: K/V bytes allocated up front per token generated, Engine's pool vs generate_batch's "
            f"cache, both for {num_blocks} blocks", ours.kv_bytes_allocated / generated,
            cb.kv_bytes_allocated / generated, cb.kv_bytes_allocated / ours.kv_bytes_allocated, "—", None,
            "B/token"),
        Row(f"{few_name}: K/V bytes reserved per token held over the run ({bytes_per_token:,} B of K/V per "
            f"token), Engine's blocks in use vs static padded batches' cache", per_token["engine"],
            per_token["static"], per_token["static"] / per_token["engine"], "—", None, "B/token"),
    ]  # fmt: skip


def servers_of(timings: Timings) -> list[str]:
    """The contestants of :func:`compare` that served the whole workload."""
    return [name for name in timings.samples if not name.endswith(", one request")]


def round_ratios(timings: Timings, name: str, baseline: str) -> list[float]:
    """``name``'s time over ``baseline``'s, round by round (the median is ``timings.ratio``)."""
    return [a / b for a, b in zip(timings.samples[name], timings.samples[baseline], strict=True)]


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {
    "num_requests": 6,
    "static_requests": 4,
    "forward_requests": 6,
    "budget": 16,
    "scale": 32,
    "max_len": 64,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "block_size": 4,
    "num_blocks": 64,
    "batch_size": 4,
    "alone": 2,
    "repeats": 1,
    "forward_repeats": 1,
    "warmup": 0,
}


if __name__ == "__main__":
    print(text_table(run()))

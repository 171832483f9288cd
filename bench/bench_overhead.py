"""The engine's own cost: a whole decode step of :class:`~paged_kv.serving.llm_engine.LLMEngine`
against the model's bare forward over the same tokens with contiguous attention.

Both sides hold the same ``num_seqs`` sequences of the same prompts on the same model, decoding one
token each per step, greedily. The baseline is what any inference loop must pay at the least: the
model's own ``forward_step`` over the batch's last tokens, each layer writing the new K/V into one
preallocated contiguous tensor and attending with one batched
``torch.nn.functional.scaled_dot_product_attention`` (a mask hides each row's tail), then the
argmax; both sides must generate the same tokens before anything is reported. The engine's step is
everything a served request pays on top: ``LLMEngine.step()``, the scheduler (a block when a sequence
crosses a boundary), the runner's inputs (block tables, slot mapping), the forward over the paged cache
through the platform's attention backend (``CPU_ATTN`` on the CPU), the sampler, ``update_from_output``
and the output processor's streamed ``RequestOutput`` per request. The ratio is the engine's
step time over the bare forward's, the rounds interleaved (one step of each in turn), so a busy
machine moves both alike; the limit is :data:`TARGET`.

    .venv/bin/python bench/bench_overhead.py
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, compare_thread_times, spread_of, text_table

from paged_kv.attention.contiguous import causal_attention
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.sampling_params import RequestOutputKind, SamplingParams

TARGET = 1.2
"""The most an engine step may cost over the bare forward: a fifth more, for scheduling, paging and
outputs, at the sizes of :func:`run` on one CPU thread."""

CONFIG = GPTConfig(num_layers=4, num_heads=8, head_dim=32, max_len=512)
"""A model whose forward, not its Python, dominates a bare decode step: 4 layers of width 256."""


class BareForward:
    """The baseline: the model's own forward (``forward_step``) with contiguous attention. Each
    layer's K/V of every sequence sits in one preallocated ``(num_seqs, max_len, heads, head_dim)``
    tensor; a step writes the new token's K/V at its position and attends with one batched SDPA
    over the positions so far, a mask hiding each row's tail; then the argmax."""

    def __init__(self, model: TinyGPT, prompts: list[list[int]]) -> None:
        config, self.model = model.config, model
        shape = (config.num_layers, len(prompts), config.max_len, config.num_heads, config.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.rows = torch.arange(len(prompts))
        self.lengths = torch.tensor([len(p) for p in prompts])
        self.tokens: list[list[int]] = [[] for _ in prompts]
        first = [self._prefill(i, prompt) for i, prompt in enumerate(prompts)]
        self.last = torch.tensor(first)
        for tokens, token in zip(self.tokens, first, strict=True):
            tokens.append(token)

    def _prefill(self, row: int, prompt: list[int]) -> int:
        """One prompt's forward, its K/V stored in the row (untimed)."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[layer, row, : len(prompt)], self.v[layer, row, : len(prompt)] = k[0], v[0]
            return causal_attention(q, k, v)

        ids = torch.tensor(prompt)
        with torch.no_grad():
            logits = self.model.forward_step(
                ids, torch.arange(len(prompt)), attend, torch.tensor([len(prompt) - 1])
            )
        return int(logits.argmax(dim=-1))

    def step(self) -> None:
        positions = self.lengths
        seen = int(positions.max()) + 1
        visible = (torch.arange(seen)[None] <= positions[:, None])[:, None, None]  # (seqs, 1, 1, seen)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[layer, self.rows, positions], self.v[layer, self.rows, positions] = k[0], v[0]
            keys = self.k[layer, :, :seen].transpose(1, 2)
            values = self.v[layer, :, :seen].transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(q[0][:, :, None], keys, values, visible)
            return out[:, :, 0][None]

        with torch.no_grad():
            self.last = self.model.forward_step(self.last, positions, attend, self.rows).argmax(dim=-1)
        self.lengths = positions + 1
        for tokens, token in zip(self.tokens, self.last.tolist(), strict=True):
            tokens.append(token)


class EngineStep:
    """The engine: the same prompts as requests of ``max_tokens`` greedy tokens, streamed (vLLM's
    ``RequestOutputKind.DELTA``, a server's), every one decoding once the first step prefilled them."""

    def __init__(self, model: TinyGPT, prompts: list[list[int]], max_tokens: int, block_size: int) -> None:
        num_blocks = 1 + sum(-(-(len(p) + max_tokens) // block_size) for p in prompts)
        self.llm = LLMEngine.from_engine_args(
            model, EngineArgs(block_size=block_size, num_gpu_blocks_override=num_blocks)
        )
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        for i, prompt in enumerate(prompts):
            self.llm.add_request(i, prompt, params)
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.step()  # every prompt prefilled in one step (no token budget)
        scheduler = self.llm.engine_core.scheduler
        assert not scheduler.waiting and len(scheduler.running) == len(prompts), "not all decoding"

    def step(self) -> None:
        for output in self.llm.step():
            self.tokens[output.request_id] += output.outputs[0].token_ids


def run(
    num_seqs: int = 32, max_prompt: int = 128, block_size: int = 16, repeats: int = 15, warmup: int = 3
) -> list[Row]:
    """The row: one decode step of the engine over the bare forward, at ``num_seqs`` sequences of
    prompts of 16 to ``max_prompt`` seeded random tokens, on one thread."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(16, max_prompt))]
        for _ in range(num_seqs)
    ]
    steps = warmup + repeats + 2
    if max(map(len, prompts)) + steps > CONFIG.max_len:
        raise ValueError(f"max_prompt {max_prompt} leaves too few positions for {steps} steps")
    model = TinyGPT(CONFIG, seed=0)
    with torch.inference_mode(False):
        bare, engine = BareForward(model, prompts), EngineStep(model, prompts, steps + 1, block_size)
        timings = compare_thread_times({"engine": engine.step, "bare": bare.step}, repeats=repeats,
                                       warmup=warmup, threads=1)  # fmt: skip
    assert engine.tokens == bare.tokens, "the engine and the bare forward generated different tokens"
    ours, theirs = timings.samples["engine"], timings.samples["bare"]
    ratio, spread = spread_of(a / b for a, b in zip(ours, theirs, strict=True))
    return [
        Row(
            f"one decode step at {num_seqs} sequences (prompts 16-{max_prompt}, block {block_size}) of a "
            f"{CONFIG.num_layers}-layer GPT of width {CONFIG.num_heads * CONFIG.head_dim}, CPU, 1 thread, "
            f"thread CPU time, median of {repeats} interleaved rounds: LLMEngine.step() (schedule, paged "
            f"forward, sample, outputs) vs the model's bare forward_step with batched SDPA over "
            f"contiguous K/V and an argmax "
            f"(time ratio, the rounds' range in brackets)",
            statistics.median(ours) * 1e6, statistics.median(theirs) * 1e6, ratio,
            f"<= {TARGET:.1f}x", ratio <= TARGET, spread=spread,
        )
    ]  # fmt: skip


QUICK = {"num_seqs": 4, "max_prompt": 24, "block_size": 4, "repeats": 2, "warmup": 1}

if __name__ == "__main__":
    print(text_table(run()))

"""What a ``cache_salt`` removes: the time to first token of a prompt another request of the same salt
computed (a prefix-cache hit) against the same prompt under another salt (a miss), in one run.

The engine (``LLMEngine``, prefix caching on) serves one long prompt again and again, one request at a
time, each to its first token (``max_tokens=1``, so the request is a prefill and nothing else): the
"hit" requests all carry one salt, whose blocks the warm-up cached, and find every full block but
the last; each "miss" request carries a salt never seen before, so its first block's hash, and so
every hash of its chain, is new and its whole prompt is computed. The two are timed in turn, round
by round (``paged_kv.timing.compare_times``), from ``add_request`` to the step that returns the
token: the engine's time to first token. The difference is the side channel a salt closes: without
salts, a tenant who times its own request learns whether another tenant sent the same prefix.
Every request must give the same token, and the prefill tokens each computed are counted (exact).

    .venv/bin/python bench/bench_cache_salt.py
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Row, spread_of, text_table

from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.sampling_params import SamplingParams
from paged_kv.timing import compare_times

SPEED_TARGET = 1.0  # a hit must be faster than a miss: the difference the salt takes away


class FirstTokenTimer:
    """One engine, one prompt: :meth:`first_token` serves it to its first token under a salt and
    returns the token; :attr:`computed` keeps, per salt kind, the prompt tokens each call computed."""

    def __init__(self, model: TinyGPT, prompt: list[int], block_size: int, num_blocks: int) -> None:
        args = EngineArgs(
            block_size=block_size, num_gpu_blocks_override=num_blocks, enable_prefix_caching=True
        )
        self.llm = LLMEngine.from_engine_args(model, args)
        self.prompt = prompt
        self.params = SamplingParams(temperature=0.0, max_tokens=1)
        self.computed: dict[str, set[int]] = {"hit": set(), "miss": set()}
        self.tokens: set[int] = set()
        self._ids = itertools.count()
        self._new_salts = (f"tenant-{i}" for i in itertools.count())

    def first_token(self, kind: str) -> int:
        """Serve the prompt once, under the shared salt (``"hit"``) or a new one (``"miss"``)."""
        salt = "shared" if kind == "hit" else next(self._new_salts)
        llm = self.llm
        llm.add_request(next(self._ids), self.prompt, self.params, cache_salt=salt)
        (out,) = llm.step()
        self.computed[kind].add(llm.last_step[0].total_num_scheduled_tokens)
        (token,) = out.outputs[0].token_ids
        self.tokens.add(token)
        return token


def run(
    prompt_tokens: int = 1_024,
    block_size: int = 16,
    num_layers: int = 4,
    num_heads: int = 4,
    head_dim: int = 32,
    repeats: int = 9,
    threads: int = 1,
) -> list[Row]:
    """The timing row and the counting row of the module docstring; raises if a salt changes the token."""
    config = GPTConfig(
        num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, max_len=prompt_tokens + 1
    )
    model = TinyGPT(config, seed=0).eval()
    prompt = [random.Random(0).randrange(config.vocab_size) for _ in range(prompt_tokens)]
    num_blocks = 4 * -(-prompt_tokens // block_size) + 1  # the shared salt's blocks and a few misses'
    timer = FirstTokenTimer(model, prompt, block_size, num_blocks)
    timer.first_token("hit")  # the shared salt's first request computes and caches the prompt
    timer.computed["hit"].clear()
    timings = compare_times(
        {"hit": lambda: timer.first_token("hit"), "miss": lambda: timer.first_token("miss")},
        repeats=repeats,
        warmup=1,
        threads=threads,
    )
    if len(timer.tokens) != 1:
        raise AssertionError(f"a salt changed the first token: {sorted(timer.tokens)}")
    if len(timer.computed["hit"]) != 1 or len(timer.computed["miss"]) != 1:
        raise AssertionError(f"the tokens computed varied between calls: {timer.computed}")
    (hit_tokens,), (miss_tokens,) = timer.computed["hit"], timer.computed["miss"]
    hit, miss = timings.median("hit"), timings.median("miss")
    ratio, spread = spread_of(
        m / h for h, m in zip(timings.samples["hit"], timings.samples["miss"], strict=True)
    )
    name = (
        f"a {prompt_tokens:,}-token prompt served again to its first token, block {block_size}, "
        f"tiny GPT {num_layers} layers x {num_heads} heads x {head_dim}, {threads} thread(s)"
    )
    return [
        Row(f"{name}: time to first token, the same salt (hit) vs another salt (miss)",
            hit * 1e3, miss * 1e3, ratio, f"> {SPEED_TARGET:g}x", ratio > SPEED_TARGET, "ms", spread),
        Row(f"{name}: prefill tokens computed, the same salt vs another salt",
            hit_tokens, miss_tokens, miss_tokens / hit_tokens, "—", None, "tokens"),
    ]  # fmt: skip


# Tiny sizes for a smoke run (``run_all.py --quick``, the tests).
QUICK = {"prompt_tokens": 256, "num_layers": 2, "head_dim": 16, "repeats": 3}


if __name__ == "__main__":
    print(text_table(run()))

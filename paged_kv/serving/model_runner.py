"""Runners: what computes the step a :class:`~paged_kv.serving.scheduler.Scheduler` decided (lessons 07, 09).

* :class:`ModelRunner` runs a :class:`~paged_kv.model.causal_lm.CausalLM` (the tiny GPT or a
  Hugging Face model) on the cache: the step's prefill chunks in one packed ``prefill_batch``, each
  from its first position not yet computed (a chunk at an offset reads the cached positions
  before it through the paged cache), then every decode in one batched ``decode_step``, and samples
  greedily (vLLM: ``GPUModelRunner.execute_model``, which flattens prefill and decode tokens into
  one forward).
* :class:`CountingRunner` runs no model: it does to the memory what the model would (each decoding
  sequence grows by one token) and "samples" token 0, so a simulator counts steps and tokens
  exactly as the engine does.
"""

from __future__ import annotations

import torch

from paged_kv.model.causal_lm import CausalLM
from paged_kv.model.kv_cache import KVCache
from paged_kv.serving.memory import KVMemory
from paged_kv.serving.scheduler import RunnerOutput, SchedulerOutput


class ModelRunner:
    """Runs ``model`` on ``cache`` for each :class:`~paged_kv.serving.scheduler.SchedulerOutput`.

    The prompts' room is already in the cache (the scheduler added them); the step's prefill chunks
    write their K/V in one packed forward, each from its ``start`` (its computed tokens) to its
    ``end``, and a chunk that ends its prefill samples the next token from its last logits; a
    decode feeds each sequence's last token.
    """

    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        sampled: dict = {}
        if output.prefills:  # every prefill chunk of the step in one forward, as vLLM flattens a step
            prefills = output.prefills
            prompts = [torch.tensor(p.token_ids[: p.end], device=self.device) for p in prefills]
            ids = [p.request.request_id for p in prefills]
            logits = self.model.prefill_batch(prompts, ids, self.cache, [p.start for p in prefills])
            tokens = logits.argmax(dim=-1).tolist()
            sampled.update((i, t) for i, t, p in zip(ids, tokens, prefills, strict=True) if p.samples)
        if output.decodes:
            ids = [d.request_id for d in output.decodes]
            last = torch.tensor([d.token for d in output.decodes], device=self.device)
            tokens = self.model.decode_step(last, ids, self.cache).argmax(dim=-1).tolist()
            sampled.update(zip(ids, tokens, strict=True))
        return RunnerOutput(sampled)


class CountingRunner:
    """Runs no model: the decoding sequences grow by one token in ``memory``, and every token is 0."""

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        self.memory.append([d.request_id for d in output.decodes])
        ids = [p.request.request_id for p in output.prefills if p.samples]
        return RunnerOutput(dict.fromkeys(ids + [d.request_id for d in output.decodes], 0))

"""Runners: what computes the step a :class:`~paged_kv.serving.scheduler.Scheduler` decided (lessons 06, 09).

* :class:`ModelRunner` runs a :class:`~paged_kv.model.causal_lm.CausalLM` (the tiny GPT or a
  Hugging Face model) on the cache: each prefill from its first uncached position, then every decode
  in one batched ``decode_step``, and samples greedily (vLLM: ``GPUModelRunner.execute_model``).
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

    The prompts' room is already in the cache (the scheduler added them); a prefill writes their
    K/V and its last logits give the first token; a decode feeds each sequence's last token.
    """

    def __init__(self, model: CausalLM, cache: KVCache, device: torch.device) -> None:
        self.model, self.cache, self.device = model, cache, device

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        sampled: dict = {}
        for prefill in output.prefills:
            request = prefill.request
            prompt = torch.tensor(request.prompt_token_ids, device=self.device)
            logits = self.model.prefill(
                prompt, request.request_id, self.cache, start=prefill.num_cached_tokens
            )
            sampled[request.request_id] = int(logits[-1].argmax())
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
        ids = [p.request.request_id for p in output.prefills] + [d.request_id for d in output.decodes]
        return RunnerOutput(dict.fromkeys(ids, 0))

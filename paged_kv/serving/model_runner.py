"""Runners: what computes the step a :class:`~paged_kv.serving.scheduler.Scheduler` decided (lessons 07-10).

* :class:`ModelRunner` runs a :class:`~paged_kv.model.causal_lm.CausalLM` (the tiny GPT or a
  Hugging Face model) over a :class:`~paged_kv.kv.storage.KVStorage`, as vLLM's model runner does
  (Model Runner V2, the default in vLLM 0.33.0: ``GPUModelRunner.execute_model`` in
  ``vllm/v1/worker/gpu/model_runner.py``). Each step it

  1. applies the :class:`~paged_kv.serving.scheduler.SchedulerOutput` to its persistent state:
     the rows of finished and preempted requests go, swapped-out K/V is copied to host memory and
     swapped-in K/V back, new requests get a row of the block table, running ones the blocks they
     gained (:class:`~paged_kv.model.step.BlockTables`);
  2. prepares the step's inputs once: the flattened batch's token ids, and the
     :class:`~paged_kv.model.step.AttentionMetadata` (positions, ``query_start_loc``, ``seq_lens``,
     the block-table rows and the slot mapping of every token);
  3. runs **one** forward over the batch, prefill chunks and decodes together; each layer writes
     its K/V at the slot mapping and attends through the block table
     (:func:`~paged_kv.model.attend.step_attend`);
  4. samples greedily at each request's last token, for the requests whose tokens reached their
     end (a partial prefill chunk samples nothing).

  It never allocates nor frees a block: the scheduler has done both.
* :class:`CountingRunner` runs no model and "samples" token 0, so a simulator counts steps and
  tokens exactly as the engine does: the blocks were taken when the step was scheduled.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from paged_kv.kv import swap
from paged_kv.kv.storage import KVStorage
from paged_kv.model.attend import step_attend
from paged_kv.model.causal_lm import CausalLM
from paged_kv.model.step import BlockTables, long_tensor, prepare_attention
from paged_kv.serving.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass
class CachedRequestState:
    """What the runner keeps of a request between steps (vLLM: ``CachedRequestState``): its token
    ids (prompt, then every sampled token) and the tokens whose K/V the cache holds."""

    token_ids: list[int]
    num_computed_tokens: int


class ModelRunner:
    """Runs ``model`` over ``storage`` for each :class:`~paged_kv.serving.scheduler.SchedulerOutput`.

    ``max_num_reqs`` rows of ``max_blocks_per_req`` blocks bound the persistent block table;
    ``strategy`` is the paged attention's (:func:`~paged_kv.attention.paged.paged_prefill_attention`).

    Invariant between steps: :attr:`requests` holds exactly the running requests, each with the
    block table row the scheduler's block ids built and the computed tokens the scheduler counts.
    """

    def __init__(
        self,
        model: CausalLM,
        storage: KVStorage,
        *,
        max_num_reqs: int,
        max_blocks_per_req: int,
        strategy: str = "auto",
    ) -> None:
        self.model, self.storage, self.strategy = model, storage, strategy
        self.block_size = storage.block_size
        self.device = storage.device
        self.tables = BlockTables(max_num_reqs, max_blocks_per_req, self.device)
        self.requests: dict[Hashable, CachedRequestState] = {}
        self.swapped: dict[Hashable, swap.SwappedKV] = {}

    @torch.no_grad()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply ``output``, run its one forward and sample (see the module).

        Raises:
            ValueError: ``output`` cannot be applied: a scheduled request the runner does not know,
                a new one it knows already, block ids outside the pool, too few blocks for a
                request's tokens, or computed counts that disagree with the runner's. Nothing changes.
        """
        self._check(output)
        self._update_states(output)
        scheduled = output.num_scheduled_tokens
        if not scheduled:
            return ModelRunnerOutput({})
        req_ids = list(scheduled)
        states = [self.requests[r] for r in req_ids]
        query_lens = [scheduled[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]
        metadata = prepare_attention(self.tables, req_ids, computed, query_lens, self.block_size)
        tokens: list[int] = []
        for state, c, n in zip(states, computed, query_lens, strict=True):
            if n == 1:  # a decode: its last token
                tokens.append(state.token_ids[c])
            else:
                tokens += state.token_ids[c : c + n]
        input_ids = long_tensor(tokens, self.device)
        attend = step_attend(metadata, self.storage, self.strategy)
        logits = self.model.forward_step(input_ids, metadata.positions, attend, metadata.logits_indices)
        sampled = {}
        for req_id, state, n, token in zip(
            req_ids, states, query_lens, logits.argmax(dim=-1).tolist(), strict=True
        ):
            state.num_computed_tokens += n
            if state.num_computed_tokens == len(state.token_ids):
                state.token_ids.append(token)
                sampled[req_id] = token
        return ModelRunnerOutput(sampled)

    # ------------------------------------------------------------------------------ the state

    def _check(self, output: SchedulerOutput) -> None:
        """Every check of :meth:`execute_model`, before anything changes."""
        if not isinstance(output, SchedulerOutput):
            raise ValueError(f"output must be a SchedulerOutput, got {type(output).__name__}")
        leaving = set(output.finished_req_ids) | output.preempted_req_ids
        running = set(self.requests) - leaving
        num_blocks = self.storage.num_blocks
        blocks_after: dict[Hashable, int] = {}
        starts: dict[Hashable, int] = {}
        for new in output.scheduled_new_reqs:
            if new.req_id in running:
                raise ValueError(f"new request {new.req_id!r} is running already")
            if new.token_ids is None:
                raise ValueError(f"new request {new.req_id!r} has no token ids: a model needs them")
            self._check_blocks(new.req_id, new.block_ids, num_blocks)
            blocks_after[new.req_id], starts[new.req_id] = len(new.block_ids), new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests.get(req_id)
            if state is None or req_id in leaving:
                raise ValueError(f"scheduled request {req_id!r} has no row in the runner")
            if state.num_computed_tokens != num_computed:
                raise ValueError(
                    f"request {req_id!r}: the scheduler counts {num_computed} computed tokens, "
                    f"the runner {state.num_computed_tokens}"
                )
            self._check_blocks(req_id, block_ids, num_blocks)
            blocks_after[req_id] = self.tables.num_blocks[self.tables.rows[req_id]] + len(block_ids)
            starts[req_id] = num_computed
        for req_id, n in output.num_scheduled_tokens.items():
            if req_id not in blocks_after:
                raise ValueError(f"request {req_id!r} is scheduled but neither new nor running")
            start = starts[req_id]
            if blocks_after[req_id] * self.block_size < start + n:
                raise ValueError(
                    f"request {req_id!r}: {start + n} tokens do not fit in its {blocks_after[req_id]} blocks"
                )
        for req_id in output.blocks_to_swap_in:
            if req_id not in self.swapped:
                raise ValueError(f"request {req_id!r} is swapped in but was never swapped out")

    @staticmethod
    def _check_blocks(req_id: Hashable, block_ids: tuple[int, ...], num_blocks: int) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
            raise ValueError(
                f"request {req_id!r} was given block ids outside 0 .. {num_blocks - 1}: {block_ids}"
            )

    def _update_states(self, output: SchedulerOutput) -> None:
        """Apply ``output`` to the rows and the request states (vLLM: ``_update_states``)."""
        for req_id in output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.tables.remove(req_id)
        for req_id, block_ids in output.blocks_to_swap_out.items():  # before the forward overwrites them
            state = self.requests.pop(req_id)
            self.swapped[req_id] = swap.copy_out(self.storage, block_ids, state.num_computed_tokens)
            self.tables.remove(req_id)
        for preempted in output.preemptions:
            if preempted.way == "recompute":
                self.requests.pop(preempted.request_id, None)
                self.tables.remove(preempted.request_id)
        for req_id, block_ids in output.blocks_to_swap_in.items():
            swap.copy_in(self.storage, self.swapped.pop(req_id), block_ids)
        for new in output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(list(new.token_ids), new.num_computed_tokens)
            self.tables.add_row(new.req_id, new.block_ids)
        cached = output.scheduled_cached_reqs
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            self.tables.append(req_id, block_ids)


class CountingRunner:
    """Runs no model: every scheduled request "samples" token 0 (the scheduler keeps only the tokens
    of the requests whose scheduled tokens reached their end)."""

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(dict.fromkeys(output.num_scheduled_tokens, 0))

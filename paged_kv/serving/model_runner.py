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
  4. samples at each request's last token, for the requests whose tokens reached their end (a
     partial prefill chunk samples nothing): greedily, or by the request's sampling parameters
     with its own generator (:mod:`~paged_kv.serving.sampler`, lesson 16), whose
     :class:`~paged_kv.serving.sampler.SamplingState` the runner keeps from the request's first
     step to its last, through preemptions; with the log-probabilities the request asked for, of
     the sampled token and, for ``prompt_logprobs``, of every prompt token a chunk predicts (the
     logits at every position of that request's chunk, computed in the same forward; each prompt
     token scored once, even when a preemption makes the request prefill again).

  It never allocates nor frees a block: the scheduler has done both.
* :class:`CountingRunner` runs no model and "samples" token 0, so a simulator counts steps and
  tokens exactly as the engine does: the blocks were taken when the step was scheduled.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from itertools import compress, repeat

import torch

from paged_kv.core.kv_cache_coordinator import BlockIds
from paged_kv.core.kv_cache_groups import FullAttentionSpec, KVCacheGroupSpec
from paged_kv.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorOutput
from paged_kv.kv import swap
from paged_kv.kv.storage import KVStorage
from paged_kv.model.attend import step_attend
from paged_kv.model.causal_lm import CausalLM
from paged_kv.model.step import AttentionMetadata, BlockTables, long_tensor, prepare_attention_by_group
from paged_kv.serving.logprobs import TokenLogprobs
from paged_kv.serving.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from paged_kv.serving.sampler import SamplingState, needs_state, new_generator, sample, token_logprobs


class RequestState:
    """The runner's state of its requests between steps, one entry per row of the block table
    (vLLM 0.33.0: Model Runner V2's ``RequestState``, ``vllm/v1/worker/gpu/states.py``).

    Host tensors indexed by row, so that a step gathers a whole batch's entries with one
    indexing operation: ``num_computed_tokens`` (the tokens whose K/V the cache holds),
    ``num_tokens`` (the tokens the runner knows: the ones it was given, then every one it
    sampled), ``prefill_len`` (the ones it was given: the prompt, and the tokens a resumed
    request generated before) and ``last_token`` (the newest known token: a decode's input).
    ``prefill_token_ids[row]`` holds the given tokens, which prefill chunks read.

    Invariant: ``num_computed_tokens <= num_tokens`` and ``prefill_len <= num_tokens`` in every
    row in use; a row past ``prefill_len`` decodes its ``last_token``.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_computed_tokens = torch.zeros(num_rows, dtype=torch.long)
        self.num_tokens = torch.zeros(num_rows, dtype=torch.long)
        self.prefill_len = torch.zeros(num_rows, dtype=torch.long)
        self.last_token = torch.zeros(num_rows, dtype=torch.long)
        self.prefill_token_ids: list[list[int]] = [[] for _ in range(num_rows)]

    def add(self, row: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Row ``row`` holds a request given ``token_ids``, the first ``num_computed_tokens`` computed."""
        if row >= len(self.num_tokens):  # the block table grew its rows: grow alike
            more = len(self.num_tokens)
            for name in ("num_computed_tokens", "num_tokens", "prefill_len", "last_token"):
                setattr(self, name, torch.cat([getattr(self, name), torch.zeros(more, dtype=torch.long)]))
            self.prefill_token_ids += [[] for _ in range(more)]
        self.prefill_token_ids[row] = token_ids
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_tokens[row] = self.prefill_len[row] = len(token_ids)
        self.last_token[row] = token_ids[-1]

    def input_ids(
        self, rows: torch.Tensor, computed: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The step's flattened input tokens (host): each decode's last token, each chunk's given
        tokens from its computed count on (vLLM: ``prepare_prefill_inputs`` and the sampled tokens)."""
        ids = self.last_token[rows]
        chunks = torch.nonzero(computed < self.prefill_len[rows]).flatten().tolist()
        if not chunks:  # a decode step: one token per request, its last
            return ids
        starts = metadata.query_start_loc_cpu.tolist()
        ids = ids.repeat_interleave(torch.diff(metadata.query_start_loc_cpu))
        row_list = rows.tolist()
        for b in chunks:
            c, start, end = int(computed[b]), starts[b], starts[b + 1]
            ids[start:end] = long_tensor(self.prefill_token_ids[row_list[b]][c : c + end - start])
        return ids


class ModelRunner:
    """Runs ``model`` over ``storage`` for each :class:`~paged_kv.serving.scheduler.SchedulerOutput`.

    ``max_num_reqs`` rows of ``max_blocks_per_req`` blocks bound the persistent block table (it
    doubles its rows when a step needs more); ``attention_backend`` is the paged attention's
    (:func:`~paged_kv.attention.paged.paged_attention_varlen`). ``kv_cache_groups`` are the model's
    KV-cache groups (lesson 13; default: one group of every layer, attending fully): the block
    table has a row per group for each request, and each layer writes and reads through its
    group's. :attr:`last_metadata` is the :class:`~paged_kv.model.step.AttentionMetadata` of the
    last step that ran (its first group's: the groups share all but the block table and slots).
    ``kv_connector`` is a KV connector's worker half (``None``: none, and the step is as without
    one): it is given ``storage`` (``register_kv_caches``) and runs its loads before each forward
    and its stores after it.

    Invariant between steps: :attr:`block_tables` has a row for exactly the running requests, built from
    the scheduler's block ids, and :attr:`state` the computed tokens the scheduler counts.
    """

    def __init__(
        self,
        model: CausalLM,
        storage: KVStorage,
        *,
        max_num_reqs: int,
        max_blocks_per_req: int,
        attention_backend: str | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        kv_connector: KVConnectorBase_V1 | None = None,
    ) -> None:
        self.model, self.storage, self.attention_backend = model, storage, attention_backend
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(storage)
        self.block_size = storage.block_size
        self.device = storage.device
        num_layers = model.config.num_layers
        self.kv_cache_groups = tuple(
            kv_cache_groups
            or (KVCacheGroupSpec(tuple(range(num_layers)), FullAttentionSpec(self.block_size)),)
        )
        self.layer_group = [0] * num_layers
        for index, group in enumerate(self.kv_cache_groups):
            for layer in group.layers:
                self.layer_group[layer] = index
        self.block_tables = BlockTables(
            max_num_reqs, max_blocks_per_req, self.device, len(self.kv_cache_groups)
        )
        self.state = RequestState(self.block_tables.max_num_reqs)
        self.swapped: dict[Hashable, swap.SwappedKV] = {}
        self.sampling: dict[Hashable, SamplingState] = {}
        """The sampling state of every request that is not plain greedy, from its first step until it
        finishes."""
        self._seeds = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        self.last_metadata: AttentionMetadata | None = None

    def num_computed_tokens(self, req_id: Hashable) -> int:
        """The tokens of ``req_id`` whose K/V the cache holds, as the runner counts them.

        Raises:
            ValueError: the runner has no row for ``req_id``.
        """
        return int(self.state.num_computed_tokens[self.block_tables.row(req_id)])

    @torch.no_grad()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply ``output``, run its one forward and sample (see the module).

        Raises:
            ValueError: ``output`` cannot be applied: a scheduled request the runner does not know,
                a new one it knows already, block ids outside the pool, too few blocks for a
                request's tokens, tokens it was never given, or computed counts that disagree
                with the runner's. Nothing changes.
        """
        self._check(output)
        self._update_states(output)
        scheduled = output.num_scheduled_tokens
        if self.kv_connector is not None:
            return self._run_with_connector(output)
        return self._run(list(scheduled), list(scheduled.values())) if scheduled else ModelRunnerOutput({})

    def _run_with_connector(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """The step with a KV connector (vLLM's ``KVConnectorModelRunnerMixin``): its metadata bound,
        its loads before the forward (``start_load_kv``), its stores after (``wait_for_save``), and
        what its worker finished in the output."""
        connector, scheduled = self.kv_connector, output.num_scheduled_tokens
        connector.bind_connector_metadata(output.kv_connector_metadata)
        try:
            connector.start_load_kv()
            result = ModelRunnerOutput({})
            if scheduled:
                result = self._run(list(scheduled), list(scheduled.values()))
            connector.wait_for_save()
            sending, recving = connector.get_finished(set(output.finished_req_ids))
        finally:
            connector.clear_connector_metadata()
        kv_output = KVConnectorOutput(
            frozenset(sending or ()),
            frozenset(recving or ()),
            frozenset(connector.get_block_ids_with_load_errors()),
        )
        return replace(result, kv_connector_output=kv_output)

    def _run(self, req_ids: list[Hashable], query_lens: list[int]) -> ModelRunnerOutput:
        """One forward over ``query_lens[b]`` tokens of each request ``req_ids[b]``, in that order;
        the token sampled for each request whose tokens reached their end (a partial chunk samples
        none), with the log-probabilities asked for."""
        state = self.state
        rows = long_tensor(self.block_tables.rows_of(req_ids))
        computed = state.num_computed_tokens[rows]
        by_group = prepare_attention_by_group(
            self.block_tables, req_ids, computed, query_lens, self.block_size, check=False
        )
        metadata = self.last_metadata = by_group[0]
        input_ids = state.input_ids(rows, computed, metadata).to(self.device)
        attend = step_attend(
            by_group,
            self.storage,
            self.attention_backend,
            self.layer_group,
            self.model.config.layer_attention,
        )
        scored = self._prompt_positions(req_ids, computed.tolist(), query_lens, metadata)
        indices = metadata.logits_indices
        if scored:
            extra = [index for _, _, _, positions in scored for index in positions]
            indices = torch.cat([indices, long_tensor(extra).to(indices.device)])
        logits = self.model.forward_step(input_ids, metadata.positions, attend, indices)
        prompt_logprobs = self._prompt_logprobs(scored, logits[len(req_ids) :]) if scored else {}
        logits = logits[: len(req_ids)]
        after = computed + long_tensor(query_lens)
        state.num_computed_tokens[rows] = after
        samples = after == state.num_tokens[rows]
        sampled_ids = list(compress(req_ids, samples.tolist()))
        logprobs: dict[Hashable, TokenLogprobs] = {}
        if self.sampling and not self.sampling.keys().isdisjoint(sampled_ids):
            states = [self.sampling.get(req_id) for req_id in sampled_ids]
            tokens, by_row = sample(logits[samples.to(logits.device)], states)
            logprobs = {sampled_ids[row]: lp for row, lp in by_row.items()}
            for st, token in zip(states, tokens.tolist(), strict=True):
                if st is not None:
                    st.output_token_ids.append(token)
        else:  # every request plain greedy: one argmax
            tokens = logits.argmax(dim=-1).cpu()[samples]
        sampling = rows[samples]
        state.num_tokens[sampling] += 1
        state.last_token[sampling] = tokens
        sampled = dict(zip(sampled_ids, tokens.tolist(), strict=True))
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _prompt_positions(
        self, req_ids: list[Hashable], computed: list[int], query_lens: list[int], metadata: AttentionMetadata
    ) -> list[tuple[Hashable, SamplingState, int, list[int]]]:
        """For each request that wants prompt log-probabilities still unscored in its chunk: its
        state, the first prompt token its chunk scores, and the batch indices of the logits that
        score them (the logits at position ``p`` predict prompt token ``p + 1``)."""
        if not self.sampling:
            return []
        starts = None
        scored = []
        for b, req_id in enumerate(req_ids):
            st = self.sampling.get(req_id)
            if st is None or st.params.prompt_logprobs is None:
                continue
            first = max(st.next_prompt_logprob, computed[b] + 1)
            last = min(len(st.prompt_token_ids) - 1, computed[b] + query_lens[b])  # the last token scored
            if first > last:
                continue
            if starts is None:
                starts = metadata.query_start_loc_cpu.tolist()
            offset = starts[b] - computed[b]  # the batch index of position p is offset + p
            scored.append((req_id, st, first, [offset + p - 1 for p in range(first, last + 1)]))
        return scored

    @staticmethod
    def _prompt_logprobs(
        scored: list[tuple[Hashable, SamplingState, int, list[int]]], logits: torch.Tensor
    ) -> dict[Hashable, tuple[TokenLogprobs, ...]]:
        """The log-probabilities of the prompt tokens :meth:`_prompt_positions` named, from their
        logits (in that order); each request's ``next_prompt_logprob`` moves past them."""
        out: dict[Hashable, tuple[TokenLogprobs, ...]] = {}
        at = 0
        for req_id, st, first, positions in scored:
            rows = logits[at : at + len(positions)].float().log_softmax(dim=-1).cpu()
            at += len(positions)
            k = st.params.prompt_logprobs
            tokens = st.prompt_token_ids[first : first + len(positions)]
            out[req_id] = tuple(token_logprobs(row, t, k) for row, t in zip(rows, tokens, strict=True))
            st.next_prompt_logprob = first + len(positions)
        return out

    # ------------------------------------------------------------------------------ the state

    def _check(self, output: SchedulerOutput) -> None:
        """Every check of :meth:`execute_model`, before anything changes: one pass over the new
        requests (a few a step) and a few tensor operations over the running ones."""
        if not isinstance(output, SchedulerOutput):
            raise ValueError(f"output must be a SchedulerOutput, got {type(output).__name__}")
        leaving = output.finished_req_ids | output.preempted_req_ids
        rows, num_blocks, scheduled = (
            self.block_tables.rows,
            self.storage.num_blocks,
            output.num_scheduled_tokens,
        )
        for new in output.scheduled_new_reqs:
            if new.req_id in rows and new.req_id not in leaving:
                raise ValueError(f"new request {new.req_id!r} is running already")
            if new.token_ids is None:
                raise ValueError(f"new request {new.req_id!r} has no token ids: a model needs them")
            count = self._check_blocks(new.req_id, new.block_ids, num_blocks)
            n = scheduled.get(new.req_id, 0)
            if new.num_computed_tokens + n > len(new.token_ids):
                raise ValueError(
                    f"request {new.req_id!r}: {new.num_computed_tokens} computed + {n} scheduled tokens "
                    f"run past the {len(new.token_ids)} tokens the runner knows"
                )
            if count * self.block_size < new.num_computed_tokens + n:
                raise ValueError(
                    f"request {new.req_id!r}: {new.num_computed_tokens + n} tokens do not fit in its "
                    f"{count} blocks"
                )
        cached = output.scheduled_cached_reqs
        cached_rows = list(map(rows.get, cached.req_ids))
        if None in cached_rows or not leaving.isdisjoint(cached.req_ids):
            req_id = next(
                r for r, row in zip(cached.req_ids, cached_rows, strict=True) if row is None or r in leaving
            )
            raise ValueError(f"scheduled request {req_id!r} has no row in the runner")
        if len(cached.new_block_ids) != len(cached.req_ids):
            raise ValueError("scheduled_cached_reqs must give new_block_ids for each of its req_ids")
        gained = [0] * len(cached.req_ids)
        for index in _gaining(cached.new_block_ids, self.block_tables.num_groups):  # crossed a block boundary
            gained[index] = self._check_blocks(cached.req_ids[index], cached.new_block_ids[index], num_blocks)
        known = {new.req_id for new in output.scheduled_new_reqs}.union(cached.req_ids)
        if not scheduled.keys() <= known:
            req_id = next(r for r in scheduled if r not in known)
            raise ValueError(f"request {req_id!r} is scheduled but neither new nor running")
        if cached.req_ids:
            self._check_cached(cached, cached_rows, gained, scheduled)
        for req_id in output.blocks_to_swap_in:
            if req_id not in self.swapped:
                raise ValueError(f"request {req_id!r} is swapped in but was never swapped out")

    def _check_cached(
        self,
        cached: CachedRequestData,
        cached_rows: list[int],
        gained: list[int],
        scheduled: Mapping[Hashable, int],
    ) -> None:
        """The running requests' computed counts agree with the runner's, and their scheduled tokens
        fit their blocks and are tokens the runner knows: a few tensor operations, and a look at
        the first request that fails only when one does."""
        state, rows = self.state, long_tensor(cached_rows)
        theirs, ours = long_tensor(cached.num_computed_tokens), state.num_computed_tokens[rows]
        ends = ours + long_tensor(list(map(scheduled.get, cached.req_ids, repeat(0))))
        held = long_tensor(list(map(self.block_tables.num_blocks.__getitem__, cached_rows)))
        held += long_tensor(gained)
        known = state.num_tokens[rows]
        failed = (theirs != ours) | (held * self.block_size < ends) | (ends > known)
        if not bool(failed.any()):
            return
        b = int(torch.nonzero(failed)[0])
        req_id, end = cached.req_ids[b], int(ends[b])
        if theirs[b] != ours[b]:
            raise ValueError(
                f"request {req_id!r}: the scheduler counts {int(theirs[b])} computed tokens, "
                f"the runner {int(ours[b])}"
            )
        if end > held[b] * self.block_size:
            raise ValueError(f"request {req_id!r}: {end} tokens do not fit in its {int(held[b])} blocks")
        raise ValueError(
            f"request {req_id!r}: {int(ours[b])} computed + {end - int(ours[b])} scheduled tokens "
            f"run past the {int(known[b])} tokens the runner knows"
        )

    def _check_blocks(self, req_id: Hashable, block_ids: BlockIds, num_blocks: int) -> int:
        """The blocks each group of ``block_ids`` holds: as many in every group, all in the pool."""
        if len(block_ids) != self.block_tables.num_groups or len({len(ids) for ids in block_ids}) != 1:
            raise ValueError(
                f"request {req_id!r} was given block ids for {len(block_ids)} groups of "
                f"{[len(ids) for ids in block_ids]} blocks: the runner has {self.block_tables.num_groups} "
                f"groups, each as long"
            )
        flat = [b for ids in block_ids for b in ids]
        if flat and (min(flat) < 0 or max(flat) >= num_blocks):
            raise ValueError(
                f"request {req_id!r} was given block ids outside 0 .. {num_blocks - 1}: {block_ids}"
            )
        return len(block_ids[0])

    def _update_states(self, output: SchedulerOutput) -> None:
        """Apply ``output`` to the rows and the request states (vLLM: ``finish_requests``,
        ``add_requests`` and ``update_requests``)."""
        block_tables = self.block_tables
        for req_id in output.finished_req_ids:  # finished, stopped or aborted, wherever they were
            block_tables.remove(req_id)
            self.swapped.pop(req_id, None)
            self.sampling.pop(req_id, None)
        for req_id, block_ids in output.blocks_to_swap_out.items():  # before the forward overwrites them
            num_computed = self.num_computed_tokens(req_id)
            self.swapped[req_id] = swap.copy_out(self.storage, block_ids, num_computed, self.layer_group)
            block_tables.remove(req_id)
        for preempted in output.preemptions:
            if preempted.way == "recompute":
                block_tables.remove(preempted.request_id)
        for req_id, block_ids in output.blocks_to_swap_in.items():
            swap.copy_in(self.storage, self.swapped.pop(req_id), block_ids, self.layer_group)
        for new in output.scheduled_new_reqs:
            params = new.sampling_params
            if needs_state(params) and new.req_id not in self.sampling:  # its first admission
                eos = () if params.ignore_eos else self.model.eos_token_ids
                self.sampling[new.req_id] = SamplingState(
                    params,
                    new_generator(params, self._seeds),
                    tuple(new.token_ids),
                    frozenset(params.stop_token_ids).union(eos),
                )
            row = block_tables.add_row(new.req_id, new.block_ids)
            self.state.add(row, list(new.token_ids), new.num_computed_tokens)
        cached = output.scheduled_cached_reqs
        for index in _gaining(cached.new_block_ids, block_tables.num_groups):
            block_tables.append(cached.req_ids[index], cached.new_block_ids[index])


def _gaining(new_block_ids: Sequence[BlockIds], num_groups: int) -> list[int]:
    """The indices of the requests that gained a block (a few a step), found at C speed."""
    nothing = ((),) * num_groups
    return list(compress(range(len(new_block_ids)), map(nothing.__ne__, new_block_ids)))


class CountingRunner:
    """Runs no model: every scheduled request "samples" token 0 (the scheduler keeps only the tokens
    of the requests whose scheduled tokens reached their end)."""

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(dict.fromkeys(output.num_scheduled_tokens, 0))

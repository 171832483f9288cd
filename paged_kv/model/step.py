"""One step's inputs, prepared once: the persistent block table, and the attention metadata (lessons 09, 10).

A step of the engine runs **one** forward over a flattened batch: every scheduled request's new
tokens one after another, prefill chunks and decodes alike. Request ``b`` contributes
``query_lens[b]`` tokens, at positions ``num_computed[b] ..`` of its sequence; its tokens are
rows ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of the batch. Every attention layer then
needs the same five things, built here once per step and read by every layer:

* ``positions``: each token's position in its sequence (rotary or learned embeddings);
* ``query_start_loc`` (``batch + 1``, from 0) and ``seq_lens`` (the tokens each request holds once
  this step's are in);
* ``block_table``: each request's row of block ids;
* ``slot_mapping``: the flat slot each new token's K/V goes to, ``block_table[b, p // block_size] *
  block_size + p % block_size`` (:func:`paged_kv.kv.slots.slot_mapping`).

:class:`BlockTables` keeps the block ids on the device between steps, one row per request, rows
added, extended and dropped as the scheduler says: vLLM 0.33.0's Model Runner V2 does the same
(``BlockTables`` in ``vllm/v1/worker/gpu/block_table.py``; the V1 runner's, now the fallback, is
``vllm/v1/worker/block_table.py``). :func:`prepare_attention` builds the metadata from it with a
handful of tensor operations and no loop over tokens (vLLM: ``prepare_inputs`` and the attention
backend's metadata builder); the metadata's type lives below the model, with the backends that read
it (:class:`~paged_kv.attention.metadata.AttentionMetadata`).

Invariant: row ``rows[b]`` of the table holds request ``b``'s blocks in order for its first
``seq_lens[b]`` positions; entries past them are padding.
"""

from __future__ import annotations

import array
from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from paged_kv.attention.metadata import AttentionMetadata
from paged_kv.kv.slots import slot_mapping
from paged_kv.validate import check_count

PAD = -1
"""The entry of a block-table row past the request's blocks."""


def long_tensor(values: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """A LongTensor of host ints on ``device``, made through ``array('q')``: about three times as
    cheap as ``torch.tensor(list)`` for the few hundred ints of a step's per-request lists."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.long).to(device)


class BlockTables:
    """A persistent ``(num_groups, max_num_reqs, max_blocks_per_req)`` int32 block table on ``device``:
    one row per request in each KV-cache group's table (one group unless the model is hybrid,
    lesson 13; vLLM's ``BlockTables`` keeps one tensor per group alike).

    :meth:`add_row` gives a request a row with its blocks, :meth:`append` adds the blocks it gained
    in a step, :meth:`remove` frees the row; block ids always come one sequence per group, and every
    group's row of a request holds as many blocks (``num_blocks[row]``). The writes of a step are
    gathered on the host and made in one indexing operation by :meth:`commit`.

    Raises:
        ValueError: bad sizes, a request added twice or unknown, no free row, a row that would
            outgrow ``max_blocks_per_req``, or ids for another number of groups or of unequal
            lengths; nothing changes.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_blocks_per_req: int,
        device: str | torch.device = "cpu",
        num_groups: int = 1,
    ) -> None:
        self.max_num_reqs = check_count("max_num_reqs", max_num_reqs, minimum=1)
        self.max_blocks_per_req = check_count("max_blocks_per_req", max_blocks_per_req, minimum=1)
        self.num_groups = check_count("num_groups", num_groups, minimum=1)
        self.table = torch.full(
            (self.num_groups, self.max_num_reqs, self.max_blocks_per_req),
            PAD,
            dtype=torch.int32,
            device=device,
        )
        self.num_blocks = [0] * self.max_num_reqs
        self.rows: dict[Hashable, int] = {}
        self._free_rows = list(range(self.max_num_reqs - 1, -1, -1))
        self._pending: dict[tuple[int, int, int], int] = {}  # (group, row, column) -> entry: last wins
        self._host: dict[int, list[list[int]]] = {}  # each row's entries per group, as written: for sync

    def add_row(self, req_id: Hashable, block_ids: Sequence[Sequence[int]]) -> int:
        """Give ``req_id`` a row holding ``block_ids`` (one sequence per group); return the row. With
        every row taken the table doubles its rows first (a copy, rare: ``max_num_reqs`` is the
        usual bound)."""
        if req_id in self.rows:
            raise ValueError(f"request {req_id!r} has a row already")
        self._check_width(req_id, self._count(req_id, block_ids))
        if not self._free_rows:
            self._free_rows = list(range(2 * self.max_num_reqs - 1, self.max_num_reqs - 1, -1))
            self.num_blocks += [0] * self.max_num_reqs
            self.table = torch.cat([self.table, torch.full_like(self.table, PAD)], dim=1)
            self.max_num_reqs *= 2
        row = self._free_rows.pop()
        self.rows[req_id] = row
        self.num_blocks[row] = 0
        self._write(row, block_ids)
        return row

    def append(self, req_id: Hashable, block_ids: Sequence[Sequence[int]]) -> None:
        """Add the blocks ``req_id`` gained this step (one sequence per group) after its others."""
        row = self.row(req_id)
        count = self._count(req_id, block_ids)
        if count:
            self._check_width(req_id, self.num_blocks[row] + count)
            self._write(row, block_ids)

    def sync(self, req_id: Hashable, block_ids: Sequence[Sequence[int]]) -> None:
        """Make ``req_id``'s row hold ``block_ids``: the new ones appended, or the whole row written
        again when an entry changed (a copy-on-write gave the request a block of its own)."""
        row = self.row(req_id)
        held, count = self.num_blocks[row], self._count(req_id, block_ids)
        entries = self._host.get(row, [[] for _ in range(self.num_groups)])
        if count < held or any(
            e[:held] != list(ids[:held]) for e, ids in zip(entries, block_ids, strict=True)
        ):
            self._check_width(req_id, count)
            self.num_blocks[row] = 0
            self._write(row, block_ids)
            self._write_padding(row, count, held)
        else:
            self.append(req_id, [ids[held:] for ids in block_ids])

    def remove(self, req_id: Hashable) -> None:
        """Drop ``req_id``'s row (an unknown id is a no-op); the row's entries become padding."""
        row = self.rows.pop(req_id, None)
        if row is not None:
            self._write_padding(row, 0, self.num_blocks[row])
            self.num_blocks[row] = 0
            self._free_rows.append(row)

    def row(self, req_id: Hashable) -> int:
        try:
            return self.rows[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} has no row in the block table") from None

    def rows_of(self, req_ids: Sequence[Hashable]) -> list[int]:
        """The rows of ``req_ids``, in order (one C-level pass; a ValueError names the first unknown)."""
        try:
            return list(map(self.rows.__getitem__, req_ids))
        except KeyError as missing:
            raise ValueError(f"request {missing.args[0]!r} has no row in the block table") from None

    def block_ids(self, req_id: Hashable) -> tuple[list[int], ...]:
        """The blocks of ``req_id``'s row, one list per group, from the host's copy (no device read)."""
        row = self.row(req_id)
        entries = self._host.get(row, [[] for _ in range(self.num_groups)])
        return tuple(e[: self.num_blocks[row]] for e in entries)

    def commit(self) -> None:
        """Make the step's pending writes, in one indexing operation (each cell written once: a row
        freed and given again in the same step keeps only its last entry)."""
        if self._pending:
            device = self.table.device
            cells, values = zip(*self._pending.items(), strict=True)
            index = tuple(long_tensor(axis, device) for axis in zip(*cells, strict=True))
            self.table.index_put_(index, long_tensor(values, device).to(torch.int32))
            self._pending = {}

    def _count(self, req_id: Hashable, block_ids: Sequence[Sequence[int]]) -> int:
        """The blocks each group gains: as many in every group, or a ValueError."""
        if len(block_ids) != self.num_groups:
            raise ValueError(
                f"request {req_id!r}: block ids must come one sequence per group ({self.num_groups}), "
                f"got {len(block_ids)}"
            )
        counts = {len(ids) for ids in block_ids}
        if len(counts) != 1:
            raise ValueError(
                f"request {req_id!r}: every group must hold as many blocks, got {sorted(counts)}"
            )
        return counts.pop()

    def _write_padding(self, row: int, first: int, end: int) -> None:
        for group in range(self.num_groups):
            for col in range(first, end):
                self._pending[group, row, col] = PAD
        for entries in self._host.get(row, ()):
            del entries[first:]

    def _write(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        first = self.num_blocks[row]
        host = self._host.setdefault(row, [[] for _ in range(self.num_groups)])
        for group, ids in enumerate(block_ids):
            for col, block_id in enumerate(ids, first):
                self._pending[group, row, col] = block_id
            del host[group][first:]
            host[group].extend(ids)
        self.num_blocks[row] = first + len(block_ids[0])

    def _check_width(self, req_id: Hashable, num_blocks: int) -> None:
        if num_blocks > self.max_blocks_per_req:
            raise ValueError(
                f"request {req_id!r} would hold {num_blocks} blocks, more than max_blocks_per_req "
                f"{self.max_blocks_per_req}"
            )


def host_long(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``values`` as a new LongTensor on the host (a tensor copied, a list through :func:`long_tensor`)."""
    if isinstance(values, torch.Tensor):
        return values.to("cpu", torch.long, copy=True)
    return long_tensor(values)


def prepare_attention(
    tables: BlockTables,
    req_ids: Sequence[Hashable],
    num_computed: Sequence[int] | torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    block_size: int,
    *,
    check: bool = True,
) -> AttentionMetadata:
    """The metadata of a step that runs ``query_lens[b]`` tokens of request ``req_ids[b]``, from
    position ``num_computed[b]`` on, over the blocks of its row in a one-group ``tables``
    (:func:`prepare_attention_by_group` for several groups).

    ``num_computed`` and ``query_lens`` are host ints (lists, or host tensors): one per request. The
    checks and the sizes are computed on the host with a few tensor operations, and the per-token
    tensors made on the device with ``repeat_interleave`` and one gather: no Python loop over
    requests or tokens, no read of the device. ``check=False`` skips the checks of the counts
    against the rows (a query length below 1, too few blocks): for a caller that made them itself,
    as the engine's runner does before it changes anything.

    Raises:
        ValueError: ``tables`` has several groups, the three differ in length, or a request has no
            row; with ``check``, a query length is below 1 or a request has too few blocks for its
            tokens.
    """
    if tables.num_groups != 1:
        raise ValueError(f"tables holds {tables.num_groups} groups: use prepare_attention_by_group")
    return prepare_attention_by_group(tables, req_ids, num_computed, query_lens, block_size, check=check)[0]


def prepare_attention_by_group(
    tables: BlockTables,
    req_ids: Sequence[Hashable],
    num_computed: Sequence[int] | torch.Tensor,
    query_lens: Sequence[int] | torch.Tensor,
    block_size: int,
    *,
    check: bool = True,
) -> tuple[AttentionMetadata, ...]:
    """:func:`prepare_attention` for every KV-cache group of ``tables``: one metadata per group,
    sharing the positions, ``query_start_loc`` and ``seq_lens`` and each with its group's block-table
    rows and slot mapping (vLLM builds one attention metadata per group from one common one)."""
    num_reqs = len(req_ids)
    if not num_reqs == len(num_computed) == len(query_lens):
        raise ValueError(
            f"req_ids, num_computed and query_lens must be as many, got {num_reqs}, "
            f"{len(num_computed)} and {len(query_lens)}"
        )
    tables.commit()
    rows = tables.rows_of(req_ids)
    lens, computed = host_long(query_lens), host_long(num_computed)
    seq_lens = computed + lens
    needed = (seq_lens + (block_size - 1)) // block_size
    if check:
        held = long_tensor(list(map(tables.num_blocks.__getitem__, rows)))
        bad = torch.nonzero((lens < 1) | (needed > held)).flatten().tolist() if num_reqs else []
        if bad:
            b = bad[0]
            raise ValueError(
                f"request {req_ids[b]!r}: {int(lens[b])} new tokens and {int(seq_lens[b])} in all need "
                f"{int(needed[b])} blocks, its row holds {int(held[b])}"
            )
    ends = torch.cumsum(lens, 0)
    query_start_loc_cpu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    total, width, longest = (int(ends[-1]), int(needed.max()), int(lens.max())) if num_reqs else (0, 0, 0)
    device = tables.table.device
    lens, computed, ends = (t.to(device) for t in (lens, computed, ends))
    request = torch.arange(num_reqs, device=device)
    if total == num_reqs:  # a decode step: token b is request b's, at its computed count
        positions = computed
    else:
        request = torch.repeat_interleave(request, lens, output_size=total)
        positions = computed[request] + torch.arange(total, device=device) - (ends - lens)[request]
    block_tables = tables.table.index_select(1, long_tensor(rows, device))[:, :, :width]
    common = AttentionMetadata(
        positions=positions,
        query_start_loc=query_start_loc_cpu.to(device),
        query_start_loc_cpu=query_start_loc_cpu,
        query_lens=lens,
        seq_lens=computed + lens,
        block_table=block_tables[0],
        slot_mapping=slot_mapping(block_tables[0], positions, block_size, rows=request),
        logits_indices=ends - 1,
        num_reqs=num_reqs,
        max_query_len=longest,
    )
    others = (
        replace(
            common, block_table=table, slot_mapping=slot_mapping(table, positions, block_size, rows=request)
        )
        for table in block_tables[1:]
    )
    return (common, *others)

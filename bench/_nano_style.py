"""A scheduler, block manager and decode-input builder in the style of nano-vllm, written for the benches.

nano-vllm (GeeeekExplorer/nano-vllm, ``nanovllm/engine/``) is the smallest engine the course
compares itself with: about 120 lines of block manager and 80 of scheduler, with no checks beyond
asserts. The benches use these classes as the baseline of the package's bookkeeping; they are
written here in that style, not copied, and without prefix caching (the package's engine runs
without it by default), sampling or a model:

* :class:`NanoStyleSequence`: a sequence's token ids, counts and block list (nano-vllm's ``Sequence``);
* :class:`NanoStyleBlockManager`: a list of blocks with ref counts, a deque of free ids and a set of
  used ones; ``can_allocate`` / ``allocate`` a prompt's blocks, ``can_append`` / ``may_append`` the
  block a decode token opens (the token is appended first, so a new block is needed when
  ``len(seq) % block_size == 1``), ``deallocate`` a sequence's blocks;
* :class:`NanoStyleScheduler`: a deque of waiting and one of running sequences; a step prefills the
  waiting sequences that fit (whole prompts) or, when none does, decodes every running one,
  preempting the newest when a block is missing; ``postprocess`` appends the sampled tokens;
* :func:`prepare_decode`: a decode step's inputs built with Python lists, then one tensor each
  (token ids, positions, context lengths, slot mapping, and the block tables padded with -1).

``tests/test_bench.py`` checks that these take the blocks the package takes.
"""

from __future__ import annotations

from collections import deque

import torch


class NanoStyleSequence:
    """A sequence as nano-vllm's scheduler sees it: its token ids, their count (``len``), the tokens
    whose K/V are computed, the tokens scheduled this step and a list of block ids."""

    __slots__ = (
        "block_table",
        "last_token",
        "max_tokens",
        "num_cached_tokens",
        "num_prompt_tokens",
        "num_scheduled_tokens",
        "num_tokens",
        "seq_id",
        "token_ids",
    )

    def __init__(self, num_tokens: int, token_ids: list[int] | None = None, max_tokens: int = 1, seq_id=0):
        self.seq_id = seq_id
        self.token_ids = list(token_ids) if token_ids is not None else [0] * num_tokens
        self.num_tokens = self.num_prompt_tokens = num_tokens
        self.last_token = self.token_ids[-1] if self.token_ids else 0
        self.num_cached_tokens = self.num_scheduled_tokens = 0
        self.max_tokens = max_tokens
        self.block_table: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    def num_blocks(self, block_size: int) -> int:
        return (self.num_tokens + block_size - 1) // block_size

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.last_token = token
        self.num_tokens += 1


class NanoStyleBlock:
    """One block's bookkeeping: its id and how many sequences hold it."""

    __slots__ = ("block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0


class NanoStyleBlockManager:
    """nano-vllm's ``BlockManager`` without prefix caching: blocks with ref counts, a free deque and
    a set of the used ones."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [NanoStyleBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _take(self) -> int:
        block_id = self.free_block_ids.popleft()
        self.blocks[block_id].ref_count = 1
        self.used_block_ids.add(block_id)
        return block_id

    def _give_back(self, block_id: int) -> None:
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: NanoStyleSequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks(self.block_size)

    def allocate(self, seq: NanoStyleSequence) -> None:
        for _ in range(seq.num_blocks(self.block_size)):
            seq.block_table.append(self._take())

    def deallocate(self, seq: NanoStyleSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._give_back(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: NanoStyleSequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoStyleSequence) -> None:
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take())


class NanoStyleScheduler:
    """nano-vllm's ``Scheduler``, whole prompts only (no chunked prefill) and no prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 512,
                 max_num_batched_tokens: int = 16384) -> None:  # fmt: skip
        self.block_manager = NanoStyleBlockManager(num_blocks, block_size)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[NanoStyleSequence] = deque()
        self.running: deque[NanoStyleSequence] = deque()

    def add(self, seq: NanoStyleSequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[NanoStyleSequence], bool]:
        """The step's sequences and whether they prefill."""
        scheduled: list[NanoStyleSequence] = []
        tokens = 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if tokens + len(seq) > self.max_num_batched_tokens or not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = len(seq)
            tokens += len(seq)
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: NanoStyleSequence) -> None:
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[NanoStyleSequence], token_ids: list[int]) -> None:
        for seq, token in zip(seqs, token_ids, strict=True):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            seq.append_token(token)
            if seq.num_tokens - seq.num_prompt_tokens == seq.max_tokens:
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


def prepare_block_tables(seqs: list[NanoStyleSequence]) -> torch.Tensor:
    """The sequences' block lists padded with -1 to the longest, as one int32 tensor."""
    width = max(len(seq.block_table) for seq in seqs)
    return torch.tensor([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs],
                        dtype=torch.int32)  # fmt: skip


def prepare_decode(seqs: list[NanoStyleSequence], block_size: int) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs, one token per sequence (its last): ``(input_ids, positions, context_lens,
    slot_mapping, block_tables)``, built with Python lists and made into one tensor each."""
    input_ids, positions, context_lens, slots = [], [], [], []
    for seq in seqs:
        n = len(seq)
        input_ids.append(seq.last_token)
        positions.append(n - 1)
        context_lens.append(n)
        slots.append(seq.block_table[-1] * block_size + (n - 1) % block_size)
    return (
        torch.tensor(input_ids, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(context_lens, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int32),
        prepare_block_tables(seqs),
    )


def prepare_prefill(seqs: list[NanoStyleSequence], block_size: int) -> tuple[torch.Tensor, ...]:
    """A prefill step's inputs, every scheduled token of every sequence: ``(input_ids, positions,
    slot_mapping)``, lists then tensors (the benches use it to start their sequences)."""
    input_ids, positions, slots = [], [], []
    for seq in seqs:
        start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
    return tuple(torch.tensor(x, dtype=torch.int64) for x in (input_ids, positions, slots))


def null_sample(num_seqs: int) -> list[int]:
    """What the benches' model-free runners "sample": the greedy token of zero logits, 0 for everyone
    (the same tensor work on both sides of a comparison)."""
    return torch.zeros(num_seqs, 1).argmax(dim=-1).tolist()


class NanoStyleRunner:
    """A step with no model: the inputs prepared (:func:`prepare_prefill` or :func:`prepare_decode`), then
    :func:`null_sample`."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.last_inputs: tuple[torch.Tensor, ...] = ()

    def run(self, seqs: list[NanoStyleSequence], is_prefill: bool) -> list[int]:
        prepare = prepare_prefill if is_prefill else prepare_decode
        self.last_inputs = prepare(seqs, self.block_size)
        return null_sample(len(seqs))


def nano_style_step(scheduler: NanoStyleScheduler, runner: NanoStyleRunner) -> None:
    """One step of a nano-vllm-style engine: schedule, run, postprocess."""
    seqs, is_prefill = scheduler.schedule()
    scheduler.postprocess(seqs, runner.run(seqs, is_prefill))

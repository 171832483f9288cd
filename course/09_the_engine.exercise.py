# %% [markdown]
# # Exercise 09 · End to end
#
# In this exercise you write three pieces of lesson 09: the engine's admission rule, vLLM's; the
# bookkeeping of one decode step (which slot each new token's K and V go to, the `slot_mapping` of
# a step whose requests all decode); and a paged KV cache of your own, a class the tiny GPT's
# `generate` uses through the calls of `paged_kv.KVCache`. Each task says what to build and how it
# is checked; the cell after it runs the check and prints a tick, or tells you which call gave which
# wrong answer.
#
# You build on the package's `PagedKVCacheAllocator` (lessons 02 to 04) for the decode step's slots,
# on its `BlockManager` and `KVStorage`, the two halves that allocator joins (lesson 02), for the
# cache, and on `paged_attention` (lesson 05). The finished versions are the admission check of
# `paged_kv.core.kv_cache_manager.KVCacheManager.allocate_slots` (its `num_tokens_to_fit`) and
# `paged_kv.PagedKVCache`; try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/09_the_engine.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
import torch

import paged_kv
from paged_kv import (
    BlockManager,
    KVStorage,
    OutOfBlocksError,
    PagedKVCacheAllocator,
    blocks_for_tokens,
    paged_attention,
)
from paged_kv.checks import check
from paged_kv.model.config import GPTConfig
from paged_kv.model.kv_cache import KVCache

device = paged_kv.default_device()

# %% [markdown]
# ## Task 1 · The admission rule
#
# The engine admits the request at the front of its queue as vLLM does (lesson 09, section 3): when
# the blocks of its **whole prompt** are free. Nothing is kept back for the requests already running:
# vLLM admits into a full pool, and when a running request's next token then finds no free block,
# the newest running request is preempted. (vLLM can also keep a *watermark* of blocks free at
# admission; that is lesson 11's, and off here.)
#
# Write `can_admit(num_free_blocks, prompt_tokens, num_running, block_size)`: whether a request with
# a prompt of `prompt_tokens` tokens is admitted when `num_free_blocks` blocks of `block_size` slots
# are free and `num_running` other requests run. Return a `bool`. (`num_running` is in the signature
# on purpose: decide whether it matters.)
#
# **Checked:** a 9-token prompt in blocks of 4 with 2 and 3 free blocks (no, yes: exactly enough),
# beside 0 or 2 running requests; prompts of 1, 4, 5 and 8 tokens; a prompt beside 7 running
# requests; blocks of 1; that the result is a `bool`; and that your answer is what
# `paged_kv.serving.engine.Engine` does when the request arrives beside requests that are decoding,
# for 22 combinations of free blocks, prompt and running requests on both sides of the rule. A wrong
# answer is compared with headroom kept for the running requests (a block each), the blocks
# rounded down, a strict `<`, tokens compared with blocks, and a slot made for the first output token.


# %%
def can_admit(num_free_blocks: int, prompt_tokens: int, num_running: int, block_size: int) -> bool:
    """Whether the engine admits the request: the blocks of its whole prompt are free."""
    ### BEGIN SOLUTION: the prompt's blocks (rounded up) must be free; the running requests keep no headroom
    return blocks_for_tokens(prompt_tokens, block_size) <= num_free_blocks  # num_running does not count
    ### END SOLUTION


# %%
check("09.can_admit", can_admit)

# %% [markdown]
# ## Task 2 · The slots of a decode step
#
# In a decode step every running sequence gains one token, and each layer must know where to store
# that token's key and value: the step's `slot_mapping`, which the engine's runner computes once for
# every token of a step (lesson 09, section 3) and which you compute here for a step whose requests
# all decode, on lesson 04's allocator. Write `decode_slots(allocator, seq_ids)`: grow each sequence of
# `seq_ids` (distinct ids that `allocator`, a `PagedKVCacheAllocator`, holds) by one token, and return
# a `LongTensor` of shape `(len(seq_ids),)`, on `allocator.device`, with the **slot** of each new
# token: `block_id * block_size + offset`, where `(block_id, offset)` is the physical location of its
# position (lesson 03). A sequence that held `n` tokens holds `n + 1` after the call, and its new
# token is at position `n`.
#
# All or nothing, as in lesson 04: when the batch needs more new blocks than are free, raise
# `OutOfBlocksError(needed, free)` and change nothing. Count first (`allocator.needs_new_block`), then
# grow (`allocator.append_tokens`, which takes a block only at a block boundary).
#
# **Checked:** a sequence with a free slot in its last block, one whose blocks are full (it takes a
# new block), a batch of three, blocks of 1, 8 steps of two sequences; the slots against
# `allocator.slot_mapping` of the new positions; the allocator's state after each call; a batch
# needing 3 new blocks when 1 is free (`OutOfBlocksError`, nothing changed); and the dtype and
# device of the result.


# %%
def decode_slots(allocator: PagedKVCacheAllocator, seq_ids: list) -> torch.Tensor:
    """Grow each sequence by one token (all or nothing); the slots of the new tokens, a LongTensor."""
    ### BEGIN SOLUTION: count the blocks the batch needs and raise OutOfBlocksError(needed, free) when too few are free; then append one token to each sequence and compute the slot of its new position, length - 1
    seq_ids = list(seq_ids)
    needed = sum(allocator.needs_new_block(seq_id) for seq_id in seq_ids)
    if needed > allocator.num_free_blocks:
        raise OutOfBlocksError(
            needed, allocator.num_free_blocks, f"a decode step of {len(seq_ids)} sequences"
        )
    slots = []
    for seq_id in seq_ids:
        allocator.append_tokens(seq_id, 1)
        block_id, offset = allocator.physical_location(seq_id, allocator.sequence_length(seq_id) - 1)
        slots.append(block_id * allocator.block_size + offset)
    return torch.tensor(slots, dtype=torch.long, device=allocator.device)
    ### END SOLUTION


# %%
check("09.decode_slots", decode_slots)

# %% [markdown]
# ## Task 3 · Your own paged cache
#
# `MyPagedCache` is the cache `generate` hands the model (lesson 09, section 1), built the way vLLM
# builds its cache:
# **one block manager for every layer**, and one K/V pool per layer. Its `__init__` is written for
# you:
#
# * `self.manager`, a `BlockManager` (lesson 02): the block tables, the ref counts and the free list,
#   and no tensor. A block id it hands out names the same slots in every layer's pool, so a sequence
#   is allocated, grown and freed **once**, whatever the number of layers;
# * `self.storage`, a `KVStorage` with one pool per layer: layer `l` keeps its K and V in
#   `self.storage.k_caches[l]` and `self.storage.v_caches[l]`, each of shape
#   `(num_blocks, num_kv_heads, block_size, head_dim)` (the tiny GPT has as many K/V heads as query
#   heads; a model with grouped-query attention has fewer, and the cache stores only those);
# * `self.new_slots`, where `append` leaves the slots of the step's new tokens for `attend`.
#
# Write:
#
# * `num_free_blocks` (a property) and `needs_new_block(seq_id)`: the two questions task 1's rule and
#   lesson 04's boundary rule ask; the manager answers;
# * `add_sequence(seq_id, num_tokens)`: give the prompt its blocks (`self.manager.allocate`), once;
# * `write_prompt(layer, seq_id, k, v)`: store the prompt's K and V, `(tokens, num_kv_heads,
#   head_dim)`, in that layer's pool: `self.storage.write(layer, block_ids, k, v)`, with the
#   sequence's block ids as a `LongTensor` on `self.device`;
# * `append(seq_ids)`: grow each sequence by one token, all or nothing, once for all the layers
#   (`self.manager.append_batch(seq_ids)`); keep each new token's **slot** in `self.new_slots`, a
#   `LongTensor` on `self.device` (position `p` of a sequence with block ids `ids` is slot
#   `ids[p // block_size] * block_size + p % block_size`), and return a `LongTensor` on
#   `self.device` with each new token's **position**, which the model embeds: the sequence's length
#   before the append;
# * `attend(layer, seq_ids, q, k, v)`: `q`, `k` and `v` are `(batch, num_heads, head_dim)`, the new
#   token of each sequence. Store `k` and `v` at their slots in this layer's pool
#   (`self.storage.write_slots(layer, self.new_slots, k, v)`), then return `paged_attention(q,
#   k_cache, v_cache, block_tables, lengths)` over this layer's pool, with the batch's block tables
#   padded into one tensor (`self.manager.block_rows(seq_ids)` gives the rows, padded with -1) and
#   the lengths *after* the append, which include the new token. `attend` runs once per layer, after
#   one `append`: it must not grow the sequences again;
# * `free(seq_id)`: give the sequence's blocks back, once.
#
# **Checked**, on a small GPT (2 layers, 2 heads of dimension 8) on `paged_kv.default_device()`:
# the free blocks and the boundary after `add_sequence`; the K and V `write_prompt` stores in each
# layer; the positions `append` returns and the lengths it leaves; the K and V `attend` stores and
# its output, against attention over the same tokens held contiguously, and that attending changes
# no length; `free`; then `generate(model, prompts, 12, cache=MyPagedCache(...))` in a shuffled pool
# of stale blocks, whose tokens and logits (within `1e-4`) must be those of the contiguous cache,
# with every block free at the end. (The engine does not take your cache: its runner prepares each
# step's inputs once and writes every layer's K/V through the package's storage, lesson 09's
# section 3.)


# %%
class MyPagedCache(KVCache):
    """A paged KV cache for the tiny GPT: one block manager for every layer, one K/V pool per layer."""

    def __init__(
        self,
        config: GPTConfig,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.storage = KVStorage(
            config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device
        )
        self.block_size = block_size
        self.device = self.storage.device
        self.new_slots = torch.zeros(0, dtype=torch.long, device=self.device)  # set by append

    @property
    def num_free_blocks(self) -> int:
        """Free blocks: one pool of block ids serves every layer."""
        ### BEGIN SOLUTION: num_free_blocks: ask the manager
        return self.manager.num_free_blocks
        ### END SOLUTION

    def needs_new_block(self, seq_id) -> bool:
        """Whether the sequence's next token needs a new block."""
        ### BEGIN SOLUTION: needs_new_block: ask the manager
        return self.manager.needs_new_block(seq_id)
        ### END SOLUTION

    def add_sequence(self, seq_id, num_tokens: int) -> None:
        ### BEGIN SOLUTION: add_sequence: allocate the prompt's blocks in the manager, once for every layer
        self.manager.allocate(seq_id, num_tokens)
        ### END SOLUTION

    def write_prompt(self, layer: int, seq_id, k: torch.Tensor, v: torch.Tensor) -> None:
        ### BEGIN SOLUTION: write_prompt: self.storage.write(layer, block_ids, k, v) with the sequence's block ids as a LongTensor on self.device
        block_ids = torch.tensor(self.manager.get_block_table(seq_id).block_ids, device=self.device)
        self.storage.write(layer, block_ids, k, v)
        ### END SOLUTION

    def append(self, seq_ids) -> torch.Tensor:
        ### BEGIN SOLUTION: append: note the lengths before the append (the new positions), manager.append_batch(seq_ids) once, then the slot of each new position into self.new_slots
        positions = [self.manager.sequence_length(seq_id) for seq_id in seq_ids]
        self.manager.append_batch(seq_ids)
        size = self.block_size
        slots = [
            self.manager.get_block_table(seq_id).block_ids[p // size] * size + p % size
            for seq_id, p in zip(seq_ids, positions, strict=True)
        ]
        self.new_slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        return torch.tensor(positions, dtype=torch.long, device=self.device)
        ### END SOLUTION

    def attend(self, layer: int, seq_ids, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION: attend: storage.write_slots(layer, self.new_slots, k, v), then paged_attention over this layer's pool with the padded block_rows and the lengths after the append
        self.storage.write_slots(layer, self.new_slots, k, v)
        tables = torch.tensor(self.manager.block_rows(seq_ids), device=self.device)
        lengths = torch.tensor([self.manager.sequence_length(s) for s in seq_ids], device=self.device)
        k_cache, v_cache = self.storage.k_caches[layer], self.storage.v_caches[layer]
        return paged_attention(q, k_cache, v_cache, tables, lengths)
        ### END SOLUTION

    def free(self, seq_id) -> None:
        ### BEGIN SOLUTION: free: give the blocks back to the manager, once
        self.manager.free(seq_id)
        ### END SOLUTION


# %%
check("09.paged_cache", MyPagedCache)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, this generates 20 tokens for three prompts with your cache, in a pool
# of 32 blocks of 4 (they need 29 at their longest), and compares them with the contiguous cache's. Then it serves lesson 09's three
# requests with the engine and asks your `can_admit` about the step where `c` arrives, beside two
# running requests: the engine's answer and yours must agree. Try a smaller pool for your cache, or
# other arrival steps for `c`.

# %%
from paged_kv.model.generation import generate
from paged_kv.model.tiny_gpt import TinyGPT, encode
from paged_kv.serving.engine import Engine, EngineRequest

torch.set_num_threads(1)  # the tiny model's operations are too small to share between threads
model = TinyGPT(GPTConfig(), seed=0).to(device).eval()
prompts = [encode(t) for t in ["Hi", "The KV cache", "Paged attention stores K and V in blocks"]]
mine = generate(model, prompts, 20, cache=MyPagedCache(GPTConfig(), 32, 4, device))
contiguous = generate(model, prompts, 20, cache="contiguous")
print("same tokens as the contiguous cache:", mine.tokens == contiguous.tokens)

tiny = [
    EngineRequest("a", encode("Once upon"), max_tokens=6),
    EngineRequest("b", encode("KV"), max_tokens=3),
    EngineRequest("c", encode("Hello"), max_tokens=5, arrival_step=1),
]
run = Engine(model, num_blocks=7, block_size=4).run(tiny)  # the null block and 6 to give out
free_at_step_1 = 6 - run.used_blocks[0]  # a and b took their prompts' blocks at step 0
yours = can_admit(free_at_step_1, len(tiny[2].prompt), 2, 4)
engine = "c" in dict(run.scheduled_tokens[1])
print(f"c at step 1, {free_at_step_1} free blocks: can_admit says {yours}, the engine admitted it: {engine}")

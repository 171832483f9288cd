# %% [markdown]
# # Lesson 03 · Logical to physical
#
# A sequence sees its tokens as positions 0, 1, 2, … in order. The cache stores them in blocks
# scattered over a pool. Every time the engine stores a new token's key and value, and every time
# attention reads them back, it has to turn a position into a place in the pool. This lesson follows
# that translation step by step on the real K/V tensors, then writes it the way an engine must: one
# tensor expression for all tokens at once, with no Python loop.
#
# **By the end of this lesson you can**
#
# 1. compute, for any position of a sequence, its logical block, its offset, its physical block and
#    its flat slot;
# 2. show where one token's key vector sits in `k_cache`, of shape
#    `(num_blocks, num_heads, block_size, head_dim)`;
# 3. write a sequence's K/V into scattered blocks and gather them back equal to the contiguous
#    tensors;
# 4. compute the slots of many tokens with one tensor expression, and explain why a per-token Python
#    loop has no place on the hot path, the code the engine runs at every step;
# 5. read the padded block-table tensor that a batched kernel receives.

# %%
import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import PagedKVCacheAllocator
from paged_kv.pictures.plots import plot_positions_in_pool
from paged_kv.timing import compare_times, how_fast

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. A sequence in scattered blocks
#
# A fresh pool hands out blocks 0, 1, 2, … in order, which would make every block table look
# contiguous and hide the point of this lesson. A busy server is never in that state: requests come
# and go, and the free list holds the blocks of finished requests, in the order they were released.
#
# So we first keep the pool busy. Eight short requests, `r0` to `r7`, take one block each and fill
# a pool of 8 blocks of 4 slots. Then `r5`, `r2` and `r7` finish, in that order, and their blocks
# go back to the free list. A new sequence `s` with an 11-token prompt arrives and needs
# `ceil(11 / 4) = 3` blocks.

# %%
BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 4, 2, 4
cache = PagedKVCacheAllocator(
    num_blocks=8, block_size=BLOCK_SIZE, num_heads=NUM_HEADS, head_dim=HEAD_DIM, device=device
)
for i in range(8):
    cache.allocate_for_sequence(f"r{i}", 3)  # one block each, 3 of its 4 slots used
for finished in ("r5", "r2", "r7"):
    cache.free_sequence(finished)
print("free list:", list(cache.snapshot().free_block_ids))

table = cache.allocate_for_sequence("s", 11)
print("s:", table)
print("k_cache shape:", tuple(cache.k_cache.shape))

# %% [markdown]
# The block table of `s` is `[5, 2, 7]`: its logical block 0 (positions 0 to 3) lives in physical
# block 5, logical block 1 (positions 4 to 7) in block 2, and logical block 2 (positions 8 to 10) in
# block 7. This is a page table: the sequence's addresses are contiguous, the memory behind them is
# not.
#
# The picture shows both views. On the left, the positions of `s` in its logical blocks. On the
# right, the pool as the cache tensor lays it out: one row per physical block (the first axis of
# `k_cache`), one column per offset inside the block (its third axis). Grey slots hold the tokens of
# other requests; the hatched slot is reserved by `s` but still empty. The small number in each
# slot's corner is its **flat slot** number, `block × 4 + offset`, which section 4 explains.

# %%
plot_positions_in_pool(cache.snapshot(), "s")
plt.show()

# %% [markdown]
# ## 2. The translation in four steps
#
# To find position `p` of a sequence in the pool:
#
# 1. `logical_block_idx = p // block_size`: which of the sequence's blocks holds it;
# 2. `offset = p % block_size`: where inside that block;
# 3. `physical_block_id = block_table[logical_block_idx]`: the page-table look-up;
# 4. its key is `k_cache[physical_block_id, :, offset, :]`, one vector of `head_dim` numbers per
#    head, and its value sits at the same place in `v_cache`.
#
# Steps 1 and 2 are integer division and remainder, so no floating point is involved: `6 / 4` would
# give `1.5`, which cannot index a list or a tensor.
#
# **Predict, then run.** Position 6 of `s`: which logical block, which offset, which physical block?

# %%
p = 6
logical_block_idx = p // BLOCK_SIZE
offset = p % BLOCK_SIZE
physical_block_id = table.block_ids[logical_block_idx]
print(f"position {p}: logical block {logical_block_idx}, offset {offset}, physical block {physical_block_id}")
print("cache.physical_location('s', 6) ->", cache.physical_location("s", 6))

# %% [markdown]
# Logical block 1, offset 2, physical block 2: in the picture, the orange 6 sits in row `block 2`,
# column 2. `cache.physical_location` returns the same pair. Here is every position of `s`; each
# block change in the table happens exactly where `p` crosses a multiple of 4.

# %%
print("position  logical  offset  physical block")
for p in range(table.num_tokens):
    logical, offset = p // BLOCK_SIZE, p % BLOCK_SIZE
    block = table.block_ids[logical]
    assert cache.physical_location("s", p) == (block, offset)
    print(f"{p:>8} {logical:>8} {offset:>7} {block:>15}")

# %% [markdown]
# ## 3. Writing and gathering K/V on the tensors
#
# Now real data. We make K and V for the 11 tokens of `s` as contiguous tensors of shape
# `(num_tokens, num_heads, head_dim)`, the shape a model layer produces, with a value that names its
# place: element `(t, h, d)` of K is `100·t + 10·h + d`, so 613 is token 6, head 1, dimension 3.
# V is the negative of K. Any value that lands in the wrong place will show.
#
# `cache.write_kv("s", k, v)` scatters them into the pool through the block table, and
# `cache.read_kv("s")` gathers them back in position order.

# %%
t = torch.arange(table.num_tokens, device=device).view(-1, 1, 1)
h = torch.arange(NUM_HEADS, device=device).view(1, -1, 1)
d = torch.arange(HEAD_DIM, device=device).view(1, 1, -1)
k = (100 * t + 10 * h + d).float()
v = -k
print("k shape:", tuple(k.shape))

cache.write_kv("s", k, v)
k_back, v_back = cache.read_kv("s")
print("read_kv gives back K:", torch.equal(k_back, k))
print("read_kv gives back V:", torch.equal(v_back, v))
print("blocks holding data: ", cache.k_cache.flatten(1).ne(0).any(dim=1).nonzero().flatten().tolist())

# %% [markdown]
# The round trip is exact, and only the three blocks of `s` hold data; the other requests never wrote
# any. Token 6 should sit at block 2, offset 2. Indexing `k_cache[2, :, 2, :]` picks that slot for
# every head at once:

# %%
token_6 = cache.k_cache[2, :, 2, :]
print("k_cache[2, :, 2, :] shape:", tuple(token_6.shape))
print("k_cache[2, :, 2, :] =", token_6.long().tolist())
print("equal to k[6]:", torch.equal(token_6, k[6]))

# %% [markdown]
# 600 to 603 for head 0, 610 to 613 for head 1: token 6. The `:` in the middle matters. The axes of
# the cache are block, head, offset, dimension, so `k_cache[2, 2]` would pick *head* 2 of block 2,
# not offset 2; with 2 heads, that is an index error, and with more heads it would silently be the
# wrong data.
#
# `write_kv` and `read_kv` do all tokens at once. Steps 1 to 3 run on a tensor of positions, giving a
# tensor of physical blocks and a tensor of offsets, and step 4 uses both as indices:
# `k_cache[block_ids, :, offsets]`. When two index tensors surround a slice, PyTorch pairs them
# element by element, `(block_ids[i], offsets[i])`, and puts that axis first, so the result has shape
# `(num_tokens, num_heads, head_dim)`: exactly the contiguous layout. Assigning to it scatters;
# reading it gathers.

# %%
positions = torch.arange(table.num_tokens, device=device)
block_table = torch.tensor(table.block_ids, device=device)
block_ids = block_table[positions // BLOCK_SIZE]
offsets = positions % BLOCK_SIZE
print("block_ids:", block_ids.tolist())
print("offsets:  ", offsets.tolist())
gathered = cache.k_cache[block_ids, :, offsets]
print("k_cache[block_ids, :, offsets] shape:", tuple(gathered.shape))
print("equal to k:", torch.equal(gathered, k))

# %% [markdown]
# ## 4. The flat slot
#
# A pair `(block, offset)` is two numbers per token. Kernels prefer one: number every token slot of
# the pool, block by block, so that slot `block × block_size + offset` is offset `offset` of block
# `block`. These are the small numbers in the corners of the picture. vLLM calls the list of slots
# for the tokens it is about to store the **slot mapping**, and its kernel that writes new K/V into
# the cache receives exactly that: one integer per token.
#
# **Predict, then run.** `s` holds 11 tokens in blocks `[5, 2, 7]` of 4 slots. Write down its 11
# slots before you run the cell.

# %%
slots = cache.slot_mapping("s")
print("slots of s:", slots.tolist())
print("same as block_ids * 4 + offsets:", torch.equal(slots, block_ids * BLOCK_SIZE + offsets))
print("back to blocks: ", (slots // BLOCK_SIZE).tolist())
print("back to offsets:", (slots % BLOCK_SIZE).tolist())

# %% [markdown]
# Blocks 5, 2 and 7 start at slots 20, 8 and 28, and the slots run on from there. A slot carries
# the same information as the pair: `slot // block_size` and `slot % block_size` give back the block
# and the offset.
#
# The numbering treats the pool as one list of `num_blocks × block_size` token slots. In our layout
# the heads axis sits between block and offset, so that list is not a view of `k_cache`; moving the
# offset axis next to the block axis and merging the two builds it (as a copy). Indexing it with the
# slots gives K back once more:

# %%
flat_k = cache.k_cache.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)
print("pool as a list of slots:", tuple(flat_k.shape))
print("flat_k[slots] equal to k:", torch.equal(flat_k[slots], k))

# %% [markdown]
# ## 5. No Python loop on the hot path
#
# The translation is one line of arithmetic per token, so a loop looks harmless:


# %%
def slot_mapping_loop(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """One token at a time, in plain Python."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def slot_mapping_vectorised(
    block_table: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """All tokens at once, with tensor indexing."""
    return block_table[positions // block_size] * block_size + positions % block_size


print(slot_mapping_loop(table.block_ids, list(range(11)), BLOCK_SIZE))
print(slot_mapping_vectorised(block_table, positions, BLOCK_SIZE).tolist())

# %% [markdown]
# Same answer. The difference is the work around the arithmetic. An engine computes slots at every
# step for every token it processes: the whole prompt of each new request (thousands of tokens) and
# one token for each of the hundreds of sequences that are decoding. The loop runs Python bytecode
# per token, on the CPU, while the GPU waits for the result. A loop written over tensors is worse
# still: each element it reads with `int()` or `.item()` is a copy from the GPU that waits for it,
# and each small tensor operation inside the loop is a kernel launch of several microseconds. The
# vectorised version is five tensor operations whatever the number of tokens, and each one is a
# single kernel over all of them in parallel.
#
# Here are the two on a long sequence: 65,536 tokens in 4,096 blocks of 16, the blocks picked at
# random from a pool of 8,192, so the table is thoroughly scattered.

# %%
LONG_BLOCK_SIZE, LONG_TOKENS = 16, 65536
generator = torch.Generator().manual_seed(0)
long_table = torch.randperm(8192, generator=generator)[: LONG_TOKENS // LONG_BLOCK_SIZE].to(device)
long_positions = torch.arange(LONG_TOKENS, device=device)

by_loop = slot_mapping_loop(long_table.tolist(), long_positions.tolist(), LONG_BLOCK_SIZE)
by_tensor = slot_mapping_vectorised(long_table, long_positions, LONG_BLOCK_SIZE)
print("first block ids:", long_table[:6].tolist())
print("equal:", by_tensor.tolist() == by_loop)
print("result dtype:", by_tensor.dtype, "| length:", len(by_tensor))

# %% [markdown]
# How much faster is one expression? The answer depends on the machine and on what else it is doing,
# so the cell times the two the way `paged_kv.timing`, the course's one timer, always does: torch on
# one thread, each version run once before the clock starts, then the two taking turns, 9 rounds of 5
# calls each (so a burst of load from another program slows both in the same round), and the median
# of the rounds' ratios. The loop is timed with what it needs around it, converting the tensors to
# lists and the result back to a tensor, and both are timed on the first 4,096 tokens and on all
# 65,536. The course's tests do not compare this cell's output; run it a few times.

# %%
# NBVAL_IGNORE_OUTPUT
for n in (4096, LONG_TOKENS):
    some = long_positions[:n]
    timings = compare_times(
        {
            "loop": lambda some=some: torch.tensor(
                slot_mapping_loop(long_table.tolist(), some.tolist(), LONG_BLOCK_SIZE), device=device
            ),
            "tensor": lambda some=some: slot_mapping_vectorised(long_table, some, LONG_BLOCK_SIZE),
        },
        repeats=9,
        warmup=1,
        number=5,
        threads=1,
        device=device,
    )
    print(f"{n:>6} tokens: the tensor expression is {how_fast(timings.ratio('tensor', 'loop'))} the loop")

# %% [markdown]
# The cell printed two factors for this run of it. On the 2-core CPU this course was written on, six
# runs on a quiet machine gave 13 to 20 times at 4,096 tokens and 28 to 29 times at 65,536; six with
# two other processes computing on both cores (`bench/lesson_ratios.py --busy 2`) gave 15 to 17 and
# 24 to 32; other runs on the same kind of machine printed up to 49 at 4,096 and 36 at 65,536 (39 at
# 4,096 with other work beside it). So read your factors as one sample: with other work beside it a
# factor can land above or below these ranges, and on another machine anywhere; what every run
# showed is the expression many times faster than the loop. At 4,096 tokens the expression takes a
# few tens of microseconds on the quiet machine, much of it a fixed price per operation, which other
# programs easily disturb: hence the wide range. At 65,536 both sides work in proportion to the
# tokens (quiet, about 200 ns of Python per token for the loop against under 10 ns for the
# expression's five operations), and the factor varies less. On a GPU the loop would
# also wait for the copies of the table and the positions from the device, and its result would have
# to be copied back before a kernel could use it.

# %% [markdown]
# ## 6. A batch: the padded block-table tensor
#
# A kernel serves a whole batch of sequences at once, and a kernel takes tensors, not a dict of
# Python lists. The engine therefore packs the block tables of the batch into one integer tensor of
# shape `(batch, max_blocks)`, one row per sequence, padding the shorter rows on the right. The
# kernel also receives each sequence's length, and it reads only the entries that cover real
# positions, so the padding is never used.
#
# **Predict, then run.** What shape does the tensor for the batch `r0`, `s`, `r3` have, and what is
# in the row of `r0`?

# %%
batch = ["r0", "s", "r3"]
tables_tensor = cache.block_tables_tensor(batch)  # padded with -1
lengths = torch.tensor([cache.sequence_length(seq) for seq in batch], device=device)
print("shape:", tuple(tables_tensor.shape), "| dtype:", tables_tensor.dtype)
for seq, row in zip(batch, tables_tensor.tolist(), strict=True):
    print(f"{seq:>2}: {row}")
print("lengths:", lengths.tolist())

# %% [markdown]
# Shape `(3, 3)`: three sequences, and `s` holds the most blocks, 3. `r0` holds one block, so its row
# is `[0, -1, -1]`.
#
# The slot mapping of the whole batch is still one expression. List every token of the batch as a
# pair (row in the batch, position in its sequence); look up `tables_tensor[row, position // 4]`
# instead of `block_table[position // 4]`. `torch.repeat_interleave` builds the row of each token,
# and the positions restart at 0 for every sequence.

# %%
rows_of_tokens = torch.repeat_interleave(torch.arange(len(batch), device=device), lengths)
starts = torch.cumsum(lengths, dim=0) - lengths
positions_in_seq = torch.arange(int(lengths.sum()), device=device) - starts[rows_of_tokens]
entries = tables_tensor[rows_of_tokens, positions_in_seq // BLOCK_SIZE].long()  # one table entry per token
batch_slots = entries * BLOCK_SIZE + positions_in_seq % BLOCK_SIZE
print("row of each token:  ", rows_of_tokens.tolist())
print("position in its seq:", positions_in_seq.tolist())
print("slots:", batch_slots.tolist())
print("padding read:", bool((entries < 0).any()))
per_sequence = torch.cat([cache.slot_mapping(seq) for seq in batch])
print("same as one slot_mapping per sequence:", torch.equal(batch_slots, per_sequence))

# %% [markdown]
# Seventeen tokens of three sequences, one expression, no loop over tokens, and no `-1` read: every
# position is below its sequence's length, so every entry looked up is a real block. This pair of
# tensors, block tables and lengths, is what the paged attention kernel of lesson 05 reads K and V
# through.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. The translation runs in the worker, once per step for every token the
# step computes: positions become slots, and the new K/V are written at those slots.
#
# * `vllm/v1/worker/gpu/input_batch.py`: in Model Runner V2, the worker's default runner in 0.33.0,
#   `prepare_pos_seq_lens` launches a Triton kernel that sets each scheduled token's position, `pos`,
#   to its request's `num_computed_tokens` plus its index among the step's new tokens, and each
#   request's `seq_lens`.
# * `vllm/v1/worker/gpu/block_table.py`: `BlockTables.compute_slot_mappings` launches
#   `_compute_slot_mappings_kernel`, which loads `block_numbers` from the request's row at the
#   position's block index and stores `slot_ids`, the block number times `kv_block_size` plus the
#   offset, one row per KV cache group: section 5's vectorised slot mapping, for the whole step. The
#   V1 runner, still in the tree, does the same in `vllm/v1/worker/block_table.py`
#   (`BlockTable.compute_slot_mapping`).
# * `vllm/v1/attention/backends/utils.py`: `PAD_SLOT_ID`, -1, is the slot of a padding token, one the
#   step computes for a fixed-size batch but that holds no token.
# * `vllm/v1/attention/backends/flash_attn.py`: `FlashAttentionImpl.do_kv_cache_update` writes each
#   layer's new keys and values into `key_cache` and `value_cache` at `slot_mapping`, with
#   `reshape_and_cache_flash`, whose Python entry is in `vllm/_custom_ops.py` (the kernel is CUDA).
# * `vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`: `reshape_and_cache_kernel_flash`, the
#   same write in Triton, turns the slot back into the pair, `block_idx = slot_idx // block_size` and
#   `block_offset = slot_idx % block_size`, and skips a negative slot (padding).
# * `vllm/v1/attention/backend.py`: `CommonAttentionMetadata` carries the batch's
#   `block_table_tensor` (section 6's padded tensor) and `slot_mapping` to every attention backend.
#
# What the course leaves out or does differently: the course computes slots and writes K/V with
# PyTorch indexing, one sequence or one batch at a time; vLLM does both in kernels over the whole
# step, and its slot kernel also spreads a block over several GPUs when the context is split between
# them (decode context parallelism). Its table rows are not padded with -1: the lengths say where a
# row ends, and whatever the entries past it hold does not matter.

# %% [markdown]
# ## Recap
#
# * Position `p` lives in logical block `p // block_size`, at offset `p % block_size`; the block table
#   turns the logical block into a physical one, and the key is `k_cache[block, :, offset, :]` (the
#   heads axis sits between block and offset).
# * On `s`, 11 tokens in blocks `[5, 2, 7]` of 4: position 6 is block 2, offset 2; its slots are
#   20 to 23, 8 to 11 and 28 to 30.
# * The flat slot `block × block_size + offset` (vLLM's slot mapping) is one integer per token, and
#   `//` and `%` by `block_size` give the pair back.
# * `write_kv` scatters and `read_kv` gathers with `k_cache[block_ids, :, offsets]`; the round trip
#   gives back exactly the contiguous K and V.
# * Slots are computed for thousands of tokens per step: one tensor expression, never a Python loop
#   over tokens. A batch's block tables travel as one `(batch, max_blocks)` tensor padded with `-1`,
#   with the lengths beside it.
#
# **Next, lesson 04:** sequences grow one token per decode step, and we work out exactly when a new
# block is needed. The exercise for this lesson, `exercises/03_logical_to_physical.ipynb`, has you
# write the translation, the vectorised slot mapping and the K/V scatter and gather yourself.

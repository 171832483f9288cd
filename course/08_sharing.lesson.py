# %% [markdown]
# # Lesson 08 · Sharing
#
# So far every block had one owner. Yet requests often hold the same tokens: parallel sampling asks
# for several answers to one prompt, beam search follows several continuations of one prefix, and a
# chat application puts the same *system prompt* before every user's message. Identical prefixes
# have identical K/V, so storing them once is pure gain, as an operating system's `fork()` shares
# pages and copies one only when either side writes to it. Lesson 02's ref counts make it safe.
#
# **By the end of this lesson you can**
#
# 1. fork a sequence so that the copy shares every block, and compute what `n` samples of one prompt
#    hold with and without sharing (`usage().shared_blocks`);
# 2. explain copy-on-write: which block a forked sequence copies, when, why full blocks stay shared,
#    and why freeing either sequence leaves the other intact;
# 3. compute a prompt's chained block hashes, and explain why a block's identity includes its whole
#    prefix, why a cache hit compares tokens, and why the last prompt token never comes from the cache;
# 4. trace prefix caching step by step: cached blocks kept on the free list, taken from its middle
#    in O(1), evicted least recently freed first, and blocks filled during decode cached too;
# 5. read how the prefix-cache hit rate of a workload with shared system prompts grows with the
#    memory budget, and why preemptions blur it.

# %%
from unittest import mock

import matplotlib.pyplot as plt
import torch
from IPython.display import HTML

import paged_kv
from paged_kv import PagedKVCacheAllocator
from paged_kv.core.block_allocator import FreeKVCacheBlockQueue
from paged_kv.core.prefix_cache import chain_hashes, full_blocks
from paged_kv.pictures.plots import PALETTE
from paged_kv.pictures.pool import render_allocator
from paged_kv.pictures.widgets import AllocationPlayer
from paged_kv.simulation.sharing import ideal_cached_tokens, serve, system_prompt_requests

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Why share: several samples of one prompt
#
# With **parallel sampling** a client asks for `n` different answers to one prompt (the `n` of the
# OpenAI API, or of vLLM's `SamplingParams`). The prompt's K/V are computed once, and `n` sequences
# decode side by side from it: why store the prompt `n` times?
#
# `fork(parent_id, child_id)` starts a new sequence whose block table is a copy of the parent's,
# pointing at the **same physical blocks**, each of which gains a reference. No K/V moves, as Unix
# `fork()` copies the page table, not the pages.
#
# The running example, in blocks of 4: `A` holds a 10-token prompt in blocks 0, 1 and 2 (the last
# half full), and `B` forks from it.

# %%
BLOCK_SIZE, NUM_HEADS, HEAD_DIM = 4, 2, 4
cache = PagedKVCacheAllocator(
    num_blocks=8, block_size=BLOCK_SIZE, num_heads=NUM_HEADS, head_dim=HEAD_DIM, device=device
)
prompt_k = torch.randn(10, NUM_HEADS, HEAD_DIM, device=device)
prompt_v = torch.randn(10, NUM_HEADS, HEAD_DIM, device=device)
cache.allocate_for_sequence("A", 10)
cache.write_kv("A", prompt_k, prompt_v)


def ref_counts(cache: PagedKVCacheAllocator) -> list[int]:
    """The ref count of every block of the pool, block 0 first."""
    return [cache.ref_count(block_id) for block_id in range(cache.num_blocks)]


print("A:", cache.get_block_table("A"))
print("fork('A', 'B') ->", cache.fork("A", "B"))
print("ref counts:", ref_counts(cache))
print("free list: ", list(cache.snapshot().free_block_ids))
k_b, v_b = cache.read_kv("B")
print("B reads A's K and V:", torch.equal(k_b, prompt_k), torch.equal(v_b, prompt_v))
usage = cache.usage()
print("used blocks:", usage.used_blocks, "| shared blocks:", usage.shared_blocks)

# %% [markdown]
# `B` holds `A`'s three blocks, each with a ref count of 2, and the free list did not move. `usage()`
# counts a shared block once: 3 used, all 3 shared. In the picture a shared block has a dashed
# frame, its ref count (`×2`) under it, and its first holder's label with how many more (`A+1`).

# %%
HTML(render_allocator(cache.snapshot(), caption="after fork('A', 'B'): blocks 0, 1 and 2 have two holders"))

# %% [markdown]
# **Predict, then run.** A 1,000-token prompt takes 63 blocks of 16 (62 full, and 8 tokens in the
# last). Four samples of it each generate 200 tokens. How many blocks do the four hold at the end if
# each sample keeps its own copy of the prompt, and how many if they fork from one prefill?


# %%
def blocks_of_samples(n: int, share: bool, prompt: int = 1000, output: int = 200) -> paged_kv.BlockUsage:
    """The pool's usage after n samples of one prompt have each generated `output` tokens."""
    pool = PagedKVCacheAllocator(num_blocks=1024, block_size=16, num_heads=1, head_dim=1)
    pool.allocate_for_sequence(0, prompt)
    for sample in range(1, n):
        if share:
            pool.fork(0, sample)
        else:
            pool.allocate_for_sequence(sample, prompt)
    for _ in range(output):
        for sample in range(n):
            pool.append_tokens(sample, 1)
    return pool.usage()


copies, forked = blocks_of_samples(4, share=False), blocks_of_samples(4, share=True)
print("4 samples, each with its own prompt:", copies.used_blocks, "blocks")
print("4 samples forked from one prompt:   ", forked.used_blocks, "blocks,", forked.shared_blocks, "shared")
saved = copies.used_blocks - forked.used_blocks
print(f"saved: {saved} blocks, {saved / copies.used_blocks:.0%}")

# %% [markdown]
# Without sharing, each sample ends with 1,200 tokens in 75 blocks: 300 blocks. Forked, the samples
# hold 114: the prompt's 62 full blocks once, and 13 blocks of their own each, from logical block 62,
# the prompt's half-full last block, where they start to differ (section 2 shows how). That saves
# 186 blocks, 62 %: each extra sample costs 75 blocks when it stores the prompt, 13 when it shares
# it. **Beam search** shares even more: its candidates are forks of forks, and a pruned candidate
# simply frees its sequence.

# %% [markdown]
# ## 2. Copy-on-write
#
# Sharing is safe only while nobody writes into a shared block. Full blocks are never written again,
# but `A`'s last block, block 2, holds 2 tokens: `A`'s 11th token goes to its slot 2, and so does
# `B`'s, each overwriting the other's K/V.
#
# The fix is the operating system's **copy-on-write**. The first time a sequence is about to write
# into a block that another sequence also holds, it gets a fresh block with a copy of the shared
# block's K and V in its table; the shared block loses one reference and stays with the others. The
# copy is lazy, on the next `append_tokens` (or `write_kv`) into the shared block, since many forks
# never write there. `last_copies` lists the `(shared block, copy)` pairs of the last append or
# write.
#
# **Predict, then run.** `B` generates its 11th token. Which blocks does `B` hold afterwards, and
# which of them are still shared with `A`?

# %%
print("B needs a free block for token 11:", cache.needs_new_block("B"))
print("append_tokens('B', 1) ->", cache.append_tokens("B", 1), "| last_copies:", cache.last_copies)
print("A:", cache.get_block_mapping("A"), "| B:", cache.get_block_mapping("B"))
print("ref counts:", ref_counts(cache))
new_k = torch.randn(1, NUM_HEADS, HEAD_DIM, device=device)
new_v = torch.randn(1, NUM_HEADS, HEAD_DIM, device=device)
cache.write_kv("B", new_k, new_v, start_position=10)
k_b, v_b = cache.read_kv("B")
print("B's first 10 tokens are A's:", torch.equal(k_b[:10], prompt_k), torch.equal(v_b[:10], prompt_v))
print("B's 11th token is its own:  ", torch.equal(k_b[10:], new_k), torch.equal(v_b[10:], new_v))
k_a, _ = cache.read_kv("A")
print("A still holds 10 tokens, unchanged:", k_a.shape[0], torch.equal(k_a, prompt_k))

# %% [markdown]
# Only block 2 was copied: `B` took block 3, the head of the free list, with block 2's two tokens,
# and wrote its 11th token into it. Blocks 0 and 1 are full, never written again, so they stay
# shared, while block 2 now has one holder, `A`. The copy is one indexing operation per tensor,
# `k_cache[[3]] = k_cache[[2]]`, whatever the number of blocks copied.

# %%
caption = "B's 11th token: block 2 copied to block 3 for B"
HTML(render_allocator(cache.snapshot(), caption=caption, highlight=[2, 3]))

# %% [markdown]
# `A`'s 11th token now goes in place: block 2 is `A`'s alone.

# %%
print("append_tokens('A', 1) ->", cache.append_tokens("A", 1), "| last_copies:", cache.last_copies)
print("A:", cache.get_block_mapping("A"), "| ref counts:", ref_counts(cache))

# %% [markdown]
# A block is copied only when a token lands in a block that is shared *and* not yet full: after a
# fork, only the parent's last block. (Had `A` held two full blocks, `B`'s next token would have
# taken a fresh block by lesson 04's boundary rule, with no copy.)
#
# Freeing is as simple: `free_sequence` drops one reference from each of the sequence's blocks, and
# a block goes back to the free list when its last holder lets go. `A` finishes first:

# %%
print("free_sequence('A') ->", cache.free_sequence("A"))
print("ref counts:", ref_counts(cache))
print("free list: ", list(cache.snapshot().free_block_ids))
k_b, v_b = cache.read_kv("B")
print("B still reads its 11 tokens:", torch.equal(k_b, torch.cat([prompt_k, new_k])))

# %% [markdown]
# Only block 2 came back; blocks 0 and 1 lost a holder, and `B` still reads them. Freeing `B` first
# is as safe: the ref counts carry it all.
#
# The animation replays a fork with divergent appends, as in a beam search: `A` has a 6-token
# prompt, `B` and `C` fork from it, the three take turns generating 4 tokens each, then `A`
# finishes. `B`'s first token copies block 1, so does `C`'s, and by the time `A` writes, block 1 is
# its own.

# %%
recorded = PagedKVCacheAllocator(num_blocks=10, block_size=BLOCK_SIZE, num_heads=1, head_dim=1, record=True)
recorded.allocate_for_sequence("A", 6)
recorded.fork("A", "B")
recorded.fork("A", "C")
for _ in range(4):
    for seq in ("B", "C", "A"):
        recorded.append_tokens(seq, 1)
recorded.free_sequence("A")
print(len(recorded.trace), "frames;", "the copies:")
for frame in recorded.trace:
    if frame.event == "copy_on_write":
        print(" ", frame.caption)
AllocationPlayer(recorded.trace)

# %% [markdown]
# vLLM v1 instead turns a request for `n` samples into `n` child requests, which share the prompt's
# full blocks through prefix caching (next section); each computes its own partly full last block.

# %% [markdown]
# ## 3. Prefix caching
#
# Forking shares a prefix within one request. **Prefix caching** shares prefixes *between
# requests*: a new prompt that starts with tokens an earlier prompt computed reuses those blocks.
# Chat requests start with the same system prompt, and each turn resends the turns before it: the
# prefill of the shared part is skipped, which saves compute, shortens the wait for the first token
# and keeps one copy in memory. But what identifies the K/V of a block?
#
# ### A chained hash
#
# The K/V of a token depend on the token *and every token before it*: attention mixes the earlier
# tokens into each layer's hidden state. So two blocks with the same four tokens hold the same K/V
# only if everything before them is the same too: a block's identity is its tokens *and* its whole
# prefix. Rather than hash the whole prefix for every block (O(n²) for an `n`-token prompt), each
# full block's hash covers its parent's hash and its own tokens, a chain, as in vLLM:
#
# $$h_0 = \text{hash}(\text{root}, \text{tokens}_0), \qquad h_i = \text{hash}(h_{i-1}, \text{tokens}_i).$$
#
# Only **full** blocks are hashed and cached; a partly full block is hashed once decode fills it.
# So a hit is whole blocks: a prompt that shares 30 tokens with a cached one, in blocks of 16, finds
# 16 (vLLM likewise, below).
#
# `full_blocks(token_ids, block_size)` cuts a prompt into its full blocks and `chain_hashes` chains
# them. Two prompts whose second blocks hold the same tokens, `9 9 9 9`, after different first
# blocks:

# %%
first = [1, 2, 3, 4, 9, 9, 9, 9, 7]
second = [5, 6, 7, 8, 9, 9, 9, 9, 7]
print("full blocks of the first: ", full_blocks(first, 4), "(the last token, 7, is in none)")
print("full blocks of the second:", full_blocks(second, 4))
h_first, h_second = chain_hashes(full_blocks(first, 4)), chain_hashes(full_blocks(second, 4))
tokens_first, tokens_second = full_blocks(first, 4)[1], full_blocks(second, 4)[1]
print("block 1: same tokens:", tokens_first == tokens_second)
print("block 1: same chained hash:", h_first[1] == h_second[1])
print("block 1: same hash of its tokens alone:", hash(tokens_first) == hash(tokens_second))

# %% [markdown]
# A hash of the tokens alone would hand the second prompt's block 1 the K/V computed after
# `1 2 3 4`: wrong data, silently. The chained hash tells the two blocks apart.
#
# ### A hit is verified
#
# A hash is a hint, not a proof: two different blocks can hash alike. vLLM hashes blocks with
# SHA-256 by default (`prefix_caching_hash_algo` also offers `sha256_cbor`, `xxhash` and
# `xxhash_cbor`), for which a collision is practically impossible, and trusts the hash, which also
# covers *extra keys* beside the tokens: the LoRA adapter, multimodal inputs, prompt embeddings and
# a per-request `cache_salt` (below), so that two adapters or two tenants never share a block. This
# package hashes tokens only, with Python's 64-bit `hash`, easy to collide on purpose; so each cached
# block keeps its token ids and the cached block it follows, and a hit must match both. Here is a
# cache whose hash function is as bad as it gets: every block hashes to 0.

# %%
with mock.patch("paged_kv.core.prefix_cache.block_hash", lambda parent_hash, token_ids: 0):
    bad = PagedKVCacheAllocator(8, 4, 1, 1, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    other = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    bad.allocate_for_sequence("p", 9, prompt)
    bad.allocate_for_sequence("q", 9, other)
    bad.allocate_for_sequence("p again", 9, prompt)
    for seq in bad.seq_ids:
        print(
            f"{seq:<8} blocks {bad.get_block_mapping(seq)}, {bad.num_cached_tokens(seq)} tokens from the cache"
        )

# %% [markdown]
# `q`'s first block has the same hash as `p`'s but other tokens: a miss. `p again` finds its first
# block, but its second block's hash names an entry whose parent is not the block just found: a miss
# too. With a hash that bad the cache serves almost nothing, but never wrong K/V.
#
# ### The last prompt token is always computed
#
# The first new token is sampled from the prefill's output at the last prompt token, so that one
# runs through the model: at most `n - 1` tokens of an `n`-token prompt come from the cache (as
# in vLLM), and a prompt of exactly `k` full blocks reuses `k - 1`.
#
# ### Step by step
#
# The whole mechanism on a pool of 10 blocks of 4, in the style of vLLM's design document on prefix
# caching. After each step the cell prints every block table, its tokens from the cache, and the
# free list from head to tail (`*`: a block that still holds a cached prefix). Three rules:
#
# * a finished sequence's blocks go back to the free list **with their K/V and hash**, cached until
#   `allocate` hands them out for new data (evicted); it takes the head, the block freed longest
#   ago, so eviction is least recently used first;
# * a freed block with **no** cached prefix (a partly full last block) goes to the *head*, reused
#   before any cached block is evicted, as in vLLM v1;
# * a sequence frees its blocks in **reverse** order, so a prefix is evicted from its end.

# %%
pool = PagedKVCacheAllocator(num_blocks=10, block_size=4, num_heads=1, head_dim=1, enable_prefix_caching=True)


def show(step: str) -> None:
    """Print the step, every block table with its cached tokens, and the free list (* = cached)."""
    print(step)
    for seq in pool.seq_ids:
        print(
            f"    {seq}: {pool.get_block_mapping(seq)}, {pool.num_cached_tokens(seq)} tokens from the cache"
        )
    cached = pool.cached_blocks()
    free = [f"{b}*" if b in cached else str(b) for b in pool.snapshot().free_block_ids]
    print("    free list:", " ".join(free) or "(empty)")


r0 = list(range(100, 115))  # 15 tokens: 3 full blocks and 3 tokens
r1 = [*r0[:10], 200, 201, 202, 203]  # 14 tokens, the first 10 as r0's
r2 = [*r0[:12], *range(300, 313)]  # 25 tokens, the first 12 as r0's
r3 = list(range(400, 409))  # 9 new tokens
pool.allocate_for_sequence("r0", len(r0), r0)
show("1. r0 arrives with 15 tokens")
pool.allocate_for_sequence("r1", len(r1), r1)
show("2. r1 arrives with 14 tokens, the first 10 as r0's")
pool.free_sequence("r0")
show("3. r0 finishes")
pool.free_sequence("r1")
show("4. r1 finishes")
pool.allocate_for_sequence("r2", len(r2), r2)
show("5. r2 arrives with 25 tokens, the first 12 as r0's")
pool.allocate_for_sequence("r3", len(r3), r3)
show("6. r3 arrives with 9 new tokens")
print("cached blocks:", sorted(pool.cached_blocks()))
print(pool.prefix_cache_stats)

# %% [markdown]
# What happened:
#
# 1. `r0` takes blocks 0 to 3 and caches its 3 full blocks; block 3, partly full, is private.
# 2. `r1`'s first two blocks hash like `r0`'s: 8 tokens from the cache, blocks 0 and 1 gain a
#    second holder. Its third block matches `r0`'s in only 2 of 4 tokens: a miss.
# 3. `r0` frees its blocks in reverse order: block 3, with no hash, to the head; block 2, cached, to
#    the tail. `r1` still holds blocks 0 and 1.
# 4. `r1` finishes: its partly full block 5 goes to the head, blocks 4, 1 and 0 to the tail.
# 5. `r2` finds `r0`'s 3 cached blocks, taken *out of the free list*, from its middle and end.
# 6. `r3` shares nothing: it takes the head, 8 and 9 (no hash), then 4, evicting its prefix.
#
# The counters are in tokens, as vLLM's are: 4 prompts, 63 prompt tokens looked up (`queries`), 20
# found (`hits`, 8 for `r1` and 12 for `r2`).
#
# **Predict, then run.** `r2` still holds blocks 0, 1 and 2. A new prompt arrives that is exactly
# `r0`'s first 12 tokens, three full blocks that are all in the cache. How many of its tokens come
# from the cache? (The pool has no free block left, so `r3` finishes first.)

# %%
pool.free_sequence("r3")
pool.allocate_for_sequence("r4", 12, r0[:12])
show("7. r3 finishes; r4 arrives with r0's first 12 tokens")

# %% [markdown]
# 8, not 12: the last-token rule keeps the third block out of reach, so `r4` computes tokens 8 to 11
# into a fresh block of its own (a block table only grows: neither this package nor vLLM swaps block
# 2 into `r4`'s table).
#
# ### Taking a block out of the middle of the free list
#
# Step 5 took blocks from the middle and the end of the free list. With lesson 02's `deque` that is
# `free_list.remove(block_id)`, O(n) in the free blocks: a GPU with 100,000 of them would pay that
# on every cache hit. So `BlockAllocator` keeps its free list as a **doubly linked list** threaded
# through two arrays indexed by block id, `next` and `prev`, in a ring through one sentinel: a block
# id *is* its node, and taking it out relinks its two neighbours, `next[prev[b]] = next[b]` and
# `prev[next[b]] = prev[b]`, O(1) wherever it sits (vLLM's `FreeKVCacheBlockQueue` links block
# objects instead).

# %%
queue = FreeKVCacheBlockQueue(8)
print("queue:             ", list(queue))
queue.remove(5)
queue.remove(2)
print("remove 5, remove 2:", list(queue))
print("popleft ->", queue.popleft(), "then:", list(queue))
queue.append(5)
print("append 5:          ", list(queue))
print("backwards:         ", list(reversed(queue)))

# %% [markdown]
# The other blocks keep their order, so the least recently freed block is still at the head. `bench/bench_prefix_cache.py` times a take from the middle plus a free; on this course's
# 2-core machine it measured 1.0 to 1.6 µs quiet (1.5 to 1.9 µs with two busy processes) on 1,000
# free blocks and the same on 100,000, while `deque.remove` grew 124 to 143 times from one to the
# other.

# %% [markdown]
# ### Blocks filled during decode are cached too
#
# A chat resends the whole conversation at every turn: the previous prompt, the model's answer and
# the user's new message. Were only prompt blocks cached, the next turn would recompute the answer. vLLM v1 caches the answer too: a block that fills during decode gets its chained hash and
# joins the cache.
#
# For that the cache must know the tokens it holds. `append_tokens(seq_id, n, token_ids=...)` takes
# the new tokens' ids (an engine has them: a decode step's input tokens). Each sequence keeps its
# place in the chain; a block that fills is hashed after its parent and cached, and an append
# without ids ends the chain. Invariant: a cached block's hash is the chained hash of exactly the
# tokens it holds, from the sequence's first block on.
#
# Turn 1 of a chat: a 10-token prompt (an 8-token system prompt and a question) and an 8-token
# answer, of which the cache holds 7 (the last sampled token is never fed).

# %%
chat = PagedKVCacheAllocator(num_blocks=16, block_size=4, num_heads=1, head_dim=1, enable_prefix_caching=True)
prompt_1 = [*range(100, 108), 1, 2]  # 2 full blocks and 2 tokens
answer = [50, 51, 52, 53, 54, 55, 56, 57]  # what the model generated
chat.allocate_for_sequence("turn 1", len(prompt_1), prompt_1)
for token in answer[:-1]:  # one decode step per token
    chat.append_tokens("turn 1", 1, token_ids=[token])
print("turn 1 holds", chat.sequence_length("turn 1"), "tokens in blocks", chat.get_block_mapping("turn 1"))
for block, tokens in chat.cached_blocks().items():
    print(f"    block {block} cached, holding {tokens}")
held = [*prompt_1, *answer[:-1]]
hashes = {chat.manager.allocator.prefix_cache.entry(b).block_hash for b in chat.cached_blocks()}
print("the hashes a prompt of the same 17 tokens gets:", hashes == set(chain_hashes(full_blocks(held, 4))))
chat.free_sequence("turn 1")

# %% [markdown]
# Blocks 2 and 3 filled during decode, block 2 with the question's last two tokens and the answer's
# first two. Their hashes are those a prompt of the same tokens would get.
#
# **Predict, then run.** Turn 2 resends the conversation and asks something new: 10 + 8 + 3 = 21
# tokens. How many come from the cache? And how many would, had the decode steps not passed their
# token ids?

# %%
prompt_2 = [*prompt_1, *answer, 3, 4, 5]
chat.allocate_for_sequence("turn 2", len(prompt_2), prompt_2)
print("turn 2:", len(prompt_2), "tokens,", chat.num_cached_tokens("turn 2"), "from the cache")

prompts_only = PagedKVCacheAllocator(16, 4, 1, 1, enable_prefix_caching=True)
prompts_only.allocate_for_sequence("turn 1", len(prompt_1), prompt_1)
prompts_only.append_tokens("turn 1", len(answer) - 1)  # the same steps, without their ids
prompts_only.free_sequence("turn 1")
prompts_only.allocate_for_sequence("turn 2", len(prompt_2), prompt_2)
print("with prompt blocks only:", prompts_only.num_cached_tokens("turn 2"), "from the cache")

# %% [markdown]
# 16 against 8: with decode blocks cached, turn 2 computes only its last 5 tokens; without, the
# question's end and the whole answer again. `bench/bench_multiturn.py` serves 16 conversations of 4
# turns through the package's engine: caching decode blocks computes 1.78 times fewer prefill tokens
# (a count of tokens, not a time).

# %% [markdown]
# ## 4. How much a prefix cache saves, and how much memory it needs
#
# A cached prefix survives on the free list only until new data needs its blocks, so the memory
# budget decides how long an unused prefix stays cached. `paged_kv.simulation.sharing.serve` runs the
# package's scheduler with a stand-in for the model that only counts tokens, on 200 requests queued
# at step 0, each a system prompt, a user prompt and an answer of ShareGPT-shaped lengths (random
# tokens, so user prompts share nothing), at most 32 at once. Prompts are looked up on admission,
# and the blocks a request fills stay cached when it finishes; a decode that finds no free block
# preempts the newest request (lessons 07 and 11), queued again and looked up anew with the tokens
# it had generated. One system prompt stands for one application,
# 16 for several sharing a server. The lengths are ShareGPT's divided by 8 (a 32-token system prompt,
# blocks of 4) to keep the sweep small; at full size (256 tokens, blocks of 16, nine budgets, four
# series) it draws the same picture, and took about 35 s of processor time on this course's quiet
# 2-core machine, over a minute with busy processes beside it.
#
# The ideal, `ideal_cached_tokens`, is a cache that never forgets in a run that never preempts:
# every request but the first with each system prompt finds its 8 full blocks.

# %%
BUDGETS = [64, 128, 256, 512, 1024]  # blocks of 4
SYSTEM_PROMPTS = [1, 16]
sweep, ideal = {}, {}
for count in SYSTEM_PROMPTS:
    requests = system_prompt_requests(200, system_tokens=32, num_system_prompts=count, seed=0, scale=8)
    ideal[count] = ideal_cached_tokens(requests, block_size=4)
    sweep[count] = [serve(requests, budget, block_size=4, max_running=32) for budget in BUDGETS]
# Without caching, the system prompts' tokens do not matter, only the lengths, the same for every count.
uncached = [serve(requests, budget, block_size=4, max_running=32, caching=False) for budget in BUDGETS]
prompt_tokens = sum(len(request.token_ids) for request in requests)
print(f"200 requests, {prompt_tokens:,} prompt tokens; hit rate (% of the prompt tokens looked up) by budget")
print(f"{'system prompts':<16}" + "".join(f"{budget:>7}" for budget in BUDGETS) + "   ideal")
for count in SYSTEM_PROMPTS:
    rates = "".join(f"{result.hit_rate:>7.1%}" for result in sweep[count])
    print(f"{count:<16}{rates}{ideal[count] / prompt_tokens:>8.1%}")
for count in SYSTEM_PROMPTS:
    preempted = "".join(f"{result.preemptions:>7}" for result in sweep[count])
    looked_up = "".join(f"{result.prompt_tokens:>7,}" for result in sweep[count])
    print(f"{'preemptions':<16}{preempted}  ({count} system prompt{'s' if count > 1 else ''})")
    print(f"{'tokens looked up':<16}{looked_up}")

# %%
COLOURS = {1: PALETTE[0], 16: PALETTE[5]}
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
for count in SYSTEM_PROMPTS:
    label = f"{count} system prompt{'s' if count > 1 else ''}"
    left.plot(BUDGETS, [100 * r.hit_rate for r in sweep[count]], "o-", color=COLOURS[count], label=label)
    left.axhline(100 * ideal[count] / prompt_tokens, color=COLOURS[count], ls=":", lw=1)
    computed_k = [r.computed_tokens / 1000 for r in sweep[count]]
    right.plot(BUDGETS, computed_k, "o-", color=COLOURS[count], label=label)
uncached_k = [r.computed_tokens / 1000 for r in uncached]
right.plot(BUDGETS, uncached_k, "--", color="#444444", lw=1, label="without prefix caching")
left.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
left.set_title("hits (dotted: the ideal)", loc="left", fontsize=11)
right.set_ylabel("prefill tokens computed (thousands)")
right.set_title("what the model still computes", loc="left", fontsize=11)
left.set_ylim(0, 70)
right.set_ylim(0, max(r.computed_tokens for r in uncached) / 1000 * 1.1)
for ax in (left, right):
    ax.set_xscale("log", base=2)
    ax.set_xticks(BUDGETS, [str(b) for b in BUDGETS], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("memory budget (blocks of 4)")
    ax.spines[["top", "right"]].set_visible(False)
left.legend(frameon=False, fontsize=8, loc="lower right")
right.legend(frameon=False, fontsize=8, loc="upper right")
fig.tight_layout()
plt.show()

# %% [markdown]
# At 1,024 blocks nothing is preempted. One system prompt hits its ideal, 61.5 % (the model computes
# 3,986 of the 10,354 prompt tokens, 2.6 times fewer than without caching); 16 stop a point short,
# 55.9 %: the answers' freed blocks queue on the free list with the system prompts, so an idle
# system prompt can reach the head and be evicted. Smaller pools evict sooner and preempt far more
# (256 times at 64 blocks, one system prompt), as no block is kept back for running requests
# (lesson 07). A readmitted request is looked up again and finds much of its prompt and generated
# tokens: its freed blocks kept their hashes. In small pools these second lookups are most of the
# tokens looked up (17,230 of 27,584 at 64 blocks) and lift one system prompt *above* its ideal, to
# 65.8 %, though its first lookups alone find exactly the ideal. So compare the prefill work, on the
# right: without caching, 19,433 tokens at 64 blocks (preemption recomputes) against 10,354 with no
# preemption; with it, 9,424 (one system prompt) and 13,735 (16). A prefix cache lives in the memory
# the running requests do not need *right now*.
#
# `serve` also returns the allocator's counters, in tokens. For 16 system prompts at 512 blocks:

# %%
result = sweep[16][BUDGETS.index(512)]
print(result.stats)
print(f"first lookups: {result.stats.hits:,} of {result.stats.queries:,} tokens, {result.stats.hit_rate:.1%}")
print(f"every lookup: {result.cached_tokens:,} of {result.prompt_tokens:,} tokens, {result.hit_rate:.1%}")
print(f"prefill tokens computed: {result.computed_tokens:,}, {result.cached_tokens:,} saved")

# %% [markdown]
# `requests`, `queries` and `hits` count the first lookup of each of the 200 requests, in tokens;
# `hit_rate` is `hits / queries`. The 89 readmitted requests' lookups count apart, in the
# `preempted_` fields, as in vLLM, which logs and exports the first lookups' hit rate (lesson 15).
# The prefill work saved counts both.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Sharing by ref count, the chained block hashes and the cache of full
# blocks on the free list live in vLLM v1's KV cache manager, `vllm/v1/core/`.
#
# * `vllm/v1/core/block_pool.py`: `BlockPool` holds every `KVCacheBlock`, the free queue and the
#   map from hash to cached block (`BlockHashToBlockMap`): this lesson's `CachingBlockAllocator`.
#   `BlockPool.get_cached_block` looks a hash up and compares no tokens; `BlockPool.cache_full_blocks`
#   caches a request's newly full blocks, in prefill or decode (`PrefixCache.extend` here);
#   `BlockPool.free_blocks` puts blocks without a hash at the head of the free queue, cached ones at
#   the tail.
# * `vllm/v1/core/kv_cache_utils.py`: `hash_block_tokens` hashes a block from its parent's hash, its
#   token ids and its extra keys (`block_hash` here), with `NONE_HASH` as the first block's parent
#   (`ROOT_HASH` here); `generate_block_hash_extra_keys` adds the LoRA, multimodal, prompt-embedding
#   and `cache_salt` keys; `get_request_block_hasher` chains a request's hashes as its tokens grow
#   (the package's `chain_hashes`).
# * `vllm/v1/request.py`: `Request.append_output_token_ids` calls `update_block_hashes` as output
#   tokens arrive, so a block that fills during decode gets its hash, and `allocate_slots`
#   (`vllm/v1/core/kv_cache_manager.py`) caches it: the package's `append_tokens(seq_id, n, token_ids=...)`.
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.get_computed_blocks` finds a new request's
#   longest cached prefix, at most `request.num_tokens - 1` tokens (`allocate_prompt` here), and
#   `KVCacheManager.free` frees a request's blocks in reverse order.
# * `vllm/v1/metrics/stats.py`: `PrefixCacheStats` counts `requests`, `queries` and `hits`, and
#   preempted requests' lookups apart (`preempted_queries`, `preempted_hits`).
# * `vllm/config/cache.py`: `CacheConfig.enable_prefix_caching` is `True` by default,
#   `CacheConfig.prefix_caching_hash_algo` `"sha256"`. Hits finer than a block: with one KV cache
#   group, as here, hits are whole blocks, and `prefix_match_unit` may only equal `block_size`
#   (`resolve_kv_cache_block_sizes`, `vllm/v1/core/kv_cache_utils.py`); only a hybrid model (lesson
#   13) whose Mamba layers keep aligned states hits inside a block, every `prefix_match_unit` tokens
#   (`partial_hash_hits_enabled`).
# * `vllm/entrypoints/openai/chat_completion/protocol.py`: a client sends `cache_salt` as an extra
#   body field of its OpenAI request (`ChatCompletionRequest.cache_salt`, and `CompletionRequest` in
#   `vllm/entrypoints/openai/completion/protocol.py`); it reaches the engine as
#   `EngineCoreRequest.cache_salt` (`vllm/v1/engine/__init__.py`), and
#   `generate_block_hash_extra_keys` (`vllm/v1/core/kv_cache_utils.py`) puts it in the first block's
#   extra keys only: every later hash chains from that one, so no block matches across salts. That
#   closes a timing side channel, a tenant sending a guessed prompt and telling from a fast first
#   token (a hit) that someone else sent that prefix.
#
# What the course leaves out or does differently: it hashes tokens only, with Python's `hash`, and
# so compares each hit's tokens and parent, where vLLM trusts SHA-256 and adds extra keys (so no
# salt); it keeps one block per hash, where vLLM also caches a second equal block.

# %% [markdown]
# ## Recap
#
# * `fork` shares every block of a sequence through ref counts, with no copy: 4 samples of a
#   1,000-token prompt (blocks of 16, 200 tokens each) hold 114 blocks instead of 300.
# * Copy-on-write: the first token written into a shared, partly full block copies it for the
#   writer (block 2 to 3 for `B`); full shared blocks are never copied, and freeing only drops
#   references.
# * Prefix caching names a full block by a chained hash of its parent's hash and its tokens, since a
#   block's K/V depend on its whole prefix; a hit is whole blocks and compares tokens and parent, so
#   a collision can cost a hit but never share wrong K/V; at most `n - 1` prompt tokens are cached.
# * Freed cached blocks stay on the free list, evicted least recently freed first, taken from its
#   middle in O(1) on a hit; blocks filled during decode are cached too (a chat's next turn: 16 of
#   21 tokens cached instead of 8).
# * With one system prompt, 200 ShareGPT-shaped requests find the ideal 61.5 % of their prompt tokens
#   cached when nothing is preempted; with 16, 55.9 %, and 32.4 % in the smallest pool. Readmitted
#   requests' second lookups lift the hit rate: compare prefill work.
#
# **Next, lesson 09:** the engine: a tiny GPT served with continuous batching on the paged cache,
# and the step an engine runs. The exercise for this lesson, `exercises/08_sharing.ipynb`, has you
# write fork, copy-on-write and the lookup of a cached prefix yourself.

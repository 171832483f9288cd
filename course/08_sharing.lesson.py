# %% [markdown]
# # Lesson 08 · Sharing
#
# So far every block had exactly one owner. Yet requests often hold the same tokens: parallel
# sampling asks for several answers to one prompt, beam search follows several continuations of one
# prefix, and a chat application puts the same *system prompt* in front of every user's message.
# Identical prefixes have identical K/V, so storing them once is pure gain. An operating system does
# the same after `fork()`: parent and child share their pages and copy one only when either writes
# to it. A paged KV cache can do it with its blocks, and lesson 02's ref counts make it safe.
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
# decode side by side from it: there is no reason to store the prompt `n` times.
#
# `fork(parent_id, child_id)` starts a new sequence whose block table is a copy of the parent's,
# pointing at the **same physical blocks**, each of which gains a reference. No K/V moves: Unix
# `fork()` too gives the child a copy of the parent's page table, not of its pages.
#
# Here is the running example of this lesson, in blocks of 4: sequence `A` holds a 10-token prompt
# in blocks 0, 1 and 2 (the last one half full), and `B` forks from it.

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
# `B` holds the same three blocks as `A`, each with a ref count of 2, and the free list did not
# move. `usage()` counts a shared block once: 3 blocks are used, and all 3 are shared. In the picture
# a shared block has a dashed frame, its ref count (`×2`) under it, and the label of its first holder
# followed by how many more (`A+1`).

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
# hold 114: the prompt's 62 full blocks once, shared by all four, and 13 blocks of their own each,
# from logical block 62, the prompt's half-full last block, where they start to differ (section 2
# shows how). That saves 186 blocks, 62 % of the memory, and the longer the prompt compared with
# the answers, the more it saves: each extra sample costs 75 blocks when it stores the prompt, only
# 13 when it shares it. **Beam search** shares even more: its candidates are forks of forks, sharing
# a common prefix that grows as decoding goes on, and a pruned candidate simply frees its sequence.

# %% [markdown]
# ## 2. Copy-on-write
#
# Sharing is only safe while nobody writes into a shared block. Full blocks are never written again,
# but `A`'s last block, block 2, holds 2 tokens and has 2 free slots. `A`'s 11th token goes to slot 2
# of block 2, and so does `B`'s 11th token: the two sequences would overwrite each other's K/V.
#
# The fix is the operating system's **copy-on-write**. The first time a sequence is about to write
# into a block that another sequence also holds, it gets a fresh block holding a copy of the shared
# block's K and V, in that block's place in its table; the shared block loses one reference and stays
# with the other holders. The copy is lazy, on the next `append_tokens` (or `write_kv`) into the
# shared block, since many forks never write there. `last_copies` lists the `(shared block, copy)`
# pairs of the last append or write.
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
# and wrote its 11th token into it. Blocks 0 and 1 are full, no token will ever be written there
# again, so they stay shared (ref count 2), while block 2 now has one holder, `A`. The copy is one
# indexing operation per tensor on the cache's device, `k_cache[[3]] = k_cache[[2]]`, whatever the
# number of blocks copied.

# %%
HTML(
    render_allocator(
        cache.snapshot(), caption="B's 11th token: block 2 copied to block 3 for B", highlight=[2, 3]
    )
)

# %% [markdown]
# `A`'s 11th token is now no problem: block 2 is `A`'s alone, and the token goes in place.

# %%
print("append_tokens('A', 1) ->", cache.append_tokens("A", 1), "| last_copies:", cache.last_copies)
print("A:", cache.get_block_mapping("A"), "| ref counts:", ref_counts(cache))

# %% [markdown]
# A block is copied only when a token lands in a block that is shared *and* not yet full: after a
# fork, only ever the parent's last block. (Had `A` held two full blocks, `B`'s next token would
# have taken a fresh block by lesson 04's boundary rule, with no copy.)
#
# Freeing is just as simple: `free_sequence` drops one reference from each block of the sequence,
# and a block goes back to the free list only when its last holder lets go. `A` finishes first:

# %%
print("free_sequence('A') ->", cache.free_sequence("A"))
print("ref counts:", ref_counts(cache))
print("free list: ", list(cache.snapshot().free_block_ids))
k_b, v_b = cache.read_kv("B")
print("B still reads its 11 tokens:", torch.equal(k_b, torch.cat([prompt_k, new_k])))

# %% [markdown]
# Only block 2 came back; blocks 0 and 1 lost a holder but `B` still reads them. Freeing `B` first
# would have been just as safe. Nothing in the allocator needs to know who forked from whom: the
# ref counts carry it all.
#
# The animation replays a fork with divergent appends, as in a beam search with two candidates:
# `A` has a 6-token prompt, `B` and `C` fork from it, and the three take turns generating 4 tokens
# each; then `A` finishes. Watch the copies: `B`'s first token copies block 1, so does `C`'s, and
# by the time `A` writes, block 1 is its own.

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
# vLLM v1 turns a request for `n` samples into `n` child requests instead, which share the prompt's
# full blocks through prefix caching, the next section; each computes its own partly full last block.

# %% [markdown]
# ## 3. Prefix caching
#
# Forking shares a prefix that one request computed for its own samples. **Prefix caching** shares
# prefixes *between requests*: a new prompt that starts with tokens an earlier prompt computed reuses
# those blocks. Every request of a chat application starts with the same system prompt, every turn
# of a conversation resends the turns before it: the prefill of the shared part is skipped, which
# saves compute, shortens the wait for the first token and keeps one copy in memory. But to reuse a
# block, the allocator must recognise it. What identifies the K/V of a block?
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
# A hash of the tokens alone would find the second prompt's block 1 in the cache and hand it the
# K/V computed after `1 2 3 4`: wrong data, silently. The chained hash tells the two blocks apart.
#
# ### A hit is verified
#
# A hash is a hint, not a proof: two different blocks can hash alike. vLLM hashes blocks with
# SHA-256 by default (its `prefix_caching_hash_algo` setting also offers `sha256_cbor`, `xxhash` and
# `xxhash_cbor`), for which a collision is practically impossible, and trusts the hash. Its hash
# also covers *extra keys* beside the tokens: the LoRA adapter, multimodal inputs, prompt embeddings
# and a per-request `cache_salt`, so that two adapters or two tenants never share a block. This
# package hashes tokens only, with Python's 64-bit `hash`, easy to collide on purpose; so it checks:
# each cached block keeps its token ids and the cached block it follows, and a hit must match both.
# Here is a cache whose hash function is as bad as it gets: every block hashes to 0.

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
# The prefill's output at the last prompt token is what the first new token is sampled from, so at
# least that token must run through the model: at most `n - 1` tokens of an `n`-token prompt come
# from the cache (vLLM has the same rule), and a prompt of exactly `k` full blocks reuses `k - 1`.
#
# ### Step by step
#
# Here is the whole mechanism on a pool of 10 blocks of 4, in the style of vLLM's design document on
# prefix caching. After each step the cell prints every block table, how many prompt tokens came
# from the cache, and the free list from head to tail (`*`: a block that still holds a cached
# prefix). Three rules to watch:
#
# * a finished sequence's blocks go back to the free list **with their K/V and hash**, cached until
#   `allocate` hands them out for new data (only then is the hash forgotten, evicted); `allocate`
#   takes the head, the block freed longest ago, so eviction is least recently used first;
# * a freed block with **no** cached prefix (a partly full last block) goes to the *head* instead,
#   to be reused before any cached block is evicted, as in vLLM v1's free queue;
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
# 2. `r1`'s first two blocks hash like `r0`'s: 8 tokens come from the cache, and blocks 0 and 1 gain
#    a second holder. Its third block matches `r0`'s in only 2 of 4 tokens: a miss.
# 3. `r0` finishes and frees its blocks in reverse order: block 3, with no hash, goes to the head;
#    block 2, cached, to the tail. `r1` still holds blocks 0 and 1.
# 4. `r1` finishes: its partly full block 5 goes to the head, blocks 4, 1 and 0 to the tail.
# 5. `r2` finds `r0`'s 3 cached blocks, taken *out of the free list* from its middle and its end.
# 6. `r3` shares nothing: it takes the head, 8 and 9 (no hash), then 4, whose cached prefix is
#    evicted.
#
# The counters are in tokens, as vLLM's metrics are: 4 prompts, 63 prompt tokens looked up
# (`queries`), 20 of them found (`hits`, 8 for `r1` and 12 for `r2`).
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
# into a fresh block of its own, which stays private (a block table only grows: neither this package
# nor vLLM swaps block 2 into `r4`'s table).
#
# ### Taking a block out of the middle of the free list
#
# Step 5 took blocks from the middle and the end of the free list. With the `deque` of lesson 02
# that is `free_list.remove(block_id)`, O(n) in the free blocks: a GPU with 100,000 of them would
# pay that on every cache hit. `BlockAllocator` therefore keeps its free list as a **doubly linked
# list** threaded through two arrays indexed by block id, `next` and `prev`, in a ring through one
# sentinel: a block id *is* its own node, and taking it out relinks its two neighbours,
# `next[prev[b]] = next[b]` and `prev[next[b]] = prev[b]`, O(1) wherever it sits. vLLM's
# `FreeKVCacheBlockQueue` is the same list built from block objects (`prev_free_block`,
# `next_free_block`) between a fake head and a fake tail.

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
# The order of the other blocks never changes, so the least recently freed block is still at the
# head. `bench/bench_prefix_cache.py` times a take from the middle plus a free: 1.0 to 1.6 µs on a
# pool of 1,000 free blocks and the same on 100,000 on a quiet 2-core machine (1.5 to 1.9 µs with two
# busy processes beside it), while `deque.remove` grows 124 to 143 times from one pool to the other.

# %% [markdown]
# ### Blocks filled during decode are cached too
#
# A chat resends the whole conversation at every turn: the next prompt is the previous prompt, the
# model's answer and the user's new message. If only prompt blocks were cached, the next turn would
# compute the whole answer again. vLLM v1 caches the answer too: a block that fills during decode
# gets its chained hash, exactly as a prompt block would, and joins the cache.
#
# For that the cache must know the tokens it holds. `append_tokens(seq_id, n, token_ids=...)` takes
# the ids of the new tokens (an engine passes them: a decode step's input tokens are the tokens it
# appends). Each sequence keeps its place in the chain; when its filling block fills, it is hashed
# after its parent and cached, and an append without ids ends the chain. Invariant: a cached block's
# hash is the chained hash of exactly the tokens it holds, from the sequence's first block on.
#
# Turn 1 of a chat: a 10-token prompt (an 8-token system prompt and a question), and an 8-token
# answer, of which the cache holds the first 7 (the last sampled token is never fed).

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
# Blocks 2 and 3 filled during decode, block 2 with the question's last two tokens and the first two
# of the answer. Their hashes are those a prompt of the same tokens would get, so a prompt that
# starts with these 17 tokens finds them.
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
# 16 against 8: with decode blocks cached, turn 2 computes only its last 5 tokens; without, it
# computes the question's end and the whole answer again. `bench/bench_multiturn.py` serves 16
# conversations of 4 turns each through the package's engine: caching the blocks filled during
# decode computes 1.78 times fewer prefill tokens, with the same generated tokens.

# %% [markdown]
# ## 4. How much a prefix cache saves, and how much memory it needs
#
# A cached prefix survives on the free list only until new data needs its blocks, so the memory
# budget decides how long a prefix nobody is using stays cached. `paged_kv.simulation.sharing.serve`
# runs the package's scheduler with a stand-in for the model that only counts tokens, on 200
# requests queued at step 0, each a system prompt, a user prompt and an answer of ShareGPT-shaped
# lengths (random tokens, so user prompts share nothing), at most 32 at once. Each prompt is looked
# up in the cache when it is admitted; the blocks its prompt and answer fill are cached and stay so
# when it finishes; when a decode finds no free block, the newest request is preempted and queued
# again (lessons 07 and 11), to be looked up anew with the tokens it had generated.
# One system prompt stands for one application, 16 for several sharing a server. The lengths are
# ShareGPT's divided by 8 (a 32-token system prompt, blocks of 4) so that the sweep takes a few
# seconds; at full size (256 tokens, blocks of 16, nine budgets, four series) it takes about 35 s of
# processor time on a 2-core machine, over a minute with busy processes beside it, and draws the
# same picture.
#
# The ideal, `ideal_cached_tokens`, is a cache that never forgets, in a run that never preempts:
# every request but the first with each system prompt finds that system prompt's 8 full blocks.

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
    right.plot(
        BUDGETS, [r.computed_tokens / 1000 for r in sweep[count]], "o-", color=COLOURS[count], label=label
    )
right.plot(
    BUDGETS,
    [r.computed_tokens / 1000 for r in uncached],
    "--",
    color="#444444",
    lw=1,
    label="without prefix caching",
)
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
# 55.9 %: the answers' blocks are cached too and, once freed, queue on the free list with the system
# prompts, so an idle system prompt can reach the head and be evicted. Smaller pools evict sooner and
# preempt far more (256 times at 64 blocks, one system prompt), as the scheduler keeps no block back
# for running requests (lesson 07). A readmitted request is looked up again, prompt and generated
# tokens, and finds much of both: its freed blocks kept their hashes. In small pools these second
# lookups are most of the tokens looked up (17,230 of 27,584 at 64 blocks) and lift one system
# prompt *above* its ideal, to 65.8 %, though its first lookups alone find exactly the ideal in every
# pool. So compare the prefill work, on the right: without caching, 19,433 tokens at 64 blocks
# (preemption recomputes) against 10,354 when nothing is preempted; with it, 9,424 (one system
# prompt) and 13,735 (16). A prefix cache lives in the memory the running requests do not need
# *right now*.
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
# `hit_rate` is `hits / queries`. The 89 requests readmitted after a preemption were looked up again,
# prompt and generated tokens, and those lookups count apart, in the `preempted_` fields, as vLLM
# counts them: the hit rate a real server logs and exports is that of first lookups (lesson 14).
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
#   caches a request's blocks that became full, in prefill or in decode (`PrefixCache.extend`
#   here); `BlockPool.free_blocks` puts blocks without a hash at the head of the free queue and
#   cached ones at the tail.
# * `vllm/v1/core/kv_cache_utils.py`: `hash_block_tokens` hashes a block from its parent's hash, its
#   token ids and its extra keys (`block_hash` here), with `NONE_HASH` as the first block's parent
#   (`ROOT_HASH` here); `generate_block_hash_extra_keys` adds the LoRA, multimodal, prompt embedding
#   and `cache_salt` keys; `get_request_block_hasher` chains a request's block hashes as its tokens
#   grow (the package's `chain_hashes`, and the package's `HashChain`). `FreeKVCacheBlockQueue` is the doubly linked free
#   list of block objects between `fake_free_list_head` and `fake_free_list_tail`.
# * `vllm/v1/request.py`: `Request.append_output_token_ids` calls `update_block_hashes` whenever
#   output tokens arrive, so a block that fills during decode gets its hash, and the KV cache
#   manager's `allocate_slots` (`vllm/v1/core/kv_cache_manager.py`) then caches it: the package's
#   `append_tokens(seq_id, n, token_ids=...)`.
# * `vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.get_computed_blocks` finds a new request's
#   longest cached prefix, at most `request.num_tokens - 1` tokens (`allocate_prompt` here), and
#   `KVCacheManager.free` frees a request's blocks in reverse order.
# * `vllm/v1/metrics/stats.py`: `PrefixCacheStats` counts `requests`, `queries` and `hits`, and a
#   preempted request's lookup apart, in `preempted_queries` and `preempted_hits`.
# * `vllm/config/cache.py`: `CacheConfig.prefix_caching_hash_algo`, `"sha256"` by default;
#   `CacheConfig.enable_prefix_caching` is `True` by default.
#
# What the course leaves out or does differently: it hashes tokens only, with Python's `hash`, and
# so compares each hit's tokens and parent, where vLLM trusts SHA-256 and adds extra keys; it keeps
# one block per hash, where vLLM also caches a second equal block.

# %% [markdown]
# ## Recap
#
# * `fork` shares every block of a sequence through ref counts, with no copy: 4 samples of a
#   1,000-token prompt (blocks of 16, 200 tokens each) hold 114 blocks instead of 300, and `usage()`
#   counts each shared block once.
# * Copy-on-write: the first token written into a shared, partly full block copies that block for
#   the writer (block 2 to block 3 for `B`); full shared blocks are never copied, and freeing either
#   sequence only drops references.
# * Prefix caching names a full block by a chained hash of its parent's hash and its tokens, since a
#   block's K/V depend on its whole prefix; a hit compares tokens and parent, so a collision can
#   cost a hit but never share wrong K/V; at most `n - 1` prompt tokens come from the cache.
# * Freed cached blocks stay on the free list, evicted least recently freed first, taken from its
#   middle in O(1) on a hit; blocks filled during decode are cached too (a chat's next turn found 16
#   of its 21 tokens cached instead of 8).
# * With one system prompt, 200 ShareGPT-shaped requests find the ideal 61.5 % of their prompt tokens
#   cached when nothing is preempted; with 16, 55.9 % (cached answers evict a few system prompts),
#   and 32.4 % in the smallest pool. Readmitted requests are looked up again and lift the hit rate:
#   compare prefill work.
#
# **Next, lesson 09:** the engine: a tiny GPT served with continuous batching on the paged cache,
# and the step an engine runs. The exercise for this lesson, `exercises/08_sharing.ipynb`, has you write fork, copy-on-write and the lookup of a cached
# prefix yourself.

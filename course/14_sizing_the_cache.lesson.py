# %% [markdown]
# # Lesson 14 · Sizing the cache at start-up
#
# Every engine of lessons 09 to 13 was handed its pool: `Engine(model, num_blocks=96)`. vLLM is not.
# When it starts, it works out how many blocks fit on the GPU from the memory the weights, one
# profiling pass and the CUDA graphs leave, and it logs the answer in two lines every vLLM user has
# seen. This lesson does that sizing, by hand and with the package, for one model on one GPU down to
# the last block; then for three models on three GPUs, a hybrid one among them (its KV-cache groups
# are lesson 13's). It reads vLLM's start-up errors and their fixes, and ends with the two things
# that change the size of a block: who picks `block_size`, and tensor parallelism.
#
# **By the end of this lesson you can**
#
# 1. size a KV cache from a GPU's memory the way vLLM 0.33.0 does at start-up, to the block: the
#    budget, the weights, the activation peak of the profiling run (its formula, worked by hand),
#    the CUDA graphs;
# 2. read the two lines it logs, and say why the token count the second prints is not a
#    `max_model_len` that fits;
# 3. read its start-up errors, choose a fix, and explain why `nvidia-smi` shows more than
#    `gpu_memory_utilization` times the card, and how two instances share one GPU;
# 4. compute what `max_num_batched_tokens`, `max_model_len`, fp8 and tensor parallelism change;
# 5. explain who picks the block size in vLLM 0.33.0, and measure what a larger block costs in
#    prefix-cache hits on a multi-turn chat.
#
# Nothing here needs a GPU.

# %%
import textwrap

import matplotlib.pyplot as plt
import torch

import paged_kv
from paged_kv import Engine, GPTConfig, TinyGPT, kv_cache_report
from paged_kv.kv import block_size as block_sizes
from paged_kv.kv.sizing import KVCacheSpec, format_bytes
from paged_kv.pictures.plots import PALETTE
from paged_kv.serving.workloads import chat_requests, ideal_hits

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.manual_seed(0)
torch.set_num_threads(1)  # the tiny model's operations are too small to share between threads
GiB, MiB = 2**30, 2**20
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# ## 1. Five steps from a GPU's memory to a pool of blocks
#
# vLLM 0.33.0 sizes its pool once, in five steps.
#
# 1. **The memory it may use**: the GPU's total memory times `gpu_memory_utilization`, rounded up
#    (0.92 by default; the examples here take 0.9). It is a share of the whole card, measured after
#    the CUDA context, NCCL and cuBLAS are up; section 4 comes back to what that means.
# 2. **Less what a profiling run measured.** With the weights loaded, the model runner's
#    `profile_run` runs one forward pass over a dummy batch as large as any it will schedule,
#    `max_num_batched_tokens` tokens (2,048 unless the engine picks another), then the sampler.
#    Torch's memory statistics give the **activation peak**, the most that pass held at once beyond
#    the weights; vLLM also counts the memory that appeared outside torch (the attention backend's
#    workspaces).
# 3. **Less the CUDA graphs** that decode steps replay. Model Runner V2, the default runner, captures
#    the piecewise graphs in full but only the two largest full graphs, and extrapolates the rest:
#    the first capture's bytes, then the second's for every other graph. The estimate is taken from
#    the budget while `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` is 1, its default.
# 4. **Divided by the bytes of one block**, rounded down: `block_size` times the bytes per token of
#    lesson 00, all layers at once, because every layer keeps its K and V of a block at the same
#    block id. That is the pool.
# 5. **A check, then a line**: one request of `max_model_len` tokens must fit besides the **null
#    block**, block 0 of every pool, which no request ever holds (lesson 13 wrote it into block
#    tables). The line gives the pool in tokens and as a *maximum concurrency*: how many requests of
#    `max_model_len` it holds at once.
#
# $$\text{blocks} = \left\lfloor \frac{\lceil\text{total} \times \text{utilization}\rceil - \text{weights} - \text{activation peak} - \text{non-torch} - \text{CUDA graphs}}{\text{block size} \times \text{bytes per token}} \right\rfloor$$
#
# `kv_cache_report(config, gpu_memory_bytes=..., max_model_len=...)` does the five steps in integers
# and returns every number on the way. It reads the layers, heads and head size from a model config,
# here the published `config.json` of each model as a dict (a `transformers` config works too), and
# counts the weights from the shapes: 8,030,261,248 parameters of 2 bytes for Llama-3-8B. A GPU
# measures the activation peak (the package's `measure_activation_peak` does it as vLLM does); on
# the CPU the report estimates it from the model's shape (section 2). The memory outside torch and
# the CUDA graphs are 0 unless given (`non_torch_bytes`, `cudagraph_bytes`, from a vLLM log). The GPUs
# are taken as 24, 80 and 141 GiB; `device_memory(device)` reads what a real one reports.
#
# **Predict, then run.** Llama-3-8B's weights take 15 GiB. On the 24 GB card, how many tokens of KV
# cache fit: thousands, tens of thousands, or millions?

# %%
llama_3_8b = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336)
llama_3_8b |= dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, torch_dtype="bfloat16")
llama = kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=8192)
print(llama.summary())
spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
print("a block is KVCacheSpec's too:", llama.bytes_per_block == spec.bytes_per_block(16))

# %% [markdown]
# Tens of thousands. The last two lines are vLLM's, word for word. `KVCacheSpec(num_layers,
# num_kv_heads, head_dim, dtype)` is the block's arithmetic alone: 2 (K and V) × 32 layers × 8 heads
# × 128 × 16 tokens × 2 bytes, 2 MiB.
#
# ## 2. The same, by hand, to the block
#
# Only one number above is not arithmetic on the config: the activation peak, 325.2 MiB. On a GPU
# vLLM measures it; the package estimates it from what the dummy forward holds at its widest. The
# forward of `T = max_num_batched_tokens` tokens runs layer by layer, and at a layer's peak it holds
# the residual stream and the normed input (`2 × hidden_size` numbers a token) and the wider of the
# attention's tensors (q, k, v and the output, `2 × q width + 2 × kv width`) and the MLP's (gate, up
# and their product, `3 × intermediate_size`). Then the sampler takes one row of float32 logits per
# request, `S = min(max_num_seqs, T)` rows, and a copy of them for the probabilities:
#
# $$\text{peak} = T \cdot b \cdot (2H + \max(2 q + 2 k,\ 3 I)) + S \cdot V \cdot 4 \cdot 2$$
#
# with `b` the bytes of a number (2), `H` 4,096, `q` 32 heads × 128, `k` 8 heads × 128, `I` 14,336,
# `V` 128,256, and `S` 128 (the report's `max_num_seqs`). Every step in integers:

# %%
T, S, b = 2048, 128, 2
H, inter, V = 4096, 14336, 128256
q_width, kv_width = 32 * 128, 8 * 128
peak = T * b * (2 * H + max(2 * q_width + 2 * kv_width, 3 * inter)) + S * V * 4 * 2
budget = -(-24 * GiB * 9 // 10)  # ceil(24 GiB x 0.9), in integers
weights = 8_030_261_248 * 2
available = budget - weights - peak
blocks = available // llama.bytes_per_block
print(f"peak {peak:,} B = {peak / MiB:.1f} MiB; available {available:,} B; {blocks:,} blocks")
print("the report's:", llama.activation_peak_bytes == peak, llama.num_gpu_blocks == blocks)
print(f"the line's tokens: {blocks:,} blocks x 16 = {blocks * 16:,}")

# %% [markdown]
# The MLP is the widest tensor (43,008 numbers a token against 10,240 for the attention), so the
# layer's part is 2,048 × 2 × 51,200 bytes, 200 MiB, and the sampler's 125.3 MiB. The result is the
# report's to the byte, and 3,238 blocks. Rounding the peak to "a third of a GiB" would give 3,230:
# eight blocks, 128 tokens, lost to a rough number.
#
# One request of 8,192 tokens needs 512 blocks, so the pool holds 6.32 of them: "Maximum
# concurrency ... 6.32x". The line's 51,808 tokens are 6.32 × 8,192 rounded down, which here is
# also every block of the pool times 16, **the null block included**. So 51,808 is not a
# `max_model_len` that fits: a request that long needs all 3,238 blocks, and one of them is the
# null block. The longest that fits is one block shorter:

# %%
for length in (51808, 51792):
    try:
        line = kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=length).lines[1]
    except ValueError as error:
        line = str(error).split(". ")[0] + " ..."
    print(f"max_model_len {length:,}: {textwrap.fill(line, 96, subsequent_indent='  ')}")

# %% [markdown]
# Both GiB figures round to 6.32, which makes the first message look absurd; the blocks settle it:
# 3,239 needed, 3,238 there. A `max_model_len` below the limit fits a pool with room for many
# requests, and a request near the limit waits until enough of the others have finished.
#
# Where the card's 24 GiB went, drawn to scale, for the 2,048-token budget above and for one of
# 32,768 (section 3 comes back to it): the part left outside the budget, the weights, the activation
# peak, the pool, and the bytes too few for one more block.

# %%
parts = ["outside the budget", "weights", "activation peak", "KV cache pool", "less than a block"]
fig, ax = plt.subplots(figsize=(8, 1.9))
for row, tokens in enumerate((2048, 32768)):
    r = kv_cache_report(
        llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=8192, max_num_batched_tokens=tokens
    )
    pool = r.num_gpu_blocks * r.bytes_per_block
    sizes = [24 * GiB - r.requested_memory, r.weight_bytes, r.activation_peak_bytes, pool]
    sizes.append(r.available_kv_cache_memory - pool)
    left = 0
    colours = (PALETTE[7], PALETTE[5], PALETTE[2], PALETTE[0], PALETTE[3])
    for part, size, colour in zip(parts, sizes, colours, strict=True):
        ax.barh(row, size / GiB, left=left / GiB, color=colour, label=part if row == 0 else None)
        left += size
    ax.text(24.2, row, f"{r.num_gpu_blocks:,} blocks", va="center", fontsize=8)
ax.set_yticks([0, 1], ["budget 2,048", "budget 32,768"])
ax.invert_yaxis()
ax.set_xlim(0, 27.5)
ax.set_xlabel("GiB of a 24 GiB card, gpu_memory_utilization 0.9")
ax.legend(frameon=False, ncol=5, fontsize=7, loc="lower center", bbox_to_anchor=(0.45, 1.0))
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
plt.show()

# %% [markdown]
# The weights are the same in both rows; everything the profiling run holds at its peak comes out
# of the pool, block for block.
#
# ## 3. Three models on three GPUs
#
# SmolLM2-135M, Llama-3-8B, and Gemma 3 27B, a hybrid model whose 62 layers attend through a sliding
# window of 1,024 tokens but for every sixth (lesson 13). Each is given its own context length.

# %%
smollm2 = llama_3_8b | dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, vocab_size=49152)
smollm2 |= dict(num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
gemma_3_27b = dict(model_type="gemma3_text", num_hidden_layers=62, hidden_size=5376, intermediate_size=21504)
gemma_3_27b |= dict(num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208)
gemma_3_27b |= dict(sliding_window=1024, sliding_window_pattern=6, torch_dtype="bfloat16")
configs = {"SmolLM2-135M": smollm2, "Llama-3-8B": llama_3_8b, "Gemma 3 27B": gemma_3_27b}
lengths = {"SmolLM2-135M": 8192, "Llama-3-8B": 8192, "Gemma 3 27B": 131072}
for name, config in configs.items():
    for gpu in (24, 80, 141):
        try:
            line = kv_cache_report(config, gpu_memory_bytes=gpu * GiB, max_model_len=lengths[name]).lines[1]
        except ValueError as error:
            line = str(error).split(".")[0]
        print(f"{name:<13}{gpu:>4} GB  {line.removeprefix('GPU KV cache size: ')}")

# %% [markdown]
# SmolLM2-135M is so small that nearly all the budget is cache: a million tokens on the 24 GB card,
# 121 requests of its whole context. Llama-3-8B pays its 15 GiB of weights on every card, so the 80 GB
# one holds 9 times the tokens of the 24 GB one for 3.3 times the memory. Gemma 3 27B's 50 GiB of
# weights do not fit in 21.6 GiB: vLLM stops with its first error. On the 80 GB card a block of its
# pool holds 10 layers (its KV-cache groups of ten, lesson 13), and one request of 131,072 tokens
# needs 8,192 blocks in the full-attention group but only 321 in each sliding group: the window, the
# tokens in flight (two steps of 2,048 under vLLM's default async scheduling) and one block because a
# window seldom starts at a block's edge. vLLM pays the whole length in sliding layers too when its
# hybrid KV-cache manager is off: asked for (`--disable-hybrid-kv-cache-manager`), or turned off by a
# KV connector that does not support it ("Turning off hybrid kv cache manager because
# `--kv-transfer-config` selects a KV connector that does not support it"), or on a platform
# without it. Then `unify_hybrid_kv_cache_specs` makes every sliding layer's spec a full-attention
# one, and the pool holds far fewer requests of that length.
#
# **Predict, then run.** On an H100, vLLM's `LLM` class takes a `max_num_batched_tokens` of 16,384,
# eight times the 2,048 above. What happens to Llama-3-8B's tokens on the 24 GB card as the budget
# grows from 512 to 32,768? And to Gemma 3 27B's on the 80 GB card as `max_model_len` grows?

# %%
print(f"{'budget':>7}{'peak':>11}{'blocks':>8}{'tokens':>8}")
for budget_tokens in (512, 2048, 8192, 16384, 32768):
    r = kv_cache_report(
        llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=8192, max_num_batched_tokens=budget_tokens
    )
    print(
        f"{budget_tokens:>7,}{format_bytes(r.activation_peak_bytes):>11}{r.num_gpu_blocks:>8,}{r.kv_cache_tokens:>8,}"
    )
for length in (8192, 32768, 131072):
    r = kv_cache_report(gemma_3_27b, gpu_memory_bytes=80 * GiB, max_model_len=length)
    print(f"Gemma 3 27B, max_model_len {length:>7,}: {r.blocks_per_request:>6,} blocks a request, ", end="")
    print(f"{r.num_gpu_blocks:,} in the pool, {r.kv_cache_tokens:,} tokens")

# %% [markdown]
# The profiling run holds more the more tokens it pushes through at once (the formula is linear in
# `T`), and every byte of its peak is a byte the cache does not get: at 32,768 tokens the estimate
# passes 3 GiB and Llama-3-8B keeps about half its tokens. A large budget makes long prompts prefill
# in fewer steps (lesson 10), so it is a trade: faster prefill against fewer requests at once.
#
# `max_model_len` leaves Gemma 3 27B's pool alone, 17,329 blocks, but changes what one request needs,
# and the line counts the pool in requests of that length. A longer request pays for every token only
# in the full-attention group, while its sliding groups stop at the window, so the tokens the line
# reports grow with `max_model_len`. For a model that attends fully everywhere they stay near
# blocks × 16 whatever the length.
#
# ## 4. When it does not fit
#
# Llama-3.1-8B is Llama-3-8B's shape with a context of 131,072 tokens, and vLLM's `max_model_len`
# defaults to the model's context. On the 24 GB card:

# %%
try:
    kv_cache_report(llama_3_8b, gpu_memory_bytes=24 * GiB, max_model_len=131072)
except ValueError as error:
    for paragraph in str(error).split("\n"):
        print(textwrap.fill(paragraph, 100))

# %% [markdown]
# The first paragraph is vLLM 0.33.0's, word for word: 16 GiB for one request of 131,072 tokens,
# 6.32 GiB available, and the longest `max_model_len` that would fit, 51,792 tokens (section 2's),
# which vLLM finds by binary search. The fixes after it are this course's, in the order to try them:
# a shorter `max_model_len` costs nothing when your requests are shorter anyway; a higher
# `gpu_memory_utilization` only takes what nothing else on the card needs; an fp8 cache halves every
# block for a small loss of accuracy (section 6); tensor parallelism takes more GPUs; a smaller
# `max_num_batched_tokens` shrinks only the activation peak, and slows prefill. Users still paste the
# older wording of vLLM's V0 engine ("The model's max seq len (131072) is larger than the maximum
# number of tokens that can be stored in KV cache"): the same check, counted in tokens.
#
# When the weights, the activation peak and the graphs take the whole budget, vLLM stops earlier,
# with **"No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"**
# (Gemma 3 27B on 24 GB above). No `max_model_len` can help then; what can, from the cheapest:
#
# * a higher `gpu_memory_utilization`, when the card holds nothing else;
# * less for the profiling run: a smaller `max_num_batched_tokens`, and a smaller `max_num_seqs`
#   (fewer sampler rows, fewer and smaller CUDA graphs);
# * no CUDA graphs, `--enforce-eager` (slower decodes), or fewer of them
#   (`max_cudagraph_capture_size`, `cudagraph_capture_sizes`);
# * smaller weights: a quantized checkpoint (fp8, AWQ, GPTQ), or part of them in host memory
#   (`--cpu-offload-gb`, paid for in every forward);
# * more GPUs: `--tensor-parallel-size` splits the weights and the heads (section 6).
#
# vLLM's guide to these is its "Conserving memory" page, which the message links.
#
# **Two more start-up surprises.** The budget is a share of the card's *total* memory, not of what
# is free. A second vLLM on a GPU where the first took 90 % therefore stops at once: "Free memory on
# device (…/79.19 GiB) on startup is less than desired GPU memory utilization (0.9, 71.27 GiB)".
# Two instances share a GPU when their utilizations add up to less than one, less what each process
# holds outside its budget (0.45 each on an 80 GB card, say). That outside part is also why
# `nvidia-smi` shows each process above utilization × total: the snapshot that sets the budget is
# taken after the CUDA context, NCCL and cuBLAS's handles exist, so those few hundred MiB are not in
# the budget. CUDA graphs are inside
# the budget by default (step 3); with `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0` they come on top
# of it, and `--enforce-eager` captures none.
#
# `kv_cache_memory_bytes` sets the pool's bytes outright and ignores `gpu_memory_utilization`. The
# profiling run still runs (it compiles the model for `max_num_batched_tokens` tokens); only its
# measurement is skipped, so nothing checks that the weights, the activations and the graphs fit
# beside the pool you asked for.
#
# ## 5. Who picks the block size
#
# vLLM 0.33.0 has no single block size. `CacheConfig.DEFAULT_BLOCK_SIZE` is 16, but unless you pass
# `block_size`, the platform asks the model's **attention backends** which block sizes their kernels
# take and picks one every backend accepts:
#
# * each backend lists its kernel's sizes: exact ones, or `MultipleOf(n)` (any multiple of `n`);
# * one backend: the default when the backend takes it, else the smallest size it lists;
# * several backends (a model whose layers use two kernels): the default when all take it, else the
#   smallest least common multiple of one size from each that all accept;
# * the CPU platform starts from 128 instead of 16, so the CPU backend, which takes multiples of 32,
#   gets 128;
# * a hybrid model with Mamba layers then grows the block until an attention page matches a Mamba
#   state's page (lesson 13's 544 tokens), even over the block size you passed.
#
# `paged_kv.kv.block_size` does the same arithmetic over the backends' lists as 0.33.0 has them:

# %%
models = [["FLASH_ATTN"], ["FLASHINFER"], ["FLASHMLA"], ["CUTLASS_MLA"], ["FLASHINFER", "FLASHMLA"]]
for names in models:  # the layers of one model may use two backends
    print(f"{' + '.join(names):<24}{block_sizes.common_block_size(names, default_block_size=16):>5}")
cpu = block_sizes.common_block_size(["CPU_ATTN"], default_block_size=block_sizes.CPU_DEFAULT_BLOCK_SIZE)
print(f"{'CPU_ATTN, from 128':<24}{cpu:>5}")
for backend in ("FLASH_ATTN", "FLASHINFER"):
    print(
        f"{backend}: a 544-token block is read as kernel blocks of {block_sizes.kernel_block_size(544, backend)}"
    )

# %% [markdown]
# FlashAttention, vLLM's usual backend on NVIDIA GPUs, takes any multiple of 16 and gets 16. The MLA
# backends of DeepSeek-style models want 64 or 128, and the CPU gets 128. The manager's block (the
# unit of the block table, prefix caching and the pool) may also differ from the **kernel's** block:
# for a hybrid model's 544-token blocks, FlashAttention reads them whole, but FlashInfer, which takes
# 16, 32 or 64 tokens a page, gets each split into 17 pages of 32 (the model runner picks the largest
# of its sizes that divides the manager's block, its `kernel_block_sizes`).
#
# What does a larger block cost? Its last block is half empty on average (lesson 00), and prefix
# caching works in whole blocks: a prompt's last partial block is never cached, and a hit stops at
# the last full block the previous turn filled. On a chat, where every turn resends the conversation
# so far, that grain is lost at every turn. `chat_requests` builds 8 conversations of 4 turns under
# one 48-token system prompt, with lesson 09's tiny GPT's own answers (each turn's prompt is the
# previous prompt, its answer and a new message); the engine serves all 32 prompts with prefix
# caching at several block sizes, on a pool that evicts nothing.
#
# **Predict, then run.** With 16-token blocks the cache serves about 80 % of the prompt tokens. With
# 128-token blocks, the CPU platform's choice?

# %%
model = TinyGPT(GPTConfig(max_len=512), seed=0).to(device).eval()
chats, answers = chat_requests(
    model, num_chats=8, num_turns=4, system_tokens=48, message=(8, 32), answer=(16, 48)
)
print(f"{len(chats)} prompts, {sum(len(r.prompt) for r in chats):,} prompt tokens")
print("block size  hit rate  ideal  same tokens")
for size in (4, 16, 32, 64, 128):
    chat_run = Engine(model, num_blocks=4096 // size, block_size=size, enable_prefix_caching=True).run(chats)
    stats = chat_run.prefix_cache_stats
    ideal = ideal_hits(chats, answers, size) / stats.queries
    print(f"{size:>10}{stats.hit_rate:>10.1%}{ideal:>7.1%}  {chat_run.tokens == answers}")

# %% [markdown]
# From 83.9 % with 4-token blocks to 80.4 % with 16, 59.9 % with 64 and 44.5 % with 128: at every
# turn the cache loses the tokens after the last full block, on average half a block, and a turn here
# adds only 8 to 32 tokens of message and 16 to 48 of answer. The engine reaches the ideal (every full
# block of every earlier prompt and answer, lesson 08) at every size, so the loss is the block's, not
# the cache's. A short block also costs: more entries in every block table, more blocks to look up and
# hash, and kernels that read K/V in smaller pieces. That is why vLLM leaves the choice to the
# attention backend and why 16 is its default on GPUs.
#
# ## 6. fp8, tensor parallelism, and the usage a log shows
#
# `kv_cache_dtype="fp8"` stores every number of K and V in one byte: half a block, twice the blocks.
# With `tensor_parallel_size` GPUs, vLLM splits every layer's heads between them: each GPU keeps
# `num_kv_heads / tp` of the K/V heads of every block, so a block costs it `1/tp` of the bytes, and
# about `1/tp` of the weights. Both leave its cache more room, so the tokens grow faster than the
# GPUs. Past one K/V head a GPU (Llama-3-8B's 8 heads at tp 16) vLLM replicates the heads, and a size
# that splits them unevenly is refused.
#
# The last column takes 40,000 tokens held by running requests (2,500 blocks of 16) and gives the
# usage the log line would show on each GPU: the blocks in use over the pool, the null block left out.

# %%
held_blocks = 40_000 // 16
print(f"{'':<10}{'K/V heads':>10}{'block':>9}{'weights':>10}{'blocks':>8}{'tokens':>11}{'usage':>8}")
for dtype, tp in (("auto", 1), ("fp8", 1), ("auto", 2), ("auto", 4), ("auto", 8)):
    r = kv_cache_report(
        llama_3_8b,
        gpu_memory_bytes=24 * GiB,
        max_model_len=8192,
        kv_cache_dtype=dtype,
        tensor_parallel_size=tp,
    )
    usage = held_blocks / (r.num_gpu_blocks - 1)
    sizes = f"{format_bytes(r.bytes_per_block):>9}{format_bytes(r.weight_bytes):>10}"
    name = f"{'fp8' if dtype == 'fp8' else 'bf16'}, tp {tp}"
    print(
        f"{name:<10}{r.num_kv_heads_per_gpu:>10}{sizes}{r.num_gpu_blocks:>8,}{r.kv_cache_tokens:>11,}{usage:>8.1%}"
    )

# %% [markdown]
# fp8 doubles the tokens on one card: 103,616 against 51,808. Every GPU under tensor parallelism
# holds the same tokens, a slice of each one's heads, so the tokens in the line are the whole
# cluster's: eight 24 GB cards hold 1,281,600 tokens of Llama-3-8B, 25 times one card's, eight times
# from the smaller blocks and three more from the 13 GiB of weights each card no longer holds. The
# same 2,500 blocks in use are 77.2 % of one card's pool, 17.6 % at tp 2 and 3.1 % at tp 8: a
# dashboard's usage is a share of the pool, not a number of tokens, so comparing it across
# deployments means comparing pools.

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0. Its GPU worker runs Model Runner V2 (`vllm/v1/worker/gpu/`) by
# default. The package's `kv_cache_report` follows the start-up step by step.
#
# * `vllm/v1/worker/gpu_worker.py`: `Worker.init_device` takes the memory snapshot once the CUDA
#   context, NCCL and cuBLAS are up, and `requested_memory` from `request_memory`
#   (`vllm/v1/worker/utils.py`: rounded up; the "Free memory on device" error of section 4);
#   `Worker.determine_available_memory` runs `profile_run` and `profile_cudagraph_memory`, subtracts
#   both and logs "Available KV cache memory"; with `kv_cache_memory_bytes` it still runs
#   `profile_run` and skips the measurement.
# * `vllm/v1/worker/gpu/model_runner.py`: `GPUModelRunner.profile_run`, the dummy forward of
#   `max_num_tokens` tokens, then `_dummy_sampler_run`. `vllm/v1/worker/gpu/cudagraph_utils.py`:
#   `profile_cudagraph_memory` captures `_FULL_GRAPH_PROFILING_SAMPLES` (two) full graphs and
#   `_extrapolate_full_graph_memory` extrapolates them. `vllm/envs.py`:
#   `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`.
# * `vllm/utils/mem_utils.py`: `memory_profiling` measures `non_kv_cache_memory = total_consumed +
#   transient_peak_headroom`, the weights and the memory outside torch plus the activation peak
#   (`torch_peak - torch_allocated`); `format_gib` writes the GiB of every message.
# * `vllm/config/cache.py`: `CacheConfig.gpu_memory_utilization` (0.92 by default), `CacheDType`
#   ("fp8" is "fp8_e4m3"), `kv_cache_memory_bytes`, `num_gpu_blocks_override`, `block_size` with
#   `DEFAULT_BLOCK_SIZE`. `vllm/config/scheduler.py`: `DEFAULT_MAX_NUM_BATCHED_TOKENS` (2,048);
#   `EngineArgs.get_batch_defaults` in `vllm/engine/arg_utils.py` picks larger ones by GPU.
#   `vllm/config/model.py`: `ModelConfig.get_num_kv_heads` (the K/V heads a GPU keeps, one at
#   least), `verify_with_parallel_config` and `enforce_eager`.
# * `vllm/v1/core/kv_cache_planning.py`: `unify_hybrid_kv_cache_specs`, for a model whose
#   `disable_hybrid_kv_cache_manager` `VllmConfig` set (`vllm/config/vllm.py`, which logs why);
#   `get_kv_cache_configs` reserves the null block's bytes, runs `_check_enough_kv_cache_memory` (both errors of section 4, with
#   `_estimate_max_model_len_from_groups`' binary search) and divides the memory by
#   `_get_kv_cache_bytes_per_block`, the largest group's layers' pages.
# * `vllm/v1/kv_cache_interface.py`: `AttentionSpec.page_size_bytes`, one layer's block;
#   `FullAttentionSpec.max_memory_usage_bytes` and `SlidingWindowSpec.max_admission_blocks_per_request`,
#   a request's need in each group.
# * `vllm/v1/core/kv_cache_utils.py`: `get_max_concurrency_for_kv_cache_config` (the pool's blocks,
#   null block included, over one request's), `get_kv_cache_capacity` (the tokens) and
#   `update_kv_cache_capacity`, which logs the line.
# * `vllm/platforms/interface.py`: `Platform.update_block_size_for_backend` and
#   `_preferred_block_size_for_backends`, section 5's rule; `vllm/platforms/cpu.py` starts the CPU
#   platform from 128. `vllm/v1/attention/backend.py`: `AttentionBackend.get_supported_kernel_block_sizes`,
#   `supports_block_size` and `MultipleOf`. `vllm/v1/worker/utils.py`: `prepare_kernel_block_sizes`
#   and `select_common_block_size`, the kernel's block inside the manager's.
#
# What the course leaves out or does differently: on the CPU the activation peak is an estimate from
# the model's shape (fused kernels, `torch.compile` and the backend's buffers move the real one), the
# memory outside torch and the CUDA graphs are 0 unless given, and the weights are counted from the
# config's shapes, without vLLM's padding of the vocabulary to a multiple of 64.

# %% [markdown]
# ## Recap
#
# * vLLM sizes its pool once: (⌈total × `gpu_memory_utilization`⌉ − weights − activation peak −
#   memory outside torch − CUDA graphs) // bytes per block, one request of `max_model_len` checked
#   besides the null block.
# * The activation peak is one forward of `max_num_batched_tokens` tokens at its widest tensor plus
#   the sampler's rows: 325.2 MiB for Llama-3-8B, which lands on the report's 3,238 blocks. The
#   line's 51,808 tokens count the null block; the longest `max_model_len` that fits is 51,792.
# * "No available memory for the cache blocks" means the weights and the profiling took the budget:
#   raise the utilization, shrink the profiling run or the graphs, shrink the weights, or add GPUs.
#   The budget is a share of the whole card, which is why two instances must split it and why
#   `nvidia-smi` shows a little more.
# * A larger budget costs blocks; fp8 doubles them; eight GPUs hold 25 times the tokens, and the same
#   requests show a much lower usage.
# * The attention backend picks the block size: 16 for FlashAttention, 64 or 128 for MLA kernels,
#   128 on the CPU. On a multi-turn chat, 16-token blocks serve 80.4 % of prompt tokens from the
#   cache, 128-token blocks 44.5 %.
#
# **Next, lesson 15:** the rest of vLLM's settings, mapped to what you built, and the metrics it
# reports about the cache. The exercise for this lesson, `exercises/14_sizing_the_cache.ipynb`, has
# you write vLLM's block bytes and start-up line, and the block size every backend accepts.

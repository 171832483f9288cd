# %% [markdown]
# # Exercise 10 · Real models and the token budget
#
# In this exercise you write three small pieces of lesson 10: what one token of a real model costs
# in the KV cache, read from its Hugging Face config; one step of vLLM's token budget,
# `max_num_batched_tokens`, deciding how many tokens each request runs; and, from a run's schedule,
# the step that samples each request's first token. Each task says what to build and how it is
# checked; the cell after it runs the check and prints a tick, or tells you which call gave which
# wrong answer.
#
# The checks compare your answers with the package's: the bytes with what the engine allocates for
# tiny models built from `transformers` configs, the schedule and the first-token steps with what
# `paged_kv.serving.engine.Engine` actually ran under a budget. A wrong answer is compared with the
# classic mistakes, and the hint names the one your code makes. Nothing is downloaded: the configs
# are built from the published sizes.
#
# Work top to bottom. Replace each `raise NotImplementedError(...)` with your code, run the task's
# cell, then its check cell. The finished package's versions live in `paged_kv.model.hf` (how a
# config is read), `paged_kv.kv.sizing.KVCacheSpec` (the bytes), and
# `paged_kv.serving.scheduler.Scheduler.schedule` (the budget); try without looking first.
#
# When every task passes, save the notebook and grade the whole exercise from a terminal in the
# repository, with the path of the notebook you work on (`make lab` opens your copy in `my_course/`):
# `.venv/bin/python -m paged_kv.grade my_course/exercises/10_real_models_and_the_token_budget.ipynb`
# prints each task's points and what went wrong where a task lost them. A copy under another name
# grades too: the notebook records its lesson.

# %%
from paged_kv.checks import check

# %% [markdown]
# ## Task 1 · K/V bytes per token, from a config
#
# Write `kv_bytes_per_token(config, bytes_per_number)`: the bytes the KV cache of one token takes
# over all the model's layers, K and V, with `bytes_per_number` bytes per number (2 in 16-bit, 1
# in fp8, 4 in float32). `config` is a Hugging Face config, or any object with the same attributes:
#
# * `num_hidden_layers`: every layer keeps its own K and V;
# * `num_attention_heads`, the query heads, and `num_key_value_heads`, the K/V heads: the cache
#   holds only the K/V heads. The attribute may be `None` or missing: then there are as many K/V
#   heads as query heads;
# * `head_dim`, the size of one head: it may be `None` or missing, and then it is
#   `hidden_size // num_attention_heads`. When it is set, use it, even where it differs from that
#   quotient (some models' heads are wider or narrower).
#
# `getattr(config, "head_dim", None)` reads an attribute that may be missing. Return an `int`.
#
# **Checked:** `transformers` configs with the published sizes of Llama-2-7B (no grouped-query
# attention), Llama-3-8B (in 16-bit, fp8 and float32), Qwen2-7B (no `head_dim` attribute),
# Mistral-7B, Mistral-NeMo-12B (`head_dim` 128 where `hidden_size // num_attention_heads` is 160)
# and SmolLM2-135M (the lesson's 22.5 KiB); a plain object without the optional attributes and one
# with them set to `None`; that the result is an `int`; and tiny random-weight Llama, Qwen2 and
# Mistral models, against the bytes the engine gives a block of one token
# (`Engine(model, num_blocks=1, block_size=1).bytes_per_block`). A wrong answer is compared with the
# query heads counted instead of the K/V heads, the head size taken from `hidden_size` although the
# config gives one, K and V counted once, one layer, and numbers counted instead of bytes.


# %%
def kv_bytes_per_token(config, bytes_per_number: int) -> int:
    """K and V of one token over all the model's layers, in bytes."""
    ### BEGIN SOLUTION: 2 (K and V) * num_hidden_layers * K/V heads * head_dim * bytes_per_number, with the K/V heads and head_dim defaulting when None or missing
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * bytes_per_number
    ### END SOLUTION


# %%
check("10.kv_bytes_per_token", kv_bytes_per_token)

# %% [markdown]
# ## Task 2 · One step under the token budget
#
# Write `schedule_step(running, waiting, budget)`: how many tokens each request runs in one step
# of the engine when a step may run at most `budget` tokens (vLLM's `max_num_batched_tokens`), as
# section 2 of the lesson describes it. Memory is not the limit here: every request fits.
#
# * `running` is a list of `(request_id, tokens_lacking)` in running order: a decode lacks 1 token,
#   a partly prefilled prompt (at most one, the newest, last) lacks the rest of its prompt;
# * `waiting` is a list of `(request_id, prompt_tokens)` in queue order, first come first;
# * `budget` is a positive `int`, or `None` for no budget (everyone gets all it needs).
#
# Return the step as a list of `(request_id, num_scheduled_tokens)` tuples, in this order:
#
# 1. the running requests, in order, each `min(tokens_lacking, budget left)`;
# 2. then the waiting ones, in queue order, each `min(prompt_tokens, budget left)`: a chunk of its
#    prompt when the budget does not reach its end;
# 3. each entry spends its tokens from the budget; once nothing is left, admission stops, first
#    come first served: no later request overtakes the one at the front;
# 4. a request that gets no token this step has no entry.
#
# **Checked:** hand cases: no budget; two decodes and two prompts under a budget of 8 (the second
# prompt gets a chunk of 1); the lesson's 19-token prompt in chunks of 8, 8 and 3 beside a 5-token
# prompt that waits; decodes that spend the whole budget; a long prompt in front of a short one; a
# budget spent exactly; a budget larger than the step; an empty step. Then every step of the engine
# on four random streams of 12 requests, under budgets of 8, 5 and 16 tokens and none, with blocks
# to spare: each step's running and waiting requests replayed from what the engine ran before it,
# and your step compared with what the engine's scheduler ran (`EngineResult.scheduled_tokens`). A
# wrong answer is compared with the prompts scheduled before the running requests, a chunk not
# capped by the budget left (a step over budget), the running requests' tokens not taken from the
# budget, a prompt that does not fit passed over for a later, shorter one, entries of 0 tokens
# kept, and `budget=None` read as a budget of 0.


# %%
def schedule_step(running, waiting, budget):
    """One step's [(request_id, num_scheduled_tokens), ...]: running requests first, then the queue."""
    ### BEGIN SOLUTION: walk running then waiting in order, give each min(tokens it needs, budget left) (all of it when budget is None), subtract it, and stop when the budget is spent
    left = budget
    scheduled = []
    for request_id, wanted in [*running, *waiting]:
        if left == 0:  # spent: nobody else runs, and admission stops
            break
        n = wanted if left is None else min(wanted, left)
        scheduled.append((request_id, n))
        if left is not None:
            left -= n
    return scheduled
    ### END SOLUTION


# %%
check("10.schedule_step", schedule_step)

# %% [markdown]
# ## Task 3 · The step of the first token
#
# Under a budget a prompt may take several steps, and only the step whose chunk reaches the end of
# the prompt samples a token: the request's first. Write `first_token_steps(scheduled_tokens,
# prompt_lens)`:
#
# * `scheduled_tokens` holds one sequence per step, step 0 first, of `(request_id, tokens)` pairs,
#   what the step ran, as `EngineResult.scheduled_tokens` records it (a step may be empty);
# * `prompt_lens` maps each request to its prompt's length (no prefix caching: every prompt token
#   is scheduled);
# * return a dict `{request_id: step}` of the step that sampled each request's first token. A
#   request whose prompt has not been scheduled to its end by the last step has no entry.
#
# After its prompt, a request decodes one token per step; those entries come after its first token.
#
# **Checked:** a prompt prefilled whole; the lesson's two requests (`a`'s 19 tokens in chunks of 8,
# 8 and 3, `b`'s 5 beside `a`'s last chunk); a last chunk of one token; a one-token prompt; a prompt
# still prefilling at the end (no entry); empty steps; then the four engine runs of task 2, against
# `EngineResult.first_token_step`. A wrong answer is compared with the step of the first chunk, one
# step late (`>` for `>=`), the step of the first one-token entry, and every one-token entry taken
# for a decode.


# %%
def first_token_steps(scheduled_tokens, prompt_lens):
    """{request_id: the step whose chunk completes its prompt}, for every request whose prompt completed."""
    ### BEGIN SOLUTION: add up each request's scheduled tokens step by step; the first step where the sum reaches its prompt length (>=) is the one
    computed = dict.fromkeys(prompt_lens, 0)
    first = {}
    for step, scheduled in enumerate(scheduled_tokens):
        for request_id, n in scheduled:
            computed[request_id] += n
            if request_id not in first and computed[request_id] >= prompt_lens[request_id]:
                first[request_id] = step
    return first
    ### END SOLUTION


# %%
check("10.first_token_steps", first_token_steps)

# %% [markdown]
# ## Putting it together
#
# With all three tasks done, this sizes the caches of the models the checks used, in 16-bit, and
# says how many tokens 16 GiB of K/V holds for each. Then it serves the lesson's two requests under a
# budget of 8 tokens twice: with the engine, and with a loop of a dozen lines around your
# `schedule_step` that keeps each request's computed and generated tokens (memory is never the limit
# here). The two schedules must be the same, and so must the first-token steps. Try other budgets,
# prompts and arrival steps.

# %%
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

import paged_kv
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT, encode
from paged_kv.serving.engine import Engine, EngineRequest

configs = {
    "Llama-3-8B": LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
    "Qwen2-7B": Qwen2Config(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4
    ),
    "Mistral-NeMo-12B": MistralConfig(
        hidden_size=5120, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128
    ),
}
for name, config in configs.items():
    per_token = kv_bytes_per_token(config, 2)
    print(f"{name:>16}: {per_token // 1024} KiB per token, {16 * 2**30 // per_token:,} tokens in 16 GiB")

device = paged_kv.default_device()
torch.set_num_threads(1)  # the tiny model's operations are too small to share between CPU threads
model = TinyGPT(GPTConfig(), seed=0).to(device).eval()
requests = [
    EngineRequest("a", encode("a 19-token prompt.."), max_tokens=3),
    EngineRequest("b", encode("short"), max_tokens=3, arrival_step=1),
]
BUDGET = 8
engine = Engine(model, num_blocks=16, block_size=4, max_num_batched_tokens=BUDGET).run(requests)

prompt_lens = {r.request_id: len(r.prompt) for r in requests}
wanted = {r.request_id: r.max_tokens for r in requests}
computed, generated, running, waiting, mine = {}, {}, [], [], []
for step in range(engine.steps):
    waiting += [r.request_id for r in requests if r.arrival_step == step]
    lacking = [(r, max(prompt_lens[r] - computed[r], 1)) for r in running]  # a decode lacks 1
    scheduled = schedule_step(lacking, [(r, prompt_lens[r]) for r in waiting], BUDGET)
    for request_id, n in scheduled:
        if request_id in waiting:  # admitted
            waiting.remove(request_id)
            running.append(request_id)
            computed[request_id], generated[request_id] = 0, 0
        if computed[request_id] < prompt_lens[request_id]:  # a chunk: samples if it ends the prompt
            computed[request_id] += n
            generated[request_id] += computed[request_id] == prompt_lens[request_id]
        else:  # a decode
            generated[request_id] += 1
    running = [r for r in running if generated[r] < wanted[r]]
    mine.append(scheduled)
    print(f"step {step}: " + ", ".join(f"{request_id} {n}" for request_id, n in scheduled))

print("the engine ran the same steps:", mine == [list(s) for s in engine.scheduled_tokens])
print("first token at step:", first_token_steps(mine, prompt_lens))
print("as the engine recorded:", first_token_steps(mine, prompt_lens) == engine.first_token_step)

# %% [markdown]
# # Lesson 16 · Serving it
#
# Fourteen lessons served lists of requests known in advance: `Engine.run(requests)` steps until
# every one has finished. Nobody meets vLLM that way. They meet `vllm serve` and the `openai`
# client: requests arrive at any moment, stream their tokens back, and are cancelled when a user
# closes a tab. This last lesson puts the cache you built behind the same front door: an online
# engine that takes requests while it steps, sampling parameters by vLLM's names, an
# OpenAI-compatible HTTP server, its `/metrics`, and a page that draws the block pool while clients
# stream and hang up.
#
# **By the end of this lesson you can**
#
# 1. drive an online engine by hand (`add_request`, `step`, `abort_request`) and say where vLLM
#    splits the same loop between a front end and an engine core;
# 2. explain what each sampling parameter does to a request, where its log-probabilities come
#    from, and why `n` completions of one prompt share its blocks;
# 3. serve the model with the course's cache behind an OpenAI-compatible API and send it requests,
#    streamed and not, with the real `openai` client;
# 4. say what a server does with each field a client sends, and how `cache_salt` keeps two
#    tenants from sharing (and timing) each other's blocks;
# 5. show that a client who hangs up frees its blocks before the next step;
# 6. read the server's `/metrics` by vLLM's names and watch the pool live at `/kv`.
#
# The cells take about 10 s on a 2-core CPU; nothing needs a GPU or a network.

# %%
import time

import httpx
import matplotlib.pyplot as plt
import openai
import torch
from IPython.display import HTML, display

import paged_kv
from paged_kv import GPTConfig, TinyGPT
from paged_kv.entrypoints.openai.api_server import ServerThread, build_app
from paged_kv.model.tiny_gpt import decode, encode
from paged_kv.pictures.plots import PALETTE
from paged_kv.pictures.pool import render_allocator
from paged_kv.serving.async_llm import AsyncLLM
from paged_kv.serving.engine_args import EngineArgs
from paged_kv.serving.llm_engine import LLMEngine
from paged_kv.serving.sampling_params import SamplingParams

device = paged_kv.default_device()  # CUDA when a GPU is visible, else the CPU
torch.set_num_threads(1)  # the tiny model's operations are too small to share between threads
print("paged_kv", paged_kv.__version__)

# %% [markdown]
# The model is lesson 09's tiny GPT, with its byte tokens: `encode` turns text into the bytes of its
# UTF-8, `decode` turns them back. Its weights are random, so its text is noise; the cells print
# token counts, finish reasons and blocks, which do not depend on the weights. `paged-kv serve`
# serves lesson 10's SmolLM2-135M instead (`load_model`: the real model when the Hugging Face Hub
# answers), with the same code; on a CPU its steps take ten times as long.

# %%
model = TinyGPT(GPTConfig(max_len=512), seed=0).to(device).eval()

# %% [markdown]
# ## 1. From a list of requests to a stream of them
#
# `Engine.run` knows every request before it starts. A server knows none: each arrives with an HTTP
# request, while the engine is busy with others. vLLM's answer is a loop with three entry points,
# `LLMEngine.add_request`, `LLMEngine.step` and `LLMEngine.abort_request`, and the course's
# `LLMEngine` has the same three:
#
# * `add_request(request_id, prompt_token_ids, sampling_params)` checks the request (its length
#   against `max_model_len`, in vLLM's words) and queues it in the scheduler. Nothing runs yet.
# * `step()` is the step you built in lessons 09 to 11: the scheduler decides every request's tokens
#   and takes their blocks, the model runner runs one forward, the sampled tokens are appended. It
#   returns a `RequestOutput` for each request that moved: its new tokens, its text, and, when it is
#   done, a `finish_reason`.
# * `abort_request(request_ids)` finishes requests wherever they are. A running request's blocks
#   go back to the free queue at once; a waiting or preempted one just leaves the queue.
#
# vLLM builds its `LLMEngine` from the engine's settings, `EngineArgs` (the keywords of `LLM(...)`
# and the flags of `vllm serve`, by the same names), with `LLMEngine.from_engine_args`; the offline
# `LLM` sits on top. So does the course's: `Engine(model, **settings)` fills the same `EngineArgs`,
# and `Engine.run` is a short loop over the `LLMEngine` they make, adding each request at its arrival
# step and calling `step()` until nothing is left.
#
# Build one with a pool of 64 blocks of 16 tokens (`num_gpu_blocks_override`, vLLM's setting that
# skips the sizing of lesson 14; block 0 is the null block, so 63 hold tokens) and prefix caching on
# (vLLM v1's default), add two requests, step three times, and add a third while the first two
# decode:

# %%
settings = EngineArgs(
    num_gpu_blocks_override=64, block_size=16, enable_prefix_caching=True, max_model_len=512
)
llm = LLMEngine.from_engine_args(model, settings, decode=decode)
pool = llm.engine_core.scheduler.memory  # the KVCacheManager the scheduler takes blocks from


def used_blocks() -> int:
    """Blocks held by running requests: the usage (vLLM's) times the blocks the pool gives out, all
    but the null block (a free block that still caches a prefix counts as free)."""
    return round(pool.usage * (pool.num_blocks - 1))


greedy = SamplingParams(temperature=0.0, max_tokens=40)
llm.add_request("A", encode("Paged attention splits the KV cache into blocks. " * 3), greedy)
llm.add_request("B", encode("A block table maps logical blocks to physical ones."), greedy)
history = [0]  # blocks in use after each step (history[k]: after step k), for the plot below
for _ in range(3):
    llm.step()
    history.append(used_blocks())
llm.add_request("C", encode("Continuous batching admits requests as others finish."), greedy)
llm.step()
history.append(used_blocks())
print(f"after 4 steps: {len(llm.engine_core.scheduler.running)} running, {used_blocks()} blocks in use")

# %% [markdown]
# *Predict, then run:* request B is aborted now, between two steps. How many blocks are in use
# right after the call, before any other step runs?
#
# Its prompt is 51 tokens and it has generated 4: 55 tokens, in four blocks. They go back at once:

# %%
before = used_blocks()
llm.abort_request("B")
print(f"{before} blocks in use before the abort, {used_blocks()} right after it")
while llm.has_unfinished_requests():
    for output in llm.step():
        if output.finished:
            done = output.outputs[0]
            print(f"{output.request_id}: {len(done.token_ids)} tokens, finish_reason={done.finish_reason!r}")
    history.append(used_blocks())
print("blocks in use at the end:", used_blocks())

# %% [markdown]
# The blocks in use over the run: the first step takes A's and B's prompt blocks, C's prompt is a
# jump at step 4, B's abort a drop between steps 4 and 5; then one more block whenever a request's
# tokens cross a block boundary (lesson 04), and each request gives all its blocks back in the step
# it finishes.

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
ax.step(range(len(history)), history, where="post", color=PALETTE[0])
ax.axvline(4.5, color=PALETTE[1], linestyle="--", label="B aborted")
ax.set_xlabel("step")
ax.set_ylabel("blocks in use")
ax.legend(loc="lower left", frameon=False)
plt.show()

# %% [markdown]
# The pool after the run, in lesson 02's picture. Every block is free again, and the free queue's
# order is the eviction order: the blocks freed last are reused last, so the prefixes they cache
# stay findable longest (lesson 08).

# %%
display(HTML(render_allocator(pool.snapshot(), caption="after A and C finished and B was aborted")))

# %% [markdown]
# vLLM splits this loop across two processes. The *front end* (`AsyncLLM`, with an
# `InputProcessor` that checks and tokenizes, and an `OutputProcessor` that detokenizes and checks
# stop strings) runs beside the HTTP server; the *engine core* (`EngineCore`, the scheduler and the
# model executor) runs in a process of its own, stepping in a busy loop and talking to the front
# end through ZeroMQ sockets. The split keeps the Python work of the server (parsing JSON, writing
# events) from stalling the GPU between steps. The course keeps one process: its front end,
# `AsyncLLM`, hands each step to a worker thread, so the event loop stays free for clients while the
# model runs.

# %% [markdown]
# ## 2. Sampling parameters
#
# Every lesson so far decoded greedily: the most likely token at each step, the tokens Hugging
# Face's `generate` gives. A server takes vLLM's `SamplingParams` with each request:
#
# | parameter | vLLM's default | what it does |
# |---|---|---|
# | `max_tokens` | 16 | the most tokens to generate; capped at `max_model_len` less the prompt |
# | `temperature` | 1.0 | divides the logits before the softmax: below 1 sharpens, 0 is greedy |
# | `top_k` | 0 (all) | keep the `k` most likely tokens |
# | `top_p` | 1.0 | keep the smallest set of most likely tokens whose probability reaches `p` |
# | `seed` | none | draw from the request's own generator, seeded once |
# | `stop`, `stop_token_ids` | none | end the completion at a string (left out of the text) or a token (kept) |
# | `ignore_eos` | False | go on past the model's end-of-sequence tokens |
# | `n` | 1 | that many completions of the prompt |
# | `presence_penalty`, `frequency_penalty` | 0.0 | in [-2, 2]: subtracted from the logit of each token already in the output, once (presence) or once per occurrence (frequency) |
# | `repetition_penalty` | 1.0 | above 0: a token already in the prompt or the output has its logit divided by it when positive, multiplied when negative |
# | `min_p` | 0.0 | drop the tokens less likely than `min_p` times the most likely one |
# | `min_tokens` | 0 | no stop token or stop string before that many tokens |
# | `logit_bias` | none | `{token_id: bias}` added to the logits, each bias clamped to [-100, 100] |
# | `bad_words` | none | words never generated: a word's last token is banned once the output ends with the rest of it |
# | `logprobs` | none | each sampled token's log-probability and rank, and the `logprobs` most likely tokens' (-1: every token; at most `max_logprobs`, 20) |
# | `prompt_logprobs` | none | the same for each prompt token but the first, scored from the position before it |
#
# The sampler applies them in Model Runner V2's order: the bias, the `min_tokens` mask, the
# penalties and the banned words change the logits, then temperature, top-k, min-p and top-p shape
# the distribution it draws from. The log-probabilities are taken before any of it, from the raw
# logits (vLLM's default `logprobs_mode="raw_logprobs"`), so they say what the *model* thinks of a
# token, whatever the request did to its draw. A greedy probe of 3 tokens with its top 2 at every
# step, and every prompt token scored (`prompt_logprobs=0`: the token itself only):

# %%
probe = encode("A block")
llm.add_request("probe", probe, SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=0))
while llm.has_unfinished_requests():
    (final,) = llm.step()
completion = final.outputs[0]
for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
    top = sorted(position.items(), key=lambda item: item[1].rank)[:2]
    print(f"sampled {token:>3}: {position[token].logprob:.3f}, rank {position[token].rank}; top 2:", end=" ")
    print(", ".join(f"{t} ({lp.logprob:.3f})" for t, lp in top))
scored = [
    None if p is None else round(p[t].logprob, 3) for t, p in zip(probe, final.prompt_logprobs, strict=True)
]
print("the prompt's tokens:", scored)

# %% [markdown]
# A greedy token is always of rank 1; the prompt's first token has no position before it, hence
# `None`. They are the log-softmax of the logits a plain forward of the whole sequence gives, which
# is how `tests/test_logprobs.py` checks them against Hugging Face's Llama:

# %%
with torch.no_grad():
    sequence = probe + completion.token_ids
    reference = model(torch.tensor([sequence[:-1]], device=device))[0].log_softmax(-1)
engine_says = [p[t].logprob for t, p in zip(probe[1:], final.prompt_logprobs[1:], strict=True)]
engine_says += [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)]
gap = max(abs(a - reference[i, sequence[i + 1]].item()) for i, a in enumerate(engine_says))
print(f"within 1e-5 of a plain forward's log-softmax at every position: {gap < 1e-5}")
print(f"cumulative_logprob {completion.cumulative_logprob:.3f}")

# %% [markdown]
# The course's model runner draws a random request's tokens from the request's own `torch.Generator`,
# kept from its first step to its last, through preemptions, as vLLM's V1 runner did. Model Runner
# V2, 0.33.0's default, keeps no generator: it samples by the Gumbel-max trick, adding to every logit
# noise hashed from the request's seed, the token's position and the token id
# (`vllm/v1/worker/gpu/sample/gumbel.py`), so a draw depends on nothing else in the batch. Either way a
# seeded request here gets the same tokens whatever else runs in its batch: the course's logits do
# not depend on the neighbours (lesson 09's batch-invariance check). vLLM's do only with
# `VLLM_BATCH_INVARIANT=1`, off by default, so there a seed repeats a completion exactly only when
# the batch does too.
#
# `n` is where sampling meets the cache. vLLM turns a request with `n = 3` into three child
# requests, `0_id`, `1_id` and `2_id`, with seeds `seed`, `seed + 1`, `seed + 2`, and gathers their
# outputs into one `RequestOutput`. The children have the same prompt, so with prefix caching the
# second and third find the first child's full prompt blocks in the cache and hold them too (lesson
# 08's ref counts), instead of computing and storing their own copies:

# %%
prompt = encode("The scheduler takes blocks for every token it schedules. " * 2)
three = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8)
llm.add_request("three", prompt, three)
llm.step()
tables = {child: pool.get_block_ids(child)[0] for child in ("0_three", "1_three", "2_three")}
for child, blocks in tables.items():
    print(f"{child}: blocks {list(blocks)}")
shared = set.intersection(*(set(blocks) for blocks in tables.values()))
print(f"prompt of {len(prompt)} tokens: {len(shared)} full blocks held by all three children")
while llm.has_unfinished_requests():
    finished = [out for out in llm.step() if out.finished]
print([(c.index, len(c.token_ids), c.finish_reason) for c in finished[0].outputs])

# %% [markdown]
# The last block of the prompt is partial, so each child computes it and writes its own: only full
# blocks are hashed and shared (lesson 08). A seeded request repeats itself exactly; the same
# request again, alone or beside others, gives the same tokens:

# %%
seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)


def serve(requests: dict[str, SamplingParams]) -> dict[str, list[int]]:
    """Add every request at once, step until all are done; each request's tokens."""
    tokens: dict[str, list[int]] = {}
    for request_id, params in requests.items():
        llm.add_request(request_id, prompt, params)
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


alone = serve({"alone": seeded})["alone"]
crowd = serve({"crowd": seeded, "other-1": three, "other-2": SamplingParams(temperature=1.0, max_tokens=12)})
print("same tokens alone and in a crowd:", alone == crowd["crowd"])

# %% [markdown]
# ## 3. An OpenAI-compatible server
#
# `vllm serve MODEL` starts an HTTP server (FastAPI on uvicorn) that speaks OpenAI's API:
# `/v1/models`, `/v1/completions`, `/v1/chat/completions`, plus `/health`, `/metrics`,
# `/tokenize`, `/detokenize` and `/version`. Any
# client of OpenAI's API can use it by changing one URL. `paged-kv serve` is the course's: the same
# routes, FastAPI and uvicorn as vLLM's, over `AsyncLLM` and the cache you built. From a terminal:
#
# ```bash
# paged-kv serve --port 8000          # or: make serve
# ```
#
# Here the server runs in a background thread of this notebook, on a free port of 127.0.0.1, and
# the last cell stops it. `AsyncLLM` runs the engine loop: when a request arrives, the loop hands
# steps to a worker thread until nothing is left, and each client's coroutine receives its outputs
# as the steps produce them.

# %%
async_llm = AsyncLLM.from_engine_args(model, settings, decode=decode)  # a new engine, the same settings
app = build_app(async_llm, model_name="tiny-gpt", encode=encode)  # max_model_len: the engine's
server = ServerThread(app)  # binds 127.0.0.1 on a free port; returns once /health answers
client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed")
print([m.id for m in client.models.list().data])

# %% [markdown]
# The real `openai` client sends a completion and a chat completion. The server turns the text into
# tokens, the chat messages into one prompt (vLLM applies the model's chat template; the course
# uses a plain one), and counts the tokens it used:

# %%
completion = client.completions.create(
    model="tiny-gpt", prompt="The KV cache", max_tokens=16, temperature=0.0
)
choice = completion.choices[0]
print(f"{completion.usage.prompt_tokens} prompt tokens, {completion.usage.completion_tokens} generated,")
print(f"finish_reason={choice.finish_reason!r}")
chat = client.chat.completions.create(
    model="tiny-gpt",
    messages=[{"role": "user", "content": "What does a block table hold?"}],
    max_tokens=12,
    seed=3,
)
print(f"chat: {chat.usage.completion_tokens} tokens, finish_reason={chat.choices[0].finish_reason!r}")

# %% [markdown]
# The text itself, which is noise offline:

# %%
# NBVAL_IGNORE_OUTPUT
print(repr(choice.text))
print(repr(chat.choices[0].message.content))

# %% [markdown]
# With `stream=True` the server answers with *server-sent events*: one `data: {...}` line per chunk
# of new text, as each step produces it, then `data: [DONE]`. The client reads them as they come.
# Count the chunks and time the first one:

# %%
start = time.perf_counter()
chunks, first_chunk = [], None
stream = client.completions.create(
    model="tiny-gpt", prompt="Blocks are taken on demand", max_tokens=24, temperature=0.0, stream=True
)
for chunk in stream:
    if first_chunk is None:
        first_chunk = time.perf_counter() - start
    chunks.append(chunk.choices[0])
print(f"{len(chunks)} chunks; the last says finish_reason={chunks[-1].finish_reason!r}")

# %%
# NBVAL_IGNORE_OUTPUT
print(
    f"first chunk after {1e3 * first_chunk:.0f} ms, the whole answer after {1e3 * (time.perf_counter() - start):.0f} ms"
)

# %% [markdown]
# ## 4. What clients send: log-probabilities, tenants and ranks
#
# A client sends more than a prompt, and a server that drops a field in silence answers a question
# nobody asked. Every field of OpenAI's requests and vLLM's extra ones is served here, accepted
# where its value changes nothing, or refused with a 400 that names it
# (`docs/server_fields.md` lists them all); a field no API declares is ignored and logged, as vLLM
# logs it. Log-probabilities come back in OpenAI's shapes: a chat answer's `logprobs.content`, a
# completion's `tokens` and `token_logprobs`, and with `echo=True` the prompt's tokens scored
# first, which is how evaluation harnesses score a text without generating one:

# %%
chat = client.chat.completions.create(
    model="tiny-gpt",
    messages=[{"role": "user", "content": "Hi"}],
    max_tokens=2,
    temperature=0.0,
    logprobs=True,
    top_logprobs=2,
)
for entry in chat.choices[0].logprobs.content:
    print(
        f"{entry.token!r}: {entry.logprob:.3f}; top 2:",
        [(t.token, round(t.logprob, 3)) for t in entry.top_logprobs],
    )
scored = client.completions.create(
    model="tiny-gpt", prompt="A block", max_tokens=0, echo=True, logprobs=1, temperature=0.0
)
logprobs = scored.choices[0].logprobs
print("echo:", logprobs.tokens, [None if lp is None else round(lp, 3) for lp in logprobs.token_logprobs])

# %% [markdown]
# The echoed prompt's scores are the prompt log-probabilities of section 2's probe, the same
# prompt on the same model. Two of vLLM's extra fields are the KV cache's own business.
#
# **`cache_salt`.** Prefix caching shares a block between any two requests whose prefixes match,
# whoever sent them, and a hit answers sooner. So the time to first token tells a client whether
# someone sent that prefix lately: a side channel between the tenants of one server. vLLM closes
# it with a salt per tenant. The salt enters the hash of the request's first block, as one of its
# *extra keys* (`generate_block_hash_extra_keys`); every later block's hash chains its parent's, so
# the whole chain differs and two salts never share a block, while one salt shares as before. A
# LoRA adapter's name is an extra key of every block, so that two adapters' K/V never mix. On the
# engine of section 1, a long system prompt sent by tenant A twice, then by tenant B:

# %%
system = encode("You are tenant A's support bot; its customer list is private. " * 4)


def first_step(request_id: str, salt: str) -> tuple[int, float, list[int]]:
    """Add one request under ``salt``: its cached tokens, first step's seconds and full blocks."""
    llm.add_request(request_id, system, SamplingParams(temperature=0.0, max_tokens=2), cache_salt=salt)
    start = time.perf_counter()
    (out,) = llm.step()
    seconds = time.perf_counter() - start
    blocks = list(pool.get_block_ids(request_id)[0][: len(system) // settings.block_size])
    while llm.has_unfinished_requests():
        llm.step()
    return out.num_cached_tokens, seconds, blocks


tenants = {
    rid: first_step(rid, salt) for rid, salt in (("a1", "tenant-a"), ("a2", "tenant-a"), ("b1", "tenant-b"))
}
for request_id, (cached, _, blocks) in tenants.items():
    print(f"{request_id}: {cached:>3} of {len(system)} prompt tokens from the cache; full blocks {blocks}")

# %%
# NBVAL_IGNORE_OUTPUT
print("first step: " + ", ".join(f"{rid} {1e3 * seconds:.1f} ms" for rid, (_, seconds, _) in tenants.items()))

# %% [markdown]
# Tenant A's second request finds the 15 full blocks of A's first, 240 tokens, and computes only
# the 8 tokens of its last, partial block; tenant B computes all 248 in blocks of its own, its first
# step about as slow as a miss: the hit B could have timed is not there for B. A client sends the salt as vLLM's extra body field,
# `extra_body={"cache_salt": "tenant-a"}`; an empty salt, or one with `@`, `/`, `\` or a NUL in
# it, is refused with vLLM's message.
#
# **`priority`.** `--scheduling-policy priority` orders the waiting requests by `(priority,
# arrival_time)` and takes the blocks of the running request with the largest (lesson 11,
# section 5). This server runs vLLM's default, first come first served, and there a priority
# other than 0 is refused rather than ignored, as vLLM's API documents; `paged-kv serve
# --scheduling-policy priority` takes it. Three requests the server refuses, each by name:

# %%
refused = [{"priority": -1}, {"cache_salt": ""}, {"response_format": {"type": "json_object"}}]
for extra in refused:
    try:
        client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=extra
        )
    except openai.BadRequestError as error:
        print(f"{error.status_code}, param {error.body['param']!r}: {error.body['message']}")

# %% [markdown]
# ## 5. A client who hangs up
#
# A user closes the tab in the middle of an answer. The server sees the connection close, the
# coroutine that was waiting for the request's next output is cancelled, and it aborts the request
# (vLLM: `AsyncLLM.abort`). The abort is applied before the engine's next step, so the request's
# blocks are free before anything else is scheduled. The server's `/kv/state` (the numbers of the
# live page of section 7) shows it: open a stream of up to 200 tokens, read five chunks, and hang up.


# %%
def kv_state() -> dict:
    return httpx.get(f"{server.url}/kv/state").json()


with httpx.Client(base_url=server.url, timeout=30) as http:
    body = {"model": "tiny-gpt", "prompt": "A long answer " * 8, "max_tokens": 200, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for count, _ in enumerate(response.iter_lines()):
            if count == 0:
                during = kv_state()
            if count >= 5:
                break  # leaving the block closes the connection: the client hangs up
print(f"while it streamed: {during['num_running']} running")
for _ in range(100):  # the server notices within a step or two
    after = kv_state()
    if after["num_running"] == 0:
        break
    time.sleep(0.05)
print(f"after it hung up: {after['num_running']} running, usage {after['kv_cache_usage_perc']:.0%}")

# %% [markdown]
# Without the abort, the request would go on decoding its 200 tokens for nobody, holding its blocks
# and its share of every step. vLLM guards the other end of the path too: a request cancelled
# before it got a block is freed as one with none (`SingleTypeKVCacheManager.pop_blocks_for_free`
# in `vllm/v1/core/single_type_kv_cache_manager.py` defaults to an empty list).

# %% [markdown]
# ## 6. `/metrics`, by vLLM's names
#
# A vLLM server publishes its counters, gauges and histograms at `/metrics`, in Prometheus' text
# format, and Grafana dashboards read them. Lesson 15 computed each from a finished run; the
# server keeps them live, with `prometheus_client`, and the names are vLLM 0.33.0's. Read the
# gauges and counters of the requests so far:

# %%
metrics = httpx.get(f"{server.url}/metrics").text
wanted = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_success_total",
)
for line in metrics.splitlines():
    if line.startswith(wanted):
        print(line)

# %% [markdown]
# The usage is 0 % between requests even though the prefix cache still holds their blocks: a free
# block that caches a prefix counts as free (lesson 15). The histograms hold seconds, a bucket per
# bound (`le="0.1"`: requests whose first token came within 100 ms); the count of
# `vllm:time_to_first_token_seconds` is one per request that got a first token, the hung-up one
# included, and `vllm:request_success` counts the requests by how they ended: three reached their
# `max_tokens` (`length`). The one that hung up is in none of them: vLLM's front end aborts it
# (`OutputProcessor.abort_requests`) and drops its state without recording it as finished, so a
# client's hang-up leaves no trace in `vllm:request_success`; the course's server does the same.

# %% [markdown]
# ## 7. The KV cache, live
#
# The server also serves a page, `/kv`, that draws the pool with lesson 02's picture and updates it
# after every step, by server-sent events: each running request's blocks in its colour, its block
# table, the free queue in eviction order, and the usage gauge. Open `{server.url}/kv` in a browser
# while requests stream and watch blocks taken on demand, shared by prefix caching, freed on finish
# and on abort (the repository's `docs/images/kv_page.png` is a screenshot of it, taken while three
# requests streamed). The same picture, drawn here from the server's state while two clients stream
# the same prompt: the pool is drawn as soon as a step has both running, then both hang up.

# %%
shared_prompt = "Two clients send the same long system prompt first. " * 2
body = {"model": "tiny-gpt", "prompt": shared_prompt, "max_tokens": 200, "temperature": 0.0, "stream": True}
with (
    httpx.Client(base_url=server.url, timeout=30) as http,
    http.stream("POST", "/v1/completions", json=body) as one,
    http.stream("POST", "/v1/completions", json=body) as two,
):
    deadline = time.monotonic() + 10  # the view is the pool after the engine's last step: watch it
    view = async_llm.kv_view  # until a step has both requests running (10 s at most)
    while len(view.snapshot.tables) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
        view = async_llm.kv_view
    for response in (one, two):  # each client reads a chunk, then hangs up
        next(response.iter_lines())
tables = [set(table.block_ids) for table in view.snapshot.tables.values()]
print(f"{len(tables)} requests running; {len(set.intersection(*tables))} blocks held by both")

# %%
# NBVAL_IGNORE_OUTPUT
display(HTML(render_allocator(view.snapshot, caption=f"the server's pool at step {view.step}")))

# %%
server.stop()  # the engine loop stops; every block is free
print("stopped; KV cache usage:", async_llm.kv_view.kv_cache_usage)

# %% [markdown]
# ## In vLLM
#
# Checked against vLLM 0.33.0.
#
# * `vllm/v1/engine/async_llm.py`: `AsyncLLM.generate` is an async generator of `RequestOutput`;
#   when the caller stops iterating (`asyncio.CancelledError`, `GeneratorExit`) it calls `abort`,
#   and an `output_handler` task moves outputs from the engine core to each request's queue.
# * `vllm/v1/engine/core.py`: `EngineCore.step` is `schedule`, `execute_model`,
#   `update_from_output`; `EngineCoreProc` runs it in its own process, in `run_busy_loop`, and
#   applies queued `add_request` and `abort_requests` calls between steps.
# * `vllm/v1/engine/output_processor.py`: `OutputProcessor.process_outputs` detokenizes, checks
#   stop strings and returns the requests a stop string finished, for the core to abort.
# * `vllm/v1/engine/parallel_sampling.py`: `ParentRequest` fans `n` out into children named
#   `f"{index}_{request_id}"` with seeds `seed + index`.
# * `vllm/sampling_params.py`: `SamplingParams` with the defaults and messages of section 2
#   (`n must be 1 when using greedy sampling`).
# * `vllm/entrypoints/openai/`: the API server's routers (`completion/`, `chat_completion/`,
#   `models/`); `vllm/entrypoints/serve/engine/protocol.py` has `ErrorResponse`, the error format,
#   and `OpenAIBaseModel`, which logs "The following fields were present in the request but
#   ignored"; `vllm/entrypoints/openai/chat_completion/serving.py` has `_create_chat_logprobs`
#   and `vllm/entrypoints/openai/completion/serving.py` `_create_completion_logprobs`, the shapes
#   of section 4's log-probabilities.
# * `vllm/v1/engine/logprobs.py`: `LogprobsProcessor` keeps a request's sample and prompt
#   log-probabilities; `vllm/v1/sample/logits_processor/builtin.py` has `LogitBiasLogitsProcessor`,
#   `MinTokensLogitsProcessor` and `MinPLogitsProcessor`, and `vllm/v1/sample/ops/penalties.py`
#   `apply_all_penalties`: section 2's table.
# * `vllm/v1/core/kv_cache_utils.py`: `generate_block_hash_extra_keys` puts a request's LoRA name
#   in every block's extra keys and its `cache_salt` in the first block's; `hash_block_tokens`
#   hashes the parent's hash, the block's tokens and those keys: section 4's tenants.
# * `vllm/v1/metrics/loggers.py`: `PrometheusStatLogger` declares the `vllm:` metrics read in
#   section 6.
#
# What the course leaves out or does differently: one process, the engine stepping in a worker
# thread, where vLLM runs the engine core in a process of its own behind ZeroMQ (and its API server
# can run several front-end processes); a plain chat template instead of the tokenizer's; no
# tool calls, structured output, LoRA adapters (the name is only a hash key) or API keys, each
# refused by name when asked for; a priority under FCFS is refused, as vLLM's API documents (its
# 0.33.0 code lets it through); a stream sends a chunk per
# step, where vLLM can batch them (`stream_interval`); `n` children share blocks through prefix
# caching only, as in vLLM v1, not through lesson 08's fork.

# %% [markdown]
# ## Recap
#
# * An online engine has three entry points: `add_request` queues, `step` runs one step and returns
#   each moved request's output, `abort_request` finishes requests wherever they are and frees a
#   running one's blocks at once.
# * Sampling parameters change how a token is chosen, not how the cache works; log-probabilities
#   come from the raw logits, before any of them; `n` completions of one prompt share its full
#   blocks through prefix caching.
# * Every request field is served, a no-op, or refused by name. `cache_salt` enters the first
#   block's hash: tenant A's second request found 240 of its 248 tokens cached, tenant B none.
# * `paged-kv serve` puts the cache you built behind OpenAI's API: the `openai` client talks to it
#   unchanged, streams by server-sent events, and a client that hangs up frees its blocks before
#   the next step.
# * `/metrics` publishes vLLM's `vllm:` metrics live; `/kv` draws the pool as it moves.
#
# This is the end of the course. The exercise asks you to write three pieces of the front end:
# cutting text at a stop string, naming a request's children, and aborting requests.

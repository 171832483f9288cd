"""vLLM 0.33.0's start-up sizing, whole (lesson 00): the budget, the pool, the line it logs, its errors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

from paged_kv import kv_cache_report
from paged_kv.kv.sizing import KVCacheSpec
from paged_kv.kv.startup import (
    NO_MEMORY,
    KVCacheReport,
    estimate_activation_peak,
    format_gib,
    kv_heads_per_gpu,
    measure_activation_peak,
    model_shape,
    startup_lines,
)
from paged_kv.model.config import GPTConfig
from paged_kv.model.tiny_gpt import TinyGPT

pytestmark = pytest.mark.lesson14

KiB, MiB, GiB = 2**10, 2**20, 2**30
GPUS = {"24 GB": 24 * GiB, "80 GB": 80 * GiB, "141 GB": 141 * GiB}  # the labels, taken as GiB

# The published configs (config.json on the Hugging Face Hub), written out: no download.
SMOLLM2_135M = LlamaConfig(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    num_hidden_layers=30,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    dtype="bfloat16",
)
LLAMA_3_8B = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    vocab_size=128256,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
GEMMA_3_27B = Gemma3TextConfig(  # the language model of google/gemma-3-27b-it (its text_config)
    hidden_size=5376,
    intermediate_size=21504,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=128,
    num_hidden_layers=62,
    vocab_size=262208,
    sliding_window=1024,
    max_position_embeddings=131072,
    dtype="bfloat16",
)
LLAMA_3_8B_JSON = {  # the same model as its config.json dict
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODELS = {
    "SmolLM2-135M": (SMOLLM2_135M, 8192),
    "Llama-3-8B": (LLAMA_3_8B, 8192),
    "Gemma 3 27B": (GEMMA_3_27B, 131072),
}


def report(config=LLAMA_3_8B, gpu="24 GB", **settings) -> KVCacheReport:
    settings.setdefault("max_model_len", 8192)
    return kv_cache_report(config, gpu_memory_bytes=GPUS[gpu], **settings)


def error_of(call) -> str:
    with pytest.raises(ValueError) as caught:
        call()
    return str(caught.value)


# ------------------------------------------------------------------------------ the shapes


def test_the_parameters_counted_from_the_shapes_are_the_published_counts():
    assert model_shape(SMOLLM2_135M).num_parameters() == 134_515_008
    assert model_shape(LLAMA_3_8B).num_parameters() == 8_030_261_248
    # Gemma 3 27B's language model, by hand: the tied embedding, then 62 layers of attention
    # (q and o 5376 x 4096, k and v 5376 x 2048), a gated MLP (3 x 5376 x 21504), four norms of 5376 and
    # the q and k norms of 128; and the final norm.
    layer = 2 * 5376 * 4096 + 2 * 5376 * 2048 + 3 * 5376 * 21504 + 4 * 5376 + 2 * 128
    assert model_shape(GEMMA_3_27B).num_parameters() == 262208 * 5376 + 62 * layer + 5376 == 27_009_346_304
    assert model_shape(LLAMA_3_8B_JSON) == model_shape(LLAMA_3_8B)
    gemma_json = {"model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "head_dim": 128}
    gemma_json |= {"intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16}
    gemma_json |= {"vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6}
    gemma_json |= {
        "torch_dtype": "bfloat16"
    }  # no layer_types, no tie_word_embeddings: transformers' defaults
    assert model_shape(gemma_json).num_parameters() == 27_009_346_304
    assert model_shape(gemma_json).layer_windows == model_shape(GEMMA_3_27B).layer_windows


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("LlamaConfig", {}),
        ("LlamaConfig", {"tie_word_embeddings": True}),
        ("Qwen2Config", {}),  # q, k and v have biases
        ("Qwen3Config", {"head_dim": 24}),  # q and k norms, a head_dim that is not hidden / heads
        ("Gemma2Config", {"head_dim": 24}),  # four norms a layer
        ("Gemma3TextConfig", {"head_dim": 24}),
        ("MistralConfig", {"sliding_window": 32}),
    ],
)
def test_the_count_from_the_shapes_is_the_models_own(name, extra):
    import transformers

    config = getattr(transformers, name)(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=300,
        **extra,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    parameters = {id(p): p for p in model.parameters()}.values()  # a tied head counts once
    assert model_shape(config).num_parameters() == sum(p.numel() for p in parameters)


@pytest.mark.parametrize(
    "config", [GPTConfig(), GPTConfig(vocab_size=100, num_layers=3, num_heads=4, num_kv_heads=2)]
)
def test_the_tiny_gpts_parameters_are_counted_too(config):
    assert model_shape(config).num_parameters() == sum(p.numel() for p in TinyGPT(config).parameters())


def test_the_tiny_gpt_is_sized_like_the_engine_sizes_it():
    config = GPTConfig(
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, sliding_windows=(8, None, 8, None)
    )
    model = TinyGPT(config)
    r = kv_cache_report(config, gpu_memory_bytes=GiB, max_model_len=256, dtype=torch.float32)
    assert r.weight_bytes == model.weight_bytes  # the weights counted from the shapes are the module's
    # Two groups of two layers (lesson 13): a block of the pool is two layers' pages.
    assert r.num_kv_cache_groups == 2 and r.bytes_per_block == 2 * 2 * 16 * 2 * 8 * 4
    # A request of 256 tokens: 16 blocks in the full group; in the sliding one min(7 + 4,096, 256) tokens
    # and one more block, as vLLM reserves even when the window covers the whole request.
    assert r.blocks_per_request == 16 + (16 + 1)


def test_each_layers_window_is_read_as_transformers_reads_it():
    gemma = model_shape(GEMMA_3_27B).layer_windows
    assert len(gemma) == 62 and [i for i, w in enumerate(gemma) if w is None] == list(range(5, 62, 6))
    assert set(gemma) == {None, 1024}
    assert set(model_shape(LLAMA_3_8B).layer_windows) == {None}
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 2, "hidden_size": 8}
    qwen |= {"intermediate_size": 8, "vocab_size": 10, "sliding_window": 4096, "max_window_layers": 2}
    assert model_shape(qwen).layer_windows == (None,) * 4  # use_sliding_window is off
    assert model_shape({**qwen, "use_sliding_window": True}).layer_windows == (None, None, 4096, 4096)
    assert model_shape(Qwen2Config(num_hidden_layers=2)).layer_windows == (None, None)
    mistral = {**qwen, "model_type": "mistral", "max_window_layers": None}
    assert model_shape(mistral).layer_windows == (4096,) * 4


def test_the_models_dtype_is_vllms_auto():
    assert model_shape(LLAMA_3_8B).dtype == torch.bfloat16
    assert model_shape(LlamaConfig(dtype="float16")).dtype == torch.float16
    assert model_shape(LlamaConfig(dtype="float32")).dtype == torch.bfloat16  # vLLM downcasts float32
    assert model_shape(GPTConfig()).dtype == torch.bfloat16  # no dtype named: vLLM's auto
    assert model_shape(GPTConfig(), torch.float32).dtype == torch.float32  # a given dtype is kept


# ------------------------------------------------------------------------------ worked numbers


def test_llama_3_8b_on_a_24_gb_gpu_by_hand():
    r = report()
    assert r.requested_memory == math.ceil(24 * GiB * 0.9) == 23_192_823_399  # request_memory rounds up
    assert r.weight_bytes == 8_030_261_248 * 2 and r.weight_source == "from the config's shapes"
    # The estimate: 2,048 tokens x 2 bytes x (2 x 4096 + the MLP's 3 x 14336), then 128 rows of 128,256
    # float32 logits, twice.
    assert r.activation_peak_bytes == 2048 * 2 * (2 * 4096 + 3 * 14336) + 128 * 128256 * 4 * 2 == 341_049_344
    assert r.available_kv_cache_memory == 23_192_823_399 - 16_060_522_496 - 341_049_344 == 6_791_251_559
    assert r.bytes_per_block == 32 * 2 * 16 * 8 * 128 * 2 == 2 * MiB
    assert r.num_gpu_blocks == 6_791_251_559 // (2 * MiB) == 3238
    assert r.blocks_per_request == 8192 // 16 == 512
    assert r.max_concurrency == 3238 / 512
    assert r.kv_cache_tokens == int(3238 / 512 * 8192) == 51_808
    assert r.lines == (
        "Available KV cache memory: 6.32 GiB",
        "GPU KV cache size: 51,808 tokens, Maximum concurrency for 8,192 tokens per request: 6.32x",
    )
    assert r.non_kv_cache_memory == r.weight_bytes + r.activation_peak_bytes
    assert r.num_kv_cache_groups == 1 and r.num_kv_heads_per_gpu == 8 and r.model == "llama"
    assert r.summary().endswith("\n".join(r.lines))


def test_gemma_3_27b_on_an_80_gb_gpu_by_hand():
    r = report(GEMMA_3_27B, "80 GB", max_model_len=131072)
    # Ten full layers (5, 11, .., 59) and 52 sliding ones: groups of 10 layers, one full and six sliding
    # (9, 9, 9, 9, 8 and 8 layers), so a block of the pool is 10 layers' pages.
    assert r.num_kv_cache_groups == 7
    assert r.bytes_per_block == 10 * 2 * 16 * 16 * 128 * 2 == 1_310_720
    # One request: every block of its 131,072 tokens in the full group; in each sliding group, the
    # window's 1,023 earlier tokens and two steps of 2,048 tokens in flight, plus one block.
    assert r.blocks_per_request == 131072 // 16 + 6 * (-(-(1023 + 2 * 2048) // 16) + 1) == 10_118
    assert r.num_gpu_blocks == r.available_kv_cache_memory // 1_310_720 == 17_329
    assert r.kv_cache_tokens == int(17_329 / 10_118 * 131072) == 224_485
    assert r.lines[1] == (
        "GPU KV cache size: 224,485 tokens, Maximum concurrency for 131,072 tokens per request: 1.71x"
    )
    sync = report(GEMMA_3_27B, "80 GB", max_model_len=131072, async_scheduling=False)
    assert sync.blocks_per_request == 8192 + 6 * (-(-(1023 + 2048) // 16) + 1)


LINES = {
    (
        "SmolLM2-135M",
        "24 GB",
    ): "GPU KV cache size: 991,744 tokens, Maximum concurrency for 8,192 tokens per request: 121.06x",
    (
        "SmolLM2-135M",
        "80 GB",
    ): "GPU KV cache size: 3,340,544 tokens, Maximum concurrency for 8,192 tokens per request: 407.78x",
    (
        "SmolLM2-135M",
        "141 GB",
    ): "GPU KV cache size: 5,899,072 tokens, Maximum concurrency for 8,192 tokens per request: 720.10x",
    (
        "Llama-3-8B",
        "24 GB",
    ): "GPU KV cache size: 51,808 tokens, Maximum concurrency for 8,192 tokens per request: 6.32x",
    (
        "Llama-3-8B",
        "80 GB",
    ): "GPU KV cache size: 464,688 tokens, Maximum concurrency for 8,192 tokens per request: 56.72x",
    (
        "Llama-3-8B",
        "141 GB",
    ): "GPU KV cache size: 914,416 tokens, Maximum concurrency for 8,192 tokens per request: 111.62x",
    (
        "Gemma 3 27B",
        "80 GB",
    ): "GPU KV cache size: 224,485 tokens, Maximum concurrency for 131,072 tokens per request: 1.71x",
    (
        "Gemma 3 27B",
        "141 GB",
    ): "GPU KV cache size: 807,094 tokens, Maximum concurrency for 131,072 tokens per request: 6.16x",
}


@pytest.mark.parametrize(("model", "gpu"), list(LINES), ids=lambda x: x)
def test_the_line_for_three_models_on_three_gpus(model, gpu):
    config, length = MODELS[model]
    r = report(config, gpu, max_model_len=length)
    assert r.lines[1] == LINES[model, gpu]
    # The line's numbers are vLLM's: the pool over one request, and the tokens from the concurrency.
    assert r.max_concurrency == r.num_gpu_blocks / r.blocks_per_request
    assert r.kv_cache_tokens == int(r.max_concurrency * length)
    assert r.lines[0] == f"Available KV cache memory: {round(r.available_kv_cache_memory / GiB, 2)} GiB"


def test_gemma_3_27b_does_not_fit_a_24_gb_gpu_at_all():
    message = error_of(lambda: report(GEMMA_3_27B, "24 GB", max_model_len=131072))
    assert message.startswith(NO_MEMORY + "\nFixes, in order: 1. raise gpu_memory_utilization")
    assert "take 50.85 GiB of the 21.6 GiB requested" in message


def test_the_tokens_are_the_concurrency_times_the_length_not_the_blocks_times_the_block_size():
    r = report(max_model_len=1000)  # 63 blocks a request, the last one part full
    assert r.blocks_per_request == 63 and r.num_gpu_blocks == 3238
    assert r.kv_cache_tokens == int(3238 / 63 * 1000) == 51_396 != 3238 * 16


# ------------------------------------------------------------------------------ the null block


def exact_pool(blocks: int, **settings) -> KVCacheReport:
    """Llama-3-8B with exactly ``blocks`` blocks of 2 MiB available and nothing else in the budget."""
    return kv_cache_report(
        LLAMA_3_8B,
        gpu_memory_bytes=blocks * 2 * MiB,
        gpu_memory_utilization=1.0,
        weight_bytes=0,
        activation_peak_bytes=0,
        **{"max_model_len": 8192, **settings},
    )


def test_the_check_reserves_the_null_block_and_the_line_counts_it():
    # 512 blocks hold one request of 8,192 tokens, but the pool keeps its null block back.
    message = error_of(lambda: exact_pool(512))
    assert "max seq len (8192), (1.0 GiB KV cache is needed" in message
    assert "the estimated maximum model length is 8176. " in message  # 511 blocks of 16
    r = exact_pool(513)
    assert (r.num_gpu_blocks, r.blocks_per_request) == (513, 512)
    assert r.max_concurrency == 513 / 512  # 0.33.0's line counts the null block among the pool's
    assert r.lines[1].endswith("Maximum concurrency for 8,192 tokens per request: 1.00x")
    assert r.kv_cache_tokens == 8208


# ------------------------------------------------------------------------------ the errors


def test_one_request_that_does_not_fit_is_vllms_message_verbatim_then_the_fixes_in_order():
    message = error_of(lambda: report(max_model_len=131072))
    vllm, fixes = message.split("\n")
    # available - the null block = 6,789,154,407 bytes: 3,237 blocks of 2 MiB, 51,792 tokens.
    assert vllm == (
        "To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (6.32 GiB). Based on the available "
        "memory, the estimated maximum model length is 51792. Try increasing `gpu_memory_utilization` "
        "(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when "
        "initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for "
        "more details."
    )
    assert fixes == (
        "Fixes, in order: 1. lower max_model_len to 51,792 or less; 2. raise gpu_memory_utilization above "
        "0.9 (at most 1.0); 3. an fp8 KV cache, kv_cache_dtype='fp8': one byte a number, half a 16-bit "
        "cache; 4. tensor parallelism, tensor_parallel_size=2: each GPU holds 1/2 of the weights and of "
        "every block's K/V heads; 5. a smaller max_num_batched_tokens than 2,048: a smaller activation peak."
    )


def test_every_fix_helps():
    def fits(**settings):
        settings.setdefault("max_model_len", 60_000)
        try:
            return report(**settings).kv_cache_tokens
        except ValueError:
            return 0

    assert fits() == 0
    assert fits(max_model_len=51_792) > 0
    assert fits(gpu_memory_utilization=0.95) > 0
    assert fits(kv_cache_dtype="fp8") > 0
    assert fits(tensor_parallel_size=2) > 0
    assert fits(max_num_batched_tokens=512, activation_peak_bytes=0) == 0 < fits(gpu_memory_utilization=1.0)


def test_nothing_left_is_vllms_first_message_verbatim():
    assert NO_MEMORY == (
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
        "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
        "details."
    )
    message = error_of(lambda: report(LLAMA_3_8B, "24 GB", gpu_memory_utilization=0.6))
    assert message.split("\n")[0] == NO_MEMORY
    assert "A shorter max_model_len or an fp8 KV cache cannot help" in message
    # Less than one block besides the null block is nothing, too.
    assert error_of(lambda: exact_pool(1)).startswith(NO_MEMORY)
    assert exact_pool(2, max_model_len=16).num_gpu_blocks == 2  # the null block and one of 16 tokens
    assert error_of(lambda: exact_pool(2, max_model_len=17)).startswith("To serve")  # 17 tokens: 2 blocks
    at_one = error_of(lambda: report(LLAMA_3_8B, "24 GB", gpu_memory_utilization=1.0, weight_bytes=24 * GiB))
    assert "raise gpu_memory_utilization: it is 1.0 already" in at_one


def test_no_length_fits_leaves_the_estimate_out_as_vllm_does():
    # Two blocks: one is the null block, the other holds 16 tokens; a sliding group needs two blocks
    # for even one token (its + 1), so a model that slides everywhere cannot take one.
    mistral = {**LLAMA_3_8B_JSON, "model_type": "mistral", "sliding_window": 4096}
    message = error_of(
        lambda: kv_cache_report(
            mistral,
            gpu_memory_bytes=2 * 2 * MiB,
            gpu_memory_utilization=1.0,
            weight_bytes=0,
            activation_peak_bytes=0,
            max_model_len=16,
        )
    )
    assert "Based on the available memory" not in message
    assert (
        "GiB). Try increasing" in message
        and "1. lower max_model_len (not even one token fits now)" in message
    )


def blocks_for_each_length(config, lengths: np.ndarray, block_size: int, in_flight: int) -> np.ndarray:
    """The blocks one request of each length needs, group by group, with numpy: the test's own formula."""
    from paged_kv.core.kv_cache_groups import SlidingWindowSpec, kv_cache_groups

    total = np.zeros_like(lengths)
    for group in kv_cache_groups(model_shape(config).layer_windows, block_size):
        if isinstance(group.spec, SlidingWindowSpec):
            tokens = np.minimum(group.spec.sliding_window - 1 + in_flight, lengths)
            total += -(-tokens // block_size) + 1
        else:
            total += -(-lengths // block_size)
    return total


@pytest.mark.parametrize(
    ("config", "gpu", "utilization", "length"),
    [
        (LLAMA_3_8B, "24 GB", 0.9, 131072),
        (LLAMA_3_8B, "24 GB", 0.72, 20000),
        (GEMMA_3_27B, "80 GB", 0.66, 131072),
        (GEMMA_3_27B, "80 GB", 0.655, 131072),
        (SMOLLM2_135M, "24 GB", 0.02, 100_000),
    ],
)
def test_the_estimated_max_model_len_is_the_longest_that_fits_by_brute_force(
    config, gpu, utilization, length
):
    message = error_of(lambda: report(config, gpu, gpu_memory_utilization=utilization, max_model_len=length))
    estimated = int(re.search(r"the estimated maximum model length is (\d+)\. ", message)[1])
    fitting = report(config, gpu, gpu_memory_utilization=utilization, max_model_len=estimated)
    lengths = np.arange(1, length + 1)
    needed = fitting.bytes_per_block * blocks_for_each_length(config, lengths, 16, 2 * 2048)
    check_memory = fitting.available_kv_cache_memory - fitting.bytes_per_block
    assert estimated == lengths[needed <= check_memory].max()


# ------------------------------------------------------------------------------ tensor parallelism


def test_each_gpu_holds_its_share_of_the_kv_heads():
    blocks = {tp: report(LLAMA_3_8B, "80 GB", tensor_parallel_size=tp) for tp in (1, 2, 4, 8, 16)}
    assert [blocks[tp].num_kv_heads_per_gpu for tp in blocks] == [8, 4, 2, 1, 1]
    assert [blocks[tp].bytes_per_block for tp in blocks] == [2 * MiB, MiB, 512 * KiB, 256 * KiB, 256 * KiB]
    # The weights are split too, so the tokens grow faster than the GPUs.
    assert blocks[2].weight_bytes < blocks[1].weight_bytes / 2 + 2 * 4096 * 33 * 2
    tokens = [blocks[tp].kv_cache_tokens for tp in blocks]
    assert tokens == sorted(tokens) and tokens[1] > 2 * tokens[0]
    # tp 16 replicates each K/V head on two GPUs: a block costs what it costs at tp 8.
    assert blocks[16].bytes_per_block == blocks[8].bytes_per_block


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "expected"),
    [(32, 8, 1, 8), (32, 8, 2, 4), (32, 8, 8, 1), (32, 8, 16, 1), (32, 8, 32, 1), (9, 3, 3, 1), (9, 3, 9, 1)],
)
def test_kv_heads_per_gpu_follows_vllm(heads, kv_heads, tp, expected):
    assert kv_heads_per_gpu(heads, kv_heads, tp) == expected


@pytest.mark.parametrize(
    ("config", "tp", "message"),
    [
        (LLAMA_3_8B, 3, r"tensor_parallel_size 3 must divide the model's 32 attention heads .*divisible by"),
        (LLAMA_3_8B, 64, r"tensor_parallel_size 64 must divide the model's 32 attention heads"),
        (SMOLLM2_135M, 2, r"tensor_parallel_size 2 must divide the model's 9 attention heads"),
        (SMOLLM2_135M, 6, r"tensor_parallel_size 6 must divide"),
        (GPTConfig(num_heads=12, num_kv_heads=4), 6, r"more than the model's 4 K/V heads and not a multiple"),
        (
            GPTConfig(num_heads=24, num_kv_heads=6),
            4,
            r"tensor_parallel_size 4 must divide the model's 6 K/V heads",
        ),
        (LLAMA_3_8B, 0, r"tensor_parallel_size must be at least 1, got 0"),
    ],
)
def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_refused(config, tp, message):
    with pytest.raises(ValueError, match=message):
        report(config, "80 GB", tensor_parallel_size=tp)


# ------------------------------------------------------------------------------ the cache dtype


def test_an_fp8_block_is_half_a_bfloat16_one():
    bf16 = report()
    fp8 = {name: report(kv_cache_dtype=name) for name in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert {r.bytes_per_block for r in fp8.values()} == {MiB} == {bf16.bytes_per_block // 2}
    assert fp8["fp8"].num_gpu_blocks == 6_791_251_559 // MiB == 2 * bf16.num_gpu_blocks
    assert (
        report(kv_cache_dtype="float16").bytes_per_block == report(kv_cache_dtype="bfloat16").bytes_per_block
    )
    assert report(gpu="80 GB", dtype=torch.float32).bytes_per_block == 4 * MiB  # "auto": the model's


def test_the_blocks_agree_with_the_kv_cache_spec():
    for config in (SMOLLM2_135M, LLAMA_3_8B):
        shape = model_shape(config)
        spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
        for block_size in (1, 16, 32):
            assert report(config, block_size=block_size).bytes_per_block == spec.bytes_per_block(block_size)


# ------------------------------------------------------------------------------ the budget


def test_the_kv_capacity_shrinks_as_the_token_budget_grows():
    for config, gpu, length in ((LLAMA_3_8B, "24 GB", 8192), (GEMMA_3_27B, "141 GB", 131072)):
        reports = [
            report(config, gpu, max_model_len=length, max_num_batched_tokens=budget)
            for budget in (512, 2048, 8192, 16384)
        ]
        peaks = [r.activation_peak_bytes for r in reports]
        assert peaks == sorted(peaks) and len(set(peaks)) == 4
        tokens = [r.kv_cache_tokens for r in reports]
        assert tokens == sorted(tokens, reverse=True) and len(set(tokens)) == 4
    # vLLM's LLM class takes 16,384 by default on an H100: Gemma 3 27B's 128K context then does not start.
    assert error_of(
        lambda: report(GEMMA_3_27B, "80 GB", max_model_len=131072, max_num_batched_tokens=16384)
    ).startswith("To serve at least one request with the model's max seq len (131072)")
    # A hybrid model's request also reserves more blocks in its sliding groups for the tokens in flight.
    per_request = [
        report(GEMMA_3_27B, "80 GB", max_model_len=131072, max_num_batched_tokens=b) for b in (512, 8192)
    ]
    assert per_request[0].blocks_per_request < per_request[1].blocks_per_request


def test_the_measured_parts_are_taken_as_given():
    r = report(
        non_torch_bytes=GiB, cudagraph_bytes=GiB // 2, weight_bytes=15 * GiB, activation_peak_bytes=GiB
    )
    assert (r.weight_source, r.activation_source, r.num_parameters) == ("given", "given", None)
    assert r.available_kv_cache_memory == r.requested_memory - 15 * GiB - GiB - GiB - GiB // 2
    assert r.non_kv_cache_memory == 17 * GiB


def test_the_default_token_budget_is_the_scheduler_configs():
    assert report().max_num_batched_tokens == 2048 and report().max_num_seqs == 128
    assert report(max_num_batched_tokens=2048) == report()


def test_the_estimate_is_linear_in_the_tokens_beyond_the_sampler():
    shape = model_shape(LLAMA_3_8B)
    sampler = 128 * 128256 * 8
    assert estimate_activation_peak(shape, 4096) - sampler == 2 * (
        estimate_activation_peak(shape, 2048) - sampler
    )
    assert estimate_activation_peak(shape, 64) == 64 * 2 * (8192 + 3 * 14336) + 64 * 128256 * 8  # 64 requests
    half = estimate_activation_peak(shape, 2048, tensor_parallel_size=2)
    assert half == 2048 * 2 * (8192 + 3 * 7168) + sampler  # the MLP split, the residual stream whole


@given(
    st.integers(min_value=16, max_value=200).map(lambda g: g * GiB),
    st.floats(min_value=0.5, max_value=1.0),
    st.integers(min_value=1, max_value=3),
)
def test_more_memory_or_utilization_never_means_fewer_blocks(memory, utilization, extra_gib):
    def blocks(memory, utilization):
        try:
            return kv_cache_report(
                LLAMA_3_8B, gpu_memory_bytes=memory, gpu_memory_utilization=utilization, max_model_len=4096
            ).num_gpu_blocks
        except ValueError:
            return 0

    assert blocks(memory, utilization) <= blocks(memory + extra_gib * GiB, utilization)
    assert blocks(memory, utilization) <= blocks(memory, min(1.0, utilization + 0.01 * extra_gib))


@given(
    st.integers(min_value=10**8, max_value=2**38),
    st.sampled_from([SMOLLM2_135M, LLAMA_3_8B, GEMMA_3_27B]),
    st.sampled_from([1, 8, 16, 32]),
    st.sampled_from(["auto", "fp8"]),
    st.integers(min_value=1, max_value=4096),
)
def test_the_pool_is_the_most_whole_blocks_that_fit(memory, config, block_size, cache_dtype, length):
    try:
        r = kv_cache_report(
            config,
            gpu_memory_bytes=memory,
            max_model_len=length,
            block_size=block_size,
            kv_cache_dtype=cache_dtype,
            weight_bytes=0,
        )
    except ValueError as error:
        assert str(error).startswith(("No available memory", "To serve at least one request"))
        return
    blocks, block = r.num_gpu_blocks, r.bytes_per_block
    assert blocks * block <= r.available_kv_cache_memory < (blocks + 1) * block
    assert (blocks - 1) >= r.blocks_per_request  # one request fits besides the null block
    assert r.kv_cache_tokens == int(blocks / r.blocks_per_request * length)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ({"gpu_memory_utilization": math.nan}, r"gpu_memory_utilization must be in \(0, 1\], got nan"),
        ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization must be a number, got str"),
        (
            {"kv_cache_dtype": "float32"},
            r"kv_cache_dtype must be one of \['auto', 'bfloat16', 'float16', 'fp8', ",
        ),
        ({"kv_cache_dtype": "int8"}, r"kv_cache_dtype must be one of .*got 'int8'"),
        ({"max_model_len": 0}, "max_model_len must be at least 1, got 0"),
        ({"max_model_len": 8192.0}, "max_model_len must be an integer"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
        ({"block_size": 0}, "block_size must be at least 1, got 0"),
        ({"weight_bytes": -1}, "weight_bytes must be at least 0, got -1"),
        ({"cudagraph_bytes": 0.5}, "cudagraph_bytes must be an integer"),
        ({"dtype": torch.int8}, "dtype must be a floating point torch.dtype"),
        ({"async_scheduling": 1}, "async_scheduling must be True or False"),
        ({"gpu_memory_bytes": 0}, "gpu_memory_bytes must be at least 1, got 0"),
    ],
)
def test_bad_settings_are_value_errors_naming_the_argument(settings, message):
    arguments = {"gpu_memory_bytes": 24 * GiB, "max_model_len": 8192, **settings}
    with pytest.raises(ValueError, match=message):
        kv_cache_report(LLAMA_3_8B, **arguments)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (object(), r"config must be a transformers config .*, got object"),
        ({**LLAMA_3_8B_JSON, "layer_types": ["full_attention"]}, "lists 1 layer_types for its 32 layers"),
        ({**LLAMA_3_8B_JSON, "layer_types": ["chunked_attention"] * 32}, r"got \['chunked_attention'\]"),
        ({**LLAMA_3_8B_JSON, "num_local_experts": 8}, "a mixture of experts .* give its weight_bytes"),
    ],
)
def test_a_config_it_cannot_read_is_a_value_error(config, message):
    with pytest.raises(ValueError, match=message):
        kv_cache_report(config, gpu_memory_bytes=80 * GiB, max_model_len=8192)


# ------------------------------------------------------------------------------ the pieces


def test_format_gib_is_vllms():
    assert [format_gib(b) for b in (16 * GiB, 6_791_251_559, GiB // 3, 0)] == ["16.0", "6.32", "0.33", "0.0"]
    assert startup_lines(GiB, 1234567, 131072, 2 / 3) == (
        "Available KV cache memory: 1.0 GiB",
        "GPU KV cache size: 1,234,567 tokens, Maximum concurrency for 131,072 tokens per request: 0.67x",
    )


def test_the_report_is_frozen():
    with pytest.raises(AttributeError):
        report().num_gpu_blocks = 1  # type: ignore[misc]


def test_measuring_the_peak_needs_a_gpu():
    if torch.cuda.is_available():
        model = TinyGPT(GPTConfig(max_len=64)).to("cuda")
        assert measure_activation_peak(model, 64) > 0
    with pytest.raises(ValueError, match="reads a CUDA GPU's memory statistics, not 'cpu'"):
        measure_activation_peak(TinyGPT(GPTConfig(max_len=64)), 64)

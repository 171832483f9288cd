"""vLLM's start-up sizing of the KV cache, whole: the budget, the profiled peak, the blocks, the line it logs.

Lesson 00 works it for real models on real GPUs. :func:`kv_cache_report` does, with integers, what a vLLM
0.33.0 engine does between loading the weights and serving the first request, and returns every number
on the way (:class:`KVCacheReport`), down to the two lines vLLM logs. The K/V heads, layers and head size
come from a model config: a ``transformers`` config (``LlamaConfig``, ``Qwen2Config``,
``Gemma3TextConfig``...), the dict of a published ``config.json``, or the course's ``GPTConfig``.

The steps, and where vLLM keeps each (``vllm-project/vllm`` at v0.33.0):

1. **The memory requested**, ``ceil(total_memory * gpu_memory_utilization)``: ``request_memory`` in
   ``vllm/v1/worker/utils.py``, called by ``Worker.init_device`` (``vllm/v1/worker/gpu_worker.py``)
   after the CUDA context, NCCL and cuBLAS are up, so those are not counted against it.
2. **Less the non-KV memory** the profiling run measured (``memory_profiling`` in
   ``vllm/utils/mem_utils.py``, around ``GPUModelRunner.profile_run``, a dummy forward of
   ``max_num_batched_tokens`` tokens split over ``min(max_num_seqs, max_num_batched_tokens)``
   requests, then the sampler on one row per request): ``non_kv_cache_memory = total_consumed +
   transient_peak_headroom``, that is the weights, the memory outside torch that appeared since
   start-up, and the activation peak ``torch_peak - torch_allocated``.
3. **Less the CUDA graphs' estimate** (``GPUModelRunner.profile_cudagraph_memory``: the first two
   graphs of each mode are captured and measured, the rest extrapolated), subtracted because
   ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` is on by default: ``Worker.determine_available_memory``
   returns ``requested_memory - non_kv_cache_memory - cudagraph_memory_estimate``.
4. **The pool**: ``num_blocks = available // bytes_per_block`` (``get_kv_cache_configs`` in
   ``vllm/v1/core/kv_cache_planning.py``), where a block holds ``block_size`` tokens of K and V for
   every layer of the largest KV-cache group (``_get_kv_cache_bytes_per_block``): all the layers of a
   model that attends alike, ``group_size`` layers of a hybrid one (``kv_cache_groups`` and
   ``num_tensors`` of :mod:`paged_kv.core.kv_cache_groups`).
   One layer's page is ``2 * block_size * num_kv_heads * head_size * dtype size``
   (``AttentionSpec.page_size_bytes`` in ``vllm/v1/kv_cache_interface.py``), with the K/V heads of
   *one* GPU: ``max(1, num_kv_heads // tensor_parallel_size)`` (``ModelConfig.get_num_kv_heads``,
   ``vllm/config/model.py``; below one head per GPU the heads are replicated).
5. **The check** that one request of ``max_model_len`` fits (``_check_enough_kv_cache_memory``, called
   by ``get_kv_cache_configs``), after reserving the bytes of the **null block** that ``BlockPool``
   holds back for good: ``available - bytes_per_block`` must hold
   ``bytes_per_block * blocks_per_request`` (``_max_memory_usage_bytes_from_groups``), where a request
   needs ``ceil(max_model_len / block_size)`` blocks in a full-attention group and
   ``ceil(min(sliding_window - 1 + max_in_flight_tokens, max_model_len) / block_size) + 1`` in a
   sliding-window one (``SlidingWindowSpec.max_admission_blocks_per_request``), ``max_in_flight_tokens``
   being ``max_num_batched_tokens`` times 2 with async scheduling (the default), else 1
   (``VllmConfig.max_in_flight_tokens``). When it does not fit, the error estimates the longest
   ``max_model_len`` that would, by binary search (``_estimate_max_model_len_from_groups``).
6. **The line**: ``max_concurrency = num_blocks / blocks_per_request`` and ``tokens =
   int(max_concurrency * max_model_len)`` (``get_max_concurrency_for_kv_cache_config`` and
   ``get_kv_cache_capacity`` in ``vllm/v1/core/kv_cache_utils.py``), logged by
   ``update_kv_cache_capacity`` with thousands separators and two decimals. There ``num_blocks`` is the
   whole pool, the null block *included*: 0.33.0 reserves it for the check of step 5, not for the line.

What a GPU measures and a CPU cannot, the report estimates or takes as given, and says which
(:attr:`KVCacheReport.weight_source`, :attr:`KVCacheReport.activation_source`): the weights are the
parameter count of the config's shapes times the model's dtype size (or ``weight_bytes=``); the
activation peak is :func:`estimate_activation_peak` (or ``activation_peak_bytes=``, measured on a GPU by
:func:`measure_activation_peak`); the memory outside torch and the CUDA graphs are ``non_torch_bytes=``
and ``cudagraph_bytes=``, 0 unless given (read them from a vLLM log; 0 graphs is ``enforce_eager=True``).
"""

from __future__ import annotations

import gc
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from paged_kv.core.block import blocks_for_tokens
from paged_kv.core.kv_cache_groups import SlidingWindowSpec, kv_cache_groups, num_tensors
from paged_kv.kv.sizing import format_bytes
from paged_kv.validate import check_count

GiB = 1 << 30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM 0.33.0's ``SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS`` (``vllm/config/scheduler.py``). The
engine's arguments pick larger ones by hardware (``EngineArgs.get_batch_defaults``: 8,192 for ``vllm
serve`` and 16,384 for ``LLM`` on an H100 or H200), so pass the one your engine logs."""
DEFAULT_MAX_NUM_SEQS = 128
"""vLLM 0.33.0's ``SchedulerConfig.DEFAULT_MAX_NUM_SEQS`` (256 or 1,024 by hardware in ``EngineArgs``)."""
KV_CACHE_DTYPE_BYTES: dict[str, int | None] = {
    "auto": None,  # the model's dtype
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,  # vLLM's alias of fp8_e4m3
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
"""The ``kv_cache_dtype`` strings served here, a subset of vLLM 0.33.0's ``CacheDType``
(``vllm/config/cache.py``), and the bytes of one number in each. vLLM has no ``"float32"`` cache dtype."""
CONSERVING_MEMORY = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"
SAMPLER_COPIES = 2
"""The float32 ``(requests, vocab)`` tensors the estimate counts for the sampler: logits and probabilities."""


# ------------------------------------------------------------------------------ the model's shape


@dataclass(frozen=True)
class ModelShape:
    """What the start-up sizing reads from a model config: the K/V side (layers, heads, head size,
    each layer's sliding window, dtype) and the shapes the weights and activations are counted from.

    ``mlp_matrices`` is 3 for a gated MLP (Llama's gate, up and down) and 2 for a plain one (the tiny
    GPT's); ``norm_vectors`` counts the ``hidden_size`` vectors of a layer's norms (2 RMSNorms: 2;
    Gemma's four: 4; two LayerNorms, weight and bias: 4); ``qk_norm`` adds Gemma 3's and Qwen3's
    ``head_dim`` norms of q and k; ``position_rows`` are learned position embeddings (0 with rotary).
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype
    layer_windows: tuple[int | None, ...]
    tie_word_embeddings: bool = False
    mlp_matrices: int = 3
    attention_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    norm_vectors: int = 2
    qk_norm: bool = False
    final_norm_vectors: int = 1
    position_rows: int = 0
    num_experts: int = 0

    def num_parameters(self, tensor_parallel_size: int = 1) -> int:
        """The parameters one GPU holds under tensor parallelism (all of them at 1), from the shapes.

        Sharded as vLLM shards them: the query heads, the K/V heads (each GPU at least one), the MLP's
        ``intermediate_size`` and the vocabulary are split ``tensor_parallel_size`` ways; norms,
        ``hidden_size`` biases and learned positions are replicated. The vocabulary is not padded
        (vLLM pads it to a multiple of 64, a few rows more). A tied head shares the embedding.
        """
        tp = tensor_parallel_size
        hidden, head_dim = self.hidden_size, self.head_dim
        q_width = self.num_heads // tp * head_dim
        kv_width = kv_heads_per_gpu(self.num_heads, self.num_kv_heads, tp) * head_dim
        inner = blocks_for_tokens(self.intermediate_size, tp)
        attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
        attention += (q_width + 2 * kv_width) * self.attention_bias + hidden * self.output_bias
        mlp = self.mlp_matrices * hidden * inner + ((self.mlp_matrices - 1) * inner + hidden) * self.mlp_bias
        norms = self.norm_vectors * hidden + 2 * head_dim * self.qk_norm
        rows = blocks_for_tokens(self.vocab_size, tp)
        embeddings = rows * hidden * (1 if self.tie_word_embeddings else 2) + self.position_rows * hidden
        return self.num_layers * (attention + mlp + norms) + embeddings + self.final_norm_vectors * hidden


def model_shape(config: object, dtype: torch.dtype | None = None) -> ModelShape:
    """The :class:`ModelShape` of a ``transformers`` config, a ``config.json`` dict or a ``GPTConfig``.

    ``dtype`` is the model's dtype. ``None`` is vLLM's ``dtype="auto"`` (``_resolve_auto_dtype`` in
    ``vllm/config/model.py``): the config's ``dtype`` (``torch_dtype`` in older configs), and a
    float32 model, or a config that names none (the ``GPTConfig``), runs in bfloat16 on a GPU that has
    it. A given dtype is taken as it is.

    The weights are counted for the dense decoders of the Llama family (Llama, Mistral, Qwen2 and 3,
    Gemma 2 and 3, the tiny GPT); a mixture of experts is refused unless its ``weight_bytes`` are given
    to :func:`kv_cache_report` (its ``num_experts`` is kept so the report can say so).

    Raises:
        ValueError: not a config of a known kind (the message lists them), a layer type other than
            full or sliding attention, or layer types of another length than the layers.
    """
    if isinstance(config, Mapping):
        get = config.get
    else:

        def get(name: str, default: object = None) -> object:
            return getattr(config, name, default)

    if get("num_hidden_layers") is None and get("text_config") is not None:  # a multimodal config
        return model_shape(get("text_config"), dtype)
    if get("num_hidden_layers") is not None:
        # transformers 5 names it dtype and warns on reading torch_dtype; a config.json may have either
        named = get("dtype") if isinstance(config, Mapping) or hasattr(config, "dtype") else None
        if named is None and (isinstance(config, Mapping) or not hasattr(config, "dtype")):
            named = get("torch_dtype")
        return _hf_shape(get, _model_dtype(named, dtype))
    if get("num_layers") is not None and get("d_model") is not None:  # the course's GPTConfig
        d = config.d_model  # type: ignore[attr-defined]
        windows = config.sliding_windows or (None,) * config.num_layers  # type: ignore[attr-defined]
        return ModelShape(
            name="GPTConfig",
            num_layers=config.num_layers,  # type: ignore[attr-defined]
            num_heads=config.num_heads,  # type: ignore[attr-defined]
            num_kv_heads=config.num_kv_heads,  # type: ignore[attr-defined]
            head_dim=config.head_dim,  # type: ignore[attr-defined]
            hidden_size=d,
            intermediate_size=4 * d,
            vocab_size=config.vocab_size,  # type: ignore[attr-defined]
            dtype=_model_dtype(None, dtype),
            layer_windows=tuple(windows),
            mlp_matrices=2,
            attention_bias=True,
            output_bias=True,
            mlp_bias=True,
            norm_vectors=4,
            final_norm_vectors=2,
            position_rows=config.max_len,  # type: ignore[attr-defined]
        )
    raise ValueError(
        "config must be a transformers config (LlamaConfig, Qwen2Config, Gemma3TextConfig...), the dict "
        f"of a config.json or paged_kv's GPTConfig, got {type(config).__name__}"
    )


def _hf_shape(get: Callable[..., object], dtype: torch.dtype) -> ModelShape:
    kind = str(get("model_type") or "")
    layers = check_count("num_hidden_layers", get("num_hidden_layers"), minimum=1)
    heads = check_count("num_attention_heads", get("num_attention_heads"), minimum=1)
    hidden = check_count("hidden_size", get("hidden_size"), minimum=1)
    kv_heads = check_count("num_key_value_heads", get("num_key_value_heads") or heads, minimum=1)
    head_dim = check_count("head_dim", get("head_dim") or hidden // heads, minimum=1)
    gemma = kind.startswith(("gemma2", "gemma3"))
    return ModelShape(
        name=kind or "transformers config",
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=check_count("intermediate_size", get("intermediate_size"), minimum=1),
        vocab_size=check_count("vocab_size", get("vocab_size"), minimum=1),
        dtype=dtype,
        layer_windows=_hf_windows(get, kind, layers),
        # transformers' default where a config.json leaves it out: Gemma ties, Llama, Mistral, Qwen do not
        tie_word_embeddings=bool(get("tie_word_embeddings", kind.startswith("gemma"))),
        attention_bias=bool(get("attention_bias", kind == "qwen2")),  # Qwen2's q, k, v have biases
        mlp_bias=bool(get("mlp_bias", False)),
        norm_vectors=4 if gemma else 2,
        qk_norm=kind.startswith(("gemma3", "qwen3")),
        num_experts=int(get("num_local_experts") or get("num_experts") or 0),
    )


def _hf_windows(get: Callable[..., object], kind: str, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (``None``: full attention), as ``transformers`` reads them."""
    window = get("sliding_window")
    types = get("layer_types")
    if types is None:
        pattern = get("sliding_window_pattern") or (2 if kind == "gemma2" else None)
        if pattern and window:  # Gemma 2 and 3 before layer_types: every pattern-th layer is full
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
            ]
        elif window and get("use_sliding_window", not kind.startswith("qwen")):
            # Mistral slides in every layer; Qwen2 and 3, with use_sliding_window, from max_window_layers on
            first = (get("max_window_layers") or 0) if kind.startswith("qwen") else 0
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            types = ["full_attention"] * layers
    types = list(types)
    if len(types) != layers:
        raise ValueError(f"the config lists {len(types)} layer_types for its {layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types must be full_attention or sliding_attention, got {unknown}")
    if "sliding_attention" in types:
        window = check_count("sliding_window", window, minimum=1)
    return tuple(window if layer_type == "sliding_attention" else None for layer_type in types)


def _model_dtype(named: object, given: torch.dtype | None) -> torch.dtype:
    if given is not None:
        if not isinstance(given, torch.dtype) or not given.is_floating_point:
            raise ValueError(f"dtype must be a floating point torch.dtype, got {given!r}")
        return given
    if isinstance(named, str):
        named = getattr(torch, named.removeprefix("torch."), None)
    if not isinstance(named, torch.dtype) or named == torch.float32:
        return torch.bfloat16  # vLLM's "auto": a float32 model (or none named) runs in bfloat16
    return named


def kv_heads_per_gpu(num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> int:
    """The K/V heads each GPU keeps of every block: ``max(1, num_kv_heads // tensor_parallel_size)``.

    vLLM 0.33.0 (``ModelConfig.verify_with_parallel_config``, ``QKVParallelLinear``) needs the query heads
    to split evenly, and the K/V heads too, or, with more GPUs than K/V heads, the GPUs to be a multiple
    of them: each K/V head is then replicated on ``tensor_parallel_size // num_kv_heads`` GPUs.

    >>> kv_heads_per_gpu(32, 8, 2), kv_heads_per_gpu(32, 8, 16)
    (4, 1)

    Raises:
        ValueError: a split vLLM refuses, naming ``tensor_parallel_size``.
    """
    tp = check_count("tensor_parallel_size", tensor_parallel_size, minimum=1)
    if num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the model's {num_heads} attention heads (vLLM: "
            f'"Total number of attention heads ({num_heads}) must be divisible by tensor parallel size '
            f'({tp}).")'
        )
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the model's {num_kv_heads} K/V heads: vLLM's "
                f"QKVParallelLinear gives every GPU the same number of them"
            )
        return num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} is more than the model's {num_kv_heads} K/V heads and not a multiple "
            f"of them: vLLM's QKVParallelLinear replicates each K/V head on tensor_parallel_size / "
            f"num_kv_heads GPUs"
        )
    return 1


def estimate_activation_peak(
    shape: ModelShape,
    num_tokens: int,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    tensor_parallel_size: int = 1,
) -> int:
    """An **estimate** of the activation peak of vLLM's profiling run on one GPU, from the model's shape.

    The dummy forward of ``T = num_tokens`` tokens runs layer by layer; at a layer's peak it holds the
    residual stream and the normed input (``2 * hidden_size`` numbers a token) and the wider of the
    attention's tensors (``q``, ``k``, ``v`` and the attention's output: ``2 * q_width + 2 * kv_width``)
    and the MLP's (gate and up, then the activation: ``mlp_matrices * intermediate_size / tp``). Then
    the sampler takes one row per request, ``S = min(max_num_seqs, T)`` rows of ``vocab_size`` float32
    logits, and the probabilities it derives from them::

        peak = T * b * (2 * H + max(2 * q_width + 2 * kv_width, mlp_matrices * I / tp))
               + S * vocab_size * 4 * 2

    with ``b`` the bytes of the model's dtype and the widths per GPU (``q_width = num_heads / tp *
    head_dim``, ``kv_width = kv_heads_per_gpu * head_dim``). It is an estimate: on a GPU, vLLM measures
    the peak with torch's memory statistics (:func:`measure_activation_peak`), and fused kernels,
    ``torch.compile`` and the attention backend's buffers move it. It grows linearly with the tokens.
    """
    tokens = check_count("max_num_batched_tokens", num_tokens, minimum=1)
    seqs = check_count("max_num_seqs", max_num_seqs, minimum=1)
    tp = tensor_parallel_size
    q_width = shape.num_heads // tp * shape.head_dim
    kv_width = kv_heads_per_gpu(shape.num_heads, shape.num_kv_heads, tp) * shape.head_dim
    widest = max(
        2 * q_width + 2 * kv_width, shape.mlp_matrices * blocks_for_tokens(shape.intermediate_size, tp)
    )
    layer_peak = tokens * shape.dtype.itemsize * (2 * shape.hidden_size + widest)
    return layer_peak + min(seqs, tokens) * shape.vocab_size * 4 * SAMPLER_COPIES


def measure_activation_peak(
    model: torch.nn.Module, num_tokens: int, *, device: torch.device | None = None
) -> int:
    """The activation peak of a dummy forward of ``num_tokens`` tokens, measured on a CUDA GPU as vLLM does.

    ``memory_profiling`` (``vllm/utils/mem_utils.py``): empty the allocator's cache, reset the peak
    statistics, run ``model(token_ids)`` on a ``(1, num_tokens)`` batch of token 0 with no grad, and
    return ``torch_peak - torch_allocated`` afterwards, the ``transient_peak_headroom`` that the weights
    and whatever stays allocated do not count. Pass it to :func:`kv_cache_report` as
    ``activation_peak_bytes``. ``model`` is any module called with token ids (a ``TinyGPT``, a
    ``transformers`` causal LM) on ``device`` (default: its parameters').

    Raises:
        ValueError: the device is not a CUDA GPU: on the CPU, use :func:`estimate_activation_peak`.
    """
    tokens = check_count("num_tokens", num_tokens, minimum=1)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(
            f"measure_activation_peak reads a CUDA GPU's memory statistics, not {device.type!r}'s: "
            "on the CPU, kv_cache_report estimates the peak from the model's shape (estimate_activation_peak)"
        )
    ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        output = model(ids)
    del output, ids
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    stats = torch.cuda.memory_stats(device)
    return stats.get("allocated_bytes.all.peak", 0) - stats.get("allocated_bytes.all.current", 0)


# ------------------------------------------------------------------------------ the report


def format_gib(num_bytes: int) -> str:
    """Bytes in GiB as vLLM's logs write them, ``str(round(b / 2**30, 2))``: ``'6.32'``, ``'16.0'``."""
    return f"{round(num_bytes / GiB, 2)}"


def startup_lines(available_memory: int, kv_cache_tokens: int, max_model_len: int, max_concurrency: float):
    """vLLM 0.33.0's two start-up lines, the worker's then the engine's, with ``"GPU"`` as the pool's name.

    >>> startup_lines(6791251559, 51808, 8192, 3238 / 512)[1]
    'GPU KV cache size: 51,808 tokens, Maximum concurrency for 8,192 tokens per request: 6.32x'
    """
    return (
        f"Available KV cache memory: {format_gib(available_memory)} GiB",
        f"GPU KV cache size: {kv_cache_tokens:,} tokens, "
        f"Maximum concurrency for {max_model_len:,} tokens per request: {max_concurrency:.2f}x",
    )


@dataclass(frozen=True)
class KVCacheReport:
    """What :func:`kv_cache_report` found, per GPU under tensor parallelism; every byte count an int.

    The budget: ``requested_memory = ceil(gpu_memory_bytes * gpu_memory_utilization)``, less
    ``weight_bytes``, ``activation_peak_bytes`` and ``non_torch_bytes`` (together vLLM's
    :attr:`non_kv_cache_memory`) and ``cudagraph_bytes``, leaves ``available_kv_cache_memory``. The pool:
    ``num_gpu_blocks`` blocks of ``bytes_per_block``. One request of ``max_model_len`` takes
    ``blocks_per_request`` of them; ``max_concurrency`` is their ratio, ``kv_cache_tokens`` that times
    ``max_model_len`` (rounded down), and ``lines`` vLLM's two start-up lines.
    """

    model: str
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    kv_cache_dtype: str
    kv_dtype_bytes: int
    tensor_parallel_size: int
    num_kv_heads_per_gpu: int
    num_kv_cache_groups: int
    requested_memory: int
    num_parameters: int | None
    weight_bytes: int
    weight_source: str
    activation_peak_bytes: int
    activation_source: str
    non_torch_bytes: int
    cudagraph_bytes: int
    available_kv_cache_memory: int
    bytes_per_block: int
    num_gpu_blocks: int
    blocks_per_request: int
    kv_cache_tokens: int
    max_concurrency: float
    lines: tuple[str, str]

    @property
    def non_kv_cache_memory(self) -> int:
        """vLLM's ``non_kv_cache_memory``: the weights, the activation peak, the memory outside torch."""
        return self.weight_bytes + self.activation_peak_bytes + self.non_torch_bytes

    def summary(self) -> str:
        """The budget line by line, then vLLM's two lines."""
        rows = [
            (
                f"requested ({self.gpu_memory_utilization} of {format_bytes(self.gpu_memory_bytes)})",
                self.requested_memory,
            ),
            (f"- weights ({self.weight_source})", self.weight_bytes),
            (f"- activation peak ({self.activation_source})", self.activation_peak_bytes),
            ("- memory outside torch", self.non_torch_bytes),
            ("- CUDA graphs", self.cudagraph_bytes),
            ("= available for the KV cache", self.available_kv_cache_memory),
        ]
        text = [f"{label:<48}{format_bytes(value):>10}" for label, value in rows]
        text.append(
            f"{self.num_gpu_blocks:,} blocks of {format_bytes(self.bytes_per_block)}, "
            f"{self.blocks_per_request:,} for one request of {self.max_model_len:,} tokens"
        )
        return "\n".join([*text, *self.lines])


def kv_cache_report(
    config: object,
    *,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
    dtype: torch.dtype | None = None,
    weight_bytes: int | None = None,
    activation_peak_bytes: int | None = None,
    non_torch_bytes: int = 0,
    cudagraph_bytes: int = 0,
    async_scheduling: bool = True,
) -> KVCacheReport:
    """Size the KV cache of ``config``'s model on a GPU of ``gpu_memory_bytes`` as vLLM 0.33.0 does.

    The steps and their vLLM functions are in this module's docstring. ``config`` is a ``transformers``
    config, a ``config.json`` dict or a ``GPTConfig`` (:func:`model_shape`, where ``dtype`` is read).
    ``gpu_memory_bytes`` is what the GPU reports (``device_memory``: a little under its label). With
    ``tensor_parallel_size`` GPUs, every number is one GPU's: its share of the weights and of the K/V
    heads. ``max_num_batched_tokens`` and ``max_num_seqs`` default to ``SchedulerConfig``'s (2,048 and
    128): the dummy forward's size. ``kv_cache_dtype`` is one of :data:`KV_CACHE_DTYPE_BYTES`
    (``"auto"``: the model's dtype). ``weight_bytes`` and ``activation_peak_bytes`` replace the count
    from the shapes and :func:`estimate_activation_peak`; ``non_torch_bytes`` and ``cudagraph_bytes`` are
    measured by vLLM and 0 unless given. ``async_scheduling`` (vLLM's default) doubles the tokens in
    flight that a sliding-window group reserves for.

    Raises:
        ValueError: a bad argument, named (``gpu_memory_utilization`` outside ``(0, 1]``, an unknown
            ``kv_cache_dtype`` with the list, a ``tensor_parallel_size`` that does not split the heads,
            a ``max_model_len`` below 1...); or, with vLLM 0.33.0's message verbatim and the fixes in
            order after it, no memory left for the cache, or too little for one request of
            ``max_model_len``.
    """
    shape = model_shape(config, dtype)
    total = check_count("gpu_memory_bytes", gpu_memory_bytes, minimum=1)
    utilization = _check_utilization(gpu_memory_utilization)
    max_model_len = check_count("max_model_len", max_model_len, minimum=1)
    budget = check_count(
        "max_num_batched_tokens",
        DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens,
        minimum=1,
    )
    seqs = check_count(
        "max_num_seqs", DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs, minimum=1
    )
    block_size = check_count("block_size", block_size, minimum=1)
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_BYTES)} (a subset of vLLM 0.33.0's "
            f"CacheDType, which has no float32), got {kv_cache_dtype!r}"
        )
    if not isinstance(async_scheduling, bool):
        raise ValueError(f"async_scheduling must be True or False, got {async_scheduling!r}")
    tp = check_count("tensor_parallel_size", tensor_parallel_size, minimum=1)
    heads = kv_heads_per_gpu(shape.num_heads, shape.num_kv_heads, tp)

    if weight_bytes is None:
        if shape.num_experts:
            raise ValueError(
                f"a mixture of experts ({shape.num_experts} experts) is not counted from its shapes here: "
                "give its weight_bytes"
            )
        parameters = shape.num_parameters(tp)
        weights, weight_source = parameters * shape.dtype.itemsize, "from the config's shapes"
    else:
        parameters, weights, weight_source = None, check_count("weight_bytes", weight_bytes), "given"
    if activation_peak_bytes is None:
        activation = estimate_activation_peak(shape, budget, seqs, tp)
        activation_source = "estimated"
    else:
        activation, activation_source = check_count("activation_peak_bytes", activation_peak_bytes), "given"
    non_torch = check_count("non_torch_bytes", non_torch_bytes)
    cudagraphs = check_count("cudagraph_bytes", cudagraph_bytes)

    requested = math.ceil(total * utilization)
    available = requested - weights - activation - non_torch - cudagraphs

    dtype_bytes = KV_CACHE_DTYPE_BYTES[kv_cache_dtype] or shape.dtype.itemsize
    groups = kv_cache_groups(shape.layer_windows, block_size)
    bytes_per_block = num_tensors(groups) * 2 * block_size * heads * shape.head_dim * dtype_bytes
    in_flight = budget * (2 if async_scheduling else 1)

    def blocks_per_request(length: int) -> int:
        return sum(
            group.spec.max_admission_blocks_per_request(in_flight, length)
            if isinstance(group.spec, SlidingWindowSpec)
            else blocks_for_tokens(length, block_size)
            for group in groups
        )

    # The check of get_kv_cache_configs: the null block's bytes reserved, then one request must fit.
    check_memory = available - bytes_per_block
    fixes = _Fixes(max_model_len, utilization, kv_cache_dtype, tp, budget, requested, requested - available)
    if check_memory <= 0:
        raise ValueError(NO_MEMORY + fixes.nothing_left())
    per_request = blocks_per_request(max_model_len)
    needed = bytes_per_block * per_request
    if needed > check_memory:
        estimated = _estimate_max_model_len(
            lambda length: bytes_per_block * blocks_per_request(length) <= check_memory, max_model_len
        )
        raise ValueError(
            too_little_message(max_model_len, needed, check_memory, estimated) + fixes.too_little(estimated)
        )

    num_blocks = available // bytes_per_block
    concurrency = num_blocks / per_request
    tokens = int(concurrency * max_model_len)
    return KVCacheReport(
        model=shape.name,
        gpu_memory_bytes=total,
        gpu_memory_utilization=utilization,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        kv_dtype_bytes=dtype_bytes,
        tensor_parallel_size=tp,
        num_kv_heads_per_gpu=heads,
        num_kv_cache_groups=len(groups),
        requested_memory=requested,
        num_parameters=parameters,
        weight_bytes=weights,
        weight_source=weight_source,
        activation_peak_bytes=activation,
        activation_source=activation_source,
        non_torch_bytes=non_torch,
        cudagraph_bytes=cudagraphs,
        available_kv_cache_memory=available,
        bytes_per_block=bytes_per_block,
        num_gpu_blocks=num_blocks,
        blocks_per_request=per_request,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        lines=startup_lines(available, tokens, max_model_len, concurrency),
    )


def _check_utilization(utilization: object) -> float:
    if isinstance(utilization, bool) or not isinstance(utilization, numbers.Real):
        raise ValueError(f"gpu_memory_utilization must be a number, got {type(utilization).__name__}")
    if not 0 < utilization <= 1:  # also refuses nan
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    return float(utilization)


def _estimate_max_model_len(fits: Callable[[int], bool], max_model_len: int) -> int:
    """vLLM's binary search (``estimate_max_model_len``): the longest length in ``1..max_model_len``
    that fits, 0 when not even one token does."""
    left, right = 1, max_model_len
    if not fits(left):
        return 0
    result = 1
    while left <= right:
        middle = (left + right) // 2
        if fits(middle):
            result, left = middle, middle + 1
        else:
            right = middle - 1
    return result


# ------------------------------------------------------------------------------ the errors

NO_MEMORY = (
    "No available memory for the cache blocks. "
    "Try increasing `gpu_memory_utilization` when initializing the engine "
    "(this flag also controls CPU memory reservation on the CPU "
    "backend, despite its name). "
    f"See {CONSERVING_MEMORY} for more details."
)
"""vLLM 0.33.0's message when nothing is left for the cache (``_check_enough_kv_cache_memory``)."""


def too_little_message(max_model_len: int, needed: int, available: int, estimated: int) -> str:
    """vLLM 0.33.0's message when one request of ``max_model_len`` does not fit, verbatim
    (``_check_enough_kv_cache_memory``); ``available`` is the memory less the null block's bytes."""
    estimated_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimated}. "
        if estimated > 0
        else ""
    )
    return (
        f"To serve at least one request with the model's max seq len "
        f"({max_model_len}), ({format_gib(needed)} GiB KV "
        f"cache is needed, which is larger than the available KV cache "
        f"memory ({format_gib(available)} GiB). {estimated_msg}"
        f"Try increasing `gpu_memory_utilization` (which also controls "
        f"CPU memory on the CPU backend) or decreasing `max_model_len` "
        f"when initializing the engine. "
        f"See {CONSERVING_MEMORY} for more details."
    )


@dataclass(frozen=True)
class _Fixes:
    """The fixes appended after vLLM's message, in the order to try them."""

    max_model_len: int
    utilization: float
    kv_cache_dtype: str
    tp: int
    budget: int
    requested: int
    non_kv_memory: int

    def _utilization(self) -> str:
        if self.utilization >= 1:
            return "raise gpu_memory_utilization: it is 1.0 already, the whole GPU"
        return f"raise gpu_memory_utilization above {self.utilization} (at most 1.0)"

    def _tensor_parallel(self) -> str:
        return (
            f"tensor parallelism, tensor_parallel_size={2 * self.tp}: each GPU holds 1/{2 * self.tp} of the "
            "weights and of every block's K/V heads"
        )

    def _budget(self) -> str:
        return f"a smaller max_num_batched_tokens than {self.budget:,}: a smaller activation peak"

    def nothing_left(self) -> str:
        return (
            f"\nFixes, in order: 1. {self._utilization()}; 2. {self._tensor_parallel()}; "
            f"3. {self._budget()}. A shorter max_model_len or an fp8 KV cache cannot help: the weights, the "
            f"activation peak, the memory outside torch and the CUDA graphs take "
            f"{format_gib(self.non_kv_memory)} GiB of the {format_gib(self.requested)} GiB requested, which "
            "leaves less than one block besides the null block."
        )

    def too_little(self, estimated: int) -> str:
        shorter = f"to {estimated:,} or less" if estimated else "(not even one token fits now)"
        fp8 = (
            "an fp8 KV cache, kv_cache_dtype='fp8': one byte a number, half a 16-bit cache"
            if self.kv_cache_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2")
            else f"an fp8 KV cache (kv_cache_dtype={self.kv_cache_dtype!r} already is one)"
        )
        return (
            f"\nFixes, in order: 1. lower max_model_len {shorter}; 2. {self._utilization()}; 3. {fp8}; "
            f"4. {self._tensor_parallel()}; 5. {self._budget()}."
        )

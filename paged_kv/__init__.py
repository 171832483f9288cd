"""paged_kv: a KV cache kept in fixed-size blocks, the way vLLM's PagedAttention does it.

The companion package of the paged_kv course. What a learner imports is here, at the top level;
each name's home module is in the layer its lesson builds (see ``docs/architecture.md``):

* :mod:`paged_kv.core`: bookkeeping with no tensors (blocks, tables, the free list, prefix caching,
  the block pool, the engine's KV-cache manager and the lessons' block manager);
* :mod:`paged_kv.kv`: the K/V tensors (storage, mapping, the one-layer cache, swapping, sizing);
* :mod:`paged_kv.attention`: attention over the paged cache;
* :mod:`paged_kv.model`: the tiny GPT, Hugging Face models on the paged cache, the caches and
  ``generate``;
* :mod:`paged_kv.serving`: the engine from its settings to its step, online and offline;
* :mod:`paged_kv.simulation`: workloads and simulations that need no model;
* :mod:`paged_kv.pictures`: drawings, plots and widgets (imported on demand, not here);
* :mod:`paged_kv.checks` and :mod:`paged_kv.grading`: the exercises' checks and the grader.
"""

from paged_kv.attention.paged import paged_attention, paged_attention_varlen, paged_prefill_attention
from paged_kv.core.block import Block, BlockTable, blocks_for_tokens
from paged_kv.core.block_allocator import BlockAllocator
from paged_kv.core.block_manager import BlockManager
from paged_kv.core.changes import BlockChange
from paged_kv.core.prefix_cache import PrefixCacheStats
from paged_kv.core.snapshot import AllocatorSnapshot
from paged_kv.core.trace import Recorder, TraceFrame
from paged_kv.core.usage import BlockUsage
from paged_kv.device import default_device
from paged_kv.errors import OutOfBlocksError, UnknownSequenceError
from paged_kv.kv.cache import PagedKVCacheAllocator
from paged_kv.kv.sizing import KVCacheSpec, kv_cache_budget
from paged_kv.kv.startup import kv_cache_report
from paged_kv.kv.storage import KVStorage
from paged_kv.model.causal_lm import CausalLM, as_causal_lm
from paged_kv.model.config import GPTConfig
from paged_kv.model.generation import GenerationResult, generate
from paged_kv.model.hf import HFCausalLM
from paged_kv.model.hub import load_model
from paged_kv.model.kv_cache import ContiguousKVCache, KVCache, PagedKVCache
from paged_kv.model.tiny_gpt import TinyGPT, decode, encode
from paged_kv.serving.engine import Engine, EngineRequest
from paged_kv.serving.engine_result import EngineResult
from paged_kv.serving.metrics import RunMetrics, SchedulerStats
from paged_kv.serving.outputs import SchedulerOutput
from paged_kv.serving.request import EngineCoreRequest
from paged_kv.serving.scheduler import Scheduler
from paged_kv.simulation.fragmentation import ContiguousUsage, contiguous_baseline, fragmentation_report
from paged_kv.simulation.workload import ContiguousPolicy, PagedPolicy, Request, sample_requests, simulate

__version__ = "0.1.0"

__all__ = [
    "AllocatorSnapshot",
    "Block",
    "BlockAllocator",
    "BlockChange",
    "BlockManager",
    "BlockTable",
    "BlockUsage",
    "CausalLM",
    "ContiguousKVCache",
    "ContiguousPolicy",
    "ContiguousUsage",
    "Engine",
    "EngineCoreRequest",
    "EngineRequest",
    "EngineResult",
    "GPTConfig",
    "GenerationResult",
    "HFCausalLM",
    "KVCache",
    "KVCacheSpec",
    "KVStorage",
    "OutOfBlocksError",
    "PagedKVCache",
    "PagedKVCacheAllocator",
    "PagedPolicy",
    "PrefixCacheStats",
    "Recorder",
    "Request",
    "RunMetrics",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "TinyGPT",
    "TraceFrame",
    "UnknownSequenceError",
    "as_causal_lm",
    "blocks_for_tokens",
    "contiguous_baseline",
    "decode",
    "default_device",
    "encode",
    "fragmentation_report",
    "generate",
    "kv_cache_budget",
    "kv_cache_report",
    "load_model",
    "paged_attention",
    "paged_attention_varlen",
    "paged_prefill_attention",
    "sample_requests",
    "simulate",
]

"""paged_kv: a KV cache kept in fixed-size blocks, the way vLLM's PagedAttention does it.

The companion package of the paged_kv course. The names below are the API that lessons,
exercises, grader and tests share.
"""

from .attention import paged_attention, paged_prefill_attention
from .block import Block, BlockTable, blocks_for_tokens
from .block_allocator import BlockAllocator
from .cache import PagedKVCacheAllocator
from .device import default_device
from .errors import OutOfBlocksError, UnknownSequenceError
from .fragmentation import ContiguousUsage, contiguous_baseline, fragmentation_report
from .prefix_cache import PrefixCacheStats
from .snapshot import AllocatorSnapshot
from .usage import BlockUsage

__version__ = "0.1.0"

__all__ = [
    "AllocatorSnapshot",
    "Block",
    "BlockAllocator",
    "BlockTable",
    "BlockUsage",
    "ContiguousUsage",
    "OutOfBlocksError",
    "PagedKVCacheAllocator",
    "PrefixCacheStats",
    "UnknownSequenceError",
    "blocks_for_tokens",
    "contiguous_baseline",
    "default_device",
    "fragmentation_report",
    "paged_attention",
    "paged_prefill_attention",
]

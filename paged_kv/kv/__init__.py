"""The K/V tensors: the paged storage, logical-to-physical mapping, the one-layer cache, swapping.

Lessons 02, 03 and 11. :class:`~paged_kv.kv.cache.PagedKVCacheAllocator` joins one block manager
(:mod:`paged_kv.core`) and one layer of storage.
"""

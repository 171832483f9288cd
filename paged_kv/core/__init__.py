"""Block bookkeeping, with no tensors: blocks, block tables, the free list, the block manager, prefix caching.

Lessons 01, 02, 04 and 07. Everything here is plain Python on block ids and token counts; the K/V
tensors live in :mod:`paged_kv.kv`.
"""
